"""Checkpoint files: atomic writes, leftovers of a killed save, unreadable and
foreign shards, shard identities, and loads into an engine they do not fit.
Every failure is a CheckpointError that names the file, never a parser traceback."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import chunkstar
from chunkstar.checkpoint import CheckpointError, main_merge, merge_checkpoint

from ._models import CASES, engine_config, train_engine

SHARD = "rank0-of-1.safetensors"
BUDGET = 1 << 24  # roomy: these tests are about files


def _engine(dtype: str = "fp32", chunk_size: int = 4096) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    return chunkstar.initialize_engine(CASES["mlp"].build, 0, engine_config(dtype, budget=BUDGET, chunk_size=chunk_size))


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, chunkstar.ChunkEngine]:
    """A checkpoint of the MLP after two optimizer steps."""
    engine, optimizer = _engine()
    train_engine(engine, optimizer, CASES["mlp"], 2)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt))
    return ckpt, engine


def _leftovers(directory: Path) -> list[str]:
    return sorted(f.name for f in directory.iterdir() if f.name.endswith(".tmp"))


def test_a_shard_records_its_identity(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    with safe_open(str(ckpt / SHARD), framework="pt") as h:
        meta = h.metadata()
    assert meta["run_id"] == engine.run_id and len(engine.run_id) == 32
    assert meta["step"] == "2" and meta["world_size"] == "1" and meta["rank"] == "0"
    assert len(meta["layout"]) == 64 and meta["dtype"] == "torch.float32"
    assert _leftovers(ckpt) == []


def test_a_killed_save_is_cleaned_up_and_a_truncated_shard_is_named(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    shard = ckpt / SHARD
    # what a save killed mid-way leaves behind: its temporary file, and (say, from a
    # copy that did not finish) a truncated shard
    temp = ckpt / f".{SHARD}.0123456789ab.tmp"
    temp.write_bytes(shard.read_bytes()[:1000])
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    fresh, _ = _engine()
    with pytest.raises(CheckpointError, match=r"rank0-of-1\.safetensors.*truncated"):
        fresh.load_checkpoint(str(ckpt))
    assert not temp.exists(), "load left the temporary file of the killed save behind"
    with pytest.raises(CheckpointError, match=r"rank0-of-1\.safetensors.*truncated"):
        merge_checkpoint(ckpt)

    temp.write_bytes(b"partial")
    engine.save_checkpoint(str(ckpt))  # the next save replaces the shard and removes the leftover
    assert _leftovers(ckpt) == []
    fresh.load_checkpoint(str(ckpt))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), engine.state_dict().values()))


def test_a_failed_write_keeps_the_previous_shard(saved: tuple[Path, chunkstar.ChunkEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, engine = saved
    before = (ckpt / SHARD).read_bytes()
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    def replace(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(str(ckpt))
    assert synced, "the temporary file was not fsynced before the rename"
    assert (ckpt / SHARD).read_bytes() == before and _leftovers(ckpt) == []
    monkeypatch.undo()
    synced.clear()
    monkeypatch.setattr(os, "fsync", fsync)
    engine.save_checkpoint(str(ckpt))
    assert len(synced) >= 2, "file and directory are both fsynced"


@pytest.mark.parametrize("content", ["junk", "plain-safetensors"])
def test_a_foreign_file_named_like_a_shard(content: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    if content == "junk":
        (ckpt / SHARD).write_bytes(b"\x00" * 4 + b"this is not a checkpoint" * 10)
        what = "cannot read it as a safetensors file"
    else:
        safetensors.torch.save_file({"weight": torch.zeros(3)}, str(ckpt / SHARD))
        what = "not a chunkstar checkpoint shard"
    engine, _ = _engine()
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*{what}"):
        engine.load_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*{what}"):
        merge_checkpoint(ckpt)


def test_merge_refuses_bad_outputs(saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, engine = saved
    with pytest.raises(CheckpointError, match=r"no_such_folder.*does not exist"):
        merge_checkpoint(ckpt, tmp_path / "no_such_folder" / "merged.safetensors")
    with pytest.raises(CheckpointError, match="is a directory"):
        merge_checkpoint(ckpt, tmp_path)
    assert main_merge([str(ckpt), str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    out = tmp_path / "merged.safetensors"
    assert main_merge([str(ckpt), str(out)]) == 0
    assert _leftovers(tmp_path) == []
    merged = safetensors.torch.load_file(str(out))
    assert all(torch.equal(merged[k], v) for k, v in engine.state_dict().items())
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_merge_never_destroys_its_input_a_device_or_an_existing_file(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = saved
    shards = sorted(ckpt.iterdir())
    before = {f: f.read_bytes() for f in shards}
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        merge_checkpoint(ckpt, shards[0])  # a shard itself
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        merge_checkpoint(ckpt, ckpt / "merged.safetensors")
    assert {f: f.read_bytes() for f in sorted(ckpt.iterdir())} == before
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        merge_checkpoint(ckpt, fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    with pytest.raises(CheckpointError, match="not a regular file"):
        merge_checkpoint(ckpt, "/dev/null")
    out = tmp_path / "merged.safetensors"
    out.write_bytes(b"mine")
    assert main_merge([str(ckpt), str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"mine"
    assert main_merge([str(ckpt), str(out), "--force"]) == 0
    assert out.read_bytes() != b"mine"


@pytest.mark.parametrize("other", ["chunk_size", "precision"])
def test_load_refuses_another_layout(other: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    engine, _ = _engine(chunk_size=2048) if other == "chunk_size" else _engine(dtype="bf16")
    why = "default_chunk_size differs" if other == "chunk_size" else "precision differs"
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'layout'.*{why}.*merge-checkpoint"):
        engine.load_checkpoint(str(ckpt))


def test_load_refuses_another_world_size(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    (ckpt / SHARD).rename(ckpt / "rank0-of-2.safetensors")  # as if two ranks had written it
    engine, _ = _engine()
    with pytest.raises(CheckpointError, match=r"written by 2 rank.*this engine runs 1.*merge-checkpoint.*load_state_dict"):
        engine.load_checkpoint(str(ckpt))


def test_merge_refuses_shards_of_different_steps(saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path) -> None:
    """Two shards that disagree on the step: the second one is named, with both values."""
    ckpt, _ = saved
    for rank in (0, 1):  # a two-rank checkpoint made of the same shard, once with another step
        with safe_open(str(ckpt / SHARD), framework="pt") as h:
            meta = dict(h.metadata())
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        meta.update(rank=str(rank), world_size="2", step=str(2 + rank))
        safetensors.torch.save_file(tensors, str(tmp_path / f"rank{rank}-of-2.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match=r"rank1-of-2\.safetensors: field 'step' is '3' but rank0-of-2\.safetensors has '2'"):
        merge_checkpoint(tmp_path)
    assert json.loads(meta["slots"])  # the layout travels as JSON metadata


def test_load_refuses_pending_gradients(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    engine, _ = _engine()
    case = CASES["mlp"]
    engine.backward(case.loss(engine, case.batch(0), torch.float32))
    with pytest.raises(chunkstar.ChunkStateError, match="gradients are pending"):
        engine.load_checkpoint(str(ckpt))
