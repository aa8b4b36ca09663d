"""The chunk-traffic model the activation plan weighs plans with (Note [chunk traffic under a plan])."""

from __future__ import annotations

import random

import pytest

from chunkstar.placement.chunk_traffic import CacheModel

# four chunks of 10 bytes: the forward uses 0, 1, 2, 3 and the backward 3, 2, 1, 0
USES = [(0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]


@pytest.mark.parametrize("room, loads", [(10, (30, 30)), (20, (20, 20)), (30, (10, 10)), (40, (0, 0))])
def test_a_room_for_k_chunks_keeps_the_k_nearest_across_the_turn(room: int, loads: tuple[int, int]) -> None:
    # steady state: what the backward leaves resident (chunk 0) serves the next forward
    assert CacheModel(USES, [10] * 4, [room] * 8, backward_from=4).loads() == loads


def test_bytes_held_beside_the_chunks_cost_reloads_after_them() -> None:
    cache = CacheModel(USES, [10] * 4, [40] * 8, backward_from=4)
    # 30 bytes held at the turn (a kept block's activations): chunks 0-2 go there and the
    # backward loads them again
    assert cache.loads([0, 0, 0, 30, 30, 0, 0, 0]) == (0, 30)


def test_a_moment_keeps_its_own_chunks_whatever_the_room() -> None:
    # room below a moment's own chunks: the model never evicts them (the runtime's warm-up would fail)
    assert CacheModel([(0, 1), (0, 1)], [10, 10], [5, 5], backward_from=1).loads() == (0, 0)


def _reference(uses: list[tuple[int, ...]], sizes: list[int], room: list[int], backward_from: int) -> tuple[int, int]:
    """Belady over two iterations written plainly (next use found by scanning), the second counted."""
    n = len(uses)
    seq = uses + uses + uses

    def next_use(c: int, after: int) -> int:
        return next((t for t in range(after + 1, len(seq)) if c in seq[t]), 1 << 60)

    resident: set[int] = set()
    fwd = bwd = 0
    for t in range(2 * n):
        m = t % n
        for c in uses[m]:
            if c not in resident:
                resident.add(c)
                if t >= n:
                    fwd, bwd = (fwd + sizes[c], bwd) if m < backward_from else (fwd, bwd + sizes[c])
        while sum(sizes[c] for c in resident) > room[m]:
            victims = sorted((c for c in resident if c not in uses[m]), key=lambda c: (-next_use(c, t), c))  # ties: the lower id, as the model
            if not victims:
                break
            resident.discard(victims[0])
    return fwd, bwd


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_a_plain_replay(seed: int) -> None:
    rng = random.Random(seed)
    n_chunks = rng.randint(2, 8)
    sizes = [rng.choice([10, 20, 40]) for _ in range(n_chunks)]
    forward = [tuple(rng.sample(range(n_chunks), rng.randint(1, 2))) for _ in range(rng.randint(3, 10))]
    uses = forward + list(reversed(forward))
    room = [sum(sizes[c] for c in u) + rng.choice([0, 10, 30, 60, 200]) for u in uses]
    got = CacheModel(uses, sizes, room, backward_from=len(forward)).loads()
    assert got == _reference(uses, sizes, room, len(forward))


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="moments"):
        CacheModel(USES, [10] * 4, [40] * 7, backward_from=4)
