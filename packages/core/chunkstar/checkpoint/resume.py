"""Save an engine's state into per-rank shards, and load it back for an exact resume.

Saving writes this rank's own chunks and the scalar state into one shard of a
step directory that is published once every rank has written (Note
[multi-rank checkpoints] in :mod:`chunkstar.checkpoint.directory`), each tensor
with its checksum (Note [shard checksums]); loading checks everything on every
rank, every tensor's bytes included, before anything changes, and a load
stopped half-way leaves an optimizer that refuses to go on until a load
completes (Note [all or nothing] in :mod:`chunkstar.interrupts`).

Note [saving between steps]: a checkpoint holds the weights and the optimizer
state, never gradients. A save while gradients wait for a step (after some of
``gradient_accumulation_steps`` micro-batches, their sums in the fp32
accumulators; after the last, in the param slots; kept across a forward) is
refused, as a load is, rather than resuming without them: saving them would add
4 bytes per parameter to every rank's shard (each rank accumulates for every
chunk it computes, Note [accumulation across ranks]) and tie the format to how
the accumulators are kept, for a save the loop can make one step later.
A loop whose own checkpoints never hold gradients (Lightning saves inside a
window and resumes without it) may save anyway (``drop_pending``): the shards
hold the masters and Adam state, which no backward touches, so the save is the
state as of the last step, and the gradients stay for the step to come.

This module reads and writes the chunks through the chunk manager's payloads
and the optimizer's typed doors; it does not decide placement.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Protocol

import torch

from chunkstar.checkpoint.directory import remove_leftovers, resolve, save_step
from chunkstar.interrupts import deferred_interrupts
from chunkstar.checkpoint.shard import (
    CHECKSUMS, FORMAT, MERGE_HINT, SHARD_NAME, CheckpointError, ShardMeta, check_regular, checksums, dump_json, json_field,
    open_shard,
    optimizer_state, read_meta, safetensors_module, shard_name, tensor_checksum, verify_tensor,
)  # fmt: skip
from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import TensorSlot, layout_fingerprint
from chunkstar.chunk.lists import STATE_LISTS, ChunkList
from chunkstar.chunk.store import Chunks, ChunkStore
from chunkstar.errors import ChunkStateError

if TYPE_CHECKING:
    from torch import nn

    from chunkstar.config import EngineConfig
    from chunkstar.distributed.comm import Comm
    from chunkstar.optim.adam import ChunkAdam
    from chunkstar.optim.loss_scaler import LossScaler

__all__ = ["CLIENT_STATE", "Checkpointable", "load_checkpoint", "pending_gradients", "read_client_state", "save_checkpoint"]


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


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _own_frozen(chunks: Chunks) -> list[Chunk]:
    """This rank's frozen param chunks: a shard stores them in place of master chunks."""
    return [c for c in chunks.chunks_of(ChunkList.PARAM) if chunks.frozen(c.chunk_id) and chunks.own(c.chunk_id)]


def _buffers(engine: Checkpointable) -> dict[str, torch.Tensor]:
    """The model's buffers by state-dict key (every rank keeps them all)."""
    slots = {id(p) for p in engine.parameters()}
    return {k: t for k, t in engine.module.state_dict(keep_vars=True).items() if id(t) not in slots}


# ---------------------------------------------------------------------- save
def pending_gradients(micro_batches: int, accumulation_steps: int) -> ChunkStateError:
    """The refusal of a save while gradients wait for a step (Note [saving between steps])."""
    if micro_batches % accumulation_steps:
        where = (
            f"after {micro_batches % accumulation_steps} of {accumulation_steps} micro-batches of gradient accumulation: "
            "their gradients wait in fp32 accumulators"
        )
    else:
        where = "with gradients that no optimizer.step() has consumed"
    return ChunkStateError(
        f"engine.save_checkpoint() {where}, and a checkpoint holds weights and optimizer state, not gradients, so "
        "training resumed from it would go on without them. Save between steps, after optimizer.step() (say every N "
        "steps), or drop the gradients with optimizer.zero_grad() first"
    )


