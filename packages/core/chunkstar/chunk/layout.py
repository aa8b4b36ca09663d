"""Where every parameter lives: chunk id and offset. Pure arithmetic, no tensors.

Parameters are packed in registration order (close to first-use order, so
fetching one chunk brings its neighbours along). A parameter larger than the
chunk size gets a chunk of its own, sized to fit it exactly. The same layout
serves all four chunk lists (param, master, exp_avg, exp_avg_sq): chunk *i* of
each list holds the same tensors at the same offsets.

The layout is shard-ready: chunks form groups of ``world_size`` consecutive
chunks and chunk *k* is owned by rank ``k % world_size`` (docs/design.md, 'Many processes').

Note [frozen chunks]: parameters with ``requires_grad=False`` (LoRA base
weights, frozen embeddings) are packed into chunks of their own, apart from the
trainable ones, so a frozen chunk needs only its param list: no fp32 master,
no Adam moments, no gradient traffic (docs/design.md, 'Chunks'). The two kinds are packed as
two streams in registration order, each with its own open chunk (LoRA
interleaves a frozen base weight with small trainable adapters in every layer;
closing a chunk at every switch would make hundreds of tiny chunks), and whole
groups of the two streams are interleaved by their first parameter, so chunk
ids still follow first use. The last group of each stream is trimmed to what
it holds (rounded up to 64 elements): a LoRA model's few trainable elements
then cost their own bytes of state, not a whole chunk's. A model without
frozen parameters is laid out exactly as before.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

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
    frozen: frozenset[int] = frozenset()
    """Chunk ids holding frozen parameters only: param list, no master or Adam state (Note [frozen chunks])."""

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_sizes)

    @property
    def total_elements(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def used_elements(self) -> int:
        return sum(s.numel for s in self.slots)

    def used_ends(self) -> dict[int, int]:
        """Each chunk's used extent: the end of its last parameter (what follows is padding)."""
        ends: dict[int, int] = {}
        for s in self.slots:
            ends[s.chunk_id] = max(ends.get(s.chunk_id, 0), s.end)
        return ends

    def owner(self, chunk_id: int) -> int:
        """Rank that owns the fp32 master and Adam state of ``chunk_id``."""
        return chunk_id % self.world_size

    def group(self, chunk_id: int) -> range:
        """The communication group (``world_size`` consecutive chunks) holding ``chunk_id``."""
        start = chunk_id - chunk_id % self.world_size
        return range(start, min(start + self.world_size, self.n_chunks))

    def slots_of(self, chunk_id: int) -> list[TensorSlot]:
        return [s for s in self.slots if s.chunk_id == chunk_id]

    def is_frozen(self, chunk_id: int) -> bool:
        return chunk_id in self.frozen

    @property
    def trainable_elements(self) -> int:
        """Elements of the chunks that keep master and Adam state (padding included)."""
        return sum(n for i, n in enumerate(self.chunk_sizes) if i not in self.frozen)


