"""Per-rank checkpoints: save, load (exact resume), and merge into one state dict.

``engine.save_checkpoint(dir)`` has every rank write the chunks it owns (fp32
master, exp_avg, exp_avg_sq; a frozen chunk's param chunk) to ``rank{r}-of-{W}.safetensors``, with, as
safetensors metadata, the layout (which parameter sits in which chunk at which
offset), the optimizer's scalar state (per-parameter step counts, parameter
group settings such as lr, skipped steps), the loss scaler's state, the model's
buffers, and the shard's identity (Note [shard identity]). Nothing is gathered:
saving costs no communication and no rank holds more than its share.

``engine.load_checkpoint(dir)`` reads this rank's shard back into the chunks
(wherever they are, host or device), refreshes the param chunks from the
masters, and restores the optimizer and the scaler, so training continues bit
for bit as if it had never stopped. It needs an engine of the same layout and
world size; for anything else, ``chunkstar merge-checkpoint DIR OUT.safetensors``
(or :func:`merge_checkpoint`) reassembles every parameter from its owner's
master chunk into a plain state dict keyed by the model's parameter names (tied
parameters once, under their first name, as Hugging Face does), which
``model.load_state_dict`` of the plain model or ``engine.load_state_dict`` of an
engine of any world size loads (weights only; Adam starts afresh).

Note [shard identity]: every shard records the engine's run id (drawn once at
start-up, the same on every rank: Note [start-up agreement] in
:mod:`chunkstar.distributed.startup`), the optimizer step, the world size and
the layout fingerprint (:func:`~chunkstar.chunk.layout.layout_fingerprint`).
Loading and merging refuse a set of shards that disagree on any of them (a
stale shard of an earlier save would otherwise be stitched into mixed weights)
and name the file, the field and both values.

Note [atomic files]: a shard (and merge's output) is written to a temporary
file ``.NAME.<random>.tmp`` in the same directory, fsynced, renamed over the
final name with ``os.replace`` (atomic on POSIX), and the directory is fsynced,
so a reader sees the old file or the new one, never half of one. A save killed
mid-way leaves a temporary file behind; the next save or load of the same file
removes it. Anything that cannot be read (a truncated shard, a foreign file
named like one) raises :class:`CheckpointError` naming the file.

Data files are safetensors, never pickle. This module reads and writes the
chunks through the chunk manager's payloads and the optimizer's typed doors; it
does not decide placement.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import TensorSlot, layout_fingerprint
from chunkstar.chunk.lists import STATE_LISTS, ChunkList
from chunkstar.chunk.store import ChunkStore
from chunkstar.errors import ChunkStateError

if TYPE_CHECKING:
    from safetensors import safe_open as SafeOpen
    from torch import nn

    from chunkstar.config import EngineConfig
    from chunkstar.distributed.comm import Comm
    from chunkstar.optim.adam import ChunkAdam
    from chunkstar.optim.loss_scaler import LossScaler

__all__ = ["CheckpointError", "Checkpointable", "load_checkpoint", "merge_checkpoint", "save_checkpoint", "shard_name"]


class Checkpointable(Protocol):
    """What saving and loading a checkpoint needs of an engine (a ChunkEngine is one): the
    chunk store's narrow door, the model's keys, and the optimizer's and loss scaler's state.
    A Protocol, so this module depends on no runtime module and the engine may import it."""

    @property
    def mgr(self) -> ChunkStore: ...
    @property
    def comm(self) -> Comm: ...
    @property
    def config(self) -> EngineConfig: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def run_id(self) -> str: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def module(self) -> nn.Module: ...
    @property
    def scaler(self) -> LossScaler: ...
    @property
    def optimizer(self) -> ChunkAdam | None: ...
    def parameters(self) -> Iterator[nn.Parameter]: ...
    def parameter_aliases(self) -> dict[str, list[str]]: ...
    def restore_params_from_master(self, slots_by_chunk: dict[int, list[TensorSlot]]) -> None: ...

_FORMAT = "chunkstar-checkpoint/2"
_FORMAT_V1 = "chunkstar-checkpoint/1"  # before shard identities: still merged, never loaded
_MERGED_FORMAT = "chunkstar-merged/1"
_NAME = re.compile(r"rank(\d+)-of-(\d+)\.safetensors")
_IDENTITY = ("run_id", "step", "world_size", "layout")  # Note [shard identity]
_MERGE_HINT = (
    "To load only the weights into a different engine, merge the shards with "
    "`chunkstar merge-checkpoint DIR OUT.safetensors` and call engine.load_state_dict(safetensors.torch.load_file(OUT)) "
    "(the Adam state then starts afresh)"
)


class CheckpointError(ValueError):
    """A checkpoint is incomplete, inconsistent, unreadable or does not fit this engine."""


def shard_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.safetensors"


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - an extra
        raise ImportError("per-rank checkpoints need safetensors: pip install 'chunkstar[hf]'") from None
    return st


# ---------------------------------------------------------------------- files (Note [atomic files])
def _leftovers(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def _remove_leftovers(path: Path) -> None:
    for f in _leftovers(path):
        f.unlink(missing_ok=True)


def _fsync_dir(directory: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # pragma: no cover - Windows cannot open a directory
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary file next to ``path``, make it durable, rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        write(str(tmp))
        # the permissions of any new file (safetensors creates its files 0600)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        fd = os.open(tmp, os.O_RDWR)  # the writer closed it; fsync its data through a new descriptor
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _check_output(path: Path, directory: Path | None = None, overwrite: bool = False) -> None:
    """Refuse an output that would destroy something: inside the checkpoint directory being
    read (a shard, or a file a later merge would trip over), anything but a regular file or
    a new path (a device, a FIFO), or an existing file unless ``overwrite``."""
    if path.is_dir():
        raise CheckpointError(f"{path}: is a directory; give a file name for the output (e.g. {path / 'model.safetensors'})")
    if not path.parent.is_dir():
        raise CheckpointError(f"{path}: the output's folder {path.parent} does not exist; create it first")
    if directory is not None and directory.is_dir():
        inside = path.resolve().parent == directory.resolve() or directory.resolve() in path.resolve().parents
        if inside:
            raise CheckpointError(
                f"{path}: is inside the checkpoint directory {directory} being merged; write the merged file "
                "somewhere else (a shard there would be destroyed, and any other file confuses the next load)"
            )
    if os.path.lexists(path):
        if not path.is_file() or path.is_symlink():
            raise CheckpointError(f"{path}: exists and is not a regular file; give the path of a new file")
        if not overwrite:
            raise CheckpointError(f"{path}: exists; pass --force (overwrite=True) to replace it")


@contextlib.contextmanager
def _open(path: Path) -> Iterator[SafeOpen]:
    """A safetensors file, with reading errors turned into a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        h = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"{path}: cannot read it as a safetensors file ({type(e).__name__}: {e}): the file is truncated "
            "(a save that did not finish, an incomplete copy) or not a chunkstar checkpoint shard"
        ) from e
    with h:
        try:
            yield h
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path}: reading a tensor failed ({type(e).__name__}: {e})") from e


