"""Per-rank checkpoints and merging them into one standard state dict.

``engine.save_checkpoint(dir)`` has every rank write the chunks it owns (fp32
master, exp_avg, exp_avg_sq) to ``rank{r}-of-{W}.safetensors``, with the
layout (which parameter sits in which chunk at which offset) and the step
counts as safetensors metadata; nothing is gathered, so saving costs no
communication and no rank holds more than its share.

``chunkstar merge-checkpoint DIR OUT.safetensors`` (or :func:`merge_checkpoint`)
reassembles every parameter from its owner's master chunk and writes a plain
state dict keyed by the model's parameter names (tied parameters once, under
their first name, as Hugging Face does), which ``model.load_state_dict`` of
the plain model or ``engine.load_state_dict`` of an engine of any world size
loads. Data files are safetensors, never pickle.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from chunkstar.runtime.engine import ChunkEngine

__all__ = ["save_checkpoint", "merge_checkpoint", "CheckpointError"]

_FORMAT = "chunkstar-checkpoint/1"
_NAME = re.compile(r"rank(\d+)-of-(\d+)\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, inconsistent or not a chunkstar checkpoint."""


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - an extra
        raise ImportError("per-rank checkpoints need safetensors: pip install 'chunkstar[hf]'") from None
    return st


def save_checkpoint(engine: ChunkEngine, directory: str | os.PathLike[str]) -> str:
    """Write this rank's shard; returns the file written. Call it on every rank."""
    st = _safetensors()
    mgr = engine.mgr
    comm = engine.comm
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in ("master", "exp_avg", "exp_avg_sq"):
        for c in mgr.chunks[name]:
            if mgr.own(c.chunk_id):
                tensors[f"{name}.{c.chunk_id}"] = c.payload.detach().to("cpu").contiguous().clone()
    if comm.rank == 0:
        slots = {id(p): i for i, p in enumerate(engine.parameters())}
        for key, t in engine.module.state_dict(keep_vars=True).items():
            if id(t) not in slots:
                tensors[f"buffer.{key}"] = t.detach().to("cpu").contiguous().clone()
    layout = mgr.layout
    meta = {
        "format": _FORMAT,
        "rank": str(comm.rank),
        "world_size": str(comm.world_size),
        "chunk_sizes": json.dumps(list(layout.chunk_sizes)),
        "slots": json.dumps([[s.name, s.chunk_id, s.offset, s.numel, list(s.shape)] for s in layout.slots]),
        "aliases": json.dumps(engine.parameter_aliases()),
    }
    path = out / f"rank{comm.rank}-of-{comm.world_size}.safetensors"
    st.save_file(tensors, str(path), metadata=meta)
    return str(path)


def merge_checkpoint(directory: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> dict[str, torch.Tensor]:
    """Reassemble the full fp32 state dict from all ranks' shards (and write it to ``out``)."""
    st = _safetensors()
    from safetensors import safe_open

    files = sorted(Path(directory).glob("rank*-of-*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no rank*-of-*.safetensors files (write them with engine.save_checkpoint)")
    worlds = {int(m.group(2)) for f in files if (m := _NAME.fullmatch(f.name))}
    if len(worlds) != 1:
        raise CheckpointError(f"{directory}: shards of several world sizes {sorted(worlds)}; keep one run's files only")
    world = worlds.pop()
    ranks = {int(m.group(1)) for f in files if (m := _NAME.fullmatch(f.name))}
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise CheckpointError(f"{directory}: world size {world} but the shards of ranks {missing} are missing")

    chunks: dict[int, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    slots: list[Any] = []
    aliases: dict[str, list[str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata() or {}
            if meta.get("format") != _FORMAT:
                raise CheckpointError(f"{f}: not a chunkstar checkpoint shard (format {meta.get('format')!r})")
            slots = json.loads(meta["slots"])
            aliases = json.loads(meta.get("aliases", "{}"))
            for key in h.keys():
                if key.startswith("master."):
                    chunks[int(key.split(".", 1)[1])] = h.get_tensor(key)
                elif key.startswith("buffer."):
                    buffers[key.split(".", 1)[1]] = h.get_tensor(key)
    state: dict[str, torch.Tensor] = {}
    for name, cid, offset, numel, shape in slots:
        if cid not in chunks:
            raise CheckpointError(f"{directory}: the master chunk {cid} holding '{name}' is in no shard")
        state[name] = chunks[cid][offset : offset + numel].reshape(shape).clone()
    state.update(buffers)
    if out is not None:
        st.save_file(state, str(out), metadata={"format": "chunkstar-merged/1", "aliases": json.dumps(aliases)})
    return state


def main_merge(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="chunkstar merge-checkpoint", description=merge_checkpoint.__doc__)
    ap.add_argument("directory")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    try:
        state = merge_checkpoint(args.directory, args.out)
    except CheckpointError as e:
        print(f"chunkstar merge-checkpoint: {e}")
        return 2
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {n:,} elements")
    return 0
