"""Two gloo ranks: save on both, load on both into engines of other weights, continue
bit for bit; shards of different steps or runs, or of another world size, are refused;
a save that fails on one rank, or is killed at any point, leaves the previous one loadable."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import chunkstar
from chunkstar.checkpoint import CheckpointError, merge_checkpoint
from tests.core._models import CASES, engine_config

from ._ckpt_worker import SAVE_AFTER, STEPS, killed_save, load_after_kill, resume, unshared_save
from ._spawn import run_ranks
from ._worker import CHUNK


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("resume")
    param_bytes = sum(p.numel() * 4 for p in CASES["gpt2"].build().parameters())
    results = run_ranks(resume, out, int(0.9 * param_bytes))  # under eviction
    assert len(results) == 2 and all("error" not in r for r in results), results
    return out, results


def test_two_ranks_resume_bit_exactly(run: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = run
    for r in results:
        assert r["moves_to_host"] > 0, "no eviction happened"
        assert r["resumed"] == r["uninterrupted"][SAVE_AFTER:STEPS], r
    assert results[0]["run_id"] == results[1]["run_id"], "the ranks drew different run ids"


def test_two_ranks_refuse_shards_of_different_steps(run: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = run
    for r in results:  # every rank refuses (none is left waiting), naming the file and both values
        assert "field 'step' is 5 in rank1-of-2.safetensors but 3 in rank0-of-2.safetensors" in r["mixed"], r["mixed"]
    with pytest.raises(CheckpointError, match=r"rank1-of-2\.safetensors: field 'step' is '5' but rank0-of-2\.safetensors has '3'"):
        merge_checkpoint(out / "mixed")


def test_merge_refuses_a_shard_of_another_run(run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    out, results = run
    for rank in (0, 1):
        step3 = out / "ckpt3" / (out / "ckpt3" / "latest").read_text().strip()  # the published save
        with safe_open(str(step3 / f"rank{rank}-of-2.safetensors"), framework="pt") as h:
            meta = dict(h.metadata())
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        assert meta["run_id"] == results[0]["run_id"] and meta["step"] == str(SAVE_AFTER)
        if rank == 1:
            meta["run_id"] = uuid.uuid4().hex  # a stale shard of another run
        safetensors.torch.save_file(tensors, str(tmp_path / f"rank{rank}-of-2.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=rf"rank1-of-2\.safetensors: field 'run_id' is '{meta['run_id']}' but rank0"):
        merge_checkpoint(tmp_path)


def test_a_two_rank_checkpoint_into_one_process(run: tuple[Path, list[dict[str, Any]]], tmp_path: Path) -> None:
    out, _ = run
    param_bytes = sum(p.numel() * 4 for p in CASES["gpt2"].build().parameters())
    engine, _ = chunkstar.initialize_engine(CASES["gpt2"].build, 0, engine_config("fp32", budget=4 * param_bytes, chunk_size=CHUNK))
    with pytest.raises(CheckpointError, match=r"written by 2 rank.*this engine runs 1.*merge-checkpoint.*load_state_dict"):
        engine.load_checkpoint(str(out / "ckpt3"))
    merged = merge_checkpoint(out / "ckpt3", tmp_path / "merged.safetensors")  # the way the message suggests
    engine.load_state_dict(merged)


# ---------------------------------------------------------------------- a save killed on one rank
KILLS = ("before-write", "before-publish")


@dataclass
class Kill:
    out: Path
    results: dict[int, dict[str, Any]]  # by rank
    merged: dict[str, torch.Tensor]
    merged_step: str
    loaded: dict[int, dict[str, Any]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def kills(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Kill]:
    """Each kill in its own pair of processes (the dead rank breaks the group), merged
    here, then one pair that loads what each left behind (and saves into it again)."""
    kills = {}
    for when in KILLS:
        out = tmp_path_factory.mktemp(when)
        results = {r["rank"]: r for r in run_ranks(killed_save, out, when)}
        merged_path = out / "merged.safetensors"
        merged = merge_checkpoint(out / "ckpt", merged_path)
        with safe_open(str(merged_path), framework="pt") as h:
            kills[when] = Kill(out, results, merged, h.metadata()["step"])
    loaded = run_ranks(load_after_kill, tmp_path_factory.mktemp("load"), *(str(k.out / "ckpt") for k in kills.values()))
    assert len(loaded) == 2 and all("error" not in r for r in loaded), loaded
    for k in kills.values():
        k.loaded = {r["rank"]: r[str(k.out / "ckpt")] for r in loaded}
    return kills


def test_a_failed_write_on_one_rank_fails_every_rank_and_publishes_nothing(kills: dict[str, Kill]) -> None:
    for kill in kills.values():
        assert "File too large" in kill.results[1]["failed_write"], kill.results[1]
        assert "rank(s) [1] could not write" in kill.results[0]["failed_write"], kill.results[0]


@pytest.mark.parametrize("when", KILLS)
def test_a_save_killed_on_one_rank_leaves_the_previous_checkpoint(when: str, kills: dict[str, Kill]) -> None:
    kill = kills[when]
    survivor = kill.results[1]
    assert "error" not in survivor, survivor
    assert survivor["killed_save"].startswith("DistributedError"), survivor  # not a hang, not a success
    step3 = torch.load(kill.out / "step3.pt", weights_only=True)
    assert kill.merged_step == str(SAVE_AFTER)
    assert all(torch.equal(v, step3[k]) for k, v in kill.merged.items())
    for entry in kill.loaded.values():
        assert entry["load"] == "loaded" and entry["step"] == SAVE_AFTER, entry
        assert entry["step_after_save"] == SAVE_AFTER + 1, entry
    ckpt = kill.out / "ckpt"
    back = torch.load(ckpt.with_suffix(".loaded.pt"), weights_only=True)
    assert all(torch.equal(v, step3[k]) for k, v in back.items())
    # the next save published itself and removed the unfinished one and the one it replaced
    assert sorted(f.name for f in ckpt.iterdir() if not f.name.startswith("step-")) == ["latest"]
    assert len([f for f in ckpt.iterdir() if f.name.startswith("step-")]) == 1


def test_a_folder_each_rank_sees_alone_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    """Note [one folder for every rank]: ranks given folders that are not one (a path local to
    each node) hear so at the save, on every rank; rank 1 does not see rank 0's ``latest``."""
    results = run_ranks(unshared_save, tmp_path)
    assert len(results) == 2 and all("error" not in r for r in results), results
    for r in results:
        assert "rank(s) [1] do not see the save rank 0 published" in r["unshared"], r["unshared"]
        assert "a filesystem the nodes share" in r["unshared"]
        assert r["shared"].endswith(f"rank{r['rank']}-of-2.safetensors")