def _shard_meta(path: Path, h: SafeOpen, formats: tuple[str, ...] = (_FORMAT,)) -> dict[str, str]:
    meta = h.metadata() or {}
    fmt = meta.get("format")
    if fmt not in formats:
        if fmt == _FORMAT_V1:
            raise CheckpointError(
                f"{path}: a shard of the older format {fmt!r} (no run id or step): it cannot be resumed from; "
                + _MERGE_HINT.replace("DIR", str(path.parent))
            )
        raise CheckpointError(f"{path}: not a chunkstar checkpoint shard (metadata 'format' is {fmt!r}, expected {formats[-1]!r})")
    need = ("rank", "world_size", "chunk_sizes", "slots") + (_IDENTITY if fmt == _FORMAT else ())
    missing = [k for k in need if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: a damaged chunkstar shard: its metadata lacks {missing}")
    m = _NAME.fullmatch(path.name)
    if m and (meta["rank"], meta["world_size"]) != (m.group(1), m.group(2)):
        raise CheckpointError(
            f"{path}: its metadata says rank {meta['rank']} of {meta['world_size']}, its name another: was it renamed?"
        )
    return meta


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save {what}: {e} (checkpoint metadata holds numbers, strings and lists only)") from e


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _own_frozen(mgr: ChunkStore) -> list[Chunk]:
    """This rank's frozen param chunks: a shard stores them in place of master chunks."""
    return [c for c in mgr.chunks_of(ChunkList.PARAM) if mgr.frozen(c.chunk_id) and mgr.own(c.chunk_id)]


# ---------------------------------------------------------------------- save
def save_checkpoint(engine: Checkpointable, directory: str | os.PathLike[str]) -> str:
    """Write this rank's shard atomically; returns the file written. Call it on every rank."""
    st = _safetensors()
    mgr = engine.mgr
    comm = engine.comm
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out}: is a file; save_checkpoint writes a directory of per-rank shards")
    out.mkdir(parents=True, exist_ok=True)
    path = out / shard_name(comm.rank, comm.world_size)
    _remove_leftovers(path)

    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad(), mgr.paused_probe():
        for name in STATE_LISTS:
            for c in mgr.chunks_of(name):
                if mgr.own(c.chunk_id):  # host or device payload; serialised before anything changes it
                    # a chunk on disk is staged in and copied (its buffer goes back to the staging pool)
                    with mgr.staged([(name, c.chunk_id)], write=False):
                        tensors[f"{name}.{c.chunk_id}"] = c.payload.detach().to("cpu", copy=mgr.on_disk(name))
        for c in _own_frozen(mgr):  # the values of a frozen chunk are its param chunk (Note [frozen chunks])
            tensors[f"{ChunkList.PARAM.value}.{c.chunk_id}"] = c.payload.detach().to("cpu")
        slots = {id(p) for p in engine.parameters()}
        for key, t in engine.module.state_dict(keep_vars=True).items():
            if id(t) not in slots:  # every rank keeps its buffers: a rank resumes from its own shard
                tensors[f"buffer.{key}"] = t.detach().to("cpu").contiguous().clone()

    layout = mgr.layout
    dtype = str(engine.config.precision.dtype)
    opt = engine.optimizer
    scalars = opt.scalar_state() if opt is not None else None
    meta = {
        "format": _FORMAT,
        "rank": str(comm.rank),
        "world_size": str(comm.world_size),
        "run_id": engine.run_id,
        "step": str(scalars["step_count"] if scalars else 0),
        "layout": layout_fingerprint(layout, dtype),
        "dtype": dtype,
        "chunk_size": str(engine.chunk_size),
        "chunk_sizes": json.dumps(list(layout.chunk_sizes)),
        "slots": json.dumps([[s.name, s.chunk_id, s.offset, s.numel, list(s.shape)] for s in layout.slots]),
        "aliases": json.dumps(engine.parameter_aliases()),
        "loss_scaler": _json(engine.scaler.state_dict(), "the loss scaler state"),
    }
    if scalars is not None:
        meta["optimizer"] = _json(scalars, "the optimizer's parameter groups")
    _write_atomic(path, lambda tmp: st.save_file(tensors, tmp, metadata=meta))
    return str(path)


