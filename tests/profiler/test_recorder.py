"""The recorder against the engine's own accounting, and its cost when absent."""

from __future__ import annotations

from typing import Any

import pandas as pd
import pytest
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import chunkstar_profiler


def test_moves_add_up_to_the_engines_counters(recorded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(str(recorded["path"]))
    before, after = recorded["before"], recorded["after"]
    to_host = p.moves[p.moves["dst"] == "host"]
    to_dev = p.moves[p.moves["dst"] == "device"]
    assert len(to_host) == after["chunk_moves_to_host"] - before["chunk_moves_to_host"]
    assert to_host["nbytes"].sum() == after["bytes_to_host"] - before["bytes_to_host"]
    assert to_dev["nbytes"].sum() == after["bytes_to_device"] - before["bytes_to_device"]
    evictions = p.moves[p.moves["reason"] == "eviction"]
    assert len(evictions) > 0 and (evictions["dst"] == "host").all()
    n_evict = after["moves_by_reason"]["eviction"] - before["moves_by_reason"]["eviction"]
    assert len(evictions) == n_evict


def test_moments_stages_and_memory_are_consistent(recorded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(str(recorded["path"]))
    per_step = recorded["after"]["moments_per_micro_step"]
    assert p.meta["iterations"] == 3
    # every micro-step's module moments, plus one optimizer moment per step
    assert len(p.moments) == 3 * (per_step + 1)
    assert (p.moments["t_end_s"] >= p.moments["t_start_s"]).all()
    assert set(p.stages["stage"]) == {"fwd", "bwd", "optim"}
    assert (p.moves["moment_row"] >= 0).all(), "every move is attributed to the moment that caused it"
    dev = p.memory[p.memory["tier"] == "device"]
    assert (dev["chunk_bytes"] <= dev["budget_bytes"]).all()
    assert dev["non_model_bytes"].max() > 0, "non-model memory is measured after warm-up too"
    assert dev["chunk_bytes"].max() <= recorded["after"]["device_chunk_bytes_peak"]


def test_placements_follow_the_moves(recorded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(str(recorded["path"]))
    pl = p.placements
    assert (pl["t_end_s"] >= pl["t_start_s"]).all()
    for (lst, cid, tier), grp in pl.groupby(["chunk_list", "chunk_id", "tier"]):
        grp = grp.sort_values("t_start_s")
        # a chunk's stays in one tier follow each other; a host stay may span device stays
        # (a clean host copy kept while the chunk is on the device, Note [clean host copy])
        assert (grp["t_start_s"].to_numpy()[1:] >= grp["t_end_s"].to_numpy()[:-1]).all(), (lst, cid, tier)
    device_stays = pl[pl["tier"] == "device"]
    assert len(device_stays) >= (p.moves["dst"] == "device").sum()


def test_round_trip_equals_the_in_memory_profile(recorded: dict[str, Any]) -> None:
    live = recorded["prof"].profile()
    disk = chunkstar_profiler.load(str(recorded["path"]))
    for table in ("moments", "moves", "memory", "stages", "placements"):
        a, b = getattr(live, table), getattr(disk, table)
        assert list(a.columns) == list(b.columns), table
        # times are stored in microseconds
        pd.testing.assert_frame_equal(a, b, check_exact=False, atol=1e-6, rtol=0, obj=table)
    assert disk.meta["n_params"] == live.meta["n_params"]
    assert disk.meta["config"] == live.meta["config"]


def test_detached_engine_pays_nothing(recorded: dict[str, Any]) -> None:
    engine = recorded["engine"]
    assert not engine.events.active
    assert not engine.memory_probe.active
    assert _get_current_dispatch_mode_stack() == []


def test_a_profiler_records_once(recorded: dict[str, Any]) -> None:
    with pytest.raises(RuntimeError, match="records once"):
        recorded["prof"].start()
    with pytest.raises(TypeError, match="chunkstar engine"):
        chunkstar_profiler.Profiler(object())  # type: ignore[arg-type]


def test_device_memory_stays_within_the_budget_from_the_first_step() -> None:
    """Chunks plus measured non-model memory stay under the budget at every sample,
    warm-up included, even though the loop keeps the previous step's output (and its
    logits) alive through the next forward, which the first step cannot see."""
    import torch

    import chunkstar
    from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, gpt2_batch

    case = CASES["gpt2"]
    budget = eviction_budget(case.build(), DTYPES["bf16"])
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, engine_config("bf16", budget=budget))
    out = None
    with chunkstar_profiler.Profiler(engine) as prof:
        for i in range(5):
            batch = gpt2_batch(i)
            out = engine(**batch)  # the previous `out` lives until this returns
            engine.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
    assert out is not None and torch.isfinite(out.loss)
    dev = prof.profile().memory.query("tier == 'device'")
    assert engine.stats()["chunk_moves_to_host"] > 0
    over = dev[dev["total_bytes"] > budget]
    assert over.empty, over[["t_s", "chunk_bytes", "non_model_bytes", "module", "iteration"]].to_string()