def _pack(numels: Sequence[int], chunk_size: int, world_size: int = 1) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy in-order packing; returns chunk capacities and (chunk, offset) per tensor.

    With several ranks the chunks of a group keep one size (:func:`_group_sizes`), so
    once a tensor larger than ``chunk_size`` opened a chunk of its own in a group, the
    group's later chunks are packed up to that size rather than padded to it. (Packed to
    ``chunk_size`` and padded, a 20B GPT's 412M-element embedding on 8 ranks made its
    group's seven other chunks mostly padding: the layout held 104% more elements than
    the model; the dry run found it.)"""
    sizes: list[int] = []
    places: list[tuple[int, int]] = []
    fill = 0  # elements used in the open chunk (sizes[-1]) when it is a regular chunk
    open_regular = False

    def room(chunk_id: int) -> int:
        """What a regular chunk opened as ``chunk_id`` may hold: the largest chunk its group has so far."""
        start = chunk_id - chunk_id % world_size
        return max([chunk_size, *sizes[start:chunk_id]])

    for n in numels:
        if open_regular and fill + n <= sizes[-1]:
            places.append((len(sizes) - 1, fill))
            fill += n
            continue
        if n > room(len(sizes)):
            # a chunk of its own, sized to fit; it closes the open regular chunk so
            # chunk ids stay in first-use order
            sizes.append(n)
            places.append((len(sizes) - 1, 0))
            open_regular = False
            continue
        sizes.append(room(len(sizes)))
        places.append((len(sizes) - 1, 0))
        fill = n
        open_regular = True
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


def _stream_sizes(numels: Sequence[int], frozen: Sequence[bool] | None, chunk_size: int, world_size: int) -> int:
    """Total elements of the chunks when ``numels`` are laid out by :func:`build_layout`."""
    if frozen is None or not any(frozen):
        return sum(_group_sizes(_pack(numels, chunk_size, world_size)[0], chunk_size, world_size))
    total = 0
    for kind in (False, True):
        part = [n for n, f in zip(numels, frozen) if f is kind]
        if part:
            sizes, places = _pack(part, chunk_size, world_size)
            total += sum(_trim_last_group(_group_sizes(sizes, chunk_size, world_size), places, part, world_size))
    return total


def search_chunk_size(
    numels: Sequence[int],
    *,
    world_size: int = 1,
    align: int = 64,
    candidates: int = 256,
    frozen: Sequence[bool] | None = None,
    max_size: int | None = None,
) -> int:
    """The chunk size (elements) that wastes least, between total/(256 x world_size) and
    total/(16 x world_size), or with several ranks the size of a tensor larger than that
    (and at most ``max_size``: a few groups must fit the device, and the disk tier stages
    whole chunks through a bounded buffer).

    The bounds keep 16-256 chunks per rank, that is 16-256 groups (plus the chunks of
    parameters bigger than the size), so a budget can be met at a useful granularity and
    a module's working set is a few groups, not the whole model: with several ranks a
    module gathers its chunks' whole groups, ``world_size`` chunks each. (Bounded by
    chunks alone, a 68B model on 8 ranks got chunks of a billion elements, groups of
    16 GB, and a warm-up moment that needed more than an 80 GB device: the dry run found it.) ``candidates`` sizes,
    multiples of ``align``, are tried by packing the parameters in order;
    ties go to the larger size (fewer chunks, fewer moves). With several
    ranks, the padding that rounds the count up to whole groups and evens out
    the sizes within a group counts as waste. ``frozen`` (per tensor) packs the
    frozen and trainable tensors as separate streams (Note [frozen chunks]).
    """
    total = sum(numels)
    if total == 0:
        return align
    lo = max(align, total // (256 * world_size) // align * align)
    hi = max(lo, math.ceil(total / (16 * world_size) / align) * align)
    if max_size is not None:
        hi = min(hi, max(align, max_size // align * align))
        lo = min(lo, hi)

    def least_waste(sizes: Iterable[int]) -> tuple[int, int]:
        best_size, best_waste = lo, -1
        for size in sorted(set(sizes)):
            waste = _stream_sizes(numels, frozen, size, world_size) - total
            if best_waste < 0 or waste <= best_waste:
                best_size, best_waste = size, waste
        return best_size, best_waste

    best_size, best_waste = least_waste(
        max(align, (lo + (hi - lo) * i // candidates) // align * align) for i in range(candidates + 1)
    )
    # with several ranks, tensors larger than the range each get a chunk of their own, and
    # their groups' other chunks take that size. Sizes up to twice the largest tensor, where
    # whole tensors pack, can waste far less (a 20B GPT on 8 ranks, whose layer matrices
    # exceed the range, padded 73% within it and 5% at a size that holds two of them);
    # they are taken only where they save at least 5% of the model: fewer, larger chunks
    # cost granularity
    widest = max(numels)
    top = 2 * widest if max_size is None else min(2 * widest, max_size)
    top = max(align, top // align * align)
    if world_size > 1 and top > hi and best_waste > total // 20:
        size, waste = least_waste(
            max(align, (hi + (top - hi) * i // candidates) // align * align) for i in range(1, candidates + 1)
        )
        if waste < best_waste - total // 20:
            best_size = size
    return best_size


def _trim_last_group(sizes: list[int], places: list[tuple[int, int]], numels: Sequence[int], world_size: int) -> list[int]:
    """``sizes`` with the chunks of the last group cut to the most any of them holds,
    rounded up to 64 elements (the chunks of a group keep one size)."""
    if not sizes:
        return sizes
    start = (len(sizes) - 1) // world_size * world_size
    used = [0] * (len(sizes) - start)
    for (c, o), n in zip(places, numels):
        if c >= start:
            used[c - start] = max(used[c - start], o + n)
    top = max(64, -(-max(used) // 64) * 64)
    return sizes[:start] + [min(n, top) for n in sizes[start:]]


def build_layout(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    chunk_size: int,
    *,
    world_size: int = 1,
    frozen: Sequence[bool] | None = None,
) -> ChunkLayout:
    """Pack parameters (already de-duplicated, in registration order) into chunks;
    ``frozen[i]``: tensor *i* gets no gradient, and goes to a frozen chunk (Note [frozen chunks])."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    numels = [math.prod(s) for s in shapes]
    if frozen is None or not any(frozen):
        sizes, places = _pack(numels, chunk_size, world_size)
        sizes = _group_sizes(sizes, chunk_size, world_size)
        slots = tuple(
            TensorSlot(index=i, name=names[i], chunk_id=c, offset=o, numel=numels[i], shape=tuple(shapes[i]))
            for i, (c, o) in enumerate(places)
        )
        return ChunkLayout(chunk_sizes=tuple(sizes), slots=slots, world_size=world_size)
    if len(frozen) != len(numels):
        raise ValueError(f"frozen has {len(frozen)} flags for {len(numels)} tensors")
    # each stream packed on its own; then its groups, keyed by their first tensor, merged in that order
    groups: list[tuple[float, bool, list[int]]] = []  # (first tensor index, frozen, chunk sizes)
    where: dict[int, tuple[int, int, int]] = {}  # tensor index -> (group number in its stream, chunk within, offset)
    stream_groups: dict[bool, list[int]] = {}  # kind -> positions in `groups`
    for kind in (False, True):
        members = [i for i, f in enumerate(frozen) if bool(f) is kind]
        if not members:
            continue
        part = [numels[i] for i in members]
        sizes, places = _pack(part, chunk_size, world_size)
        sizes = _trim_last_group(_group_sizes(sizes, chunk_size, world_size), places, part, world_size)
        firsts: dict[int, int] = {}
        for i, (c, o) in zip(members, places):
            firsts.setdefault(c // world_size, i)
            where[i] = (c // world_size, c % world_size, o)
        positions = []
        for g in range(len(sizes) // world_size):
            positions.append(len(groups))
            # a group of padding only (no tensor) follows its stream's last real group
            key = firsts.get(g, members[-1] + 0.5)
            groups.append((key, kind, sizes[g * world_size : (g + 1) * world_size]))
        stream_groups[kind] = positions
    order = sorted(range(len(groups)), key=lambda k: groups[k][0])
    first_chunk = {k: n * world_size for n, k in enumerate(order)}
    chunk_sizes: list[int] = []
    frozen_ids: set[int] = set()
    for k in order:
        _, kind, sizes = groups[k]
        if kind:
            frozen_ids.update(range(len(chunk_sizes), len(chunk_sizes) + len(sizes)))
        chunk_sizes += sizes
    placed: list[TensorSlot] = []
    for i in range(len(numels)):
        g, c, o = where[i]
        cid = first_chunk[stream_groups[bool(frozen[i])][g]] + c
        placed.append(TensorSlot(index=i, name=names[i], chunk_id=cid, offset=o, numel=numels[i], shape=tuple(shapes[i])))
    return ChunkLayout(chunk_sizes=tuple(chunk_sizes), slots=tuple(placed), world_size=world_size, frozen=frozenset(frozen_ids))


def layout_fingerprint(layout: ChunkLayout, dtype: str) -> str:
    """A hash (hex) of everything that places a value in the chunks: the chunk sizes,
    each slot's name, chunk, offset and shape, the param chunks' dtype name and the
    frozen chunks.

    Two engines with the same fingerprint put every parameter at the same place,
    so a checkpoint shard of one loads into the other chunk for chunk, and ranks
    that agree on it agree on every collective's size."""
    facts = {
        "chunk_sizes": list(layout.chunk_sizes),
        "slots": [[s.name, s.chunk_id, s.offset, list(s.shape)] for s in layout.slots],
        "dtype": dtype,
    }
    if layout.frozen:  # absent for a model without frozen parameters: its fingerprint is unchanged
        facts["frozen"] = sorted(layout.frozen)
    return hashlib.sha256(json.dumps(facts, separators=(",", ":")).encode()).hexdigest()
