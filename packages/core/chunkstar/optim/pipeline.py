"""The gradient pipeline: complete gradient chunks leave for the optimizer during backward.

Note [gradient pipeline]: with one process, a chunk whose gradients are
complete during backward is handed over at once (:meth:`GradientPipeline.take`):
a host-Adam chunk starts its copy to the host and its per-range norms are
taken where the gradient lies (on CUDA on the device before it leaves; on the
CPU virtual device by the host worker once the copy has landed), so both
overlap the rest of the backward. At the step, the global norm needs every
partial (clipping is exact, so nothing is updated before it is known); then
each host-Adam chunk's update is one job on the host worker, queued in the
order the next forward needs the chunks, and its param chunk's next copy to
the device is ordered after that job only (Note [pending copy] in
chunk/chunk.py): the forward starts while later chunks are still updating.
With ``overlap: false`` the worker runs each job in place: the same arithmetic
on the same values in the same order, so both paths give the same bits.

The pipeline is built with the engine, before the optimizer: the gradients
hand chunks to it from the first backward (:mod:`chunkstar.runtime.gradients`),
and the optimizer (:class:`chunkstar.optim.adam.ChunkAdam`) reads what it took
at its step. It moves chunks through the store's narrow door only and does no
update itself.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState
from chunkstar.chunk.store import ChunkStore
from chunkstar.device.copy_engine import CopyEvent, HostWorker, InlineWorker

__all__ = ["GradientPipeline", "range_norms", "runs"]


def runs(slots: list[TensorSlot], key: Callable[[TensorSlot], Any]) -> list[tuple[Any, int, int]]:
    """Merge slots (sorted by offset) into contiguous (key, start, end) element ranges."""
    out: list[tuple[Any, int, int]] = []
    for s in slots:
        k = key(s)
        if out and out[-1][0] == k and out[-1][2] == s.offset:
            out[-1] = (k, out[-1][1], s.end)
        else:
            out.append((k, s.offset, s.end))
    return out


def range_norms(ranges: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each gradient range, as one 1-D fp32 tensor where they lie (one foreach call)."""
    if not ranges:
        return torch.zeros(0)
    return torch.stack(torch._foreach_norm(ranges, 2, dtype=torch.float32))


Partial = tuple[CopyEvent | None, list[torch.Tensor] | None]
"""A chunk handed over: the event of the job computing its per-range norms (None: already
computed) and the box its result lands in, or (None, None) when the step needs no norm."""


class GradientPipeline:
    def __init__(
        self,
        store: ChunkStore,
        device: torch.device,
        host_work: HostWorker | InlineWorker,
        device_adam_chunks: set[int],
        *,
        norm_by_config: bool,
    ) -> None:
        """``device_adam_chunks``: the set the iteration plans hybrid Adam into when the warm-up
        ends (read here, never written); ``norm_by_config``: the config asks for the global
        norm at every step (clipping, or fp16's overflow check: Note [norm only when needed]
        in :mod:`chunkstar.optim.adam`)."""
        self._store = store
        self._device = device
        self._host_work = host_work
        self._device_adam_chunks = device_adam_chunks
        self._norm_by_config = norm_by_config
        self.measure_grad_norm = False
        """Measure the global gradient norm at every step even when the config does not need
        it (:attr:`ChunkAdam.measure_grad_norm`)."""
        self.partials: dict[int, Partial] = {}
        """Chunks handed over since the last step, by chunk id."""

    def needs_norm(self) -> bool:
        """Whether the step takes the global gradient norm (Note [norm only when needed])."""
        return self._norm_by_config or self.measure_grad_norm

    def take(self, chunk_id: int) -> None:
        """The backward is done with param chunk ``chunk_id``: a host-Adam chunk goes to the
        host now and its gradient norms are taken on the way; a device-Adam chunk waits for
        the step where it is."""
        mgr = self._store
        if chunk_id in self._device_adam_chunks or chunk_id in self.partials:
            return
        slots = [s for s in mgr.slots_of(chunk_id) if mgr.states[s.index] is TensorState.HOLD_AFTER_BWD]
        if not slots:
            return
        if not self.needs_norm():
            self.partials[chunk_id] = (None, None)
            mgr.offload(chunk_id)
            return
        spans = [(a, b) for _, a, b in runs(slots, lambda s: 0)]
        chunk = mgr.chunks.chunk(ChunkList.PARAM, chunk_id)
        cur = mgr.cursor
        last = cur.moment >= cur.trace.n_moments - 1  # no backward left to hide the copy behind
        if self._device.type == "cuda" or last or mgr.chunks.on_disk(ChunkList.PARAM):
            # where the gradient lies, before the chunk leaves: on CUDA on the compute stream;
            # on the CPU virtual device for the chunks the last moment completes, so the step
            # does not wait for their copy, and for those whose home is a file, which go
            # straight on to it (the same kernel on the same values either way)
            g = chunk.payload
            self.partials[chunk_id] = (None, [range_norms([g[a:b] for a, b in spans])])
            mgr.offload(chunk_id)
            return
        mgr.offload(chunk_id)
        host = chunk.host_buffer
        box: list[torch.Tensor] = []
        event = self._host_work.submit(lambda: box.append(range_norms([host[a:b] for a, b in spans])), after=chunk.pending_copy)
        self.partials[chunk_id] = (event, box)

    def forget(self, chunk_ids: Iterable[int] | None = None) -> None:
        """The pending gradients were dropped (zero_grad without a step, a failed backward), or
        changed after this took them (``chunk_ids`` only: a module's zero_grad(), a forward that
        kept them, Note [gradients kept across a forward] in runtime/gradients.py)."""
        for cid in list(self.partials) if chunk_ids is None else [c for c in chunk_ids if c in self.partials]:
            event, _ = self.partials.pop(cid)
            if event is not None:
                event.wait()  # its job reads a buffer the restore is about to write

    def has_norm(self, chunk_id: int) -> bool:
        """Whether chunk ``chunk_id`` was handed over with its per-range norms (not: not
        handed over, or handed over by a backward that needed no norm)."""
        part = self.partials.get(chunk_id)
        return part is not None and part[1] is not None

    def norm_of(self, chunk_id: int) -> torch.Tensor:
        """The per-range norms taken when chunk ``chunk_id`` was handed over (:meth:`has_norm`),
        once their job is done."""
        event, box = self.partials[chunk_id]
        if event is not None:
            event.wait()
        assert box is not None
        return box[0]

