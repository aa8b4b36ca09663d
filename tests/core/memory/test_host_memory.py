"""Host memory of the CPU virtual device: what the engine does to keep RSS near the live bytes.

* The optimizer's fp32 gradient copies are taken in batches of at most
  ``_HOST_BATCH_ELEMENTS`` elements on the CPU (``_BATCH_ELEMENTS`` on CUDA), a
  longer run (a tied embedding alone in its chunk, say) in pieces of that size,
  which changes no bit of the result.
* The engine hands glibc's free heap pages back once per iteration, right
  before its peak (Note [host heap] in chunkstar/memory/host_heap.py), and when
  everything is resident only if the iteration could raise the peak RSS; that
  moves no data, so training is bit-identical with and without it.

RSS itself depends on glibc's heap layout and is measured by
``benchmarks/host_memory.py``, not asserted here.
"""

from __future__ import annotations

import pytest
import torch

import chunkstar
from chunkstar.memory import host_heap
from chunkstar.memory.host_heap import HostHeap, release_moment
from chunkstar.memory.tracer import TracePhase
from chunkstar.optim import adam

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine

STEPS = 5


def _train(dtype: str, *, heap: bool = True) -> tuple[list[float], dict[str, torch.Tensor], chunkstar.ChunkEngine]:
    case = CASES["gpt2"]
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config(dtype, budget="64MB", chunk_size="auto")
    )
    if not heap:
        engine.host_heap = None
    losses = train_engine(engine, optimizer, case, STEPS, dtype=dtype)
    return losses, engine.state_dict(), engine


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _batch(monkeypatch: pytest.MonkeyPatch, elements: int) -> None:
    """The optimizer's batch size on both the CPU and CUDA."""
    monkeypatch.setattr(adam, "_BATCH_ELEMENTS", elements)
    monkeypatch.setattr(adam, "_HOST_BATCH_ELEMENTS", elements)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_adam_batches_and_cut_runs_give_the_same_bits(dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _batch(monkeypatch, 1 << 40)  # one batch: every run whole
    whole_losses, whole, _ = _train(dtype)
    _batch(monkeypatch, 1 << 10)  # many batches, long runs cut mid-tensor
    cut_losses, cut, _ = _train(dtype)
    assert cut_losses == whole_losses
    _assert_bitwise(cut, whole)


def test_adam_fp32_copies_stay_within_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """No fused call gets more than a batch of gradient elements, even from a chunk larger than that."""
    limit = 1 << 10
    _batch(monkeypatch, limit)
    sizes: list[int] = []
    fused = torch._fused_adamw_

    def spy(masters: list[torch.Tensor], *args: object, **kwargs: object) -> None:
        sizes.append(sum(t.numel() for t in masters))
        fused(masters, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    _, _, engine = _train("bf16")
    assert engine.mgr.layout.chunk_sizes[0] > limit  # the tied embedding's chunk is larger than a batch
    assert sizes and max(sizes) <= limit, max(sizes)


def test_training_is_the_same_with_and_without_heap_releases() -> None:
    losses, state, engine = _train("bf16")
    plain_losses, plain, _ = _train("bf16", heap=False)
    assert losses == plain_losses
    _assert_bitwise(state, plain)
    assert engine.host_heap is not None
    if engine.host_heap.available:
        assert engine.host_heap.releases > STEPS  # every forward moment of the first pass, then at most one per iteration
    else:
        assert engine.host_heap.releases == 0


@pytest.mark.parametrize("budget, raises_peak", [("1GB", True), ("1GB", False), ("pressure", True)])
def test_the_heap_is_released_before_each_iterations_peak(budget: str, raises_peak: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``raises_peak``: what the process's RSS says of every resident iteration (whether it could
    raise the peak RSS): released at its peak when it could, not at all when it cannot."""
    case = CASES["gpt2"]
    if budget == "pressure":
        budget = eviction_budget(case.build(), DTYPES["bf16"])
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config("bf16", budget=budget, chunk_size="auto")
    )
    heap = engine.host_heap
    assert heap is not None
    at: list[tuple[int, int, str]] = []  # (step, moment, stage) of each release
    step = 0
    monkeypatch.setattr(heap, "release", lambda: at.append((step, engine.mgr.cursor.moment, engine.mgr.cursor.stage.value)))
    asked: list[tuple[int, int]] = []  # (step, margin) of each question

    def could_raise_peak(margin: int) -> bool:
        asked.append((step, margin))
        return raises_peak

    monkeypatch.setattr(heap, "could_raise_peak", could_raise_peak)
    peaks: list[int | None] = []
    warm: list[bool] = []
    loads: list[int] = []  # param chunk loads before each step
    for step in range(STEPS):
        records = engine.mgr.cursor.trace.records
        peaks.append(release_moment([r.non_model_peak for r in records]) if engine.mgr.cursor.trace.passes else None)
        warm.append(engine.schedule.phase is TracePhase.WARMUP)
        loads.append(engine.stats()["moves_by_reason"]["access"] + engine.stats()["moves_by_reason"]["prefetch"])
        train_engine(engine, optimizer, case, range(step, step + 1), dtype="bf16")
    n_forward = sum(r.stage == "fwd" for r in engine.mgr.cursor.trace.records)
    assert warm[0] and not warm[-1]
    for s in range(STEPS):
        got = [(m, st) for t, m, st in at if t == s and st != "optim"]
        if warm[s]:
            # warm-up passes: at every forward moment (and at the traced peak or the turn)
            assert len({m for m, st in got if st == "fwd"}) >= n_forward and len(got) <= n_forward + 2, (s, got)
        elif not warm[s - 1] and loads[s] > loads[s - 1]:
            # under pressure (the iteration before loaded chunks): never, the moves would fault the pages in again
            assert got == [], (s, at)
            assert not [t for t, _ in asked if t == s], (s, asked)
        elif warm[s - 1]:
            # the first frozen iteration: once, at the start of the traced peak moment (the warm-up's pages go)
            assert [m for m, _ in got] == [peaks[s]], (s, at)
            assert not [t for t, _ in asked if t == s], (s, asked)
        else:
            # frozen iterations with everything resident: at the start of the traced peak moment if
            # the iteration could raise the peak RSS, asked once with the traced non-model peak
            assert [m for m, _ in got] == ([peaks[s]] if raises_peak else []), (s, at)
            margin = max(r.non_model_peak for r in engine.mgr.cursor.trace.records)
            assert [mg for t, mg in asked if t == s] == [margin], (s, asked)
    pressured = [s for s in range(1, STEPS) if not warm[s - 1] and loads[s] > loads[s - 1]]
    assert bool(pressured) == (budget != "1GB"), (budget, loads)
    assert bool(asked) == (budget == "1GB"), asked  # a resident iteration after the first frozen one was asked
    # at the optimizer steps of warm-up, and around the one that moves the optimizer state (once)
    optim = [t for t, _, st in at if st == "optim"]
    # (the first step is in warm-up; the second's trace freezes at the end of its backward)
    assert optim[0] == 0 and len([t for t in optim if t > 1]) <= 2, optim


def test_release_moment_is_the_first_largest_peak() -> None:
    assert release_moment([]) is None
    assert release_moment([3, 9, 1, 9]) == 1
    assert release_moment([5]) == 0


def test_without_malloc_trim_release_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_heap, "_find_malloc_trim", lambda: None)
    heap = HostHeap()
    assert not heap.available
    heap.release()
    assert heap.releases == 0


def test_a_resident_iteration_releases_only_if_it_could_raise_the_peak_rss(monkeypatch: pytest.MonkeyPatch) -> None:
    from chunkstar.memory.tracer import MemoryTrace, MomentRecord

    trace = MemoryTrace(records=[MomentRecord("a", "fwd", (0,), 10), MomentRecord("b", "fwd", (0,), 30)], passes=2)
    resident = host_heap.plan_heap_release(trace, warmup=False, frozen=True, frozen_before=True, loaded=False)
    assert resident.release_at == 1 and resident.margin == 30 and not resident.skip
    first = host_heap.plan_heap_release(trace, warmup=False, frozen=True, frozen_before=False, loaded=False)
    assert first.release_at == 1 and first.margin is None  # the first frozen iteration: unconditional
    pressured = host_heap.plan_heap_release(trace, warmup=False, frozen=True, frozen_before=True, loaded=True)
    assert pressured.skip and pressured.margin is None
    monkeypatch.setattr(host_heap, "resident_bytes", lambda: 1000)
    monkeypatch.setattr(host_heap, "peak_resident_bytes", lambda: 1030)
    assert not HostHeap().could_raise_peak(30) and HostHeap().could_raise_peak(31)
    heap = HostHeap()
    assert heap.could_raise_peak(31)
    # the peak held since the last question: the iteration in between fitted in its pages
    assert not heap.could_raise_peak(31) and not heap.could_raise_peak(500)
    # glibc's fragments crept the peak up by at most a quarter of the margin: not worth the faults
    monkeypatch.setattr(host_heap, "peak_resident_bytes", lambda: 1030 + 31 // 4)
    assert not heap.could_raise_peak(31)
    monkeypatch.setattr(host_heap, "peak_resident_bytes", lambda: 1050)  # iterations raised it by more
    assert heap.could_raise_peak(51) and not heap.could_raise_peak(51)
    monkeypatch.setattr(host_heap, "resident_bytes", lambda: None)
    assert heap.could_raise_peak(0)  # unknown: release
    monkeypatch.undo()
    rss, peak = host_heap.resident_bytes(), host_heap.peak_resident_bytes()
    assert rss is not None and peak is not None and 0 < rss <= peak + (4 << 20)  # Linux: both readable
