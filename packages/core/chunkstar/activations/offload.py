"""Offloading a block's saved tensors to host memory: the pack and unpack of ``saved_tensors_hooks``.

Note [activation offload]: inside an offloaded block's forward, every tensor
autograd saves goes through :meth:`HostOffload.pack`. A device tensor whose
storage is large enough (:data:`MIN_OFFLOAD_BYTES`) and is not model data has
its whole storage copied to host memory once per block call (several saved
views of one storage share the copy), and autograd keeps the host copy's record
in its place. :meth:`HostOffload.unpack` brings a storage back to the device
once, at the first saved view the backward reads, and rebuilds every view on it
with its own size, stride and offset: the bytes are the forward's, so the
backward is bit-exact.

The copies run on the engine's copy engines (:mod:`chunkstar.device.copy_engine`),
the same ones that carry chunks, so they share the host link with chunk
prefetch and evictions and overlap the compute as those do:

* to the host as the forward saves: the copy is issued and the forward goes on.
  The device bytes of one block call's copies are let go when the *next* block
  call ends, whether that block is offloaded, kept or recomputed
  (:meth:`HostOffload.block_ended`), or the backward begins, after waiting for
  those copies: so the copies of a block overlap its own forward and the next
  block's, and what the
  device holds does not depend on how fast the copies ran. That matters: the
  warm-up trace measures it, the chunk budget of every later moment is planned
  on it, and bytes let go as soon as a copy happened to finish would make each
  budget hold by luck, more on the run where the copies ran slower (Note
  [activation plan] counts a block's bytes until the next one's forward ends);
* back to the device ahead of the backward: when the backward first reads a
  storage of offloaded call k, every storage of the offloaded call before it
  (the next offloaded block the backward reaches, past any kept or recomputed
  ones) is sent for on the prefetch path, and the backward reaches it to find
  the copy done or in flight. So the copies back run one offloaded block
  ahead, in reverse order, bounded by one block's bytes. The first block the
  backward reaches (the last offloaded) is brought back when it is read.

What is not offloaded, and why:

* model data: parameters, and views of a chunk's payload (a linear layer saves
  its weight). The chunks are placed by the engine; a copy would duplicate them.
* storages under :data:`MIN_OFFLOAD_BYTES` (1 MiB): a copy has a fixed cost
  (about 10 us to launch and order on a CUDA stream, the time 80 KB take at
  8 GB/s), and a small storage frees little; a block's large saved tensors (its
  hidden states, attention inputs and MLP activations) are megabytes each.
* tensors on other devices (a CPU scalar, an index on the host), and tensor
  subclasses (a guarded parameter view keeps its type).

On the CPU virtual device the host and the device are both this machine's
memory: the host copy is made with the memory probe paused, so it is not
counted as device memory, and the copy back is.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator

import torch

from chunkstar.device.copy_engine import CopyEngine, CopyEvent, SerialCopies
from chunkstar.device.tiers import host_device
from chunkstar.events import ActivationMoved, EventBus, Tier

__all__ = ["MIN_OFFLOAD_BYTES", "HostOffload", "SavedBytes"]

MIN_OFFLOAD_BYTES = 1 << 20
"""The smallest storage offloaded (the module docstring says why)."""


@dataclass
class SavedBytes:
    """What one block call saved for its backward: bytes in storages worth offloading, bytes
    in the small ones that stay, and the time spent waiting for copies in flight."""

    large: int = 0
    small: int = 0
    waited_s: float = 0.0


class _Call:
    """One offloaded block call: its storages (weakly: autograd's saved records keep them),
    and the call before it, whose storages the backward reaches next."""

    __slots__ = ("block", "records", "prev", "fetched", "__weakref__")

    def __init__(self, block: str, prev: _Call | None) -> None:
        self.block = block
        self.records: list[weakref.ref[_HostStorage]] = []
        self.prev = weakref.ref(prev) if prev is not None else None
        self.fetched = False


class _HostStorage:
    """One device storage's bytes on the host, and its copy back once the backward asks."""

    __slots__ = (
        "host", "call", "nbytes", "to_host", "device", "to_device", "ordered", "moment", "sent_t0", "prefetched",
        "__weakref__",
    )  # fmt: skip

    def __init__(self, host: torch.Tensor, call: _Call, to_host: CopyEvent, moment: int) -> None:
        self.host = host  # 1-D uint8, the whole storage
        self.call = call
        self.nbytes = host.numel()
        self.to_host = to_host  # the copy that fills ``host`` (waited for before the copy back)
        self.device: torch.Tensor | None = None  # 1-D uint8 on the device, once sent for
        self.to_device: CopyEvent | None = None
        self.ordered = False  # the compute stream was ordered after the copy back
        self.moment = moment  # when the copy to the host was issued, then the copy back
        self.sent_t0 = 0  # when the copy back was issued
        self.prefetched = False  # it was issued ahead of the backward's read


class _Saved:
    """A saved tensor whose storage went to the host: where it sat in the storage."""

    __slots__ = ("storage", "size", "stride", "offset", "dtype")

    def __init__(self, storage: _HostStorage, t: torch.Tensor) -> None:
        self.storage = storage
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype


class _InFlight:
    """A copy to the host not yet waited for: its event, the device bytes it reads, and when it began."""

    __slots__ = ("event", "src", "rec", "block", "t0")

    def __init__(self, event: CopyEvent, src: torch.Tensor, rec: _HostStorage, block: str, t0: int) -> None:
        self.event = event
        self.src = src
        self.rec = rec
        self.block = block
        self.t0 = t0


class HostOffload:
    """The pack and unpack hooks of offloaded blocks on ``device`` (Note [activation offload]).

    ``model_data(t)``: whether ``t`` views a chunk's payload (never offloaded); ``quiet()``:
    the memory probe paused around the host copies (model data of neither tier); ``copies``:
    the engine's copy engines (None: copies in the calling thread); ``moment()``: the running
    moment, for the events."""

    def __init__(
        self,
        device: torch.device,
        model_data: Callable[[torch.Tensor], bool],
        quiet: Callable[[], ContextManager[None]] = contextlib.nullcontext,
        *,
        copies: CopyEngine | None = None,
        events: EventBus | None = None,
        moment: Callable[[], int] = lambda: -1,
    ) -> None:
        self.device = torch.device(device)
        self._host = host_device(self.device)  # the CPU, or meta in a dry run (no bytes anywhere)
        self._pinned = self.device.type == "cuda"
        self._model_data = model_data
        self._quiet = quiet
        self._copies: CopyEngine = copies if copies is not None else SerialCopies()
        self.prefetch = True
        """Send for the next block's storages ahead of its backward (off: each when it is read)."""
        self.pipelined = True
        """A block call's copies to the host are waited for when the next call ends (off: each as it
        is issued, and its device bytes go with the call's end: the measuring run, Note [activation plan])."""
        self._events = events
        self._moment = moment
        self._lock = threading.Lock()
        self._call = threading.local()  # the running block call: storages copied (key -> record) and its _Call
        self._last: _Call | None = None  # the latest block call (weakly held by the next one)
        self._running: list[_InFlight] = []  # the running call's copies to the host (pipelined)
        self._behind: list[_InFlight] = []  # the call before's, let go when the running one ends
        self.bytes_to_host = 0
        """Bytes copied to the host so far (each storage once per block call)."""
        self.bytes_to_device = 0
        """Bytes copied back to the device so far."""
        self.prefetched_bytes = 0
        """Of :attr:`bytes_to_device`, those sent for ahead of the backward's read."""
        self.back_log: list[tuple[str, int, int]] | None = None
        """Where set, every copy back is logged here as (block, moment, bytes): the measuring run
        learns when its backward read each block's storages (Note [activation plan])."""

    @contextlib.contextmanager
    def block_call(self, block: str = "", saved: SavedBytes | None = None) -> Iterator[None]:
        """Around one offloaded block's forward: its saved tensors go through pack/unpack, views of
        one storage share one copy, and ``saved`` (if given) counts what the call saved."""
        outer = (getattr(self._call, "seen", None), getattr(self._call, "call", None), getattr(self._call, "saved", None))
        with self._lock:
            call = _Call(block, self._last)
            self._last = call
        self._call.seen, self._call.call, self._call.saved = {}, call, saved
        with self._lock:
            outer_running, self._running = self._running, []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._call.seen, self._call.call, self._call.saved = outer
            with self._lock:
                behind, self._behind = self._behind, self._running
                self._running = outer_running
            waited = self._let_go(behind)
            if saved is not None:
                saved.waited_s += waited

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.is_sparse or isinstance(t, torch.nn.Parameter):
            return False
        if type(t) is not torch.Tensor:  # a subclass (a guarded parameter view, a tensor wrapper) keeps its type
            return False
        if t.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES:
            return False
        return not self._model_data(t)

    def pack(self, t: torch.Tensor) -> Any:
        saved: SavedBytes | None = self._call.saved
        if not self._offloadable(t):
            if saved is not None and t.device == self.device:
                saved.small += t.untyped_storage().nbytes()
            return t
        storage = t.untyped_storage()
        key = storage._cdata
        # the call's storages stay alive until it ends: a storage freed within it could give its
        # address (the key) to a new one, which would find the old one's copy
        seen: dict[int, tuple[_HostStorage, torch.Tensor]] = self._call.seen
        hit = seen.get(key)
        rec = hit[0] if hit is not None else None
        if rec is None:
            nbytes = storage.nbytes()
            call: _Call = self._call.call
            raw = t.new_empty(0, dtype=torch.uint8).set_(storage)
            with self._quiet():
                host = torch.empty(nbytes, dtype=torch.uint8, device=self._host, pin_memory=self._pinned)
            t0 = time.perf_counter_ns()
            event = self._copies.to_host(host, raw)
            rec = _HostStorage(host, call, event, self._moment())
            call.records.append(weakref.ref(rec))
            seen[key] = (rec, t)
            job = _InFlight(event, raw, rec, call.block, t0)
            with self._lock:
                self.bytes_to_host += nbytes
            if saved is not None:
                saved.large += nbytes
            if self.pipelined:
                with self._lock:
                    self._running.append(job)
            else:
                waited = self._let_go([job])
                if saved is not None:
                    saved.waited_s += waited
        return _Saved(rec, t)

    def _let_go(self, jobs: list[_InFlight]) -> float:
        """Wait for ``jobs``' copies and drop their device bytes; the seconds waited."""
        t0 = time.perf_counter()
        for job in jobs:
            job.event.wait()  # raises the copy's error, if it failed
            self._landed(job)
        jobs.clear()
        return time.perf_counter() - t0

    def block_ended(self) -> None:
        """A block that is not offloaded finished its forward: the offloaded call before it lets
        its device bytes go now, as the end of an offloaded call would (the plan counts them
        until the *next block's* forward is over, whatever that block's policy)."""
        with self._lock:
            behind, self._behind = self._behind, []
        self._let_go(behind)

    def drain(self) -> None:
        """Wait for every copy to the host and let their device bytes go (the backward begins,
        or the engine closes): at the same point of every iteration."""
        with self._lock:
            jobs, self._behind = self._behind + self._running, []
            self._running = []
        self._let_go(jobs)

    def _landed(self, job: _InFlight) -> None:
        if self._events is not None and self._events.active:
            self._events.emit(ActivationMoved(
                job.block, job.rec.nbytes, Tier.DEVICE, Tier.HOST, False, job.rec.moment, job.t0, time.perf_counter_ns()
            ))  # fmt: skip

    def _send_for(self, rec: _HostStorage, prefetch: bool) -> None:
        """Issue the copy of ``rec`` back to the device (after its copy to the host)."""
        back = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
        rec.sent_t0 = time.perf_counter_ns()
        rec.moment = self._moment()
        rec.prefetched = prefetch
        rec.to_device = self._copies.to_device(back, rec.host, prefetch=prefetch, after=rec.to_host)
        rec.device = back
        with self._lock:
            self.bytes_to_device += rec.nbytes
            if self.back_log is not None:
                self.back_log.append((rec.call.block, rec.moment, rec.nbytes))
            if prefetch:
                self.prefetched_bytes += rec.nbytes

    def _fetch_call(self, call: _Call) -> None:
        """Send for every storage of ``call`` not sent for yet, ahead of its backward."""
        if call.fetched:
            return
        call.fetched = True
        for ref in call.records:
            rec = ref()
            if rec is not None and rec.device is None:
                self._send_for(rec, prefetch=True)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed  # type: ignore[no-any-return]
        rec = packed.storage
        if rec.device is None:
            self._send_for(rec, prefetch=False)
        # the next offloaded block the backward reaches: sent for now, one offloaded block ahead
        prev = rec.call.prev() if self.prefetch and rec.call.prev is not None else None
        if prev is not None:
            self._fetch_call(prev)
        if not rec.ordered:
            assert rec.to_device is not None
            rec.to_device.order()
            rec.ordered = True
            if self._events is not None and self._events.active:
                self._events.emit(ActivationMoved(
                    rec.call.block, rec.nbytes, Tier.HOST, Tier.DEVICE, rec.prefetched, rec.moment, rec.sent_t0,
                    time.perf_counter_ns(),
                ))  # fmt: skip
        assert rec.device is not None
        return _typed(rec.device, packed.dtype).as_strided(packed.size, packed.stride, packed.offset)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D uint8 tensor's bytes as ``dtype`` elements (any tail shorter than one element cut)."""
    return raw[: raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
