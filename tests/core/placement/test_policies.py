"""Eviction and hybrid-Adam placement policies, driven with made-up views."""

from __future__ import annotations

from chunkstar.memory.tracer import MemoryTrace, MomentRecord
from chunkstar.placement.eviction import ResidentChunk, choose_evictions
from chunkstar.placement.optimizer import plan_device_adam, resident_footprint
from chunkstar.placement.prefetch import MAX_LOOKAHEAD, PrefetchView, Upcoming, plan_prefetch


def _c(key: str, nbytes: int, next_use: int | None, last_use: int) -> ResidentChunk:
    return ResidentChunk(key, nbytes, next_use, last_use)


def test_furthest_next_use_first() -> None:
    cands = [_c("a", 10, 1, 5), _c("b", 10, 9, 1), _c("c", 10, 4, 2)]
    assert choose_evictions(cands, 10, "furthest_next_use") == ["b"]
    assert choose_evictions(cands, 15, "furthest_next_use") == ["b", "c"]


def test_never_used_again_goes_before_anything_scheduled() -> None:
    cands = [_c("a", 10, 100, 0), _c("b", 10, None, 9)]
    assert choose_evictions(cands, 1, "furthest_next_use") == ["b"]


def test_lru_and_fallback_without_schedule() -> None:
    cands = [_c("a", 10, None, 5), _c("b", 10, None, 1), _c("c", 10, None, 3)]
    assert choose_evictions(cands, 20, "lru") == ["b", "c"]
    # no schedule known: furthest-next-use degrades to LRU
    assert choose_evictions(cands, 20, "furthest_next_use") == ["b", "c"]


def test_not_enough_room_is_reported_not_guessed() -> None:
    assert choose_evictions([_c("a", 10, 1, 1)], 11, "furthest_next_use") is None
    assert choose_evictions([], 0, "lru") == []


def _one_process(params: list[int], non_model_peak: int) -> int:
    return resident_footprint(params, lambda c: True, lambda c: (c,), [(0,), (1,), (2,)], [non_model_peak] * 3)


def test_device_adam_only_in_margin_after_params_and_peak() -> None:
    params = [100, 100, 100]
    states = {0: 600, 1: 600, 2: 600}
    assert _one_process(params, 200) == 500
    assert plan_device_adam(states, capacity=1000, footprint=_one_process(params, 200)) == set()  # 500 left, one needs 600
    assert plan_device_adam(states, capacity=1500, footprint=_one_process(params, 200)) == {0}
    assert plan_device_adam(states, capacity=10_000, footprint=_one_process(params, 200)) == {0, 1, 2}
    assert plan_device_adam(states, capacity=250, footprint=_one_process(params, 0)) == set()  # params alone do not fit


def test_with_several_ranks_the_footprint_is_the_own_chunks_and_the_worst_gathered_groups() -> None:
    # 2 ranks, 8 chunks of 100 bytes in groups {0,1} {2,3} {4,5} {6,7}; this rank owns the even ones
    own = lambda c: c % 2 == 0  # noqa: E731
    group = lambda c: range(c - c % 2, c - c % 2 + 2)  # noqa: E731
    moments = [(0,), (2,), (4,), (6,), (6,), (4,), (2,), (0,)]  # forward, then backward
    non_model = [10, 10, 10, 150, 10, 10, 10, 10]
    # own: 400; worst moment: 3 (non-model 150) beside its group's other chunk (moment 4 needs the same group)
    assert resident_footprint([100] * 8, own, group, moments, non_model) == 400 + 150 + 100
    # moment 2 gathers ahead for moment 3: the remote chunks of its own group and of the next one
    non_model[2] = 145
    assert resident_footprint([100] * 8, own, group, moments, non_model) == 400 + 145 + 200
    # a collective's flat temporary sits beside the gathered chunks
    assert resident_footprint([100] * 8, own, group, moments, non_model, scratch=200) == 400 + 145 + 200 + 200
    # counted as one process counts (every chunk held), the same rank would have no room
    assert plan_device_adam({0: 90, 2: 90, 4: 90, 6: 90}, 1000, 800 + 150) == set()
    assert plan_device_adam({0: 90, 2: 90, 4: 90, 6: 90}, 1000, 400 + 145 + 200) == {0, 2}


