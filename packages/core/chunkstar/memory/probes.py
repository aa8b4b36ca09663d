"""Per-tier memory probes: how much non-model memory the device holds.

Model data (chunks) is counted exactly by the runtime; everything else on the
device (activations, autograd temporaries, gradients before they are folded
into their slots) is *non-model* memory and has to be measured:

* CUDA: the caching allocator's own figures (``memory_allocated`` and its
  peak), minus the chunk payload bytes the device holds (resident chunks and
  frees still pending: Note [deferred free] in :mod:`chunkstar.device.memory`)
  and the flat buffers of collectives in flight, which budgets count as scratch
  (Note [scratch counted once] in :mod:`chunkstar.distributed.comm`).
  A moment's peak is taken window by window: whenever those bytes change
  (a move, a free, a collective's buffer) the allocator's peak so far, less the
  bytes that held during the window, closes a window, so a peak is never
  compared with chunk bytes of another instant.
* CPU virtual device: PyTorch keeps no allocator statistics for CPU, so
  :class:`LiveTensorTracker` (a ``TorchDispatchMode``) watches every op while
  it is active and counts the bytes of storages the op *allocates* (outputs
  whose storage none of the inputs had), releasing them through a weakref
  callback when the storage dies. Views of parameters are therefore not
  counted, and chunk payloads are not either: the runtime allocates them
  outside the mode (see :meth:`MemoryProbe.paused`). Each allocation it counts
  is reported to the device's meter (:meth:`DeviceMemory.observe`), so the
  meter's peak is chunks plus non-model bytes at the same instant.

The tracker is active while someone holds the probe: the warm-up iterations
(its cost is paid once), a profiler, or the device meter of the strict device
(``CHUNKSTAR_STRICT_DEVICE=1``, or ``CHUNKSTAR_DEVICE_METER=1`` alone: every
iteration measured, as CUDA always is).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack, _pop_mode, _push_mode

from chunkstar.device.memory import DeviceMemory

__all__ = ["MemoryProbe", "CpuProbe", "CudaProbe", "LiveTensorTracker", "make_probe"]


def _shares_input_storage(key: int, args: Any, kwargs: Any) -> bool:
    """Whether any tensor among the op's inputs (one level of lists) has storage ``key``."""
    for a in (*args, *(kwargs.values() if kwargs else ())):
        if isinstance(a, torch.Tensor):
            if a.untyped_storage()._cdata == key:
                return True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and b.untyped_storage()._cdata == key:
                    return True
    return False


