"""Gradient reduction and gathered-copy release for chunk groups (several processes).

Note [collective schedule]: every rank runs the same modules in the same order,
so gathers and reductions are triggered by hooks alone; releasing a gathered
copy depends only on tensor states and the warm-up trace's chunk ids (the same
on every rank), never on memory measurements, so no rank waits in a collective
the others skip. Phase changes of the schedule happen at iteration ends, after
the ranks agree (:mod:`chunkstar.runtime.schedule`).

A group's gradients are reduced as soon as every parameter in it has its
gradient (NCCL reduce-scatter; gloo all-reduce in fp32), averaged over the
ranks into the owner's chunk; the other ranks' copies become values again.
"""

from __future__ import annotations

from typing import Sequence

import torch

from chunkstar.chunk.state import TensorState
from chunkstar.distributed.comm import Comm
from chunkstar.events import MoveReason
from chunkstar.runtime.chunk_manager import PARAM, ChunkManager

__all__ = ["GroupReducer"]


class GroupReducer:
    def __init__(self, mgr: ChunkManager, comm: Comm, device: torch.device, params: Sequence[torch.Tensor]) -> None:
        self.mgr = mgr
        self.comm = comm
        self.device = device
        self._params = params
        self._reduced: set[int] = set()  # first chunk ids of the groups reduced in this backward

    def release_after_forward(self, indices: Sequence[int]) -> None:
        """After a module's forward, drop gathered copies of other ranks' chunks its
        groups hold, unless the next moment (per the frozen trace) needs the group."""
        mgr = self.mgr
        groups = {mgr.layout.group(mgr.slots[i].chunk_id).start for i in indices}
        keep: set[int] = set()
        if mgr.trace.frozen:
            keep = {mgr.layout.group(c).start for c in mgr.trace.chunks_at(mgr.moment + 1)}
        for g in sorted(groups - keep):
            if not any(mgr.pinned(k) for k in mgr.layout.group(g)):
                mgr.release_group(g)

    def gradient_folded(self, chunk_id: int) -> None:
        """A gradient was folded into ``chunk_id``: reduce its group once all its gradients are in."""
        mgr = self.mgr
        start = mgr.layout.group(chunk_id).start
        if start in self._reduced:
            return
        for k in mgr.layout.group(start):
            for sl in mgr.slots_of(k):
                if self._params[sl.index].requires_grad and mgr.states[sl.index] is not TensorState.HOLD_AFTER_BWD:
                    return
        self._reduce(start)

    def end_backward(self) -> None:
        """Reduce the groups with parameters that got no gradient this time, in group
        order on every rank (Note [collective schedule])."""
        mgr = self.mgr
        for g in range(0, mgr.layout.n_chunks, self.comm.world_size):
            if g not in self._reduced and any(
                mgr.states[sl.index] is TensorState.HOLD_AFTER_BWD for k in mgr.layout.group(g) for sl in mgr.slots_of(k)
            ):
                self._reduce(g)
        self._reduced.clear()

    def release_all(self) -> None:
        for g in sorted(self.mgr.gathered_groups):
            self.mgr.release_group(g)

    def _reduce(self, start: int) -> None:
        """Average the group's gradients over ranks into this rank's own chunk; drop the rest."""
        mgr = self.mgr
        group = list(mgr.layout.group(start))
        own_id = group[self.comm.rank]
        if self.device.type == "cuda" and not mgr.resident((PARAM, own_id)):
            mgr.make_resident([(PARAM, own_id)], MoveReason.ACCESS, where=f"the gradient reduction of chunk {own_id}")
        with torch.no_grad(), mgr.probe.paused():
            payloads = [mgr.chunks[PARAM][k].payload for k in group]
            if self.comm.backend != "nccl":
                payloads = [p.float() for p in payloads]  # gloo sums in fp32: exact for fp32, better for bf16
            summed = self.comm.reduce_group(payloads, what=f"param chunks {group[0]}..{group[-1]}")
            own = mgr.chunks[PARAM][own_id].payload
            inv = 1.0 / self.comm.world_size
            for sl in mgr.slots_of(own_id):  # only gradient slots: the others still hold values
                if mgr.states[sl.index] is TensorState.HOLD_AFTER_BWD:
                    own[sl.offset : sl.end].copy_(summed[sl.offset : sl.end].to(own.device) * inv)
            for k in group:
                if k == own_id:
                    continue
                for sl in mgr.slots_of(k):
                    if mgr.states[sl.index] is TensorState.HOLD_AFTER_BWD:
                        mgr.set_state(sl.index, TensorState.HOLD)  # its owner has the gradient now
            if not any(mgr.pinned(k) for k in group):
                mgr.release_group(start)
        self._reduced.add(start)