def save_checkpoint(
    engine: Checkpointable,
    directory: str | os.PathLike[str],
    *,
    check: Callable[[], None] | None = None,
    client_state: Mapping[str, Any] | None = None,
) -> str:
    """Write this rank's shard of a new save into ``directory`` (call on every rank); the
    save is published once every rank has written. Returns the file written. ``check``
    runs first, in the save's first phase, so a refusal on one rank (gradients no step
    consumed, :func:`pending_gradients`) reaches every rank and none waits alone.
    ``client_state`` (rank 0's is written) is a training loop's own state, saved in the
    same step directory as :data:`CLIENT_STATE` (``torch.save``; tensors, numbers,
    strings, lists and dicts) and published with the shards: :func:`read_client_state`
    reads it back (Note [client state])."""
    opt = engine.optimizer
    comm = engine.comm

    def shard() -> Callable[[str], None]:
        if check is not None:
            check()
        st = safetensors_module()
        mgr = engine.mgr
        chunks = mgr.chunks
        tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad(), mgr.paused_probe():
            for name in STATE_LISTS:
                for c in chunks.chunks_of(name):
                    if chunks.own(c.chunk_id):  # host or device payload; serialised before anything changes it
                        # a chunk on disk is staged in and copied (its buffer goes back to the staging pool)
                        with chunks.staged([(name, c.chunk_id)], write=False):
                            tensors[f"{name}.{c.chunk_id}"] = c.payload.detach().to("cpu", copy=chunks.on_disk(name))
            for c in _own_frozen(chunks):  # the values of a frozen chunk are its param chunk (Note [frozen chunks])
                with chunks.staged([(ChunkList.PARAM, c.chunk_id)], write=False):
                    tensors[f"{ChunkList.PARAM.value}.{c.chunk_id}"] = c.payload.detach().to("cpu", copy=chunks.on_disk(ChunkList.PARAM))
            for key, t in _buffers(engine).items():  # every rank keeps its buffers: a rank resumes from its own shard
                tensors[f"buffer.{key}"] = t.detach().to("cpu").contiguous().clone()

        layout = mgr.layout
        dtype = str(engine.config.precision.dtype)
        scalars = opt.scalar_state() if opt is not None else None
        meta = {
            "format": FORMAT,
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
            "loss_scaler": dump_json(engine.scaler.state_dict(), "the loss scaler state"),
        }
        if scalars is not None:
            meta["optimizer"] = dump_json(scalars, "the optimizer's parameter groups")
        # summed as they are now: nothing changes them before the write (Note [shard checksums])
        meta[CHECKSUMS] = json.dumps({k: tensor_checksum(t) for k, t in tensors.items()})
        return lambda tmp: st.save_file(tensors, tmp, metadata=meta)

    def client() -> tuple[str, Callable[[str], None]] | None:
        if client_state is None:
            return None
        if not isinstance(client_state, Mapping):
            raise TypeError(f"client_state must be a dict, got {type(client_state).__name__}")
        buf = io.BytesIO()
        torch.save(dict(client_state), buf)  # in the first phase: an object torch cannot save fails every rank's save
        data = buf.getvalue()

        def write(tmp: str) -> None:
            Path(tmp).write_bytes(data)

        return CLIENT_STATE, write

    step = opt.step_count if opt is not None else 0
    name = shard_name(comm.rank, comm.world_size)
    return str(save_step(comm, engine.device, Path(directory), step, name, shard, extra=client))


# Note [client state]: a loop around the engine (Lightning, a user's own) has state of its own
# to resume with the weights: its step and epoch counters, callbacks, schedulers. Written as a
# file of its own beside the checkpoint, it could come from another save than the shards (a
# kill between the two writes), and resuming would pair one step's weights with another's
# counters. So it is a file of the same step directory, written by rank 0 before the save is
# published, and read through the same ``latest``: both come from one save or neither exists.
# It is loaded with ``weights_only=True`` (torch's restricted unpickler: tensors, numbers,
# strings, containers, and the classes torch allows), never as an arbitrary pickle.
CLIENT_STATE = "client_state.pt"
"""The file of a save holding ``client_state`` (Note [client state])."""


