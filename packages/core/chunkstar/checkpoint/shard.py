"""One rank's checkpoint file: its name, its metadata, and reading it back checked.

Note [shard identity]: every shard records the engine's run id (drawn once at
start-up, the same on every rank: Note [start-up agreement] in
:mod:`chunkstar.distributed.startup`), the optimizer step, the world size and
the layout fingerprint (:func:`~chunkstar.chunk.layout.layout_fingerprint`).
Loading and merging refuse a set of shards that disagree on any of them (a
stale shard of an earlier save would otherwise be stitched into mixed weights)
and name the file, the field and both values.

Note [shard metadata]: safetensors metadata is a map of strings; the structured
values (the layout's ``slots`` and ``chunk_sizes``, the ``aliases``, the
``optimizer``'s scalar state, the ``loss_scaler``'s) are JSON. Reading a shard
checks every value it uses against what :func:`shard_metadata` writes (JSON of
the right shape, integers where there are integers, a slot inside its chunk
with as many elements as its shape, one step count per slot) before anything
uses it, and raises :class:`CheckpointError` naming the file and the field: a
damaged or hand-edited shard never reaches ``json``, ``int()``, a reshape or an
engine as a raw error. The checks cover the metadata; the tensors' bytes are
covered by their checksums (Note [shard checksums]). A shard written before the
checksums (field ``crc32`` absent) still loads and merges, with a warning that
names it: refusing it would strand every checkpoint saved so far, and what it
lacks is a check, not data; the next save of the run writes the field.

Note [shard checksums]: every tensor of a shard is summed with crc32 at save
(over its bytes as written) and the sums are stored in the metadata field
``crc32``, ``{tensor name: sum}``; loading sums every tensor of the shard again
before anything changes, and merging every tensor it reads, and a difference
is a :class:`CheckpointError` naming the file, the tensor and, for a chunk,
the parameters in it. Without it a flipped byte (a bad disk, a truncated and
regrown or hand-edited file) loads in silence as a NaN or a wrong weight.
crc32 is the disk tier's sum (Note [chunk checksum] in
:mod:`chunkstar.disk.checksum`: every burst of up to 32 flipped bits, all but
2**-32 of other changes, zlib's, without the GIL); like it, it detects damage
and is no defence against someone who rewrites the sums too. It costs a second
read of the shard at load (the check reads every tensor once, the load once
more) and about 0.3 CPU seconds per GB at save and load.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import torch
    from safetensors import safe_open as SafeOpen

__all__ = [
    "CHECKSUMS", "CheckpointError", "FORMAT", "FORMAT_V1", "MERGED_FORMAT", "MERGE_HINT", "IDENTITY", "SHARD_NAME", "ShardMeta",
    "SlotRecord", "check_regular", "checksums", "dump_json", "json_field", "open_shard", "optimizer_state", "os_error",
    "read_meta", "safetensors_module", "shard_name", "tensor_checksum", "verify_tensor",
]  # fmt: skip

FORMAT = "chunkstar-checkpoint/2"
FORMAT_V1 = "chunkstar-checkpoint/1"  # before shard identities: still merged, never loaded
MERGED_FORMAT = "chunkstar-merged/1"
SHARD_NAME = re.compile(r"rank(\d+)-of-(\d+)\.safetensors")
IDENTITY = ("run_id", "step", "world_size", "layout")  # Note [shard identity]
CHECKSUMS = "crc32"  # Note [shard checksums]
MERGE_HINT = (
    "To load only the weights into a different engine, merge the shards with "
    "`chunkstar merge-checkpoint DIR OUT.safetensors` and call engine.load_state_dict(safetensors.torch.load_file(OUT)) "
    "(the Adam state then starts afresh)"
)
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_DECIMAL = re.compile(r"[0-9]+")

SlotRecord = tuple[str, int, int, int, tuple[int, ...]]
"""A parameter's place as a shard records it: name, chunk id, offset, element count, shape."""


