"""Chunk layout and chunk-size search: pure arithmetic, no tensors."""

from __future__ import annotations

import pytest

from chunkstar.chunk.layout import build_layout, packing_waste, search_chunk_size


def test_packs_in_order_and_never_overlaps() -> None:
    shapes = [(10,), (3, 4), (20,), (5,), (7, 2)]
    lay = build_layout([f"p{i}" for i in range(5)], shapes, chunk_size=32)
    # registration order is kept: chunk ids never go backwards
    ids = [s.chunk_id for s in lay.slots]
    assert ids == sorted(ids)
    for cid in range(lay.n_chunks):
        spans = sorted((s.offset, s.end) for s in lay.slots_of(cid))
        for (a0, a1), (b0, _) in zip(spans, spans[1:]):
            assert a1 <= b0
        assert all(end <= lay.chunk_sizes[cid] for _, end in spans)
    assert lay.used_elements == 10 + 12 + 20 + 5 + 14


def test_parameter_bigger_than_chunk_gets_its_own_chunk() -> None:
    lay = build_layout(["small", "huge", "small2"], [(4,), (100,), (4,)], chunk_size=16)
    huge = lay.slots[1]
    assert lay.chunk_sizes[huge.chunk_id] == 100 and huge.offset == 0
    assert lay.slots[2].chunk_id != huge.chunk_id and lay.slots[0].chunk_id != huge.chunk_id


def test_shard_ready_groups_and_owners() -> None:
    lay = build_layout([f"p{i}" for i in range(5)], [(10,)] * 5, chunk_size=10, world_size=2)
    assert lay.n_chunks % 2 == 0  # padded to whole groups
    assert [lay.owner(k) for k in range(4)] == [0, 1, 0, 1]
    assert list(lay.group(3)) == [2, 3]


def test_search_picks_least_waste_within_bounds() -> None:
    numels = [1000, 3000, 1000, 3000] * 16
    size = search_chunk_size(numels, align=1000)
    total = sum(numels)
    assert total // 256 <= size <= total / 16 + 1000
    best = min(packing_waste(numels, s) for s in range(size - 5000, size + 5001, 1000) if s >= 1000)
    assert packing_waste(numels, size) <= best


def test_bad_chunk_size() -> None:
    with pytest.raises(ValueError):
        build_layout(["a"], [(3,)], chunk_size=0)


def test_frozen_parameters_get_chunks_of_their_own_in_first_use_order() -> None:
    # LoRA's shape: a big frozen weight, then two small trainable adapters, per layer
    shapes = [(100,), (4,), (4,)] * 3
    frozen = [True, False, False] * 3
    lay = build_layout([f"p{i}" for i in range(9)], shapes, chunk_size=256, frozen=frozen)
    for s in lay.slots:
        assert lay.is_frozen(s.chunk_id) == frozen[s.index]
    # two open chunks at a time: the adapters share one chunk instead of closing a chunk per switch
    assert len({s.chunk_id for s in lay.slots if not frozen[s.index]}) == 1
    # chunk ids follow each chunk's first tensor
    firsts = [min(s.index for s in lay.slots_of(c)) for c in range(lay.n_chunks)]
    assert firsts == sorted(firsts)
    # the last chunk of each stream holds what it needs, rounded up to 64 elements
    trainable_chunk = lay.slots[1].chunk_id
    assert lay.chunk_sizes[trainable_chunk] == 64
    assert lay.trainable_elements == 64


def test_frozen_streams_keep_whole_groups_on_several_ranks() -> None:
    shapes = [(100,), (4,), (4,)] * 3
    frozen = [True, False, False] * 3
    lay = build_layout([f"p{i}" for i in range(9)], shapes, chunk_size=256, frozen=frozen, world_size=2)
    assert lay.n_chunks % 2 == 0
    for g in range(0, lay.n_chunks, 2):
        group = list(lay.group(g))
        assert len({lay.is_frozen(c) for c in group}) == 1  # a group is all frozen or all trainable
        assert len({lay.chunk_sizes[c] for c in group}) == 1  # and of one size (collectives)


def test_auto_chunks_keep_groups_small_on_many_ranks() -> None:
    """A module gathers whole groups (world_size chunks): "auto" keeps 16-256 groups, not 16-256
    chunks. The paper's 68B GPT on 8 ranks got chunks of a billion elements (16 GB groups) and
    did not fit an 80 GB device; the dry run found it (issue 26)."""
    h, layers, vocab = 9216, 66, 50257
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    numels = [vocab * h, 1024 * h, *block * layers, h, h]
    total = sum(numels)
    for world in (1, 8):
        size = search_chunk_size(numels, world_size=world)
        assert total / (256 * world) - 64 <= size <= total / (16 * world) + 64
        assert world * size <= total / 16 + 64 * world  # a group is at most 1/16 of the model


def test_a_group_with_a_tensor_of_its_own_packs_its_other_chunks_to_that_size() -> None:
    """The chunks of a group keep one size: after a tensor bigger than the chunk size, the
    group's later chunks hold up to that size instead of being padded to it (issue 26: a 20B
    GPT's embedding on 8 ranks made the layout 104% padding)."""
    numels = [1000, *[100] * 30]
    lay = build_layout([f"p{i}" for i in range(len(numels))], [(n,) for n in numels], 200, world_size=4)
    assert lay.chunk_sizes[:4] == (1000,) * 4
    # the group's three other chunks hold ten tensors each, not two
    assert [sum(1 for s in lay.slots if s.chunk_id == c) for c in range(1, 4)] == [10, 10, 10]
    assert len(lay.chunk_sizes) == 4
    # one process: no group to fill, the regular chunks keep the chunk size
    single = build_layout([f"p{i}" for i in range(len(numels))], [(n,) for n in numels], 200)
    assert single.chunk_sizes == (1000,) + (200,) * 15


def test_auto_takes_a_size_that_holds_tensors_larger_than_its_range_when_it_saves_much() -> None:
    """Layer matrices larger than total/(16 x world) each get a chunk; a size holding two of
    them packs a layer into few chunks (a 20B GPT on 8 ranks: 73% padding within the range,
    5% outside it). Outside the range is taken only for a saving of 5% of the model."""
    h, layers, vocab = 8192, 25, 50257
    block = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, 4 * h * h, 4 * h, 4 * h * h, h]
    numels = [vocab * h, 2048 * h, *block * layers, h, h]
    total = sum(numels)
    names, shapes = [f"p{i}" for i in range(len(numels))], [(n,) for n in numels]

    def padding(size: int, world: int) -> float:
        return sum(build_layout(names, shapes, size, world_size=world).chunk_sizes) / total - 1

    size = search_chunk_size(numels, world_size=8)
    assert size > total / (16 * 8)
    assert padding(size, 8) < 0.06
    # within a device's cap it stays within the range when nothing outside it fits
    capped = search_chunk_size(numels, world_size=8, max_size=int(total / (16 * 8)))
    assert capped <= total / (16 * 8) + 64
    # where the range packs well, it is kept, though one tensor is larger than it
    numels = [5000, *[100] * 2000]
    assert search_chunk_size(numels, world_size=8) <= sum(numels) / (16 * 8) + 64
