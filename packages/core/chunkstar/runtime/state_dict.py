"""The engine's values by the model's keys: every chunk's fp32 values read out, and a
state dict's values written into the chunks.

Reading gives each chunk's authoritative values (its fp32 master, or a frozen
chunk's param chunk in fp32), gathered from their owners with several processes.
Loading matches the state dict's keys to the model's own (a tied parameter needs
one of its names), checks shapes before anything changes, then writes each value
into its fp32 master and its param slot, one chunk at a time (staged from disk
when the master lives there), each rank its own chunks. It is the runtime's only
writer of chunk values outside the optimizer step and a checkpoint load; the
engine (:mod:`chunkstar.runtime.engine`) checks when a load may run and tells the
optimizer when it is done or was stopped (Note [all or nothing] in
:mod:`chunkstar.interrupts`).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.store import Chunks
from chunkstar.distributed.comm import Comm
from chunkstar.interrupts import deferred_interrupts
from chunkstar.runtime.chunk_manager import ChunkManager

__all__ = ["full_masters", "match_values", "tied_names", "value_chunk", "write_values"]


def value_chunk(chunks: Chunks, chunk_id: int) -> torch.Tensor:
    """Chunk ``chunk_id``'s values: its fp32 master, or a frozen chunk's param chunk in fp32."""
    if chunks.frozen(chunk_id):
        with chunks.staged([(ChunkList.PARAM, chunk_id)], write=False):  # a copy, if staged from its file
            return chunks.chunk(ChunkList.PARAM, chunk_id).payload.to(torch.float32, copy=chunks.on_disk(ChunkList.PARAM))
    if chunks.on_disk(ChunkList.MASTER):  # a copy: the staging buffer goes back (Note [disk tier])
        with chunks.staged([(ChunkList.MASTER, chunk_id)], write=False):
            return chunks.chunk(ChunkList.MASTER, chunk_id).payload.clone()
    return chunks.chunk(ChunkList.MASTER, chunk_id).payload


def full_masters(mgr: ChunkManager, comm: Comm, device: torch.device) -> dict[int, torch.Tensor]:
    """Every chunk's fp32 values by id: the master chunks, and a frozen chunk's param chunk
    in fp32 (gathered from their owners with several processes: a collective)."""
    if not comm.distributed:
        return {i: value_chunk(mgr.chunks, i) for i in range(mgr.layout.n_chunks)}
    where = comm.exchange_device(device)
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for g in range(0, mgr.layout.n_chunks, comm.world_size):
            group = list(mgr.layout.group(g))
            own = value_chunk(mgr.chunks, group[comm.rank]).to(where)
            outs = [torch.empty_like(own) for _ in group]
            comm.all_gather_group(outs, own, what=f"master chunks {group[0]}..{group[-1]}")
            for k, t in zip(group, outs):
                out[k] = t.to("cpu")
    return out


def tied_names(module: nn.Module) -> dict[str, list[str]]:
    """Tied parameters: first name -> the other names of the same tensor."""
    first: dict[int, str] = {}
    out: dict[str, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.setdefault(first[id(p)], []).append(name)
        else:
            first[id(p)] = name
    return out


def match_values(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``module``'s own tensors by key and the values ``state_dict`` gives them (tied names
    filled from whichever is given), keys and shapes checked: nothing changes here."""
    own = module.state_dict(keep_vars=True)
    values = dict(state_dict)
    for name, others in tied_names(module).items():  # fill tied names from whichever is given
        for n in [name, *others]:
            if n in values:
                for m in [name, *others]:
                    values.setdefault(m, values[n])
                break
    missing = [k for k in own if k not in values]
    unexpected = [k for k in values if k not in own]
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing keys {missing}, unexpected keys {unexpected}")
    for key, t in own.items():
        if key in values and tuple(values[key].shape) != tuple(t.shape):
            raise ValueError(f"'{key}': shape {tuple(values[key].shape)} in the state dict, {tuple(t.shape)} in the model")
    return own, values


def write_values(
    mgr: ChunkManager, own: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor],
    slot_of: Mapping[int, TensorSlot], on_stopped: Callable[[BaseException], None],
) -> None:  # fmt: skip
    """Write the values :func:`match_values` matched: a parameter's into its fp32 master and
    its param slot (``slot_of``: ``id(parameter)`` -> its slot), anything else (buffers) in
    place. A Ctrl-C waits for the writes (:func:`chunkstar.interrupts.deferred_interrupts`);
    anything else that stops them half-way is handed to ``on_stopped`` before it propagates
    (Note [all or nothing])."""
    by_chunk: dict[int, list[tuple[TensorSlot, torch.Tensor]]] = {}
    with deferred_interrupts(), torch.no_grad(), mgr.probe.paused():  # checked: now things change
        try:
            for key, t in own.items():
                if key not in values:
                    continue
                s = slot_of.get(id(t))
                if s is None:
                    t.data.copy_(values[key])
                elif mgr.chunks.own(s.chunk_id):  # else its owner loads it (any world size can load a full state dict)
                    by_chunk.setdefault(s.chunk_id, []).append((s, values[key]))
            for cid, members in sorted(by_chunk.items()):  # one chunk at a time (staged from disk, if there)
                trainable = not mgr.chunks.frozen(cid)
                keys = [(ChunkList.MASTER, cid), (ChunkList.PARAM, cid)] if trainable else [(ChunkList.PARAM, cid)]
                with mgr.chunks.staged(keys, write=True):
                    for s, src in members:
                        if trainable:
                            mgr.chunks.slot_view(ChunkList.MASTER, s).copy_(src.reshape(-1))
                        mgr.chunks.slot_view(ChunkList.PARAM, s).copy_(src.reshape(-1))
        except BaseException as e:
            on_stopped(e)
            raise
