"""Per-tier memory probes: how much non-model memory the device holds.

Model data (chunks) is counted exactly by the runtime; everything else on the
device (activations, autograd temporaries, gradients before they are folded
into their slots) is *non-model* memory and has to be measured:

* CUDA: the caching allocator's own figures (``memory_allocated`` and its
  peak), minus the chunk bytes the runtime knows are resident.
* CPU virtual device: PyTorch keeps no allocator statistics for CPU, so
  :class:`LiveTensorTracker` (a ``TorchDispatchMode``) watches every op while
  it is active and counts the bytes of storages the op *allocates* (outputs
  whose storage none of the inputs had), releasing them through a weakref
  callback when the storage dies. Views of parameters are therefore not
  counted, and chunk payloads are not either: the runtime allocates them
  outside the mode (see :meth:`MemoryProbe.paused`).

The tracker is active only during the warm-up iteration; its cost is paid once.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._paused = 0
        self._refs: dict[int, weakref.ref[Any]] = {}

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
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
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

    def _start(self) -> None:
        pass

    def _stop(self) -> None:
        pass

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

    def __init__(self) -> None:
        super().__init__()
        self._tracker: LiveTensorTracker | None = None

    def _start(self) -> None:
        self._tracker = LiveTensorTracker()
        self._tracker.__enter__()

    def _stop(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker = None

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
    """The caching allocator's own figures; always available, holding only resets the peak."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def _start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def non_model_now(self, chunk_bytes: int) -> int:
        return max(0, torch.cuda.memory_allocated(self.device) - chunk_bytes)

    def take_peak(self, chunk_bytes: int) -> int:
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return max(0, peak - chunk_bytes)


def cuda_usable_bytes(device: torch.device) -> int:
    """Bytes of the GPU this process may use: what is free plus what torch already holds."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def make_probe(device: torch.device) -> MemoryProbe:
    return CudaProbe(device) if device.type == "cuda" else CpuProbe()
