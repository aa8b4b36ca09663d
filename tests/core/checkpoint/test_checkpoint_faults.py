"""Checkpoint faults no other test names (issue 30, item 8): a shard whose bytes changed,
a save in the middle of gradient accumulation, a pointer or shard that is a FIFO, a full
disk at publication, and output names too long for the filesystem. Each is refused with
one CheckpointError (or ChunkStateError) that says what to do; none loads silently, hangs
or leaves the directory unable to take the next save."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import chunkstar
from chunkstar.checkpoint import CheckpointError, merge_checkpoint
from chunkstar.cli import main as cli_main

from tests.core._models import CASES, engine_config, train_engine

SHARD = "rank0-of-1.safetensors"
BUDGET = 1 << 24
MLP = CASES["mlp"]


def _engine(**extra: Any) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    return chunkstar.initialize_engine(MLP.build, 0, engine_config("fp32", budget=BUDGET, **extra))


def _shard(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip() / SHARD


def _weights(engine: chunkstar.ChunkEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, chunkstar.ChunkEngine]:
    engine, optimizer = _engine()
    train_engine(engine, optimizer, MLP, 2)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt))
    return ckpt, engine


# ---------------------------------------------------------------------- changed bytes (Note [shard checksums])
def _data_range(shard: Path, key: str) -> tuple[int, int]:
    """Where tensor ``key``'s bytes lie in the safetensors file (8-byte header size, JSON header, data)."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
    return 8 + n + begin, 8 + n + end