class CheckpointError(ValueError):
    """A checkpoint is incomplete, inconsistent, unreadable or does not fit this engine."""


def shard_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.safetensors"


def safetensors_module() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - an extra
        raise ImportError("per-rank checkpoints need safetensors: pip install 'chunkstar[hf]'") from None
    return st


def dump_json(value: Any, what: str) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot save {what}: {e} (checkpoint metadata holds numbers, strings and lists only)") from e


def os_error(path: Path, e: OSError, doing: str) -> CheckpointError:
    """The CheckpointError for an OSError met ``doing`` something with ``path`` (a name too
    long for its filesystem is said so: it is the user's to shorten)."""
    if e.errno == errno.ENAMETOOLONG:
        error = CheckpointError(
            f"{path}: the name is too long for its filesystem (a file name of at most "
            f"{_name_max(path)} bytes, a path of at most {_path_max(path)}): give a shorter one"
        )
    else:
        error = CheckpointError(f"{path}: cannot {doing} ({type(e).__name__}: {e.strerror or e})")
    error.__cause__ = e
    return error


def _name_max(path: Path) -> int | str:
    for d in (path.parent, *path.parents):
        with contextlib.suppress(OSError, ValueError):
            return os.pathconf(d, "PC_NAME_MAX")
    return "255"


def _path_max(path: Path) -> int | str:
    for d in (path.parent, *path.parents):
        with contextlib.suppress(OSError, ValueError):
            return os.pathconf(d, "PC_PATH_MAX")
    return "4096"


