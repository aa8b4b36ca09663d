"""The published figures and the one table of system names: typed rows, labels, aliases, and every user agreeing."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from chunkstar_bench import plan, published
from chunkstar_bench.published import (
    SYSTEMS,
    canonical_system,
    largest_published,
    load_published,
    parse_label,
    parse_results,
    published_for,
    system_info,
)
from chunkstar_bench.systems import RUNNERS
from chunkstar_bench.zoo import ZOO, n_params

_SHARED = Path(__file__).resolve().parents[3] / "shared" / "reference" / "paper_results.csv"


def test_parse_label() -> None:
    assert parse_label("18B") == 18_000_000_000
    assert parse_label("1.5b") == 1_500_000_000
    assert parse_label(" 350M ") == 350_000_000
    assert parse_label("175B") == 175 * 10**9 and parse_label("2T") == 2 * 10**12 and parse_label("7K") == 7000
    for bad in ("big", "18", "B18", "1.5GB", ""):
        with pytest.raises(ValueError, match="not a model-size label"):
            parse_label(bad)


def test_every_packaged_row_is_typed_and_resolved() -> None:
    rows = load_published()
    assert len(rows) == 121
    assert {r.system for r in rows} == {"patrickstar", "deepspeed", "deepspeed-mp2", "deepspeed-mp4", "pytorch"}
    assert {r.hardware for r in rows} == {"v100x8_240gb", "a100x8_1tb", "superpod_8gpu_per_node"}
    top = next(r for r in rows if (r.hardware, r.system, r.gpus, r.label) == ("v100x8_240gb", "patrickstar", 8, "18B"))
    assert top.zoo_model == "GPT3_18B" and top.n_params == n_params(ZOO["GPT3_18B"]) and top.nominal_params == 18 * 10**9
    assert top.read == "label" and top.tflops_per_gpu == pytest.approx(top.tflops_total / 8)
    # a label with no config in paper_models.csv keeps its nominal size
    thirty = next(r for r in rows if r.label == "30B")
    assert thirty.zoo_model is None and thirty.n_params == 30 * 10**9
    assert load_published() is not load_published()  # a fresh list: a caller cannot change another's


@pytest.mark.skipif(not _SHARED.exists(), reason="the project's shared reference data is not beside this checkout")
def test_packaged_results_match_the_reference() -> None:
    with _SHARED.open() as f:
        lines = [line for line in f if line.strip() and not line.startswith("#")]
    reference = list(csv.DictReader(lines))
    rows = load_published()
    assert [(r["hardware"], canonical_system(r["system"]), int(r["gpus"]), r["model"], float(r["tflops_total"])) for r in reference] == [
        (r.hardware, r.system, r.gpus, r.label, r.tflops_total) for r in rows
    ]


def test_a_bad_row_is_refused_with_its_number() -> None:
    head = "# comment\nhardware,system,gpus,model,tflops_total,read\n"
    assert parse_results(head + "v100x8_240gb,deepspeed_mp2,2,8B,100,est\n")[0].system == "deepspeed-mp2"
    for row, message in (
        ("v100x8_240gb,megatron,2,8B,100,est", "row 1: unknown system 'megatron'"),
        ("v100x8_240gb,deepspeed,2,huge,100,est", "row 1: not a model-size label: 'huge'"),
        ("v100x8_240gb,deepspeed,two,8B,100,est", "row 1: gpus 'two'"),
        ("v100x8_240gb,deepspeed,2,8B,-5,est", "row 1: .* must be positive"),
        ("v100x8_240gb,deepspeed,2,8B,100,guess", "row 1: read is 'guess'"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_results(head + row + "\n")


def test_largest_published() -> None:
    v100 = largest_published("v100x8_240gb", 8)
    assert v100["patrickstar"].label == "18B" and v100["patrickstar"].nominal_params == 18 * 10**9
    assert largest_published("v100x8_240gb", 1)["patrickstar"].label == "12B"
    a100 = largest_published("a100x8_1tb", 8)
    assert a100["patrickstar"].label == "68B" and a100["deepspeed"].label == "30B"
    assert largest_published("a100x8_1tb")["patrickstar"].gpus == 8
    assert largest_published("nowhere") == {}


def test_one_table_of_system_names() -> None:
    # every part of the project names its systems from the one table
    assert tuple(RUNNERS) == published.RUN_SYSTEMS
    assert plan.SYSTEMS == published.PLAN_SYSTEMS
    assert set(published.DISK_SYSTEMS) == {"chunkstar-disk", "deepspeed-nvme"}
    assert all(s.label and s.description for s in SYSTEMS.values())
    # older spellings are read, never written
    assert canonical_system("pytorch-ddp") == "pytorch" and canonical_system("fsdp2-offload") == "fsdp2"
    assert canonical_system("deepspeed_mp4") == "deepspeed-mp4" and system_info("fsdp2").label == "FSDP2 + CPU offload"
    aliases = [a for s in SYSTEMS.values() for a in s.aliases]
    assert not set(aliases) & set(SYSTEMS) and len(aliases) == len(set(aliases))
    with pytest.raises(KeyError, match="unknown system 'megatron'; systems: chunkstar"):
        system_info("megatron")


def test_published_systems_stand_beside_ours() -> None:
    assert published_for("chunkstar") == "patrickstar"  # chunkstar re-creates PatrickStar
    assert published_for("deepspeed") == "deepspeed" and published_for("pytorch-ddp") == "pytorch"
    assert published_for("fsdp2") is None and published_for("megatron") is None
    for s in SYSTEMS.values():
        if s.stands_beside is not None:
            assert s.published and s.stands_beside in SYSTEMS, s.name
