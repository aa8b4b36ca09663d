"""Handing the CPU virtual device's freed heap pages back to the system.

This module is a mechanism (one libc call) and the choice of the moments for it in an
iteration (pure functions: :func:`plan_heap_release` once per iteration, then
:func:`release_at_moment`, :func:`release_at_turn` and :func:`release_after_step`);
it is not an allocator and it moves no data.

Note [host heap]: on the CPU virtual device every tier is process memory, and
so are the activations. glibc's malloc serves requests below its mmap
threshold (which it raises on the fly, up to 32 MiB, as large blocks are
freed) from its heap, and keeps the pages of freed blocks resident for reuse;
on its own it returns only the top of the heap. A training iteration frees
most of its temporaries before its memory peak (the forward's intermediate
results), and its chunk moves leave payload-sized holes, so at the peak the
heap holds live data *plus* pages freed earlier, and the process's RSS is the
live bytes plus whatever glibc kept, which varies from run to run with the
heap's layout. Measured on the 51.5M GPT-2 of ``chunkstar-bench step-time``
(zoo ``gpt2-51m``; ``benchmarks/host_memory.py``): chunkstar's live bytes at
the peak equal plain PyTorch's (14 bytes/param of model data against
PyTorch's 12 plus its 2 bytes/param of autocast weight copies), but glibc kept
110-250 MiB free beside them, against PyTorch's 100-130.

``malloc_trim(0)`` hands every whole free page of every arena back (madvise;
the address space stays, nothing moves). It takes a few milliseconds, and pages
reused afterwards fault back in zeroed (that is most of its cost: measured
0.45 -> 0.50 s/step on the 30M GPT-2 of ``chunkstar-bench overlap`` (zoo
``gpt2-30m-v8k``), 3-6% on the 51.5M one), so the engine calls it right before
the iteration's peak only:

* in warm-up (no frozen trace: the peak could be anywhere): at the start of
  every forward moment, and at the forward/backward turn when there is no
  trace yet or the traced peak moment was not reached;
* on the frozen schedule: once, at the start of the moment with the largest
  traced non-model peak (at the turn instead if the iteration got there
  without reaching that moment) - unless the previous frozen iteration loaded
  param chunks. Under pressure every step frees and allocates chunk payloads
  and activations anyway, so handing the pages back only has the next moves
  fault them in again (12% of the step on the 30M GPT-2 at 8 GB/s), for a
  peak RSS that the chunks' own traffic sets;
* when everything is resident (a frozen iteration after a frozen one that loaded
  nothing), only if this iteration could raise the process's peak RSS: when the
  RSS at the release point plus the traced non-model peak (the most the
  iteration's tensors can add, were every byte of it on pages faulted in anew)
  passes the peak so far (``ru_maxrss``). The first frozen iteration hands back
  the warm-up's free pages (its safe mode moved chunks at every moment); a small
  step then runs far below the peak the warm-up set, and handing its activations'
  pages back had them faulted in again by the next iteration for nothing:
  measured on a 49M GPT-2 (hidden 768, 6 layers, vocab 8192, bf16, batch 1 x 4)
  30-50 ms of a 0.82 s step; at batch 4 x 16 the steady-state RSS stayed at
  1190-1200 MiB under a 1553 MiB peak set in the warm-up. A step whose
  activations are large beside that headroom (the same model at 4 x 128) still
  releases every iteration, and pays for it: ~94k page faults per step (fp32,
  3.7 s steps on 2 cores, ~15% of the step against never releasing). Most of
  what it hands back is kept by the backward's own malloc arena (the virtual
  device runs backward on its device thread): without that thread, never
  releasing after the first frozen iteration peaked at 1780 MiB against 1828
  releasing every iteration; with it, 2187 against 1910. So a resident
  iteration also leaves the heap alone when the peak RSS held since the one
  before asked: that one fitted in the pages it had, and so will this one.
  The heap is released again only after iterations raised the peak by more
  than a quarter of the traced non-model peak; in a steady state it stays
  alone. Measured on the 49M GPT-2 at bf16, 4 x 128
  (``python benchmarks/resident_phases.py``, a noisy 2-core VM): releasing every
  iteration, ~50k page faults per step (PyTorch: 5-25k); never releasing, under
  2k. Releasing whenever the peak rose at all gave 0-2k in some runs and 30-37k
  in others: glibc's fragments crept the peak up by 4-5 MiB every few steps,
  and each release had ~100 MiB of pages faulted in again for it;
* around an optimizer step that moves the optimizer state (the first step
  after warm-up, when it fits on the device): before it, and after it if it
  moved more than a quarter of the state's bytes - the host buffers it left
  are free pages that nothing else would give back.

* with the disk tier, host memory is the tier the run is sized against, so the
  engine also bounds what glibc keeps: :func:`bound_heap_retention` gives every
  allocation of 1 MiB or more pages of its own, unmapped when freed (glibc would
  otherwise raise its threshold to 32 MiB and keep such blocks in its arenas, one
  arena per thread that allocates: the compute thread, the host worker, the I/O
  lanes). Measured with a 0.5B GPT-2 and the disk tier (master and Adam state on
  disk, 1.6 GB staging): the peak RSS of steps 1-4 went from 3.45-3.86 GiB, with
  glibc's free arena bytes growing 0.05 -> 0.60 GiB, to 3.45-3.67 GiB with them at
  0.07-0.23 GiB.

On the 51.5M GPT-2 the peak moment is ``lm_head``'s forward, which spans the loss
and the start of backward: peak RSS falls to the live bytes plus ~20 MiB. The
functions below decide when, the iteration (:mod:`chunkstar.runtime.iteration`)
asks them; :class:`HostHeap` only does it. Where libc has no
``malloc_trim`` (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, NamedTuple, Sequence

from chunkstar.memory.tracer import MemoryTrace

__all__ = [
    "HeapPlan", "HostHeap", "MMAP_THRESHOLD", "bound_heap_retention", "peak_resident_bytes", "plan_heap_release",
    "release_after_step", "release_at_moment", "release_at_turn", "release_before_step", "release_moment", "resident_bytes",
]  # fmt: skip


_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)

MMAP_THRESHOLD = 1 << 20
"""With the disk tier, allocations of at least this many bytes get pages of their own
(Note [host heap], last point)."""


def _find_mallopt() -> Callable[[int, int], int] | None:
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    fn = getattr(libc, "mallopt", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def bound_heap_retention(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``threshold`` bytes or more with its own mapping, returned to
    the system when freed, for the rest of the process (glibc's ``M_MMAP_THRESHOLD``; setting
    it also ends glibc's raising of the threshold as large blocks are freed). False where
    libc has no ``mallopt`` or refuses."""
    fn = _find_mallopt()
    return fn is not None and fn(_M_MMAP_THRESHOLD, threshold) == 1


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded in this process, libc among them
    except (OSError, TypeError):  # no dlopen(NULL) (Windows)
        return None
    fn = getattr(libc, "malloc_trim", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


class HostHeap:
    """The process's malloc heap, as far as giving free pages back goes (Note [host heap])."""

    def __init__(self) -> None:
        self._malloc_trim = _find_malloc_trim()
        self.releases = 0
        """Times :meth:`release` asked libc to hand free pages back."""
        self._peak_asked: int | None = None  # the peak RSS when could_raise_peak last answered

    @property
    def available(self) -> bool:
        """Whether this libc can hand free heap pages back (glibc)."""
        return self._malloc_trim is not None

    def release(self) -> None:
        """Hand every whole free page of the heap back to the system (no-op without glibc)."""
        if self._malloc_trim is not None:
            self._malloc_trim(0)
            self.releases += 1

    def could_raise_peak(self, margin: int) -> bool:
        """Whether a resident iteration's release could lower the process's peak resident set
        (``ru_maxrss``; Note [host heap]) by enough to pay for its page faults: not when the
        peak rose by at most a quarter of ``margin`` since the last time this answered yes or
        was first asked (the iterations in between fitted in the pages they had, give or take
        glibc's fragments: the heap's free pages are the working set the next one reuses, and
        handing them back has them faulted in again); else when the resident set plus
        ``margin`` bytes passes the peak. True where either figure is unknown."""
        rss, peak = resident_bytes(), peak_resident_bytes()
        if rss is None or peak is None:
            return True
        held = self._peak_asked is not None and peak <= self._peak_asked + margin // 4
        if not held:
            self._peak_asked = peak
        return not held and rss + margin > peak


def resident_bytes() -> int | None:
    """The process's resident set now (``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int | None:
    """The process's peak resident set so far (``ru_maxrss``, KiB on Linux); None without it."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _PAGE = 4096


def release_moment(non_model_peaks: Sequence[int]) -> int | None:
    """The moment to release the heap at: the first one holding the largest non-model
    peak of the iteration (None for an empty trace)."""
    if not non_model_peaks:
        return None
    return max(range(len(non_model_peaks)), key=non_model_peaks.__getitem__)


class HeapPlan(NamedTuple):
    """When one iteration hands the heap back (Note [host heap])."""

    release_at: int | None
    """The moment with the largest traced non-model peak (None: no trace to read, or skipped)."""
    each_forward_moment: bool
    """Warm-up: no trace yet, so at the start of every forward moment."""
    skip: bool
    """Under pressure: leave the heap alone for the whole iteration."""
    margin: int | None = None
    """Everything resident: release only if the RSS plus this many bytes (the traced
    non-model peak) could pass the peak RSS so far (:meth:`HostHeap.could_raise_peak`);
    None: release as planned."""


NO_HEAP = HeapPlan(None, False, False)
"""The plan without a heap to release (CUDA): the callers' release is a no-op then."""


def plan_heap_release(trace: MemoryTrace, *, warmup: bool, frozen: bool, frozen_before: bool, loaded: bool) -> HeapPlan:
    """The plan of an iteration that begins with ``trace`` (frozen, or the warm-up's passes
    so far). ``frozen``: it runs on the frozen schedule, ``frozen_before``: so did the one
    before, ``loaded``: that one loaded param chunks (access or prefetch). Under pressure
    (a frozen iteration after one that loaded chunks) the heap is left alone; the warm-up's
    safe mode moves chunks at every moment, so only a frozen iteration tells. A frozen
    iteration after one that loaded nothing releases only if it could raise the peak RSS
    (``margin``)."""
    skip = frozen and frozen_before and loaded
    peaks = [r.non_model_peak for r in trace.records]
    release_at = release_moment(peaks) if trace.passes > 0 and not skip else None
    # the most the iteration's tensors can add to the RSS: its traced non-model peak (every
    # byte of it on pages faulted in anew), so a skipped release cannot raise the peak RSS
    margin = max(peaks) if frozen and frozen_before and not loaded and release_at is not None else None
    return HeapPlan(release_at, warmup, skip, margin)


def release_at_moment(plan: HeapPlan, moment: int, forward: bool) -> bool:
    """Whether to release as moment ``moment`` (of the schedule) begins."""
    return moment == plan.release_at or plan.each_forward_moment and forward


def release_at_turn(plan: HeapPlan, released: bool, moment: int) -> bool:
    """Whether to release at the forward/backward turn (the iteration is at ``moment``):
    when there is no trace, or its peak moment was not reached, the turn stands in for it."""
    if plan.skip:
        return False
    return plan.release_at is None or not released and plan.release_at <= moment


def release_before_step(warmup: bool, state_moves: bool) -> bool:
    """Whether to release as an optimizer step begins: in warm-up (its safe mode freed
    payloads at every moment), or when the optimizer state is about to move to the device."""
    return warmup or state_moves


def release_after_step(moved_bytes: int, state_bytes: int) -> bool:
    """Whether an optimizer step that moved ``moved_bytes`` changed the placement of the
    optimizer state (``state_bytes``): the host buffers it left are free heap pages now."""
    return moved_bytes > state_bytes // 4
