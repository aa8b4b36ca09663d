"""The chunk store's chunks, and what the optimizer and the checkpoint code may ask of the store.

:class:`Chunks` holds the chunks of the four lists, built once for the run, and
is the only way to reach them: typed lookups of a chunk or a slot's elements,
which chunks this rank owns, their bytes, and the disk tier their state lists
may live in (Note [disk tier]), through which it stages chunks in for a block.
Nothing here exposes its dicts, so none of its users can index them. It moves
no chunk to or from the device: residency, budgets and moves are the chunk
store's (:class:`chunkstar.runtime.chunk_manager.ChunkManager`), which owns one.

:class:`ChunkStore` is the narrow door of the store for its users outside the
runtime: the chunks, the tensor index, tensor states through the checked
transition, the cursor to read, and the few moves they ask for.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.lists import CHUNK_LISTS, STATE_LISTS, ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.device.copy_engine import CopyEvent
from chunkstar.device.memory import DeviceMemory
from chunkstar.device.pinned import PinnedBuffers
from chunkstar.errors import ChunkStateError

if TYPE_CHECKING:
    from chunkstar.events import MoveReason
    from chunkstar.memory.cursor import Cursor

__all__ = ["Chunks", "ChunkStore", "DiskStaging"]

_PARAM = ChunkList.PARAM


class DiskStaging(Protocol):
    """The disk tier as the chunks and their users see it: which lists live in files, and
    staging a chunk's payload into a host buffer and back (Note [disk tier] in
    :mod:`chunkstar.runtime.disk_tier`, which satisfies it). A layer below the runtime, so
    it names what it asks for instead of importing the tier."""

    lists: tuple[ChunkList, ...]
    """The lists whose chunks live on disk."""
    budget: int
    """Host bytes for staged chunks."""

    @property
    def file_bytes(self) -> int:
        """Bytes the chunk files hold now."""

    def on_disk(self, name: ChunkList) -> bool: ...
    def staged(self, chunks: list[Chunk], *, write: bool) -> contextlib.AbstractContextManager[None]: ...
    def stage_in(self, chunk: Chunk, *, for_device: bool = False) -> None: ...
    def stage_out(self, chunk: Chunk, *, write: bool) -> None: ...
    def take(self, chunk: Chunk) -> torch.Tensor:
        """A staging buffer for ``chunk``'s bytes (waits for room)."""

    def give_back_after(self, buf: torch.Tensor, event: CopyEvent | None) -> None:
        """``buf`` goes back to the pool once the copy of ``event`` no longer reads it."""

    def slices(self, chunk: Chunk) -> list[tuple[int, int]]:
        """The (first, end) elements of each slice the step stages of ``chunk``'s used elements."""

    def stage_slices(self, chunks: list[Chunk], first: int, end: int) -> list[tuple[torch.Tensor, CopyEvent]]:
        """For each of ``chunks``, a staging buffer being filled with its elements ``first:end``,
        and the read's event (the buffers taken at once)."""

    def stage_in_all(self, chunks: list[Chunk]) -> None:
        """Stage each of ``chunks`` in, their buffers taken at once."""

    def write_slice(self, chunk: Chunk, first: int, end: int, buf: torch.Tensor, after: CopyEvent) -> CopyEvent:
        """Write ``buf`` back as elements ``first:end`` of ``chunk`` after ``after``; the write's event."""

    def issue_behind(self, chunks: list[Chunk], job: Callable[[], None]) -> None:
        """Run ``job`` on the tier's step thread; :meth:`wait_for` holds ``chunks`` until it has."""

    def wait_for(self, chunk: Chunk) -> None:
        """Return once the step thread is done with ``chunk``."""

    def settle(self) -> None:
        """Return once the step thread has run everything queued to it (raises its failure)."""

    def finish_stepping(self) -> None:
        """Run what is queued to the step thread and stop it (the engine closes)."""

    def stats(self) -> dict[str, Any]: ...
    def step_ended(self) -> None:
        """An optimizer step returned (the per-step figures, Note [disk busy time])."""

    def drain(self) -> None:
        """Return once every transfer issued so far is over."""

    def close(self) -> None: ...
    def discard(self) -> None: ...