# ---------------------------------------------------------------------- prefetch
def _view(device_bytes: int, budget_now: int, resident: dict[str, int | None], sizes: dict[str, int]) -> PrefetchView:
    """``resident``: the movable chunks on the device with their next use (moments from now)."""
    return PrefetchView(
        device_bytes=device_bytes,
        budget_now=budget_now,
        nbytes=sizes.__getitem__,
        resident=resident.__contains__,
        movable=lambda: list(resident.items()),
    )


def test_prefetch_brings_the_next_moments_chunks_in_order_within_the_window() -> None:
    sizes = dict.fromkeys("abcde", 10)
    upcoming = [Upcoming(1, 100, ["a"]), Upcoming(2, 100, ["b", "c"]), Upcoming(3, 100, ["d"]), Upcoming(4, 100, ["e"])]
    plan = plan_prefetch(_view(0, 100, {}, sizes), upcoming, now=0, window_bytes=30)
    assert plan == [("a", []), ("b", []), ("c", [])]  # d would be the 40th byte ahead


def test_the_window_counts_resident_chunks_too_so_it_bounds_how_far_a_plan_looks() -> None:
    sizes = dict.fromkeys("abc", 10)
    upcoming = [Upcoming(1, 100, ["a"]), Upcoming(2, 100, ["b"]), Upcoming(3, 100, ["c"])]
    assert plan_prefetch(_view(10, 100, {"a": 1}, sizes), upcoming, now=0, window_bytes=20) == [("b", [])]
    # many moments that need nothing new: at most MAX_LOOKAHEAD of them are looked at
    many = [Upcoming(j, 100, ["a"]) for j in range(1, 2 * MAX_LOOKAHEAD)] + [Upcoming(2 * MAX_LOOKAHEAD, 100, ["b"])]
    assert plan_prefetch(_view(10, 100, {"a": 1}, sizes), many, now=0, window_bytes=1000) == []


def test_prefetch_evicts_only_chunks_needed_later_furthest_first() -> None:
    sizes = {"x": 10, "near": 10, "far": 10, "never": 10}
    # full device: 30 of 30 bytes; "near" is needed at moment 2, before x (moment 3)
    view = _view(30, 30, {"near": 2, "far": 9, "never": None}, sizes)
    plan = plan_prefetch(view, [Upcoming(1, 30, []), Upcoming(3, 30, ["x"])], now=0, window_bytes=100)
    assert plan == [("x", ["never"])]
    view = _view(30, 30, {"near": 2, "far": 9}, sizes)
    assert plan_prefetch(view, [Upcoming(3, 30, ["x"])], now=0, window_bytes=100) == [("x", ["far"])]
    view = _view(20, 20, {"near": 2, "a": 1}, {**sizes, "a": 10})
    assert plan_prefetch(view, [Upcoming(3, 20, ["x"])], now=0, window_bytes=100) == []  # both are needed sooner


def test_prefetch_fits_every_moment_until_the_use_and_never_skips_ahead() -> None:
    sizes = {"a": 10, "b": 10, "c": 1}
    # moment 1 has room for 15 chunk bytes only (big activations): a (10) fits, b after it does not,
    # and c, small enough, is not brought past b
    upcoming = [Upcoming(1, 15, ["a"]), Upcoming(2, 100, ["b"]), Upcoming(3, 100, ["c"])]
    assert plan_prefetch(_view(0, 100, {}, sizes), upcoming, now=0, window_bytes=100) == [("a", [])]
    # the running moment's own budget counts too
    assert plan_prefetch(_view(0, 5, {}, sizes), upcoming, now=0, window_bytes=100) == []


def test_the_trace_is_read_run_by_run_with_each_runs_largest_peak() -> None:
    """Moments that need the same chunks (many small modules in one chunk) are one run for
    prefetch; its budget is the tightest of its moments, from where the reader starts."""
    trace = MemoryTrace()
    for i, (chunks, peak) in enumerate([((0,), 5), ((0,), 9), ((1,), 2), ((1,), 7), ((0,), 1)]):
        trace.record(i, MomentRecord("m", "fwd", chunks, non_model_peak=peak))
    trace.end_pass(5)
    trace.freeze()
    assert list(trace.runs_after(-1)) == [(0, 9, (0,)), (2, 7, (1,)), (4, 1, (0,))]
    assert list(trace.runs_after(0)) == [(1, 9, (0,)), (2, 7, (1,)), (4, 1, (0,))]
    assert list(trace.runs_after(2)) == [(3, 7, (1,)), (4, 1, (0,))]
    assert list(trace.runs_after(4)) == []
