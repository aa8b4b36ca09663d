"""What the optimizer and the checkpoint code may ask of the chunk store: a Protocol.

The store (:class:`chunkstar.runtime.chunk_manager.ChunkManager`) owns the
chunks of the four lists, every tensor's state and the byte counters; its
users outside the runtime see only this narrow door: typed lookups of a chunk
or a slot's elements, the tensor index, tensor states through the checked
transition, and the few moves they ask for. Nothing here exposes the store's
dicts, so none of its users can index them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import TensorState

if TYPE_CHECKING:
    from chunkstar.events import MoveReason
    from chunkstar.memory.tracer import MemoryTrace

__all__ = ["ChunkStore", "DiskStaging"]


class DiskStaging(Protocol):
    """What the optimizer asks of the disk tier (:class:`chunkstar.runtime.disk_tier.DiskTier`):
    which lists live on disk, and to stage one chunk in ahead of its update or out behind it."""

    def on_disk(self, name: ChunkList) -> bool: ...
    def stage_in(self, chunk: Chunk) -> None: ...
    def stage_out(self, chunk: Chunk, *, write: bool) -> None: ...


class ChunkStore(Protocol):
    layout: ChunkLayout
    slots: tuple[TensorSlot, ...]
    """Every tensor's slot, by slot index (registration order)."""
    states: list[TensorState]
    """Every tensor's state, by slot index: read it here, change it with :meth:`set_state`."""
    compute_dtype: torch.dtype
    """The param chunks' dtype."""

    @property
    def moment(self) -> int: ...
    @property
    def trace(self) -> MemoryTrace: ...
    @property
    def disk(self) -> DiskStaging | None:
        """The disk tier, when the config has one (Note [disk tier])."""

    def chunk(self, which: ChunkList, chunk_id: int) -> Chunk: ...
    def chunks_of(self, which: ChunkList) -> Sequence[Chunk]: ...
    def slot_view(self, which: ChunkList, slot: TensorSlot) -> torch.Tensor: ...
    def value_view(self, slot: TensorSlot) -> torch.Tensor: ...
    def lists_of(self, chunk_id: int) -> tuple[ChunkList, ...]: ...
    def frozen(self, chunk_id: int) -> bool: ...
    def slots_of(self, chunk_id: int) -> list[TensorSlot]: ...
    def own(self, chunk_id: int) -> bool: ...
    def set_state(self, index: int, new: TensorState) -> None: ...
    def resident(self, key: tuple[ChunkList, int]) -> bool: ...
    def make_resident(
        self, keys: Sequence[tuple[ChunkList, int]], reason: MoveReason, where: str, *, gather_groups: bool = False
    ) -> None: ...
    def to_host(self, key: tuple[ChunkList, int], reason: MoveReason) -> None: ...
    def offload(self, chunk_id: int) -> None: ...
    def paused_probe(self) -> AbstractContextManager[None]: ...
    def on_disk(self, name: ChunkList) -> bool: ...
    def staged(self, keys: Iterable[tuple[ChunkList, int]], *, write: bool) -> AbstractContextManager[None]: ...