def read_client_state(directory: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any] | None:
    """The ``client_state`` saved with the checkpoint last published in ``directory``, or
    None where that save had none. ``weights_only=False`` unpickles any object: only for
    files from a source you trust (Note [client state])."""
    src = resolve(Path(directory))
    path = src / CLIENT_STATE
    if not path.exists():
        return None
    check_regular(path, "a checkpoint's client state")
    try:
        state = torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - a damaged file, or a class the restricted unpickler refuses
        raise CheckpointError(f"{path}: cannot read the client state ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not the dict a save writes")
    return state


# ---------------------------------------------------------------------- load
def _layout_difference(meta: ShardMeta, engine: Checkpointable, dtype: str) -> str:
    """What makes a shard's layout differ from the engine's, in words."""
    layout = engine.mgr.layout
    raw = meta.raw
    if raw.get("dtype", dtype) != dtype:
        return f"the compute dtype is {raw['dtype']} in the checkpoint, {dtype} in this engine (precision differs)"
    sizes, slots = meta.chunk_sizes, meta.slots
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
        if shape != s.shape:
            return f"parameter '{name}' has shape {shape} in the checkpoint, {s.shape} in this model"
    if raw.get("chunk_size", str(engine.chunk_size)) != str(engine.chunk_size):
        return (
            f"the chunk size is {raw['chunk_size']} elements in the checkpoint, {engine.chunk_size} in this engine "
            "(default_chunk_size differs)"
        )
    if sizes != list(layout.chunk_sizes):
        return (
            f"the chunks differ: {len(sizes)} chunks of up to {max(sizes, default=0)} elements in the checkpoint, "
            f"{layout.n_chunks} of up to {max(layout.chunk_sizes)} in this engine (default_chunk_size differs)"
        )
    return "the parameters sit at other offsets"


def _compatible(mine: Any, theirs: Any) -> bool:
    """Whether a saved parameter group setting can replace this optimizer's (numbers for
    numbers, a list of as many for a tuple such as betas; None here takes anything)."""
    if mine is None:
        return True
    if isinstance(mine, (bool, str)):
        return type(theirs) is type(mine)
    if isinstance(mine, (int, float)):
        return isinstance(theirs, (int, float)) and not isinstance(theirs, bool)
    if isinstance(mine, (tuple, list)):
        return isinstance(theirs, list) and len(theirs) == len(mine) and all(map(_compatible, mine, theirs))
    return True


def _check_optimizer(engine: Checkpointable, meta: ShardMeta) -> dict[str, Any] | None:
    path = meta.path
    saved = optimizer_state(meta)
    opt = engine.optimizer
    if opt is None:
        if saved is not None and any(saved["steps"]):
            raise CheckpointError(
                f"{path}: it holds optimizer state but this engine has no optimizer yet: create it "
                "(initialize_engine returns it) before engine.load_checkpoint"
            )
        return saved
    if saved is None:
        return None
    current = opt.scalar_state()
    kind = saved.get("kind")  # None: saved before the kind was recorded, by AdamW or Adam
    if kind is not None and kind != current["kind"]:
        raise CheckpointError(
            f"{path}: field 'optimizer.kind' is {kind!r} in the checkpoint, this optimizer is {current['kind']!r}: "
            "resume with the optimizer it was saved with (config 'optimizer.type'). "
            + MERGE_HINT.replace("DIR", str(path.parent))
        )
    mine = [g["params"] for g in current["param_groups"]]
    theirs = [g["params"] for g in saved["param_groups"]]
    if mine != theirs:
        raise CheckpointError(
            f"{path}: field 'optimizer.param_groups' differs: the checkpoint has {len(theirs)} parameter group(s) "
            f"of {[len(g) for g in theirs]} parameters, this optimizer {len(mine)} of {[len(g) for g in mine]}: "
            "build the optimizer with the same param_groups_fn"
        )
    for i, (here, there) in enumerate(zip(current["param_groups"], saved["param_groups"])):
        bad = sorted(k for k, v in there.items() if k in here and not _compatible(here[k], v))
        if bad:
            raise CheckpointError(
                f"{path}: field 'optimizer.param_groups' sets {', '.join(f'{k}={there[k]!r}' for k in bad)} in group {i}, "
                f"where this optimizer has {', '.join(f'{k}={here[k]!r}' for k in bad)}: the shard is damaged or was edited"
            )
    return saved