# ---------------------------------------------------------------------- load
def _layout_difference(meta: dict[str, str], engine: Checkpointable, dtype: str) -> str:
    """What makes a shard's layout differ from the engine's, in words."""
    layout = engine.mgr.layout
    if meta.get("dtype", dtype) != dtype:
        return f"the compute dtype is {meta['dtype']} in the checkpoint, {dtype} in this engine (precision differs)"
    sizes = json.loads(meta["chunk_sizes"])
    slots = json.loads(meta["slots"])
    names = [s.name for s in layout.slots]
    if [s[0] for s in slots] != names:
        theirs = {s[0] for s in slots}
        only_ckpt = sorted(theirs - set(names))[:3]
        only_here = sorted(set(names) - theirs)[:3]
        return (
            f"the parameters differ (only in the checkpoint: {only_ckpt}, only in this model: {only_here}, "
            "or another order): a different model"
        )
    for (name, _, _, _, shape), s in zip(slots, layout.slots):
        if tuple(shape) != s.shape:
            return f"parameter '{name}' has shape {tuple(shape)} in the checkpoint, {s.shape} in this model"
    if meta.get("chunk_size", str(engine.chunk_size)) != str(engine.chunk_size):
        return (
            f"the chunk size is {meta['chunk_size']} elements in the checkpoint, {engine.chunk_size} in this engine "
            "(default_chunk_size differs)"
        )
    if sizes != list(layout.chunk_sizes):
        return (
            f"the chunks differ: {len(sizes)} chunks of up to {max(sizes)} elements in the checkpoint, "
            f"{layout.n_chunks} of up to {max(layout.chunk_sizes)} in this engine (default_chunk_size differs)"
        )
    return "the parameters sit at other offsets"