def check_regular(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (a link to one is one): opening a FIFO
    waits for a writer for ever, a device reads without end. ``what`` says what it should be."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # the caller's open says it is missing, in its own words
    except OSError as e:
        raise os_error(path, e, f"read {what}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a file"
        )  # fmt: skip
        raise CheckpointError(
            f"{path}: is not a regular file (it is {kind}), so it is not {what}: reading it could wait for ever. "
            "Replace it with the file engine.save_checkpoint wrote, or save again"
        )


@contextlib.contextmanager
def open_shard(path: Path) -> Iterator[SafeOpen]:
    """A safetensors file, with reading errors turned into a CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    check_regular(path, "a checkpoint shard")
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


# ---------------------------------------------------------------------- checked reading (Note [shard metadata])
@dataclass(frozen=True)
class ShardMeta:
    """A shard's metadata, checked: the strings as written (for comparing shards and for
    the fields read later, also checked, by :func:`optimizer_state`) and the parsed layout."""

    path: Path
    raw: dict[str, str]
    rank: int
    world_size: int
    step: int | None
    """None in the older format (no identity)."""
    chunk_sizes: list[int]
    slots: list[SlotRecord]
    aliases: dict[str, list[str]]


def _damaged(path: Path, field: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: metadata field '{field}' {what}: the shard is damaged or was edited; write it again with "
        "engine.save_checkpoint (a damaged shard cannot be repaired)"
    )


def _json_field(path: Path, meta: dict[str, str], field: str) -> Any:
    try:
        return json.loads(meta[field])
    except ValueError as e:
        raise _damaged(path, field, f"is not JSON ({e})") from None


def _is_int(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _decimal(path: Path, meta: dict[str, str], field: str) -> int:
    if not _DECIMAL.fullmatch(meta[field]):
        raise _damaged(path, field, f"is {meta[field]!r}, not a whole number")
    return int(meta[field])


def _layout(path: Path, meta: dict[str, str]) -> tuple[list[int], list[SlotRecord]]:
    sizes = _json_field(path, meta, "chunk_sizes")
    if not isinstance(sizes, list) or not all(_is_int(n, 1) for n in sizes):
        raise _damaged(path, "chunk_sizes", "is not a list of chunk sizes (positive integers)")
    records = _json_field(path, meta, "slots")
    if not isinstance(records, list):
        raise _damaged(path, "slots", "is not a list of [name, chunk, offset, numel, shape]")
    slots: list[SlotRecord] = []
    for i, r in enumerate(records):
        ok = (
            isinstance(r, list) and len(r) == 5 and isinstance(r[0], str) and all(_is_int(v) for v in r[1:4])
            and isinstance(r[4], list) and all(_is_int(d) for d in r[4])
        )  # fmt: skip
        if not ok:
            raise _damaged(path, "slots", f"entry {i} is {r!r}, not [name, chunk, offset, numel, shape]")
        name, cid, offset, numel, shape = r
        if cid >= len(sizes) or offset + numel > sizes[cid] or math.prod(shape) != numel:
            raise _damaged(
                path, "slots", f"entry {i} ('{name}': {numel} elements of shape {shape} at {offset} in chunk {cid}) "
                f"does not fit the {len(sizes)} chunks of 'chunk_sizes' or its own shape",
            )  # fmt: skip
        slots.append((name, cid, offset, numel, tuple(shape)))
    return sizes, slots


def read_meta(path: Path, h: SafeOpen, formats: tuple[str, ...] = (FORMAT,)) -> ShardMeta:
    """The metadata of the shard ``path`` (open as ``h``), every field that loading and
    merging read checked; a CheckpointError naming the file and the field otherwise."""
    meta = h.metadata() or {}
    fmt = meta.get("format")
    if fmt not in formats:
        if fmt == FORMAT_V1:
            raise CheckpointError(
                f"{path}: a shard of the older format {fmt!r} (no run id or step): it cannot be resumed from; "
                + MERGE_HINT.replace("DIR", str(path.parent))
            )
        raise CheckpointError(f"{path}: not a chunkstar checkpoint shard (metadata 'format' is {fmt!r}, expected {formats[-1]!r})")
    need = ("rank", "world_size", "chunk_sizes", "slots") + ((*IDENTITY, "loss_scaler") if fmt == FORMAT else ())
    missing = [k for k in need if k not in meta]
    if missing:
        raise CheckpointError(f"{path}: a damaged chunkstar shard: its metadata lacks {missing}")
    m = SHARD_NAME.fullmatch(path.name)
    if m and (meta["rank"], meta["world_size"]) != (m.group(1), m.group(2)):
        raise CheckpointError(
            f"{path}: its metadata says rank {meta['rank']} of {meta['world_size']}, its name another: was it renamed?"
        )
    rank, world = _decimal(path, meta, "rank"), _decimal(path, meta, "world_size")
    if rank >= world:
        raise _damaged(path, "rank", f"is {rank}, not below 'world_size' {world}")
    step = None
    if fmt == FORMAT:
        step = _decimal(path, meta, "step")
        if not _RUN_ID.fullmatch(meta["run_id"]):
            raise _damaged(path, "run_id", f"is {meta['run_id']!r}, not a run id (32 hex digits)")
    sizes, slots = _layout(path, meta)
    aliases = _json_field(path, meta, "aliases") if "aliases" in meta else {}
    ok = isinstance(aliases, dict) and all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in aliases.values())
    if not ok:
        raise _damaged(path, "aliases", "is not a map from a parameter's name to the list of its other names")
    return ShardMeta(path, meta, rank, world, step, sizes, slots, aliases)


# ---------------------------------------------------------------------- checksums (Note [shard checksums])
def tensor_checksum(t: torch.Tensor) -> int:
    """The crc32 of a CPU tensor's bytes as safetensors writes them (contiguous, native order)."""
    from chunkstar.disk.blockio import byte_view

    flat = t.detach().contiguous().reshape(-1)
    return zlib.crc32(byte_view(flat)) if flat.numel() else 0