_Checked = tuple[ShardMeta, dict[str, Any] | None, dict[str, Any]]
"""A shard's checked metadata, optimizer state (None: saved without) and loss scaler state."""


def _check_own_shard(engine: Checkpointable, directory: Path, path: Path) -> _Checked:
    """Validate this rank's shard against the engine without changing anything: its
    metadata, the optimizer's scalar state and the loss scaler's, all checked."""
    comm, mgr = engine.comm, engine.mgr
    chunks = mgr.chunks
    if not path.exists():
        others = sorted(f.name for f in directory.iterdir() if SHARD_NAME.fullmatch(f.name))
        worlds = sorted({int(m.group(2)) for n in others if (m := SHARD_NAME.fullmatch(n))})
        if worlds:
            raise CheckpointError(
                f"{directory}: the checkpoint was written by {' or '.join(map(str, worlds))} rank(s) ({', '.join(others[:4])}"
                f"{' ...' if len(others) > 4 else ''}), this engine runs {comm.world_size}: world size differs, so there is "
                f"no {path.name}. " + MERGE_HINT.replace("DIR", str(directory))
            )
        raise CheckpointError(f"{directory}: no {path.name} (no checkpoint shards at all: write them with engine.save_checkpoint)")
    dtype = str(engine.config.precision.dtype)
    with open_shard(path) as h:
        meta = read_meta(path, h)
        if meta.world_size != comm.world_size:
            raise CheckpointError(
                f"{path}: field 'world_size' is {meta.world_size}, this engine's is {comm.world_size}. "
                + MERGE_HINT.replace("DIR", str(directory))
            )
        if meta.raw["layout"] != layout_fingerprint(mgr.layout, dtype):
            raise CheckpointError(
                f"{path}: field 'layout' (the layout fingerprint) differs from this engine's: "
                f"{_layout_difference(meta, engine, dtype)}. load_checkpoint needs the same model, precision, "
                "chunk size and world size. " + MERGE_HINT.replace("DIR", str(directory))
            )
        keys = set(h.keys())
        expected = [(f"{name}.{c.chunk_id}", c) for name in STATE_LISTS for c in chunks.chunks_of(name) if chunks.own(c.chunk_id)]
        expected += [(f"{ChunkList.PARAM.value}.{c.chunk_id}", c) for c in _own_frozen(chunks)]
        for key, c in expected:
            if key not in keys:
                raise CheckpointError(f"{path}: tensor '{key}' is missing")
            sl = h.get_slice(key)
            want = _SAFETENSORS_DTYPES[c.dtype]
            if list(sl.get_shape()) != [c.numel] or sl.get_dtype() != want:
                raise CheckpointError(
                    f"{path}: tensor '{key}' is {sl.get_dtype()} {sl.get_shape()}, expected {want} [{c.numel}]"
                )
        for key, t in _buffers(engine).items():
            if f"buffer.{key}" in keys and list(h.get_slice(f"buffer.{key}").get_shape()) != list(t.shape):
                shape = h.get_slice(f"buffer.{key}").get_shape()
                raise CheckpointError(f"{path}: buffer '{key}' has shape {shape}, this model's {list(t.shape)}")
        # every tensor's bytes, one at a time, before anything changes (Note [shard checksums])
        names = sorted(keys)
        sums = checksums(meta, names)
        if sums is not None:
            for key in names:
                verify_tensor(meta, key, h.get_tensor(key), sums)
    saved = _check_optimizer(engine, meta)
    scaler = json_field(meta, "loss_scaler")
    try:
        engine.scaler.check_state_dict(scaler)
    except ValueError as e:
        raise CheckpointError(f"{path}: metadata field 'loss_scaler' is damaged or was edited: {e}") from None
    return meta, saved, scaler


