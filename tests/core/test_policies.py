"""Eviction and hybrid-Adam placement policies, driven with made-up views."""

from __future__ import annotations

from chunkstar.placement.eviction import ResidentChunk, choose_evictions
from chunkstar.placement.optimizer import plan_device_adam


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


def test_device_adam_only_in_margin_after_params_and_peak() -> None:
    params = [100, 100, 100]
    states = [600, 600, 600]
    assert plan_device_adam(params, states, capacity=1000, non_model_peak=200) == set()  # 500 left, one state chunk needs 600
    assert plan_device_adam(params, states, capacity=1500, non_model_peak=200) == {0}
    assert plan_device_adam(params, states, capacity=10_000, non_model_peak=200) == {0, 1, 2}
    assert plan_device_adam(params, states, capacity=250, non_model_peak=0) == set()  # params alone do not fit
