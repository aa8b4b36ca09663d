"""Gradient reduction and gathered-copy release for chunk groups (several processes).

Note [collective schedule]: every rank runs the same modules in the same order,
so gathers and reductions are triggered by hooks alone; releasing a gathered
copy depends only on tensor states and the warm-up trace's chunk ids (the same
on every rank), never on memory measurements, so no rank waits in a collective
the others skip. Phase changes of the schedule happen at iteration ends, after
the ranks agree (:mod:`chunkstar.runtime.schedule`).

A group's gradients are reduced as soon as every parameter in it has its
gradient (NCCL reduce-scatter in the config's ``reduce_dtype``, fp32 by
default; gloo all-reduce in fp32), averaged over the ranks into the owner's
chunk; the other ranks' copies become values again.

Note [reduction in flight]: the collective runs asynchronously (``async_op``:
NCCL on its own stream, gloo on its own threads) on a copy of the group, so
the backward goes on while it runs and the group's chunks are free at once.
Each finished reduction is averaged into the own chunk at the next gradient
that finds it done, and every one by the end of backward, before the
optimizer reads the chunks; the arithmetic is the same as waiting at once.

Note [pending gradients]: "every parameter has its gradient" means every slot
of the group whose parameter requires grad is in HOLD_AFTER_BWD. Once per
backward the reducer counts, per group, the slots that must be in that state
for this to hold: those requiring grad, plus those holding a gradient without
requiring grad (a backward never moves such a slot in or out of that state).
The manager counts the slots in HOLD_AFTER_BWD per chunk as states change, so
each gradient costs a comparison, not a scan of its group's slots.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import torch

from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.chunk.store import ChunkStore
from chunkstar.distributed.comm import Comm, PendingReduce
from chunkstar.distributed.gather import GroupGathers
from chunkstar.events import MoveReason
from chunkstar.placement.gathered import groups_to_release

__all__ = ["GroupReducer", "ReduceStore"]


class ReduceStore(ChunkStore, Protocol):
    """What the reducer asks of the chunk store beyond the optimizer's door: its gathered
    groups, which chunks the running moment pins, how many slots of a chunk hold their
    gradient (Note [pending gradients]), and room for a reduction's scratch."""

    gathers: GroupGathers

    def pinned(self, chunk_id: int) -> bool: ...
    def grads_in(self, chunk_id: int) -> int: ...
    def make_room(
        self, need: int, protect: set[tuple[ChunkList, int]], where: str,
        required: Iterable[tuple[ChunkList, int]] = (), optional: bool = False,
    ) -> None: ...  # fmt: skip


