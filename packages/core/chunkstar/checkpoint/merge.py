"""Merge a checkpoint's per-rank shards into one plain state dict (``chunkstar merge-checkpoint``).

Every parameter is reassembled from its owner's master chunk (a frozen one from
its param chunk) and keyed by the model's parameter names (tied parameters once,
under their first name, as Hugging Face does); the buffers are rank 0's. The
result loads into the plain model or into an engine of any world size
(weights only). Every tensor read is checked against its checksum (Note [shard
checksums]). The output is never written inside the checkpoint, over a device
or FIFO, or over an existing file without ``overwrite``; a path the filesystem
cannot take (a name too long) is a CheckpointError, as every failure here is,
and the command prints it as one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from chunkstar.checkpoint.directory import remove_leftovers, resolve, write_atomic, write_error
from chunkstar.checkpoint.shard import (
    FORMAT, FORMAT_V1, IDENTITY, MERGED_FORMAT, SHARD_NAME, CheckpointError, ShardMeta, checksums, open_shard, os_error,
    read_meta, safetensors_module, verify_tensor,
)  # fmt: skip
from chunkstar.chunk.lists import ChunkList

__all__ = ["main_merge", "merge_checkpoint"]


def _check_output(path: Path, directory: Path | None = None, overwrite: bool = False) -> None:
    """Refuse an output that would destroy something: inside the checkpoint directory being
    read (a shard, or a file a later merge would trip over), anything but a regular file or
    a new path (a device, a FIFO), or an existing file unless ``overwrite``."""
    try:
        _check_output_path(path, directory, overwrite)
    except OSError as e:  # a name too long, a folder that cannot be searched
        raise os_error(path, e, "write the merged file there") from e


def _check_output_path(path: Path, directory: Path | None, overwrite: bool) -> None:
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


def merge_checkpoint(
    directory: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
    tied: bool = False,
) -> dict[str, torch.Tensor]:
    """Reassemble the full fp32 state dict from all ranks' shards of the checkpoint last
    published in ``directory`` (and write it to ``out``: a new file outside the checkpoint
    directory, or an existing regular file with ``overwrite``). A tied parameter is there
    once, under its first name; with ``tied`` the dict returned has it under its other
    names too (the same tensor), as ``module.state_dict()`` has (the file is unchanged)."""
    st = safetensors_module()
    d = Path(directory)
    out_path = None if out is None else Path(out)
    if out_path is not None:
        _check_output(out_path, d, overwrite)
    src = resolve(d)
    named = sorted((int(m.group(1)), int(m.group(2)), f) for f in src.iterdir() if (m := SHARD_NAME.fullmatch(f.name)))
    if not named:
        raise CheckpointError(f"{src}: no rank*-of-*.safetensors files (write them with engine.save_checkpoint)")
    worlds = sorted({w for _, w, _ in named})
    if len(worlds) != 1:
        raise CheckpointError(f"{src}: shards of several world sizes {worlds}; keep one save's files only")
    world = worlds[0]
    files = [f for _, _, f in named]  # by rank
    missing = sorted(set(range(world)) - {r for r, _, _ in named})
    if missing:
        raise CheckpointError(f"{src}: world size {world} but the shards of ranks {missing} are missing")

    chunks: dict[int, tuple[torch.Tensor, Path]] = {}  # 1-D fp32, CPU; the shard it came from
    buffers: dict[str, torch.Tensor] = {}
    first: ShardMeta | None = None
    for f in files:
        with open_shard(f) as h:
            meta = read_meta(f, h, formats=(FORMAT_V1, FORMAT))
            if first is None:
                first = meta
            else:
                for field in ("format", *IDENTITY, "chunk_sizes", "slots"):
                    if meta.raw.get(field) != first.raw.get(field):
                        raise CheckpointError(
                            f"{f}: field '{field}' is {meta.raw.get(field)!r} but {first.path.name} has "
                            f"{first.raw.get(field)!r}: the shards come from different "
                            f"{'steps' if field == 'step' else 'runs'}; keep one save's files only"
                        )
            wanted: list[tuple[str, str, str]] = []  # (key, kind, rest): the tensors the merge reads
            for key in h.keys():
                kind, _, cid = key.partition(".")
                # a frozen chunk's values are its param chunk; the buffers are rank 0's
                if kind in (ChunkList.MASTER.value, ChunkList.PARAM.value) and cid.isdigit() or kind == "buffer" and f == files[0]:
                    wanted.append((key, kind, cid))
            sums = checksums(meta, [key for key, _, _ in wanted])
            for key, kind, cid in wanted:
                t = h.get_tensor(key)
                verify_tensor(meta, key, t, sums)
                if kind == "buffer":
                    buffers[cid] = t
                else:
                    chunks[int(cid)] = (t.float().reshape(-1), f)
    assert first is not None
    state: dict[str, torch.Tensor] = {}
    for name, cid, offset, numel, shape in first.slots:
        if cid not in chunks:
            raise CheckpointError(f"{src}: the master (or frozen param) chunk {cid} holding '{name}' is in no shard")
        chunk, f = chunks[cid]
        if offset + numel > chunk.numel():
            raise CheckpointError(
                f"{f}: chunk {cid} has {chunk.numel()} elements, but '{name}' lies at {offset}..{offset + numel} "
                "(metadata 'slots'): the shard is damaged or was edited"
            )
        state[name] = chunk[offset : offset + numel].reshape(shape).clone()
    state.update(buffers)
    if out_path is not None:
        remove_leftovers(out_path)
        meta_out = {"format": MERGED_FORMAT, "aliases": json.dumps(first.aliases)}
        for field in ("run_id", "step"):
            if field in first.raw:
                meta_out[field] = first.raw[field]
        try:
            write_atomic(out_path, lambda tmp: st.save_file(state, tmp, metadata=meta_out))
        except Exception as e:
            error = write_error(out_path, e, "nothing was written")
            if error is None:
                raise
            raise error from e
    if tied:
        for first_name, others in first.aliases.items():
            for other in others:
                state[other] = state[first_name]
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
