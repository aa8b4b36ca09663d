"""The dry run of two ranks against two real gloo ranks (issue 26, 'Checked against what
is real', 1): each simulated rank's chunk moves, bytes and gathers after every step equal
its real counterpart's, and its device peak is within 5%."""

from __future__ import annotations

from pathlib import Path

import pytest

import chunkstar
from tests.core.dryrun.test_dry_run import _COUNTERS, _MODELS, _config, _inputs

from ._dry_run_worker import KEYS, STEPS, real_run
from ._spawn import WORLD, run_ranks


@pytest.mark.parametrize("name,budget", [("gpt2", "1700KB"), ("llama", "3MB")])
def test_two_simulated_ranks_decide_as_two_real_ones(tmp_path: Path, name: str, budget: str) -> None:
    real = run_ranks(real_run, tmp_path, name, budget)
    assert len(real) == WORLD and all("error" not in r for r in real), real
    report = chunkstar.dry_run(_MODELS[name], _config(budget), _inputs(name), world_size=WORLD, steps=STEPS)
    assert report.fits and [r.rank for r in report.ranks] == list(range(WORLD))
    for r, d in zip(real, report.ranks):
        for step, (rs, ds) in enumerate(zip(r["steps"], d.steps)):
            assert {k: ds[k] for k in (*_COUNTERS, "all_gathers", "bytes_gathered")} == {
                k: rs[k] for k in (*_COUNTERS, "all_gathers", "bytes_gathered")
            }, (name, r["rank"], step)
        assert d.stats["device_peak_bytes"] == pytest.approx(r["steps"][-1]["device_peak_bytes"], rel=0.05)
        assert d.minimum_budget == r["steps"][-1]["minimum_budget_bytes"]
        assert d.stats["bytes_gathered"] > 0 and d.stats["collective_gather_bytes"] >= d.stats["bytes_gathered"]
    assert set(KEYS) <= set(report.ranks[0].stats)