class GroupReducer:
    def __init__(
        self,
        mgr: ReduceStore,
        comm: Comm,
        device: torch.device,
        params: Sequence[torch.Tensor],
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.mgr = mgr
        # gloo sums in fp32 whatever the config says: exact for fp32, better for bf16, and its
        # support for 16-bit types varies by build
        self.reduce_dtype = reduce_dtype if comm.on_device(device) else torch.float32
        self.comm = comm
        self.device = device
        self._params = params
        self._reduced: set[int] = set()  # first chunk ids of the groups reduced in this backward
        # per group (chunk id // world size): slots in HOLD_AFTER_BWD once it is complete, counted
        # at this backward's first gradient (Note [pending gradients]); None between backwards
        self._need: list[int] | None = None
        # reductions started and not yet averaged into their own chunk: (own chunk id, pending)
        self._inflight: list[tuple[int, PendingReduce]] = []
        # per group, the gradients a micro-batch before the last put into local accumulators
        # in this backward (Note [accumulation across ranks] in runtime/gradients.py)
        self._accumulated: dict[int, int] = {}

    def release_after_forward(self, indices: Sequence[int]) -> None:
        """After a module's forward, drop gathered copies of other ranks' chunks its
        groups hold, unless the next moment (per the frozen trace) needs the group."""
        mgr = self.mgr
        layout = mgr.layout
        cur = mgr.cursor
        trace = cur.trace
        used = {layout.group(mgr.slots[i].chunk_id).start for i in indices}
        needed = [layout.group(c).start for c in trace.chunks_at(cur.moment + 1)] if trace.frozen else []
        for g in groups_to_release(used, needed, lambda g: any(mgr.pinned(k) for k in layout.group(g))):
            mgr.gathers.release(g)

    def gradient_folded(self, chunk_id: int) -> None:
        """A gradient was folded into ``chunk_id``: reduce its group once all its gradients are in."""
        mgr = self.mgr
        group = mgr.layout.group(chunk_id)
        if group.start in self._reduced:
            return
        need = self._need if self._need is not None else self._count_needed()
        if sum(mgr.grads_in(k) for k in group) < need[group.start // mgr.layout.world_size]:
            return
        self._reduce(group.start)

    def gradient_accumulated(self, chunk_id: int) -> None:
        """A micro-batch before the last added a gradient of ``chunk_id`` to its accumulator: once
        every gradient of the group is in, its gathered copies are not needed for the rest of this
        backward (the same moment on every rank: gradients arrive in the graph's order)."""
        mgr = self.mgr
        group = mgr.layout.group(chunk_id)
        g = group.start // mgr.layout.world_size
        done = self._accumulated[g] = self._accumulated.get(g, 0) + 1
        need = self._need if self._need is not None else self._count_needed()
        if done >= need[g] and not any(mgr.pinned(k) for k in group):
            mgr.gathers.release(group.start)

    def _count_needed(self) -> list[int]:
        """Per group, the slots in HOLD_AFTER_BWD once all its gradients are in (Note [pending gradients])."""
        mgr = self.mgr
        world = mgr.layout.world_size
        states = mgr.states
        need = [0] * -(-mgr.layout.n_chunks // world)
        for s in mgr.slots:
            if self._params[s.index].requires_grad or states[s.index] is TensorState.HOLD_AFTER_BWD:
                need[s.chunk_id // world] += 1
        self._need = need
        return need

    def end_backward(self) -> None:
        """Reduce the groups with parameters that got no gradient this time, in group
        order on every rank (Note [collective schedule])."""
        mgr = self.mgr
        for g in range(0, mgr.layout.n_chunks, self.comm.world_size):
            if g not in self._reduced and any(mgr.grads_in(k) for k in mgr.layout.group(g)):
                self._reduce(g)
        self._land(wait=True)
        self._reduced.clear()
        self._accumulated.clear()
        self._need = None

    def reset(self) -> None:
        """A backward failed: forget what was reduced or counted in it (the next backward starts clean)."""
        self._reduced.clear()
        self._accumulated.clear()
        self._need = None
        self._inflight = []  # its gradients are dropped: the sums are not needed

    def release_all(self) -> None:
        for g in sorted(self.mgr.gathers.gathered):
            self.mgr.gathers.release(g)

    def _reduce(self, start: int) -> None:
        """Average the group's gradients over ranks into this rank's own chunk; drop the rest."""
        mgr = self.mgr
        group = list(mgr.layout.group(start))
        own_id = group[self.comm.rank]
        # (a chunk whose home is a file is brought to the device too: Note [param chunks on disk])
        on_disk = mgr.chunks.chunk(ChunkList.PARAM, own_id).location is ChunkLocation.DISK
        if (self.device.type == "cuda" or on_disk) and not mgr.resident((ChunkList.PARAM, own_id)):
            mgr.make_resident([(ChunkList.PARAM, own_id)], MoveReason.ACCESS, where=f"the gradient reduction of chunk {own_id}")
        # under NCCL its flat buffers are scratch the measured non-model memory leaves out: room is
        # made for them here (Note [scratch counted once] in distributed/comm.py)
        numel = mgr.chunks.chunk(ChunkList.PARAM, own_id).numel
        scratch = self.comm.reduce_scratch_bytes(numel, self.reduce_dtype, self.device)
        if scratch:
            keys = [(ChunkList.PARAM, k) for k in group]
            mgr.make_room(scratch, protect=set(keys), where=f"the gradient reduction of chunks {group[0]}..{group[-1]}", required=keys)
        with torch.no_grad(), mgr.paused_probe():
            payloads = [mgr.chunks.chunk(ChunkList.PARAM, k).payload for k in group]
            # Note [reduction in flight]: the collective works on a copy of the group (one flat
            # buffer in the config's reduce_dtype, fp32 by default, that the copy converts to), so
            # the chunks are free at once; the own chunk takes the sum when it lands
            pending = self.comm.reduce_group_async(
                payloads, what=f"param chunks {group[0]}..{group[-1]}", dtype=self.reduce_dtype
            )
            self._inflight.append((own_id, pending))
            for k in group:
                if k == own_id or not mgr.grads_in(k):
                    continue
                for sl in mgr.slots_of(k):
                    if mgr.states[sl.index] is TensorState.HOLD_AFTER_BWD:
                        mgr.set_state(sl.index, TensorState.HOLD)  # its owner has the gradient now
            if not any(mgr.pinned(k) for k in group):
                mgr.gathers.release(start)
        self._reduced.add(start)
        self._land(wait=False)

    def _land(self, wait: bool) -> None:
        """Average the reductions that are done (all of them with ``wait``) into their own
        chunks: only the gradient slots (the others hold values), one copy per run."""
        mgr = self.mgr
        still: list[tuple[int, PendingReduce]] = []
        inv = 1.0 / self.comm.world_size
        with torch.no_grad(), mgr.paused_probe():
            for own_id, pending in self._inflight:
                if not wait and not pending.done():
                    still.append((own_id, pending))
                    continue
                summed = pending.wait()  # this rank's own chunk of the sum, ours to change
                with mgr.chunks.staged([(ChunkList.PARAM, own_id)], write=True):  # gone to its file since, if so
                    own = mgr.chunks.chunk(ChunkList.PARAM, own_id).payload
                    for a, b in _gradient_runs(mgr, own_id):
                        run = summed[a:b].mul_(inv)  # in place: no temporary (same arithmetic as `* inv`)
                        own[a:b].copy_(run)
        self._inflight = still


def _gradient_runs(mgr: ReduceStore, chunk_id: int) -> list[tuple[int, int]]:
    """(start, end) element ranges of the chunk's slots in HOLD_AFTER_BWD, adjacent slots merged."""
    runs: list[tuple[int, int]] = []
    if not mgr.grads_in(chunk_id):
        return runs
    for sl in mgr.slots_of(chunk_id):
        if mgr.states[sl.index] is not TensorState.HOLD_AFTER_BWD:
            continue
        if runs and runs[-1][1] == sl.offset:
            runs[-1] = (runs[-1][0], sl.end)
        else:
            runs.append((sl.offset, sl.end))
    return runs