def checksums(meta: ShardMeta, keys: list[str]) -> dict[str, int] | None:
    """The sums the shard records for ``keys`` (every one of them must have one), or None for
    a shard written before checksums (with a warning naming it: Note [shard metadata])."""
    if CHECKSUMS not in meta.raw:
        warnings.warn(
            f"{meta.path}: the shard has no checksums (it was written by an earlier chunkstar), so bytes changed since "
            "it was written cannot be found; save the run again to add them",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    sums = _json_field(meta.path, meta.raw, CHECKSUMS)
    if not isinstance(sums, dict) or not all(_is_int(v) and v < 2**32 for v in sums.values()):
        raise _damaged(meta.path, CHECKSUMS, "is not a map from a tensor's name to its crc32 (a whole number below 2**32)")
    missing = [k for k in keys if k not in sums]
    if missing:
        raise _damaged(meta.path, CHECKSUMS, f"has no checksum for tensor(s) {missing[:3]}")
    return {k: sums[k] for k in keys}


def verify_tensor(meta: ShardMeta, key: str, t: torch.Tensor, sums: dict[str, int] | None) -> None:
    """Refuse tensor ``key`` of the shard when its bytes differ from what was saved."""
    if sums is None:
        return
    got = tensor_checksum(t)
    if got == sums[key]:
        return
    kind, _, cid = key.partition(".")
    held = ""
    if cid.isdigit():
        names = [s[0] for s in meta.slots if s[1] == int(cid)]
        held = f" (chunk {cid} of list '{kind}', holding {', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''})"
    raise CheckpointError(
        f"{meta.path}: tensor '{key}'{held} does not match its checksum (crc32 {got:08x}, the shard records "
        f"{sums[key]:08x}): its bytes changed after it was saved (a damaged disk or copy, or an edit). Load an earlier "
        "checkpoint, or write this one again with engine.save_checkpoint"
    )


def _setting(v: Any) -> bool:
    """A parameter group setting as JSON holds one: a number, string, bool, null, or a list of them."""
    scalar = (int, float, str, bool, type(None))
    return isinstance(v, scalar) or (isinstance(v, list) and all(isinstance(x, scalar) for x in v))


def json_field(meta: ShardMeta, field: str) -> Any:
    """A JSON field of the shard, parsed (its shape is for its reader to check)."""
    return _json_field(meta.path, meta.raw, field)


def optimizer_state(meta: ShardMeta) -> dict[str, Any] | None:
    """The optimizer's scalar state (``ChunkAdam.scalar_state``) the shard holds, its
    shape checked against the shard's own layout; None when it was saved without one."""
    if "optimizer" not in meta.raw:
        return None
    path, n = meta.path, len(meta.slots)
    state = _json_field(path, meta.raw, "optimizer")
    if not isinstance(state, dict):
        raise _damaged(path, "optimizer", "is not a map of the optimizer's state")
    wrong = [k for k in ("skipped_steps", "step_count") if not _is_int(state.get(k))]
    if wrong:
        raise _damaged(path, "optimizer", f"holds no step count (a whole number) under {wrong}")
    steps = state.get("steps")
    if not isinstance(steps, list) or len(steps) != n or not all(_is_int(s) for s in steps):
        raise _damaged(path, "optimizer", f"holds no list of {n} Adam step counts (one per parameter of 'slots') under 'steps'")
    if "kind" in state and not isinstance(state["kind"], str):
        raise _damaged(path, "optimizer", f"names the optimizer's kind {state['kind']!r}, not a name such as 'AdamW'")
    groups = state.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise _damaged(path, "optimizer", "holds no list of parameter groups under 'param_groups'")
    for i, g in enumerate(groups):
        members = g.get("params")
        if not isinstance(members, list) or not all(_is_int(p) and p < n for p in members):
            raise _damaged(path, "optimizer", f"parameter group {i} lists no parameters (indices into 'slots') under 'params'")
        bad = sorted(k for k, v in g.items() if k != "params" and not _setting(v))
        if bad:
            raise _damaged(path, "optimizer", f"parameter group {i} has settings {bad} that are no numbers, strings or lists")
    return state
