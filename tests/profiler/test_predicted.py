"""A predicted profile: a dry run's step on the time model's clock, in the profiler's format
(issue 26: the viewer shows a run no machine here could hold)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar
import chunkstar_profiler
from chunkstar_profiler.chrome import export_chrome_trace
from chunkstar_profiler.predicted import predicted_profile, write_predicted_profile


def _gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=64))


@pytest.fixture(scope="module")
def report() -> chunkstar.DryRunReport:
    ids = torch.zeros(2, 32, dtype=torch.long)
    cfg = {"device_memory_budget": "4MB", "default_chunk_size": 40000, "bf16": {"enabled": True}}
    return chunkstar.dry_run(_gpt2, cfg, {"input_ids": ids, "labels": ids}, world_size=2, hardware="a100x8_1tb")


def test_the_predicted_step_has_every_event_on_the_predicted_clock(report: chunkstar.DryRunReport, tmp_path: Path) -> None:
    record = report.ranks[1].record
    assert record is not None
    p = predicted_profile(report, rank=1)
    assert len(p.moves) == len(record.moves()) > 0
    assert (p.moves["nbytes"].tolist()) == [mv.nbytes for mv in record.moves()]
    # the forward and backward moments, and the optimizer step's own
    assert len(p.moments[p.moments["stage"] != "optim"]) == len(record.moments)
    seconds = p.meta["predicted"]["seconds_per_step"]
    assert seconds > 0 and p.meta["predicted"]["binding"]
    for table, cols in (("moments", ("t_start_s", "t_end_s")), ("moves", ("t_start_s", "t_end_s")), ("memory", ("t_s",))):
        df = getattr(p, table)
        for c in cols:
            assert df[c].min() >= 0 and df[c].max() <= seconds * 1.0001, (table, c)
    starts = p.moments["t_start_s"].tolist()
    assert starts == sorted(starts)  # in the order they ran
    assert (p.moves["t_end_s"] >= p.moves["t_start_s"]).all()
    assert len(p.memory) > 0 and set(p.placements["tier"]) <= {"device", "host"}
    # written and read back as any profile, and exported for Perfetto
    path = write_predicted_profile(report, tmp_path / "predicted.csprof", rank=1)
    loaded = chunkstar_profiler.load(path)
    assert len(loaded.moves) == len(p.moves) and loaded.meta["predicted"]["rank"] == 1
    trace = export_chrome_trace(loaded, tmp_path / "predicted.json")
    assert Path(trace).stat().st_size > 0
    assert loaded.prediction is not None and loaded.prediction["rank"] == 1 and loaded.prediction["world_size"] == 2
    assert loaded.prediction["seconds_per_step"] == seconds and set(loaded.prediction["busy"]) >= {"compute", "h2d", "d2h"}
    assert f"PREDICTED, not measured: a dry run's step on the time model's clock ({seconds:,.3f} s/step, bound by " in (
        chunkstar_profiler.summarize(loaded)
    )


def test_a_measured_profile_is_not_predicted(recorded: dict[str, Any]) -> None:
    measured = chunkstar_profiler.load(recorded["path"])
    assert measured.prediction is None and "predicted" not in measured.meta
    assert "PREDICTED" not in chunkstar_profiler.summarize(measured)


def test_a_rank_that_was_not_simulated_or_did_not_fit_is_refused(report: chunkstar.DryRunReport) -> None:
    with pytest.raises(ValueError, match="ranks"):
        predicted_profile(report, rank=5)
    ids = torch.zeros(2, 32, dtype=torch.long)
    small = chunkstar.dry_run(_gpt2, {"device": "cpu", "device_memory_budget": "600KB", "default_chunk_size": 40000},
                              {"input_ids": ids, "labels": ids}, hardware="a100x8_1tb")  # fmt: skip
    with pytest.raises(ValueError, match="does not fit"):
        predicted_profile(small)