def _check_own_shard(engine: Checkpointable, directory: Path, path: Path, pending_grads: bool) -> dict[str, str]:
    """Validate this rank's shard against the engine without changing anything; its metadata."""
    comm, mgr = engine.comm, engine.mgr
    if pending_grads:
        raise ChunkStateError("gradients are pending: call optimizer.step() or optimizer.zero_grad() before loading")
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not path.exists():
        others = sorted(f.name for f in directory.iterdir() if _NAME.fullmatch(f.name))
        worlds = sorted({int(m.group(2)) for n in others if (m := _NAME.fullmatch(n))})
        if worlds:
            raise CheckpointError(
                f"{directory}: the checkpoint was written by {' or '.join(map(str, worlds))} rank(s) ({', '.join(others[:4])}"
                f"{' ...' if len(others) > 4 else ''}), this engine runs {comm.world_size}: world size differs, so there is "
                f"no {path.name}. " + _MERGE_HINT.replace("DIR", str(directory))
            )
        raise CheckpointError(f"{directory}: no {path.name} (no checkpoint shards at all: write them with engine.save_checkpoint)")
    dtype = str(engine.config.precision.dtype)
    with _open(path) as h:
        meta = _shard_meta(path, h)
        if int(meta["world_size"]) != comm.world_size:
            raise CheckpointError(
                f"{path}: field 'world_size' is {meta['world_size']}, this engine's is {comm.world_size}. "
                + _MERGE_HINT.replace("DIR", str(directory))
            )
        if meta["layout"] != layout_fingerprint(mgr.layout, dtype):
            raise CheckpointError(
                f"{path}: field 'layout' (the layout fingerprint) differs from this engine's: "
                f"{_layout_difference(meta, engine, dtype)}. load_checkpoint needs the same model, precision, "
                "chunk size and world size. " + _MERGE_HINT.replace("DIR", str(directory))
            )
        keys = set(h.keys())
        expected = [(f"{name}.{c.chunk_id}", c) for name in STATE_LISTS for c in mgr.chunks_of(name) if mgr.own(c.chunk_id)]
        expected += [(f"{ChunkList.PARAM.value}.{c.chunk_id}", c) for c in _own_frozen(mgr)]
        for key, c in expected:
            if key not in keys:
                raise CheckpointError(f"{path}: tensor '{key}' is missing")
            sl = h.get_slice(key)
            want = _SAFETENSORS_DTYPES[c.dtype]
            if list(sl.get_shape()) != [c.numel] or sl.get_dtype() != want:
                raise CheckpointError(
                    f"{path}: tensor '{key}' is {sl.get_dtype()} {sl.get_shape()}, expected {want} [{c.numel}]"
                )
    opt = engine.optimizer
    saved = json.loads(meta["optimizer"]) if "optimizer" in meta else None
    if opt is None:
        if saved is not None and any(saved["steps"]):
            raise CheckpointError(
                f"{path}: it holds optimizer state but this engine has no optimizer yet: create it "
                "(initialize_engine returns it) before engine.load_checkpoint"
            )
    elif saved is not None:
        mine = [g["params"] for g in opt.scalar_state()["param_groups"]]
        theirs = [g["params"] for g in saved["param_groups"]]
        if mine != theirs:
            raise CheckpointError(
                f"{path}: field 'optimizer.param_groups' differs: the checkpoint has {len(theirs)} parameter group(s) "
                f"of {[len(g) for g in theirs]} parameters, this optimizer {len(mine)} of {[len(g) for g in mine]}: "
                "build the optimizer with the same param_groups_fn"
            )
    return meta