def _flip(shard: Path, key: str) -> None:
    """Four bytes in the middle of ``key`` become 0xFF (a float32 NaN), as a bad disk or copy would."""
    begin, end = _data_range(shard, key)
    at = (begin + (end - begin) // 2) // 4 * 4
    with open(shard, "r+b") as f:
        f.seek(at)
        f.write(b"\xff" * 4)


@pytest.mark.parametrize("key", ["master.0", "exp_avg_sq.1", "buffer"])
def test_a_shard_with_changed_bytes_is_refused_naming_the_tensor(key: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    shard = _shard(ckpt)
    if key == "buffer":  # the MLP has none: a model with a buffer of its own
        engine, optimizer = _engine()
        engine.module[1].register_buffer("seen", torch.arange(6.0))
        engine.save_checkpoint(str(ckpt))
        shard, key = _shard(ckpt), "buffer.1.seen"
    _flip(shard, key)
    fresh, _ = _engine()
    before = _weights(fresh)
    with pytest.raises(CheckpointError, match=rf"{SHARD}: tensor '{key}'.* checksum"):
        fresh.load_checkpoint(str(ckpt))
    assert _same(_weights(fresh), before), "a refused load changed the engine"
    if not key.startswith("exp_avg"):  # merge reads the weights (and rank 0's buffers) only
        with pytest.raises(CheckpointError, match=rf"{SHARD}: tensor '{key}'.* checksum"):
            merge_checkpoint(ckpt)


def test_the_checksum_names_the_parameters_of_a_damaged_chunk(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    _flip(_shard(ckpt), "master.0")
    with pytest.raises(CheckpointError, match=r"'0\.weight'") as info:
        _engine()[0].load_checkpoint(str(ckpt))
    assert "save_checkpoint" in str(info.value) or "earlier checkpoint" in str(info.value)


def _rewrite(shard: Path, **changes: str | None) -> None:
    with safe_open(str(shard), framework="pt") as h:
        meta = dict(h.metadata())
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    safetensors.torch.save_file(tensors, str(shard), metadata=meta)


def test_a_shard_written_before_checksums_loads_with_a_warning(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    _rewrite(_shard(ckpt), crc32=None)
    fresh, fresh_opt = _engine()
    with pytest.warns(RuntimeWarning, match=rf"{SHARD}.*no checksums.*save"):
        fresh.load_checkpoint(str(ckpt))
    assert fresh_opt.step_count == 2 and _same(_weights(fresh), _weights(engine))
    with pytest.warns(RuntimeWarning, match="no checksums"):
        merge_checkpoint(ckpt)


@pytest.mark.parametrize("value", ["{", "[1, 2]", '{"master.0": "x"}', '{"master.0": 1}'])
def test_a_damaged_checksum_field_is_named(value: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    _rewrite(_shard(ckpt), crc32=value)
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'crc32'"):
        _engine()[0].load_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'crc32'"):
        merge_checkpoint(ckpt)


# ---------------------------------------------------------------------- gradients no step consumed
def test_a_save_in_the_middle_of_gradient_accumulation_is_refused(tmp_path: Path) -> None:
    engine, optimizer = _engine(accum=2)
    train_engine(engine, optimizer, MLP, 1, accum=2)
    engine.save_checkpoint(str(tmp_path / "at-step"))  # between steps: nothing pending
    engine.backward(MLP.loss(engine, MLP.batch(2), torch.float32))  # one micro-batch of two
    with pytest.raises(chunkstar.ChunkStateError, match=r"1 of 2 micro-batch.*optimizer\.step\(\)") as info:
        engine.save_checkpoint(str(tmp_path / "mid"))
    assert "zero_grad" in str(info.value)
    assert not (tmp_path / "mid" / "latest").exists()
    engine.backward(MLP.loss(engine, MLP.batch(3), torch.float32))  # the last one: the gradients wait for the step
    with pytest.raises(chunkstar.ChunkStateError, match=r"optimizer\.step\(\)"):
        engine.save_checkpoint(str(tmp_path / "mid"))
    optimizer.step()
    optimizer.zero_grad()
    engine.save_checkpoint(str(tmp_path / "mid"))
    fresh, fresh_opt = _engine(accum=2)
    fresh.load_checkpoint(str(tmp_path / "mid"))
    assert fresh_opt.step_count == 2 and _same(_weights(fresh), _weights(engine))


# ---------------------------------------------------------------------- files that are no regular files
def _timed(fn: Callable[[], Any], fifo: Path, seconds: float, took: list[float]) -> None:
    """``fn()``, its duration appended to ``took``. A read blocked on ``fifo`` is let go after
    ``seconds`` by another process opening its other end (a blocked open may hold the GIL,
    so no thread of this process could)."""
    unblock = subprocess.Popen(["sh", "-c", f'sleep {seconds}; exec 3>"$0"', str(fifo)])
    start = time.monotonic()
    try:
        fn()
    finally:
        took.append(time.monotonic() - start)
        unblock.kill()
        unblock.wait()


@pytest.mark.parametrize("which", ["latest", "shard"])
def test_a_pointer_or_shard_that_is_a_fifo_is_refused_at_once(which: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    path = ckpt / "latest" if which == "latest" else _shard(ckpt)
    path.unlink()
    os.mkfifo(path)
    fresh, _ = _engine()
    took: list[float] = []
    for read in (lambda: fresh.load_checkpoint(str(ckpt)), lambda: merge_checkpoint(ckpt)):
        with pytest.raises(CheckpointError, match=rf"{path.name}: is not a regular file .*FIFO"):
            _timed(read, path, 10, took)
    assert max(took) < 10, f"a read waited on the FIFO: {took}"


# ---------------------------------------------------------------------- a full disk at publication
def _disk_of(root: Path, capacity: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk of ``capacity`` bytes under ``root``: writing a shard (or the pointer) that
    does not fit beside every file already there fails with ENOSPC."""
    st = safetensors.torch
    save_file = st.save_file

    def used() -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    def save(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        if used() + need > capacity:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", save)


def test_a_full_disk_at_publication_leaves_room_for_the_next_save(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, engine = saved
    optimizer = engine.optimizer
    assert optimizer is not None
    shard_bytes = _shard(ckpt).stat().st_size
    _disk_of(tmp_path, int(2.5 * shard_bytes), monkeypatch)  # two shards fit, three do not
    replace = os.replace

    def full_at_the_pointer(src: Any, dst: Any) -> None:
        if Path(dst).name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        replace(src, dst)

    train_engine(engine, optimizer, MLP, range(2, 3))
    monkeypatch.setattr(os, "replace", full_at_the_pointer)
    with pytest.raises(CheckpointError, match=r"latest.*No space left.*not published"):
        engine.save_checkpoint(str(ckpt))
    monkeypatch.setattr(os, "replace", replace)
    for step in range(3, 5):  # every later save fits again
        train_engine(engine, optimizer, MLP, range(step, step + 1))
        engine.save_checkpoint(str(ckpt))
    steps = sorted(f.name.split("-")[1] for f in ckpt.iterdir() if f.name.startswith("step-"))
    assert steps == ["5"], f"saves left behind: {steps}"
    fresh, fresh_opt = _engine()
    fresh.load_checkpoint(str(ckpt))
    assert fresh_opt.step_count == 5 and _same(_weights(fresh), _weights(engine))


# ---------------------------------------------------------------------- names too long
def test_merge_output_names_too_long_for_the_filesystem(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, engine = saved
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    too_long = tmp_path / ("m" * (name_max + 1))
    assert cli_main(["merge-checkpoint", str(ckpt), str(too_long)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too long" in err and "Traceback" not in err, err
    with pytest.raises(CheckpointError, match="too long"):
        merge_checkpoint(tmp_path / ("d" * (name_max + 1)), tmp_path / "out.safetensors")  # the checkpoint's name
    with pytest.raises(CheckpointError, match="too long"):
        engine.save_checkpoint(str(tmp_path / ("s" * (name_max + 1))))
    # the longest name the filesystem takes is a name the merge writes (its temporary file's too)
    longest = tmp_path / ("m" * (name_max - len(".safetensors")) + ".safetensors")
    assert cli_main(["merge-checkpoint", str(ckpt), str(longest)]) == 0
    merged = safetensors.torch.load_file(str(longest))
    assert _same(merged, _weights(engine))
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")) == []
