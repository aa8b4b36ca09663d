"""Two gloo ranks agree at start-up on config, layout, dtype and initial weights,
or every rank raises a DistributedError that says what differs between which ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ._ckpt_worker import STARTUP_STEPS, startup
from ._spawn import run_ranks
from .test_two_ranks import _reference


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    results = run_ranks(startup, tmp_path_factory.mktemp("startup"))
    assert len(results) == 2 and all("error" not in r for r in results), results
    return results


def test_different_seeds_fail_on_every_rank(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["seeds"].get("error", "")
        assert "initial weights differ between rank 0 and rank 1" in msg and "same seed" in msg, r
        assert "transformer.wte.weight" in msg, msg  # the first parameter that differs
        assert "config field" not in msg and "layout" not in msg, msg


def test_different_chunk_sizes_fail_naming_the_config_field(results: list[dict[str, Any]]) -> None:
    for r in results:
        msg = r["chunk_size"].get("error", "")
        assert "config field 'placement.chunk_size' (config key 'default_chunk_size') differs between rank 0 and rank 1" in msg, r
        assert "initial weights differ" not in msg, msg


def test_agreeing_ranks_train_and_share_a_run_id(results: list[dict[str, Any]]) -> None:
    # the device budgets differ between the ranks: that may differ
    a, b = (r["same"] for r in results)
    assert "error" not in a and "error" not in b, (a, b)
    assert a["run_id"] == b["run_id"]
    assert a["losses"] == b["losses"] == pytest.approx(_reference("gpt2", STARTUP_STEPS), rel=1e-5)
