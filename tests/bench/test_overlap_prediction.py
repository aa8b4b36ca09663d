"""The overlap table's time-model column: each chunkstar row dry-run and predicted on this machine.

The prediction path runs for real on a tiny model (seconds); the command's wiring (after the
rows, into the table and the JSON, skipped by ``--no-predict``) runs with the rows faked. How
close the prediction comes to the measured step is a benchmark figure, printed by the command,
not asserted here.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from chunkstar_bench.cli import main
from chunkstar_bench.comparisons import command, overlap
from chunkstar_bench.comparisons.rounds import Pooled, Row
from tests.bench._records import record

_RESOURCES = {"compute", "h2d", "d2h", "interconnect", "host_adam", "device_adam", "disk"}


def _tiny_rows(names: Sequence[str]) -> list[Row]:
    """The table's rows on cpu-tiny, one sequence of 16 tokens, a budget that still moves chunks."""
    tiny = dict(model="cpu-tiny", batch=1, seq_len=16, chunkstar_budget=60_000_000)
    return [
        dataclasses.replace(r, spec=dataclasses.replace(r.spec, **tiny) if r.spec.system == "chunkstar" else r.spec)
        for r in overlap.rows(overlap.OverlapSettings(), names)
    ]


def test_each_chunkstar_row_is_dry_run_and_predicted_on_this_machine() -> None:
    rows = _tiny_rows(["pytorch", "chunkstar-1gb-overlap", "chunkstar-8gb-overlap"])
    threads = torch.get_num_threads()
    said: list[str] = []
    predicted = overlap.predict_rows(rows, say=said.append)
    assert torch.get_num_threads() == threads  # the rows' one thread was for the calibration only
    assert list(predicted) == ["chunkstar-1gb-overlap", "chunkstar-8gb-overlap"]  # PyTorch has no chunks to replay
    for name, pred in predicted.items():
        assert not pred.error, pred.error
        assert pred.seconds > 0 and pred.binding in _RESOURCES and set(pred.busy) == _RESOURCES, name
        assert pred.seconds >= max(pred.busy.values()) * (1 - 1e-9)
        assert "distinct ops" in pred.hardware  # the workload's own ops set the compute rate
    assert "link 1 GB/s emulated" in predicted["chunkstar-1gb-overlap"].hardware
    assert "link 8 GB/s emulated" in predicted["chunkstar-8gb-overlap"].hardware
    # the same step and the same calibration but the link: the slower one is busier
    one, eight = predicted["chunkstar-1gb-overlap"].busy, predicted["chunkstar-8gb-overlap"].busy
    assert one["h2d"] > 0 and one["h2d"] >= eight["h2d"] and one["compute"] == eight["compute"]
    assert any("predicted, bound by" in line for line in said)
    assert json.loads(json.dumps(predicted["chunkstar-1gb-overlap"].as_dict()))["binding"] == predicted["chunkstar-1gb-overlap"].binding


def _pooled(rows: Sequence[Row], step: float = 2.0) -> dict[str, Pooled]:
    out = {}
    for row in rows:
        r = record(row.spec.system)
        r.details.update(step_times_s=[step, step], row=row.name)
        out[row.name] = Pooled(row, [r])
    return out


def test_the_report_prints_the_prediction_beside_the_measured_step() -> None:
    rows = overlap.rows(overlap.OverlapSettings(), ["chunkstar-1gb-serial", "chunkstar-1gb-overlap", "chunkstar-8gb-overlap"])
    predicted = {
        "chunkstar-1gb-serial": overlap.Predicted(1.5, "compute", {"compute": 1.4, "h2d": 0.1}, "measured: x, link 1 GB/s emulated"),
        "chunkstar-1gb-overlap": overlap.Predicted(2.5, "h2d", {"compute": 1.4, "h2d": 2.5}, "measured: x, link 1 GB/s emulated"),
        "chunkstar-8gb-overlap": overlap.Predicted(error="RuntimeError: no"),
    }
    text = overlap.report(overlap.OverlapSettings(), _pooled(rows), [], 1, predicted)
    assert "predicted / measured" in text and "calibration: measured: x" in text
    lines = {ln.split("  ")[0]: ln for ln in text.splitlines() if "1.500" in ln or "2.500" in ln or "RuntimeError" in ln}
    assert "0.75" in lines["chunkstar link 1GB/s overlap off"] and "compute (compute 1.400, h2d 0.100)" in text
    assert "1.25" in lines["chunkstar link 1GB/s overlap on"]
    assert "RuntimeError: no" in lines["chunkstar link 8GB/s overlap on"]
    assert "predicted / measured" not in overlap.report(overlap.OverlapSettings(), _pooled(rows), [], 1)


def test_the_command_predicts_after_the_rows_and_keeps_it_in_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    order: list[str] = []

    def fake_rows(rows: Sequence[Row], rounds: int, timeout_s: float, **_: object) -> dict[str, Pooled]:
        order.append("rows")
        return _pooled(rows, step=4.0)

    def fake_predict(rows: Sequence[Row]) -> dict[str, overlap.Predicted]:
        order.append("predict " + ",".join(r.name for r in rows))
        return {r.name: overlap.Predicted(3.0, "compute", {"compute": 3.0}, "measured: fake") for r in rows if r.spec.system == "chunkstar"}

    monkeypatch.setattr(command, "run_rows", fake_rows)
    monkeypatch.setattr(overlap, "predict_rows", fake_predict)
    out = tmp_path / "ov.json"
    assert main(["overlap", "--systems", "pytorch,chunkstar-8gb-overlap", "--rounds", "1", "--json", str(out)]) == 0
    assert order == ["rows", "predict pytorch,chunkstar-8gb-overlap"]
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if ln.startswith("chunkstar link 8GB/s overlap on") and "3.000" in ln)
    assert "4.000" in row and "0.75" in row
    document = json.loads(out.read_text())
    assert document["predictions"] == {
        "chunkstar-8gb-overlap": {"seconds": 3.0, "binding": "compute", "busy": {"compute": 3.0}, "hardware": "measured: fake", "error": ""}
    }
    order.clear()
    assert main(["overlap", "--systems", "chunkstar-8gb-overlap", "--rounds", "1", "--no-predict"]) == 0
    assert order == ["rows"] and "predicted / measured" not in capsys.readouterr().out