def _agree_on_identity(engine: Checkpointable, directory: Path, meta: dict[str, str] | None) -> None:
    """Every rank learns whether every rank can load, and from which run and step
    (one all-gather that every rank joins, failed or not: no rank waits alone)."""
    comm = engine.comm
    if meta is None:
        words = [0, 0, 0, 0]
    else:
        run = uuid.UUID(hex=meta["run_id"]).bytes
        words = [1, int.from_bytes(run[:8], "little", signed=True), int.from_bytes(run[8:], "little", signed=True), int(meta["step"])]
    everyone = comm.all_gather_ints(words, "the checkpoint shards' identities", engine.device)
    if meta is None:
        return  # the caller raises this rank's own error
    failed = [r for r, w in enumerate(everyone) if w[0] == 0]
    if failed:
        raise CheckpointError(
            f"{directory}: rank(s) {failed} cannot load their shards (see their errors); no rank loaded anything"
        )
    for field, cols in (("run_id", (1, 2)), ("step", (3,))):
        values = [tuple(w[c] for c in cols) for w in everyone]
        for r, v in enumerate(values):
            if v != values[0]:
                show = [
                    uuid.UUID(bytes=b"".join(x.to_bytes(8, "little", signed=True) for x in val)).hex if field == "run_id" else val[0]
                    for val in (values[0], v)
                ]
                raise CheckpointError(
                    f"{directory}: the shards are from different {'runs' if field == 'run_id' else 'steps'}: "
                    f"field '{field}' is {show[1]!r} in {shard_name(r, comm.world_size)} but {show[0]!r} in "
                    f"{shard_name(0, comm.world_size)}; keep one save's files only"
                )


def load_checkpoint(engine: Checkpointable, directory: str | os.PathLike[str], *, pending_grads: bool = False) -> str:
    """Restore what :func:`save_checkpoint` wrote (call on every rank); returns the shard read.

    Everything is validated on every rank before anything changes: on an error
    (say ``pending_grads``: the engine holds gradients no step consumed) no rank
    has loaded anything, and every rank raises."""
    mgr, comm = engine.mgr, engine.comm
    d = Path(directory)
    path = d / shard_name(comm.rank, comm.world_size)
    if d.is_dir():
        _remove_leftovers(path)
    meta: dict[str, str] | None = None
    try:
        meta = _check_own_shard(engine, d, path, pending_grads)
    finally:
        _agree_on_identity(engine, d, meta)  # even when this rank failed: the others wait for it
    assert meta is not None

    with torch.no_grad(), mgr.paused_probe(), _open(path) as h:
        for name in STATE_LISTS:
            for c in mgr.chunks_of(name):
                if mgr.own(c.chunk_id):
                    with mgr.staged([(name, c.chunk_id)], write=True):  # host, device, or disk through a buffer
                        c.payload.copy_(h.get_tensor(f"{name}.{c.chunk_id}"))
        for c in _own_frozen(mgr):
            c.payload.copy_(h.get_tensor(f"{ChunkList.PARAM.value}.{c.chunk_id}"))
        buffers = {k.split(".", 1)[1]: k for k in h.keys() if k.startswith("buffer.")}
        slots = {id(p) for p in engine.parameters()}
        for key, t in engine.module.state_dict(keep_vars=True).items():
            if id(t) not in slots and key in buffers:
                t.data.copy_(h.get_tensor(buffers[key]))
    own = {c.chunk_id: mgr.slots_of(c.chunk_id) for c in mgr.chunks_of(ChunkList.MASTER) if mgr.own(c.chunk_id)}
    engine.restore_params_from_master({cid: s for cid, s in own.items() if s})
    engine.scaler.load_state_dict(json.loads(meta["loss_scaler"]))
    opt = engine.optimizer
    if opt is not None:
        if "optimizer" in meta:
            opt.load_scalar_state(json.loads(meta["optimizer"]))
        else:  # saved before any optimizer existed: its moments are zero, so are the step counts
            fresh = opt.scalar_state()
            opt.load_scalar_state(fresh | {"steps": [0] * len(fresh["steps"]), "skipped_steps": 0, "step_count": 0})
    return str(path)


