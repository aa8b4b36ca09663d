"""The published figures and the one table of system names: typed rows, labels, aliases, and every user agreeing."""

from __future__ import annotations

import csv
import hashlib
import io
from importlib import resources

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


# the sha256 of the project's reference tables (the paper's models and the figures read off its
# plots) when they were copied into the package: an edit of either packaged table must be deliberate
_REFERENCE_SHA256 = {
    "paper_models.csv": "04b199e3cd4fda1f60db6f4738de06dbe4625408faa822d33d2f6b3ddc2d8825",
    "paper_results.csv": "8d129f3fd50225624b262899c19fee2be077e85abd2ea14b2e545ba08b4605ae",
}


@pytest.mark.parametrize("name", sorted(_REFERENCE_SHA256))
def test_the_packaged_tables_are_the_reference_tables(name: str) -> None:
    data = resources.files("chunkstar_bench.data").joinpath(name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == _REFERENCE_SHA256[name], f"{name} differs from the reference table"


def test_the_zoo_carries_every_model_of_the_packaged_table() -> None:
    text = resources.files("chunkstar_bench.data").joinpath("paper_models.csv").read_text()
    for row in csv.DictReader(io.StringIO(text)):
        spec = ZOO[row["name"]]
        assert (spec.hidden, spec.layers, spec.heads, spec.seq_len) == tuple(
            int(row[k]) for k in ("hidden", "layers", "heads", "seq_len")
        )


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
