"""Where every parameter lives: chunk id and offset. Pure arithmetic, no tensors.

Parameters are packed in registration order (close to first-use order, so
fetching one chunk brings its neighbours along). A parameter larger than the
chunk size gets a chunk of its own, sized to fit it exactly. The same layout
serves all four chunk lists (param, master, exp_avg, exp_avg_sq): chunk *i* of
each list holds the same tensors at the same offsets.

The layout is shard-ready: chunks form groups of ``world_size`` consecutive
chunks and chunk *k* is owned by rank ``k % world_size`` (DESIGN §7).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["TensorSlot", "ChunkLayout", "build_layout", "layout_fingerprint", "search_chunk_size", "packing_waste"]


@dataclass(frozen=True)
class TensorSlot:
    """One parameter's place in the chunk lists."""

    index: int
    """Position among the unique parameters, in registration order."""
    name: str
    chunk_id: int
    offset: int
    """First element within the chunk."""
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ChunkLayout:
    chunk_sizes: tuple[int, ...]
    """Capacity in elements of each chunk (the nominal size, or a big parameter's size)."""
    slots: tuple[TensorSlot, ...]
    world_size: int = 1

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_sizes)

    @property
    def total_elements(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def used_elements(self) -> int:
        return sum(s.numel for s in self.slots)

    def owner(self, chunk_id: int) -> int:
        """Rank that owns the fp32 master and Adam state of ``chunk_id``."""
        return chunk_id % self.world_size

    def group(self, chunk_id: int) -> range:
        """The communication group (``world_size`` consecutive chunks) holding ``chunk_id``."""
        start = chunk_id - chunk_id % self.world_size
        return range(start, min(start + self.world_size, self.n_chunks))

    def slots_of(self, chunk_id: int) -> list[TensorSlot]:
        return [s for s in self.slots if s.chunk_id == chunk_id]


def _pack(numels: Sequence[int], chunk_size: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy in-order packing; returns chunk capacities and (chunk, offset) per tensor."""
    sizes: list[int] = []
    places: list[tuple[int, int]] = []
    fill = 0  # elements used in the open chunk (sizes[-1]) when it is a regular chunk
    open_regular = False
    for n in numels:
        if n > chunk_size:
            # a chunk of its own, sized to fit; it closes the open regular chunk so
            # chunk ids stay in first-use order
            sizes.append(n)
            places.append((len(sizes) - 1, 0))
            open_regular = False
            continue
        if not open_regular or fill + n > chunk_size:
            sizes.append(chunk_size)
            fill = 0
            open_regular = True
        places.append((len(sizes) - 1, fill))
        fill += n
    return sizes, places


def _group_sizes(sizes: list[int], chunk_size: int, world_size: int) -> list[int]:
    """Pad to whole communication groups so every rank owns the same number of chunks,
    and give the chunks of a group one size: collectives move equal-sized buffers."""
    sizes = sizes + [chunk_size] * ((-len(sizes)) % world_size)
    if world_size > 1:
        for g in range(0, len(sizes), world_size):
            top = max(sizes[g : g + world_size])
            sizes[g : g + world_size] = [top] * world_size
    return sizes


def packing_waste(numels: Sequence[int], chunk_size: int) -> int:
    """Unused elements when ``numels`` are packed in order into chunks of ``chunk_size``."""
    sizes, _ = _pack(numels, chunk_size)
    return sum(sizes) - sum(numels)


def search_chunk_size(numels: Sequence[int], *, world_size: int = 1, align: int = 64, candidates: int = 256) -> int:
    """The chunk size (elements) that wastes least, between total/256 and total/16.

    The bounds keep 16-256 chunks (plus the chunks of parameters bigger than
    the size), so a budget can be met at a useful granularity and a module's
    working set is a few chunks, not the whole model. ``candidates`` sizes,
    multiples of ``align``, are tried by packing the parameters in order;
    ties go to the larger size (fewer chunks, fewer moves). With several
    ranks, the padding that rounds the count up to whole groups and evens out
    the sizes within a group counts as waste.
    """
    total = sum(numels)
    if total == 0:
        return align
    lo = max(align, total // 256 // align * align)
    hi = max(lo, math.ceil(total / 16 / align) * align)
    best_size, best_waste = lo, None
    for i in range(candidates + 1):
        size = max(align, (lo + (hi - lo) * i // candidates) // align * align)
        sizes = _group_sizes(_pack(numels, size)[0], size, world_size)
        waste = sum(sizes) - total
        if best_waste is None or waste <= best_waste:
            best_size, best_waste = size, waste
    return best_size


def build_layout(
    names: Sequence[str], shapes: Sequence[tuple[int, ...]], chunk_size: int, *, world_size: int = 1
) -> ChunkLayout:
    """Pack parameters (already de-duplicated, in registration order) into chunks."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    numels = [math.prod(s) for s in shapes]
    sizes, places = _pack(numels, chunk_size)
    sizes = _group_sizes(sizes, chunk_size, world_size)
    slots = tuple(
        TensorSlot(index=i, name=names[i], chunk_id=c, offset=o, numel=numels[i], shape=tuple(shapes[i]))
        for i, (c, o) in enumerate(places)
    )
    return ChunkLayout(chunk_sizes=tuple(sizes), slots=slots, world_size=world_size)


def layout_fingerprint(layout: ChunkLayout, dtype: str) -> str:
    """A hash (hex) of everything that places a value in the chunks: the chunk sizes,
    each slot's name, chunk, offset and shape, and the param chunks' dtype name.

    Two engines with the same fingerprint put every parameter at the same place,
    so a checkpoint shard of one loads into the other chunk for chunk, and ranks
    that agree on it agree on every collective's size."""
    facts = {
        "chunk_sizes": list(layout.chunk_sizes),
        "slots": [[s.name, s.chunk_id, s.offset, list(s.shape)] for s in layout.slots],
        "dtype": dtype,
    }
    return hashlib.sha256(json.dumps(facts, separators=(",", ":")).encode()).hexdigest()