# ---------------------------------------------------------------------- merge
def merge_checkpoint(
    directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *, overwrite: bool = False
) -> dict[str, torch.Tensor]:
    """Reassemble the full fp32 state dict from all ranks' shards (and write it to ``out``:
    a new file outside the checkpoint directory, or an existing regular file with ``overwrite``)."""
    st = _safetensors()
    d = Path(directory)
    out_path = None if out is None else Path(out)
    if out_path is not None:
        _check_output(out_path, d, overwrite)
    if not d.is_dir():
        raise CheckpointError(f"{d}: no such checkpoint directory")
    named = sorted((int(m.group(1)), int(m.group(2)), f) for f in d.iterdir() if (m := _NAME.fullmatch(f.name)))
    if not named:
        raise CheckpointError(f"{d}: no rank*-of-*.safetensors files (write them with engine.save_checkpoint)")
    worlds = sorted({w for _, w, _ in named})
    if len(worlds) != 1:
        raise CheckpointError(f"{d}: shards of several world sizes {worlds}; keep one save's files only")
    world = worlds[0]
    files = [f for _, _, f in named]  # by rank
    missing = sorted(set(range(world)) - {r for r, _, _ in named})
    if missing:
        raise CheckpointError(f"{d}: world size {world} but the shards of ranks {missing} are missing")

    chunks: dict[int, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    first: tuple[Path, dict[str, str]] | None = None
    for f in files:
        with _open(f) as h:
            meta = _shard_meta(f, h, formats=(_FORMAT_V1, _FORMAT))
            if first is None:
                first = (f, meta)
            else:
                for field in ("format", *_IDENTITY, "chunk_sizes", "slots"):
                    if meta.get(field) != first[1].get(field):
                        raise CheckpointError(
                            f"{f}: field '{field}' is {meta.get(field)!r} but {first[0].name} has "
                            f"{first[1].get(field)!r}: the shards come from different "
                            f"{'steps' if field == 'step' else 'runs'}; keep one save's files only"
                        )
            for key in h.keys():
                if key.startswith(f"{ChunkList.MASTER.value}."):
                    chunks[int(key.split(".", 1)[1])] = h.get_tensor(key)
                elif key.startswith(f"{ChunkList.PARAM.value}."):  # a frozen chunk's values
                    chunks[int(key.split(".", 1)[1])] = h.get_tensor(key).float()
                elif key.startswith("buffer.") and f == files[0]:  # rank 0's buffers
                    buffers[key.split(".", 1)[1]] = h.get_tensor(key)
    assert first is not None
    slots = json.loads(first[1]["slots"])
    aliases = json.loads(first[1].get("aliases", "{}"))
    state: dict[str, torch.Tensor] = {}
    for name, cid, offset, numel, shape in slots:
        if cid not in chunks:
            raise CheckpointError(f"{d}: the master (or frozen param) chunk {cid} holding '{name}' is in no shard")
        state[name] = chunks[cid][offset : offset + numel].reshape(shape).clone()
    state.update(buffers)
    if out_path is not None:
        _remove_leftovers(out_path)
        meta_out = {"format": _MERGED_FORMAT, "aliases": json.dumps(aliases)}
        for field in ("run_id", "step"):
            if field in first[1]:
                meta_out[field] = first[1][field]
        _write_atomic(out_path, lambda tmp: st.save_file(state, tmp, metadata=meta_out))
    return state


def main_merge(argv: list[str]) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="chunkstar merge-checkpoint", description=merge_checkpoint.__doc__)
    ap.add_argument("directory")
    ap.add_argument("out")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists (a regular file only)")
    args = ap.parse_args(argv)
    try:
        state = merge_checkpoint(args.directory, args.out, overwrite=args.force)
    except CheckpointError as e:
        print(f"chunkstar merge-checkpoint: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {n:,} elements")
    return 0
