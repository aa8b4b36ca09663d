"""Suites are data: the paper matrices, the CPU suite, the nightly subset."""

from __future__ import annotations

import pytest

from chunkstar_bench.published import load_published
from chunkstar_bench.suites import SUITES, get_suite, with_hardware
from chunkstar_bench.zoo import get, paper_label


def test_cpu_suite_has_all_four_systems_on_two_models() -> None:
    cpu = SUITES["cpu"]
    assert {s.system for s in cpu} == {"chunkstar", "deepspeed", "fsdp2", "pytorch"}
    assert len({s.model for s in cpu}) == 2
    assert all(s.device == "cpu" and s.warmup >= 2 and s.nprocs == 1 for s in cpu)


def test_nightly_is_a_short_subset() -> None:
    nightly = SUITES["nightly"]
    assert {s.system for s in nightly} == {"chunkstar", "deepspeed", "fsdp2", "pytorch"}
    assert len(nightly) < len(SUITES["cpu"])


@pytest.mark.parametrize("suite,hardware", [("paper-v100", "v100x8_240gb"), ("paper-a100", "a100x8_1tb")])
def test_paper_suites_cover_the_published_matrix(suite: str, hardware: str) -> None:
    specs = SUITES[suite]
    assert {s.nprocs for s in specs} == {1, 2, 4, 8}
    assert {s.system for s in specs} == {"chunkstar", "deepspeed"}
    assert all(s.device == "cuda" and s.hardware == hardware for s in specs)
    ours = {paper_label(get(s.model)) for s in specs}
    published = {r.label for r in load_published() if r.hardware == hardware}
    assert ours <= published
    assert published - ours <= {"30B"}  # the A100 figure's 30B has no config in paper_models.csv


def test_relabel_and_unknown_suite() -> None:
    assert {s.hardware for s in with_hardware(SUITES["cpu"], "xeon-2c")} == {"xeon-2c"}
    with pytest.raises(KeyError, match="nightly"):
        get_suite("weekly")