class LiveTensorTracker(TorchDispatchMode):
    """Counts live bytes of storages allocated by ops run under the mode."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo would otherwise refuse to compile under the mode and mark the frame to skip
        # for good: a compiled function the user calls during the warm-up would stay eager
        # (compiled modules run eager while measured: Note [compiled units])
        return True

    def __init__(self, memory: DeviceMemory | None = None, device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self._device_type = device.type  # the tensors counted: the CPU virtual device's, or the meta device's
        self.live_bytes = 0
        self.peak_bytes = 0
        self._paused = 0
        self._refs: dict[int, weakref.ref[Any]] = {}
        self._memory = memory  # the device's meter, told of every allocation counted

    def _forget(self, key: int, nbytes: int) -> None:
        if self._refs.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        # Hot path (every op): no pytree flattening; outputs are a tensor or a flat tuple/list.
        outs = (out,) if isinstance(out, torch.Tensor) else out if isinstance(out, (tuple, list)) else ()
        for t in outs:
            if not isinstance(t, torch.Tensor) or t.device.type != self._device_type:
                continue
            st = t.untyped_storage()
            key = st._cdata
            if key in self._refs or _shares_input_storage(key, args, kwargs):
                continue  # an alias (view, in-place result) of memory already counted or not ours
            nbytes = st.nbytes()
            if nbytes == 0:
                continue
            self._refs[key] = weakref.ref(st, lambda _r, k=key, n=nbytes: self._forget(k, n))
            self.live_bytes += nbytes
            if self.live_bytes > self.peak_bytes:
                self.peak_bytes = self.live_bytes
            if self._memory is not None:
                self._memory.observe(self.live_bytes)
        return out

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1


class MemoryProbe:
    """Non-model memory of the device tier, now and peak-since-last-reading.

    Measuring may cost something (on the CPU a dispatch mode sees every op), so
    it runs only while someone holds the probe: the engine during warm-up, a
    profiler while it records. Holders are named so each releases only its own.
    """

    def __init__(self) -> None:
        self._holders: set[str] = set()
        self.memory: DeviceMemory | None = None  # the device's chunk bytes and meter (attach)

    def attach(self, memory: DeviceMemory) -> None:
        """Measure beside ``memory``: the chunk payload bytes the device holds, and its meter."""
        self.memory = memory

    @property
    def active(self) -> bool:
        return bool(self._holders)

    def held_by(self, holder: str) -> bool:
        return holder in self._holders

    def acquire(self, holder: str) -> None:
        if not self._holders:
            self._start()
        self._holders.add(holder)

    def release(self, holder: str) -> None:
        if holder in self._holders:
            self._holders.discard(holder)
            if not self._holders:
                self._stop()

    def release_all(self) -> None:
        """Stop measuring for every holder (the engine is closed or dropped: a forward whose
        backward never came must not leave the CPU probe's dispatch mode behind)."""
        if self._holders:
            self._holders.clear()
            self._stop()
        self.drop_stale()

    def _start(self) -> None:
        pass

    def _stop(self) -> None:
        pass

    def drop_stale(self) -> None:
        """Take off this thread's stack what a stop inside a backward could not (CpuProbe)."""

    def non_model_now(self, chunk_bytes: int) -> int:
        raise NotImplementedError

    def take_peak(self, chunk_bytes: int) -> int:
        """Peak non-model bytes since the previous call; starts a new window."""
        raise NotImplementedError

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Engine bookkeeping inside this block is not non-model memory."""
        yield


class CpuProbe(MemoryProbe):
    """Live-tensor tracking while held; reports 0 when nobody holds it."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        super().__init__()
        self._device = device  # the CPU virtual device, or the meta device (Note [the meta device])
        self._tracker: LiveTensorTracker | None = None
        # trackers stopped inside a backward, still on the stack of the thread that ran it
        self._stale: list[LiveTensorTracker] = []

    def _start(self) -> None:
        if self._stale:
            self.drop_stale()
        self._tracker = LiveTensorTracker(self.memory, self._device)
        _push_mode(self._tracker)
        tracker = self._tracker
        if self.memory is not None:
            self.memory.non_model_live = lambda: tracker.live_bytes

    def _stop(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is None:
            return
        if self.memory is not None:
            self.memory.non_model_live = lambda: 0
        if torch._C._current_graph_task_id() != -1:
            # inside a backward (the end of a plain loss.backward(), run by autograd's final
            # callback): autograd restores the thread's dispatch-mode stack as it was when the
            # backward began once it is done, so a pop here would not last. The tracker stops
            # counting now and leaves the stack at the next start, step or close.
            tracker._paused += 1
            self._stale.append(tracker)
            return
        self._pop(tracker)
        if self._stale:
            self.drop_stale()

    def drop_stale(self) -> None:
        if torch._C._current_graph_task_id() != -1:
            return
        stale, self._stale = self._stale, []
        for tracker in stale:
            self._pop(tracker)

    @staticmethod
    def _pop(tracker: LiveTensorTracker) -> None:
        # pop it from this thread's mode stack even when modes entered later sit above it (they
        # go back on top); from another thread, where it is not on the stack, nothing is popped
        stack = _get_current_dispatch_mode_stack()
        if not any(m is tracker for m in stack):
            return
        above = []
        while True:
            mode = _pop_mode()
            if mode is tracker:
                break
            above.append(mode)
        for mode in reversed(above):
            _push_mode(mode)

    def non_model_now(self, chunk_bytes: int) -> int:
        return self._tracker.live_bytes if self._tracker is not None else 0

    def take_peak(self, chunk_bytes: int) -> int:
        t = self._tracker
        if t is None:
            return 0
        peak = t.peak_bytes
        t.peak_bytes = t.live_bytes
        return peak

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        if self._tracker is None:
            yield
        else:
            with self._tracker.paused():
                yield


class CudaProbe(MemoryProbe):
    """The caching allocator's own figures; always available. While held, a moment's
    peak is taken in windows of constant chunk bytes (the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self._window_peak = 0  # the largest non-model peak of the windows closed since take_peak

    def attach(self, memory: DeviceMemory) -> None:
        super().attach(memory)
        memory.before_held_change = self._close_window
        memory.after_held_change = self._open_window

    def _reset(self) -> None:
        """Fold the allocator's peak into the meter, then start a new peak."""
        if self.memory is not None:
            self.memory.observe_total(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def _scratch(self) -> int:
        """The collectives' scratch bytes now: counted apart from non-model memory (Note [scratch
        counted once] in distributed/comm.py). Within a window they only fall (a window closes
        before each rises), so the figure at a window's end is the least it held in it: never
        more than what was allocated beside the window's peak."""
        return self.memory.scratch_in_flight() if self.memory is not None else 0

    def _close_window(self, held_before: int) -> None:
        """The chunk (or scratch) bytes are about to change from ``held_before``: the window that held them closes."""
        if not self.active:
            return
        peak = torch.cuda.max_memory_allocated(self.device) - held_before - self._scratch()
        if peak > self._window_peak:
            self._window_peak = peak

    def _open_window(self) -> None:
        """The chunk bytes changed: the next window's peak starts from what is allocated now."""
        if self.active:
            self._reset()

    def _start(self) -> None:
        self._window_peak = 0
        self._reset()

    def non_model_now(self, chunk_bytes: int) -> int:
        return max(0, torch.cuda.memory_allocated(self.device) - chunk_bytes - self._scratch())

    def take_peak(self, chunk_bytes: int) -> int:
        peak = max(self._window_peak, torch.cuda.max_memory_allocated(self.device) - chunk_bytes - self._scratch())
        self._window_peak = 0
        self._reset()
        return max(0, peak)


def cuda_usable_bytes(device: torch.device) -> int:
    """Bytes of the GPU this process may use: what is free plus what torch already holds."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def make_probe(device: torch.device) -> MemoryProbe:
    return CudaProbe(device) if device.type == "cuda" else CpuProbe(device)
