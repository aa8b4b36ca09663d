"""The nightly benchmark workflow parses, has the jobs and gates the issue asks for, and its scripts are valid bash."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "nightly-bench.yml"


def _doc() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(doc, dict)
    return doc


def test_triggers_and_jobs() -> None:
    doc = _doc()
    on = doc.get("on", doc.get(True))  # PyYAML (YAML 1.1) reads the bare key `on` as True
    assert on["schedule"][0]["cron"].count(" ") == 4 and "workflow_dispatch" in on
    cpu, gpu = doc["jobs"]["cpu"], doc["jobs"]["gpu"]
    assert cpu["runs-on"] == "ubuntu-latest" and gpu["runs-on"] == ["self-hosted", "gpu"]
    cpu_runs = "\n".join(s.get("run", "") for s in cpu["steps"])
    assert "chunkstar-bench run --suite nightly --db results/nightly.sqlite" in cpu_runs
    assert "python -m pytest benchmarks/micro" in cpu_runs and "--benchmark-json" in cpu_runs
    assert "--benchmark-compare-fail=mean:25%" in cpu_runs
    assert any(s.get("with", {}).get("python-version") == "3.11" for s in cpu["steps"])
    uploads = [s for s in cpu["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert uploads and "results/nightly.sqlite" in uploads[0]["with"]["path"] and "micro-bench.json" in uploads[0]["with"]["path"]
    assert "paper-" in "\n".join(str(v) for v in gpu["env"].values())


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_blocks_are_valid_bash() -> None:
    for name, job in _doc()["jobs"].items():
        for step in job["steps"]:
            if "run" in step:
                r = subprocess.run(["bash", "-n"], input=step["run"], text=True, capture_output=True)
                assert r.returncode == 0, (name, step.get("name"), r.stderr)
