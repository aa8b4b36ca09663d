"""``benchmarks/gpu_check.py`` (``./dev gpu-check``) kept correct on CPU.

``--smoke`` runs every row of the GPU check (parity under eviction, and the
resident / overlap / serial throughput runs, each in its own subprocess) with
tiny models on chunkstar's CPU virtual device: the real engine, no stubs.
Without CUDA and without ``--smoke`` the script must refuse in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
ROWS = ["parity fp32", "parity bf16"] + [f"{m} {mode}" for m in ("tiny-a", "tiny-b") for mode in ("resident", "overlap", "serial")]


def _table_rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by run name (cells split on runs of two or more spaces)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("run ") and " status " in line)
    rows: dict[str, list[str]] = {}
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        cells = [c for c in line.split("  ") if c.strip()]
        rows[cells[0].strip()] = [c.strip() for c in cells[1:]]
    return rows


def test_smoke_prints_every_row_and_parity_passes(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stdout
    rows = _table_rows(proc.stdout)
    assert list(rows) == ROWS, proc.stdout
    for name in ("parity fp32", "parity bf16"):
        assert rows[name][0] == "PASS", proc.stdout
    for name in ROWS[2:]:
        assert rows[name][0] == "ok", proc.stdout
        float(rows[name][1])  # s/step
        float(rows[name][2])  # TFLOPS
    for model in ("tiny-a", "tiny-b"):
        assert rows[f"{model} resident"][3] == "0 B", proc.stdout  # the no-movement reference moved nothing
        assert rows[f"{model} overlap"][3] != "0 B", proc.stdout  # the pressured runs moved chunks
        hidden = rows[f"{model} overlap"][4]
        assert hidden == "n/a" or 0.0 <= float(hidden) <= 1.0, proc.stdout
    assert "[gpu-check 8/8]" in proc.stderr  # progress on stderr

    record = json.loads(out.read_text())
    assert record["flops_formula"].startswith("megatron")
    results = record["results"]
    assert results["parity fp32"]["max_abs_loss_diff"] <= 1e-5 * max(results["parity fp32"]["reference_losses"])
    for name in ("parity fp32", "parity bf16"):
        assert min(results[name]["moves_to_device_per_step"]) > 0
        assert results[name]["budget_bytes"] < results[name]["param_bytes"] + results[name]["non_model_peak_bytes"]
    for model in ("tiny-a", "tiny-b"):
        overlap, serial = results[f"{model} overlap"], results[f"{model} serial"]
        assert overlap["config"]["overlap"] is True and serial["config"]["overlap"] is False
        assert overlap["config"]["device_memory_budget"] == serial["config"]["device_memory_budget"]
        assert overlap["per_timed_step"]["chunk_moves_to_device"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_in_one_line() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--smoke" in lines[0], proc.stderr
