"""Two gloo ranks: save on both, load on both into engines of other weights, continue
bit for bit; shards of different steps or runs, or of another world size, are refused."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
from safetensors import safe_open

import chunkstar
from chunkstar.checkpoint import CheckpointError, merge_checkpoint
from tests.core._models import CASES, engine_config

from ._ckpt_worker import SAVE_AFTER, STEPS, resume
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
        with safe_open(str(out / "ckpt3" / f"rank{rank}-of-2.safetensors"), framework="pt") as h:
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
