"""Checkpoint files: atomic writes and publication, leftovers of a killed save,
unreadable, foreign and tampered shards, shard identities, the layout of earlier
versions, saves that cannot write, and loads into an engine they do not fit.
Every failure is a CheckpointError that names the file, never a parser traceback."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import chunkstar
from chunkstar.checkpoint import CheckpointError, main_merge, merge_checkpoint
from chunkstar.cli import main as cli_main

from tests.core._faults import file_size_limit
from tests.core._models import CASES, build_mlp, engine_config, train_engine

SHARD = "rank0-of-1.safetensors"
BUDGET = 1 << 24  # roomy: these tests are about files


def _engine(dtype: str = "fp32", chunk_size: int = 4096, **extra: Any) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    return chunkstar.initialize_engine(CASES["mlp"].build, 0, engine_config(dtype, budget=BUDGET, chunk_size=chunk_size, **extra))


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


def _published(ckpt: Path) -> Path:
    """The step directory that ``latest`` names (Note [multi-rank checkpoints])."""
    return ckpt / (ckpt / "latest").read_text().strip()


def _shard(ckpt: Path) -> Path:
    return _published(ckpt) / SHARD


def _contents(ckpt: Path) -> list[str]:
    """What a checkpoint directory holds, the step directories' names cut to 'step-N'."""
    return sorted("-".join(f.name.split("-")[:2]) if f.name.startswith("step-") else f.name for f in ckpt.iterdir())


def _rewrite(shard: Path, **changes: str | None) -> None:
    """Rewrite a shard with some metadata fields changed (None: removed)."""
    with safe_open(str(shard), framework="pt") as h:
        meta = dict(h.metadata())
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    safetensors.torch.save_file(tensors, str(shard), metadata=meta)


def _same_weights(a: chunkstar.ChunkEngine, b: chunkstar.ChunkEngine) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_shard_records_its_identity(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    with safe_open(str(_shard(ckpt)), framework="pt") as h:
        meta = h.metadata()
    assert meta["run_id"] == engine.run_id and len(engine.run_id) == 32
    assert meta["step"] == "2" and meta["world_size"] == "1" and meta["rank"] == "0"
    assert len(meta["layout"]) == 64 and meta["dtype"] == "torch.float32"
    assert json.loads(meta["optimizer"])["kind"] == "AdamW"
    assert _contents(ckpt) == ["latest", "step-2"] and _leftovers(ckpt) == [] and _leftovers(_published(ckpt)) == []


def test_a_truncated_shard_is_named_and_the_next_save_replaces_it(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # say, a copy that did not finish
    fresh, _ = _engine()
    with pytest.raises(CheckpointError, match=r"rank0-of-1\.safetensors.*truncated"):
        fresh.load_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match=r"rank0-of-1\.safetensors.*truncated"):
        merge_checkpoint(ckpt)
    engine.save_checkpoint(str(ckpt))
    assert _contents(ckpt) == ["latest", "step-2"] and not shard.parent.exists()
    fresh.load_checkpoint(str(ckpt))
    assert _same_weights(fresh, engine)


def _die_publishing(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    """The process is killed (an exception nobody handles) as it publishes a save."""
    replace = os.replace

    def die(src: Any, dst: Any) -> None:
        if Path(dst).parent == ckpt:  # the pointer; the shards are in their step directory
            raise KeyboardInterrupt("killed")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", die)


def test_a_save_killed_before_it_is_published_is_ignored_then_cleaned_up(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, engine = saved
    at_step_2 = merge_checkpoint(ckpt)
    optimizer = engine.optimizer
    assert optimizer is not None
    train_engine(engine, optimizer, CASES["mlp"], range(2, 4))
    _die_publishing(monkeypatch, ckpt)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(ckpt))
    monkeypatch.undo()
    assert _contents(ckpt) == ["latest", "step-2", "step-4"]  # written, never published

    fresh, fresh_opt = _engine()
    fresh.load_checkpoint(str(ckpt))
    assert fresh_opt.step_count == 2
    merged = merge_checkpoint(ckpt, tmp_path / "merged.safetensors")
    assert all(torch.equal(merged[k], v) for k, v in at_step_2.items())
    with safe_open(str(tmp_path / "merged.safetensors"), framework="pt") as h:
        assert h.metadata()["step"] == "2"
    (_published(ckpt) / f".{SHARD}.0123456789ab.tmp").write_bytes(b"partial")  # more debris
    (ckpt / ".latest.0123456789ab.tmp").write_bytes(b"step-")

    engine.save_checkpoint(str(ckpt))  # publishes step 4 again, removes the rest
    assert _contents(ckpt) == ["latest", "step-4"] and _leftovers(_published(ckpt)) == []
    fresh.load_checkpoint(str(ckpt))
    assert fresh_opt.step_count == 4 and _same_weights(fresh, engine)


def test_two_saves_at_the_same_step_are_two_checkpoints(tmp_path: Path) -> None:
    engine, _ = _engine()
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt))  # before any step
    first = _published(ckpt)
    other = build_mlp(seed=11).state_dict()
    engine.load_state_dict(other)  # new weights, still step 0
    engine.save_checkpoint(str(ckpt))
    assert _published(ckpt) != first and not first.exists() and _contents(ckpt) == ["latest", "step-0"]
    fresh, _ = _engine()
    fresh.load_checkpoint(str(ckpt))
    assert all(torch.equal(v, other[k]) for k, v in fresh.state_dict().items())