class Chunks:
    """The chunks of the four lists, by list then chunk id: lookups, ownership, bytes, and
    staging from the disk tier (the module's docstring)."""

    def __init__(
        self, layout: ChunkLayout, compute_dtype: torch.dtype, device: torch.device, memory: DeviceMemory, rank: int
    ) -> None:
        """``memory``: where every device payload grows and shrinks (device/memory.py);
        ``rank``: this process's, whose chunks are the ones with payloads here."""
        self.layout = layout
        self.compute_dtype = compute_dtype
        """The param chunks' dtype (the state lists are fp32)."""
        self.device = device
        """The compute device the chunks' device payloads live on."""
        self._rank = rank
        # param chunks travel every step on a CUDA device: their host buffers are pinned, exactly
        # sized (device/pinned.py), from the start; state chunks start in plain memory and are
        # pinned once they come back from the device (Note [pinned once it travels] in chunk/chunk.py)
        self.pinned_buffers = PinnedBuffers(device) if device.type == "cuda" else None
        # by list then chunk id; a frozen chunk has its param chunk only (Note [frozen chunks] in
        # chunk/layout.py)
        self._chunks: dict[ChunkList, dict[int, Chunk]] = {
            name: {
                i: Chunk(i, name.value, n, compute_dtype if name is _PARAM else torch.float32, device,
                         self.pinned_buffers, memory, pin_from_start=name is _PARAM)  # fmt: skip
                for i, n in enumerate(layout.chunk_sizes)
                if name is _PARAM or i not in layout.frozen
            }
            for name in CHUNK_LISTS
        }
        self._param_chunks = list(self._chunks[_PARAM].values())  # by chunk id: the list hot paths read
        self.disk: DiskStaging | None = None
        """The disk tier, when the config has one (:meth:`attach_disk`)."""

    # ------------------------------------------------------------------ lookups
    def chunk(self, which: ChunkList, chunk_id: int) -> Chunk:
        """Chunk ``chunk_id`` of list ``which`` (its payload, buffers and pending copies)."""
        try:
            return self._chunks[which][chunk_id]
        except KeyError:
            if chunk_id in self.layout.frozen:
                raise ChunkStateError(
                    f"chunk {chunk_id} holds frozen parameters (requires_grad=False): it has a param chunk only, "
                    f"no {which.value} chunk"
                ) from None
            raise

    def chunks_of(self, which: ChunkList) -> Sequence[Chunk]:
        """Every chunk of list ``which``, by chunk id (read-only); a state list has none for frozen chunks."""
        return tuple(self._chunks[which].values())

    def lists_of(self, chunk_id: int) -> tuple[ChunkList, ...]:
        """The lists chunk ``chunk_id`` has: all four, or the param list of a frozen chunk."""
        return (_PARAM,) if chunk_id in self.layout.frozen else CHUNK_LISTS

    def frozen(self, chunk_id: int) -> bool:
        """Chunk ``chunk_id`` holds frozen parameters: no master, no Adam state, no gradients."""
        return chunk_id in self.layout.frozen

    def own(self, chunk_id: int) -> bool:
        """Whether this rank owns the chunk (always, in a single process)."""
        return self.layout.owner(chunk_id) == self._rank

    def value_view(self, slot: TensorSlot) -> torch.Tensor:
        """1-D view of ``slot``'s authoritative value: its fp32 master, or for a frozen
        parameter its param slot (in the compute dtype; it has no master)."""
        which = _PARAM if slot.chunk_id in self.layout.frozen else ChunkList.MASTER
        return self._chunks[which][slot.chunk_id].payload[slot.offset : slot.end]

    def slot_view(self, which: ChunkList, slot: TensorSlot) -> torch.Tensor:
        """1-D view of ``slot``'s elements in its chunk of list ``which`` (where the payload is now)."""
        return self._chunks[which][slot.chunk_id].payload[slot.offset : slot.end]

    def param_slot_view(self, slot: TensorSlot) -> torch.Tensor:
        """``slot_view(ChunkList.PARAM, slot)`` for the per-gradient path (one lookup fewer)."""
        return self._param_chunks[slot.chunk_id].payload[slot.offset : slot.end]

    # ------------------------------------------------------------------ bytes
    def bytes_of(self, list_name: ChunkList, chunk_ids: Iterable[int] | None = None) -> int:
        """Bytes of the chunks ``chunk_ids`` (default: all) of list ``list_name`` that exist."""
        chunks = self._chunks[list_name]
        ids = range(self.layout.n_chunks) if chunk_ids is None else chunk_ids
        return sum(chunks[i].nbytes for i in ids if i in chunks)

    def state_bytes(self) -> int:
        """fp32 master + Adam moments this rank keeps (1/world_size of them)."""
        return sum(c.nbytes for name in STATE_LISTS for c in self._chunks[name].values() if self.own(c.chunk_id))

    def model_data_bytes(self) -> int:
        """Param chunks (all: each is gathered when used) plus this rank's state chunks."""
        return self.bytes_of(_PARAM) + self.state_bytes()

    # ------------------------------------------------------------------ the disk tier
    def disk_chunks(self, names: Sequence[ChunkList]) -> dict[ChunkList, dict[int, Chunk]]:
        """This rank's chunks of lists ``names`` by chunk id (what a disk tier stores)."""
        return {n: {cid: c for cid, c in self._chunks[n].items() if self.own(cid)} for n in names}

    def attach_disk(self, tier: DiskStaging) -> None:
        """From now on the chunks of ``tier.lists`` live on disk (before any chunk is allocated)."""
        self.disk = tier

    def on_disk(self, name: ChunkList) -> bool:
        """Whether list ``name``'s chunks live on disk (Note [disk tier])."""
        return self.disk is not None and self.disk.on_disk(name)

    @contextlib.contextmanager
    def staged(self, keys: Iterable[tuple[ChunkList, int]], *, write: bool) -> Iterator[None]:
        """Inside the block, the chunks ``keys`` that live on disk are staged into host buffers
        (their payloads readable and writable as usual), and go back to disk at its end,
        written back with ``write`` (:meth:`DiskStaging.staged`); nothing happens for chunks in
        memory."""
        tier = self.disk
        if tier is None:
            yield
            return
        keys = list(dict.fromkeys(keys))
        tier.settle()  # the step thread is done with every chunk first (Note [the step issued behind])
        chunks = [self._chunks[n][i] for n, i in keys if self._chunks[n][i].location is ChunkLocation.DISK]
        with tier.staged(chunks, write=write):
            yield


class ChunkStore(Protocol):
    """What the optimizer and the checkpoint code may ask of the chunk store."""

    layout: ChunkLayout
    chunks: Chunks
    """The chunks, read through :class:`Chunks` only."""
    slots: tuple[TensorSlot, ...]
    """Every tensor's slot, by slot index (registration order)."""
    states: list[TensorState]
    """Every tensor's state, by slot index: read it here, change it with :meth:`set_state`."""

    @property
    def cursor(self) -> Cursor:
        """Where the iteration is (read-only: the schedule writes it)."""

    def slots_of(self, chunk_id: int) -> list[TensorSlot]: ...
    def set_state(self, index: int, new: TensorState) -> None: ...
    def resident(self, key: tuple[ChunkList, int]) -> bool: ...
    def make_resident(
        self, keys: Sequence[tuple[ChunkList, int]], reason: MoveReason, where: str, *, gather_groups: bool = False
    ) -> None: ...
    def to_host(self, key: tuple[ChunkList, int], reason: MoveReason) -> None: ...
    def offload(self, chunk_id: int) -> None: ...
    def paused_probe(self) -> contextlib.AbstractContextManager[None]: ...
