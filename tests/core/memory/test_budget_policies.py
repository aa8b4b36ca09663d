"""Budget arithmetic, heap-release moments and gathered-copy release: pure functions, made-up numbers."""

from __future__ import annotations

from chunkstar.memory.budget import chunk_budget, device_capacity, minimum_budget, room_target
from chunkstar.memory.host_heap import (
    NO_HEAP, plan_heap_release, release_after_step, release_at_moment, release_at_turn,
)  # fmt: skip
from chunkstar.memory.tracer import MemoryTrace, MomentRecord, ScheduleMode
from chunkstar.placement.gathered import groups_to_release


def test_capacity_is_the_budget_on_cpu_and_the_smaller_of_budget_and_gpu_on_cuda_less_slack() -> None:
    assert device_capacity(1000, 0.0) == 1000
    assert device_capacity(1000, 0.1) == 900
    assert device_capacity(1000, 0.0, usable=600) == 600  # the GPU gives less than the budget
    assert device_capacity(None, 0.0, usable=600) == 600  # no budget: what the GPU gives
    assert device_capacity(500, 0.5, usable=600) == 250


def test_warm_up_makes_room_down_to_nothing_in_model_passes_only() -> None:
    for untrusted in (ScheduleMode.TRACING, ScheduleMode.EVALUATING_UNTRACED):
        assert room_target(700, untrusted, in_model_pass=True) == 0
        assert room_target(700, untrusted, in_model_pass=False) == 700  # optimizer step, between steps
    for trusted in (ScheduleMode.FOLLOWING, ScheduleMode.EVALUATING_ALONG, ScheduleMode.EVALUATING_OFF):
        assert room_target(700, trusted, in_model_pass=True) == 700


def test_the_chunk_budget_reads_the_figure_each_mode_trusts() -> None:
    at_moment = lambda: 300  # noqa: E731
    budget = lambda mode, live, in_pass=True: chunk_budget(1000, live, mode, in_pass, at_moment, 450)  # noqa: E731
    assert budget(ScheduleMode.TRACING, 100) == 900  # live only
    assert budget(ScheduleMode.EVALUATING_UNTRACED, 100) == 900
    assert budget(ScheduleMode.FOLLOWING, 100) == 700  # the traced moment's, whatever is live
    assert budget(ScheduleMode.FOLLOWING, 400) == 700
    assert budget(ScheduleMode.EVALUATING_ALONG, 100) == 700  # the larger of live and the moment's
    assert budget(ScheduleMode.EVALUATING_ALONG, 400) == 600
    assert budget(ScheduleMode.EVALUATING_OFF, 100) == 550  # the larger of live and the trace's largest
    assert budget(ScheduleMode.EVALUATING_OFF, 500) == 500
    for mode in ScheduleMode:  # the optimizer step and between steps: live
        assert budget(mode, 100, in_pass=False) == 900


def test_minimum_budget_adds_the_slack_back_and_rounds_up() -> None:
    assert minimum_budget(600, 300, 0.0) == 900
    assert minimum_budget(600, 300, 0.1) == 1000
    assert minimum_budget(1, 0, 0.3) == 2


def _trace(peaks: list[int], passes: int) -> MemoryTrace:
    t = MemoryTrace()
    for i, p in enumerate(peaks):
        t.record(i, MomentRecord(f"m{i}", "fwd", (i,)))
        t.set_peak(i, p)
    t.passes = passes
    return t


def test_heap_plan_warm_up_frozen_and_under_pressure() -> None:
    first = plan_heap_release(MemoryTrace(), warmup=True, frozen=False, frozen_before=False, loaded=True)
    assert first.release_at is None and first.each_forward_moment and not first.skip
    assert release_at_moment(first, 3, forward=True) and not release_at_moment(first, 3, forward=False)
    assert release_at_turn(first, released=True, moment=9)  # no trace: the turn stands in for the peak

    trace = _trace([5, 40, 7], passes=2)
    calm = plan_heap_release(trace, warmup=False, frozen=True, frozen_before=True, loaded=False)
    assert calm.release_at == 1 and not calm.each_forward_moment and not calm.skip
    assert release_at_moment(calm, 1, forward=False) and not release_at_moment(calm, 2, forward=True)
    assert not release_at_turn(calm, released=True, moment=2)
    assert release_at_turn(calm, released=False, moment=2)  # its peak moment passed without a release
    assert not release_at_turn(calm, released=False, moment=0)  # the peak is still ahead

    pressed = plan_heap_release(trace, warmup=False, frozen=True, frozen_before=True, loaded=True)
    assert pressed.skip and pressed.release_at is None
    assert not release_at_turn(pressed, released=False, moment=5)
    assert not release_at_moment(NO_HEAP, 0, forward=False)


def test_heap_released_after_a_step_that_moved_a_quarter_of_the_state() -> None:
    assert release_after_step(26, 100) and not release_after_step(25, 100)


def test_gathered_groups_kept_when_next_needed_or_pinned() -> None:
    assert groups_to_release({4, 0, 8}, [], lambda g: False) == [0, 4, 8]
    assert groups_to_release({4, 0, 8}, [4], lambda g: g == 8) == [0]