def test_the_flat_layout_of_earlier_versions_loads_and_merges(saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path) -> None:
    """Shards directly in the directory, as chunkstar wrote them before step directories."""
    ckpt, engine = saved
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(_shard(ckpt), flat / SHARD)
    fresh, fresh_opt = _engine()
    fresh.load_checkpoint(str(flat))
    assert fresh_opt.step_count == 2 and _same_weights(fresh, engine)
    merged = merge_checkpoint(flat)
    assert all(torch.equal(merged[k], v) for k, v in engine.state_dict().items())
    # a save into it publishes a step directory and removes the flat shard it supersedes
    fresh.save_checkpoint(str(flat))
    assert _contents(flat) == ["latest", "step-2"]
    fresh.load_checkpoint(str(flat))


@pytest.mark.parametrize("pointer", ["step-9-0123456789abcdef", "../ckpt", "", "step-2"])
def test_a_damaged_pointer_is_named(pointer: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    (ckpt / "latest").write_text(pointer + "\n")
    fresh, _ = _engine()
    with pytest.raises(CheckpointError, match=r"latest"):
        fresh.load_checkpoint(str(ckpt))
    with pytest.raises(CheckpointError, match=r"latest"):
        merge_checkpoint(ckpt)


def test_a_failed_write_keeps_the_previous_shard(saved: tuple[Path, chunkstar.ChunkEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt, engine = saved
    shard = _shard(ckpt)
    before = shard.read_bytes()
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    def replace(*args: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match=r"rank0-of-1\.safetensors.*disk full.*previous checkpoint"):
        engine.save_checkpoint(str(ckpt))
    assert synced, "the temporary file was not fsynced before the rename"
    assert shard.read_bytes() == before and _contents(ckpt) == ["latest", "step-2"] and _leftovers(shard.parent) == []
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
        (ckpt / SHARD).write_bytes(b"\x00" * 4 + b"this is not a checkpoint" * 10)  # the flat layout
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
    files = sorted(f for f in ckpt.rglob("*") if f.is_file())
    before = {f: f.read_bytes() for f in files}
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        merge_checkpoint(ckpt, _shard(ckpt))  # a shard itself
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        merge_checkpoint(ckpt, ckpt / "merged.safetensors")
    with pytest.raises(CheckpointError, match="inside the checkpoint directory"):
        merge_checkpoint(ckpt, ckpt / "latest")
    assert {f: f.read_bytes() for f in sorted(f for f in ckpt.rglob("*") if f.is_file())} == before
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
    _shard(ckpt).rename(_published(ckpt) / "rank0-of-2.safetensors")  # as if two ranks had written it
    engine, _ = _engine()
    with pytest.raises(CheckpointError, match=r"written by 2 rank.*this engine runs 1.*merge-checkpoint.*load_state_dict"):
        engine.load_checkpoint(str(ckpt))


def test_merge_refuses_shards_of_different_steps(saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path) -> None:
    """Two shards that disagree on the step: the second one is named, with both values."""
    ckpt, _ = saved
    for rank in (0, 1):  # a two-rank checkpoint made of the same shard, once with another step
        with safe_open(str(_shard(ckpt)), framework="pt") as h:
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


# ---------------------------------------------------------------------- the optimizer's kind
ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}}


def test_a_checkpoint_loads_only_into_its_kind_of_optimizer(saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, engine = saved
    adam, _ = _engine(**ADAM)
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'AdamW'.*'Adam'"):
        adam.load_checkpoint(str(ckpt))
    train_engine(adam, adam.optimizer, CASES["mlp"], 1)  # type: ignore[arg-type]
    adam.save_checkpoint(str(ckpt / "adam"))
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'Adam'.*'AdamW'"):
        _engine()[0].load_checkpoint(str(ckpt / "adam"))
    # a shard written before the kind was recorded loads as it did
    old = json.loads(_meta(_shard(ckpt))["optimizer"])
    del old["kind"]
    _rewrite(_shard(ckpt), optimizer=json.dumps(old))
    fresh, _ = _engine()
    fresh.load_checkpoint(str(ckpt))
    assert _same_weights(fresh, engine)


def _meta(shard: Path) -> dict[str, str]:
    with safe_open(str(shard), framework="pt") as h:
        return dict(h.metadata())


# ---------------------------------------------------------------------- tampered metadata
def _field(key: str, **changes: Any) -> Callable[[dict[str, str]], str]:
    """The shard's JSON field ``key`` with some of its entries changed."""
    return lambda meta: json.dumps(json.loads(meta[key]) | changes)


def _first_group(**changes: Any) -> Callable[[dict[str, str]], str]:
    def change(meta: dict[str, str]) -> str:
        opt = json.loads(meta["optimizer"])
        opt["param_groups"][0].update(changes)
        return json.dumps(opt)

    return change


def _first_slot(i: int, value: Any) -> Callable[[dict[str, str]], str]:
    def change(meta: dict[str, str]) -> str:
        slots = json.loads(meta["slots"])
        slots[0][i] = value
        return json.dumps(slots)

    return change


TAMPERED: dict[str, tuple[str, str | Callable[[dict[str, str]], str]]] = {
    "optimizer-not-json": ("optimizer", "{steps: [1"),
    "optimizer-a-list": ("optimizer", "[1, 2]"),
    "optimizer-steps": ("optimizer", _field("optimizer", steps="many")),
    "optimizer-steps-short": ("optimizer", _field("optimizer", steps=[1])),
    "optimizer-step-count": ("optimizer", _field("optimizer", step_count=2.5)),
    "optimizer-kind": ("optimizer", _field("optimizer", kind=3)),
    "optimizer-groups": ("optimizer", _field("optimizer", param_groups={"lr": 1})),
    "optimizer-group-params": ("optimizer", _first_group(params="all")),
    "optimizer-group-lr": ("optimizer", _first_group(lr="fast")),
    "optimizer-group-betas": ("optimizer", _first_group(betas=[0.9])),
    "loss_scaler-not-json": ("loss_scaler", "scale=1"),
    "loss_scaler-a-list": ("loss_scaler", "[]"),
    "loss_scaler-scale": ("loss_scaler", _field("loss_scaler", scale="big")),
    "loss_scaler-negative": ("loss_scaler", _field("loss_scaler", scale=-1.0)),
    "loss_scaler-missing": ("loss_scaler", '{"scale": 1.0}'),
    "slots-not-json": ("slots", "[["),
    "slots-a-dict": ("slots", "{}"),
    "slots-chunk": ("slots", _first_slot(1, "zero")),
    "slots-out-of-chunk": ("slots", _first_slot(2, 10**9)),
    "slots-shape": ("slots", _first_slot(4, [3, 3])),
    "chunk_sizes-not-json": ("chunk_sizes", "4096,"),
    "chunk_sizes-type": ("chunk_sizes", '{"a": 1}'),
    "chunk_sizes-strings": ("chunk_sizes", '["4096"]'),
    "aliases-not-json": ("aliases", "{"),
    "aliases-type": ("aliases", '{"0.weight": 3}'),
    "step": ("step", "three"),
    "run_id": ("run_id", "not-a-run-id"),
}
LOAD_ONLY = ("optimizer", "loss_scaler")  # merge reads the weights only


@pytest.mark.parametrize("case", list(TAMPERED))
def test_tampered_metadata_is_a_checkpoint_error(case: str, saved: tuple[Path, chunkstar.ChunkEngine]) -> None:
    ckpt, _ = saved
    field, value = TAMPERED[case]
    shard = _shard(ckpt)
    _rewrite(shard, **{field: value(_meta(shard)) if callable(value) else value})
    fresh, _ = _engine()
    before = fresh.state_dict()
    with pytest.raises(CheckpointError, match=rf"{SHARD}.*'{field}"):
        fresh.load_checkpoint(str(ckpt))
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items()), "a refused load changed the engine"
    if field in LOAD_ONLY:
        merge_checkpoint(ckpt)
    else:
        with pytest.raises(CheckpointError, match=rf"{SHARD}.*'{field}"):
            merge_checkpoint(ckpt)


# ---------------------------------------------------------------------- saves and merges that cannot write
def test_a_save_that_cannot_write_is_a_checkpoint_error_and_keeps_the_previous_one(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path
) -> None:
    ckpt, engine = saved
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CheckpointError, match=r"afile.*Not a directory"):
        engine.save_checkpoint(str(afile / "ckpt"))  # under a file
    with pytest.raises(CheckpointError, match=r"afile.*is a file"):
        engine.save_checkpoint(str(afile))
    shard = _shard(ckpt)
    before = shard.read_bytes()
    full = r"rank0-of-1\.safetensors.*File too large.*previous checkpoint"
    with file_size_limit(64 << 10), pytest.raises(CheckpointError, match=full):
        engine.save_checkpoint(str(ckpt))  # the disk is full
    assert shard.read_bytes() == before and _contents(ckpt) == ["latest", "step-2"]
    fresh, _ = _engine()
    fresh.load_checkpoint(str(ckpt))
    assert _same_weights(fresh, engine)


def _read_only_dir(tmp_path: Path) -> Path:
    ro = tmp_path / "read-only"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):
        pytest.skip("a read-only mode does not stop this user (root) from writing")
    return ro


def test_a_save_into_a_read_only_directory_is_a_checkpoint_error(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path
) -> None:
    _, engine = saved
    ro = _read_only_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"read-only.*Permission denied"):
        engine.save_checkpoint(str(ro / "ckpt"))
    with pytest.raises(CheckpointError, match=r"read-only.*Permission denied"):
        engine.save_checkpoint(str(ro))


def test_merge_that_cannot_write_prints_one_line(
    saved: tuple[Path, chunkstar.ChunkEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt, _ = saved
    out = tmp_path / "merged.safetensors"
    with file_size_limit(64 << 10):  # the disk is full
        assert cli_main(["merge-checkpoint", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("chunkstar merge-checkpoint: ") and "File too large" in err, err
    assert not out.exists() and _leftovers(tmp_path) == []
    ro = _read_only_dir(tmp_path)
    assert cli_main(["merge-checkpoint", str(ckpt), str(ro / "merged.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Permission denied" in err, err