def _agree_on_identity(engine: Checkpointable, directory: Path, meta: ShardMeta | None) -> None:
    """Every rank learns whether every rank can load, and from which run and step
    (one all-gather that every rank joins, failed or not: no rank waits alone)."""
    comm = engine.comm
    if meta is None:
        words = [0, 0, 0, 0]
    else:
        run = uuid.UUID(hex=meta.raw["run_id"]).bytes
        assert meta.step is not None  # a shard of the current format (read_meta checked it)
        words = [1, int.from_bytes(run[:8], "little", signed=True), int.from_bytes(run[8:], "little", signed=True), meta.step]
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


def load_checkpoint(
    engine: Checkpointable,
    directory: str | os.PathLike[str],
    *,
    pending_grads: bool = False,
    check: Callable[[], None] | None = None,
) -> str:
    """Restore what :func:`save_checkpoint` last published (call on every rank); returns the shard read.

    Everything is validated on every rank before anything changes: on an error
    (say ``pending_grads``: the engine holds gradients no step consumed, or one
    ``check`` raises) no rank has loaded anything, and every rank raises. Once the
    chunks change, a Ctrl-C waits for the load to finish, and anything else that
    stops it leaves an optimizer that refuses to go on until a load completes
    (Note [all or nothing])."""
    mgr, comm = engine.mgr, engine.comm
    d = Path(directory)
    checked: _Checked | None = None
    try:
        if check is not None:
            check()
        if pending_grads:
            raise ChunkStateError("gradients are pending: call optimizer.step() or optimizer.zero_grad() before loading")
        src = resolve(d)
        path = src / shard_name(comm.rank, comm.world_size)
        if src == d:
            remove_leftovers(path)  # a flat directory: what a killed save of an earlier version left
        checked = _check_own_shard(engine, src, path)
    finally:
        _agree_on_identity(engine, d, checked[0] if checked else None)  # even when this rank failed: the others wait for it
    assert checked is not None
    opt = engine.optimizer
    with deferred_interrupts():
        try:
            _load(engine, path, checked)
        except BaseException as e:
            if opt is not None:
                opt.interrupted(
                    f"engine.load_checkpoint({str(directory)!r}) was stopped by {type(e).__name__} after it had loaded "
                    "some chunks and not others",
                    "call engine.load_checkpoint again and let it complete",
                    {"weights", "optimizer"},
                )
            raise
    if opt is not None:
        opt.restored({"weights", "optimizer"})
    return str(path)


def _load(engine: Checkpointable, path: Path, checked: _Checked) -> None:
    """Write a checked shard into the engine: chunks, buffers, then the scalar state."""
    mgr = engine.mgr
    chunks = mgr.chunks
    _, saved, scaler = checked
    with torch.no_grad(), mgr.paused_probe(), open_shard(path) as h:
        for name in STATE_LISTS:
            for c in chunks.chunks_of(name):
                if chunks.own(c.chunk_id):
                    with chunks.staged([(name, c.chunk_id)], write=True):  # host, device, or disk through a buffer
                        c.payload.copy_(h.get_tensor(f"{name}.{c.chunk_id}"))
        for c in _own_frozen(chunks):
            with chunks.staged([(ChunkList.PARAM, c.chunk_id)], write=True):
                c.payload.copy_(h.get_tensor(f"{ChunkList.PARAM.value}.{c.chunk_id}"))
        keys = set(h.keys())
        for key, t in _buffers(engine).items():
            if f"buffer.{key}" in keys:
                t.data.copy_(h.get_tensor(f"buffer.{key}"))
    own = {c.chunk_id: mgr.slots_of(c.chunk_id) for c in chunks.chunks_of(ChunkList.MASTER) if chunks.own(c.chunk_id)}
    engine.restore_params_from_master({cid: s for cid, s in own.items() if s})
    engine.scaler.load_state_dict(scaler)
    opt = engine.optimizer
    if opt is not None:
        if saved is not None:
            opt.load_scalar_state(saved)
        else:  # saved before any optimizer existed: its moments are zero, so are the step counts
            fresh = opt.scalar_state()
            opt.load_scalar_state(fresh | {"steps": [0] * len(fresh["steps"]), "skipped_steps": 0, "step_count": 0})
