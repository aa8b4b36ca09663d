"""The nightly benchmark workflow parses, has the jobs and gates the issue asks for, its scripts are valid
bash, and it passes zizmor's static security audits."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

WORKFLOW = Path(__file__).resolve().parents[2] / ".github" / "workflows" / "nightly-bench.yml"


def _doc() -> dict:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(doc, dict)
    return doc


def test_triggers_and_jobs() -> None:
    doc = _doc()
    on = doc["on"] if "on" in doc else doc[True]  # PyYAML (YAML 1.1) reads the bare key `on` as True
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


def _zizmor() -> str:
    # zizmor ships as a binary in its wheel (no Python module): look in this interpreter's scripts folder
    # first, so the test finds the venv's copy when the venv is not activated
    for candidate in (Path(sysconfig.get_path("scripts")) / "zizmor", shutil.which("zizmor")):
        if candidate is not None and Path(candidate).is_file():
            return str(candidate)
    pytest.fail("zizmor is not installed; it comes with the `test` extra: run `./dev setup test` (or `pip install zizmor`).")


def test_workflow_passes_zizmor() -> None:
    # --offline: only the audits that need no GitHub API (unpinned actions, persisted credentials, template
    # injection, permissions, ...), so the test is the same everywhere; --no-exit-codes: a nonzero status is then
    # a failure of the tool itself, and the findings are read from the JSON list
    r = subprocess.run(
        [_zizmor(), "--offline", "--no-config", "--no-exit-codes", "--format", "json", str(WORKFLOW)],
        text=True, capture_output=True, timeout=120,
    )
    assert r.returncode == 0, f"zizmor failed to run (exit status {r.returncode}): {r.stderr}"
    findings = json.loads(r.stdout)
    lines = [
        f"{f['ident']} ({f['determinations']['severity']}) at line {loc['concrete']['location']['start_point']['row'] + 1}: "
        f"{loc['symbolic']['annotation']}"
        for f in findings for loc in f["locations"] if loc["symbolic"]["kind"] == "Primary"
    ]
    if findings:
        pytest.fail("zizmor findings in nightly-bench.yml (see https://docs.zizmor.sh/audits/):\n" + "\n".join(lines))


def test_actions_are_pinned_with_their_version() -> None:
    # a commit hash alone does not say which release it is; the `# vX.Y.Z` comment does (and Dependabot updates both)
    uses = [line.strip() for line in WORKFLOW.read_text().splitlines() if re.match(r"\s*(- )?uses:", line)]
    assert uses
    bad = [u for u in uses if not re.fullmatch(r"(- )?uses: [\w.-]+/[\w./-]+@[0-9a-f]{40} # v\d+\.\d+\.\d+", u)]
    assert not bad, f"pin each action to a release's full commit hash, its tag in a comment: {bad}"
