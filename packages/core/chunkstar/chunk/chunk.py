"""A chunk: one flat buffer whose payload lives on the device or on the host.

Mechanism only: a chunk knows how to allocate, copy and free its bytes; it
never decides when (that is the runtime's job, on the policies' advice).

Note [persistent device storage]: each chunk owns one 1-D device tensor for its
whole life. Parameters are views into it, and autograd may save such views
(or views of views) for backward. Evicting resizes the tensor's untyped storage
to 0 bytes and re-admitting resizes it back before copying in, so the storage
object (and every view of it) stays the same while the memory comes and goes.
On the CPU virtual device the "device" tensor is an ordinary CPU tensor held
apart from the host copy, so a move is a real copy there too.

Note [pending copy]: a move hands the copy to a copy engine
(:mod:`chunkstar.device.copy_engine`) and may return before the bytes have
landed. The chunk remembers the copy's event; reading the payload, moving the
chunk again or releasing it first waits on that event, so no reader ever sees
half a copy, and an evicted chunk's device bytes are freed only after its copy
has read them (Note [deferred free] in :mod:`chunkstar.device.memory`: every
payload storage grows and shrinks through the device's :class:`DeviceMemory`).
A chunk brought back while its eviction's copy is still in flight orders its
copy in after that copy (on CUDA a stream wait, not a host sync) and keeps the
device bytes it still has. Parameters are views of the device tensor: a module reads them
only after the runtime made the chunk resident and waited (``make_resident``).
Host-side work on the payload (the optimizer's update on a worker thread) is a
second pending event, ``_work``: readers wait on it too, and the next copy to
the device is handed it as ``after``, so the copy engine orders the copy behind
the update without stopping the compute thread.

Note [clean host copy]: a param chunk brought to the device may keep its host
buffer (``keep_host``). Until something writes the device payload the two
agree, and evicting the chunk needs no copy back: the device bytes are simply
freed (Gemini keeps such copies too). Any access to :attr:`payload` on the
device may be a write, so it marks the host copy stale; so does a change of the
``version`` the mover hands both moves (for a param chunk, the sum of its
parameters' version counters, which an in-place write by the module itself
bumps). Whether the copy is clean is this chunk's fact alone. A stale host buffer
is kept as the destination of the next copy back, so a chunk that travels every
step does not allocate host memory every step.

Note [pinned once it travels]: on CUDA a copy from or into pageable host memory
is a blocking copy plus a stream sync, and a param chunk travels every step, so
its host buffer is pinned from its first placement (:mod:`chunkstar.device.pinned`).
Optimizer state (master, moments) mostly never travels: host Adam updates it
where it is, and the state hybrid Adam keeps on the device goes there once and
stays (Note [state kept for the step] in placement/eviction.py). Pinning all of
it would lock 12 bytes per parameter of host memory for nothing. So a state
chunk starts in plain memory, its first trip to the device drops that buffer
(nothing on the host reads it while the device copy is the payload), and a trip
back, which means it travels after all, lands in a pinned buffer it keeps for
life: every later move is an asynchronous copy on a copy stream.
"""

from __future__ import annotations

from typing import Callable

import torch

from chunkstar.chunk.state import ChunkLocation, check_location_transition
from chunkstar.device.copy_engine import CopyEngine, CopyEvent
from chunkstar.device.memory import DeviceMemory, PendingFree, order_after
from chunkstar.device.pinned import PinnedBuffers
from chunkstar.device.tiers import host_device
from chunkstar.events import Tier

__all__ = ["Chunk"]


class Chunk:
    def __init__(
        self,
        chunk_id: int,
        list_name: str,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        pinned: PinnedBuffers | None = None,
        memory: DeviceMemory | None = None,
        pin_from_start: bool = True,
    ) -> None:
        self.chunk_id = chunk_id
        self.list_name = list_name
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.location = ChunkLocation.RELEASED
        # where host buffers come from: exactly-sized pinned ones for a chunk that travels to a
        # CUDA device (kept for life: pinning costs far more than the bytes), else plain memory.
        # ``pin_from_start`` False (optimizer state, Note [pinned once it travels]): plain memory
        # until the chunk first comes back from the device, pinned from then on
        self._pinned = pinned
        self._pin_from_start = pin_from_start
        self._host_pinned = False  # the host buffer is one of ``pinned``'s (kept for life)
        # where device payload bytes are allocated and freed, and counted (device/memory.py)
        self._memory = memory if memory is not None else DeviceMemory(device)
        # 1-D, on `device`; storage is 0 bytes unless location is DEVICE, or while a free is pending
        # (Note [persistent device storage]); grown and freed through the device memory from here
        self._device_buf = torch.empty(numel, dtype=dtype, device=device)
        self._device_buf.untyped_storage().resize_(0)
        # the free of the device bytes after the last eviction's copy, until it runs (Note [deferred free])
        self._free: PendingFree | None = None
        # CUDA: the last copy to the device as host code must wait for it (it reads the host buffer,
        # and the compute stream's wait does not make host writes safe); see move_to's clean eviction
        self._host_read: CopyEvent | None = None
        # 1-D, host (pinned when the device is CUDA); exists while location is HOST, and may
        # stay while the chunk is on the device (Note [clean host copy]): valid or stale
        self._host_buf: torch.Tensor | None = None
        self._host_valid = False
        # the mover's version of the payload when the clean host copy was kept (Note [clean host copy])
        self._host_version: int | None = None
        # the last copy of this chunk's payload, until someone has waited on it (Note [pending copy])
        self._pending: CopyEvent | None = None
        # host-side work on the host payload still running (the optimizer's update)
        self._work: CopyEvent | None = None
        # a chunk whose home is a file (Note [param chunks on disk]): the file holds what the
        # payload holds, as of the mover's version then (as the clean host copy's flag)
        self._file_valid = False
        self._file_version: int | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.list_name}[{self.chunk_id}], {self.numel} x {self.dtype}, {self.location.name})"

    @property
    def device_view(self) -> torch.Tensor:
        """The persistent device tensor (valid data only while on the device)."""
        return self._device_buf

    @property
    def payload(self) -> torch.Tensor:
        """The buffer holding the chunk's data now, wherever it is (once its last copy and
        any host-side work have landed). On the device the caller may write it, so a
        clean host copy is dropped (Note [clean host copy])."""
        self.wait_ready()
        if self.location is ChunkLocation.DEVICE:
            self._host_valid = False
            self._file_valid = False
            return self._device_buf
        if self.location is ChunkLocation.HOST:
            assert self._host_buf is not None
            return self._host_buf
        if self.location is ChunkLocation.DISK:
            raise RuntimeError(f"{self!r} is on disk: stage it in first (Chunks.staged in chunk/store.py)")
        raise RuntimeError(f"{self!r} has no payload")

    @property
    def tier(self) -> Tier | None:
        if self.location is ChunkLocation.DEVICE:
            return Tier.DEVICE
        if self.location is ChunkLocation.HOST:
            return Tier.HOST
        if self.location is ChunkLocation.DISK:
            return Tier.DISK
        return None

    def device_views(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Views ``(offset, end, shape)`` into the persistent device tensor.

        Views can only be created while the storage has its bytes, so a
        non-resident chunk's storage is grown for the moment and shrunk again
        (one chunk at a time, so creating all views never needs more than one
        chunk of device memory). The views stay valid across later resizes.
        """
        resident = self._device_buf.untyped_storage().nbytes() == self.nbytes
        if not resident:
            self._grow_device()
        try:
            return [self._device_buf[a:b].view(shape) for a, b, shape in spans]
        finally:
            if not resident:
                self._memory.free(self._device_buf.untyped_storage())

    def _grow_device(self) -> None:
        self._memory.grow(self._device_buf.untyped_storage(), self.nbytes)

    def _new_host(self, first: bool = False) -> torch.Tensor:
        """A host buffer for the payload; ``first``: the first placement (plain memory for a
        chunk pinned once it travels, Note [pinned once it travels])."""
        if self._pinned is not None and (self._pin_from_start or not first):
            self._host_pinned = True
            return self._pinned.take(self.numel, self.dtype)
        self._host_pinned = False
        return torch.empty(self.numel, dtype=self.dtype, device=host_device(self.device))

    def allocate(self, tier: Tier) -> None:
        """First placement: zero-filled payload in ``tier``."""
        new = ChunkLocation.DEVICE if tier is Tier.DEVICE else ChunkLocation.HOST
        check_location_transition(repr(self), self.location, new)
        if tier is Tier.DEVICE:
            self._grow_device()
            self._device_buf.zero_()
        else:
            self._host_buf = self._new_host(first=True)
            self._host_buf.zero_()
            self._host_valid = True
        self.location = new

    @property
    def clean(self) -> bool:
        """On the device with a host copy that still agrees (Note [clean host copy])."""
        return self.location is ChunkLocation.DEVICE and self._host_valid

    @property
    def has_host_buffer(self) -> bool:
        """Host bytes are allocated for this chunk (its payload, or a copy kept on the side)."""
        return self._host_buf is not None

    def mark_dirty(self) -> None:
        """The device payload was (or may have been) written: the host copy (and the file's,
        for a chunk whose home is a file) is stale."""
        self._host_valid = False
        self._file_valid = False

    @property
    def host_buffer(self) -> torch.Tensor:
        """The host payload without waiting: for work that is ordered after the chunk's
        pending copy by its own ``after`` events (the optimizer's worker)."""
        assert self._host_buf is not None and self.location is ChunkLocation.HOST, repr(self)
        return self._host_buf

    def set_work(self, event: CopyEvent) -> None:
        """Host-side work on the host payload was queued; readers and the next copy wait for it."""
        assert self.location is ChunkLocation.HOST, repr(self)
        self._work = event

    def move_to(
        self, tier: Tier, copies: CopyEngine, *, prefetch: bool = False, keep_host: bool = False,
        version: Callable[[int], int] | None = None, into: torch.Tensor | None = None,
    ) -> bool:  # fmt: skip
        """Copy the payload to ``tier`` and free it in the other one, through ``copies``;
        returns whether bytes were copied (an eviction of a clean chunk copies none).

        The copy may still be running when this returns (Note [pending copy]): the
        chunk keeps its event, and every reader of the payload waits on it first
        (:attr:`payload`, :meth:`wait_ready`). An eviction frees the device bytes
        once its copy is done (a deferred free, run by the copy engine). With
        ``keep_host`` a move to the device keeps the host buffer as a clean copy;
        ``version(chunk_id)``, read when the copy is kept and again at the eviction, says
        whether something wrote the payload in between (Note [clean host copy]). ``into``: the
        host buffer a move to the host copies into when the chunk has none (a staging buffer
        of the disk tier, Note [param chunks on disk]).
        """
        if tier is Tier.DEVICE:
            check_location_transition(repr(self), self.location, ChunkLocation.DEVICE)
            assert self._host_buf is not None
            # The previous move must have landed before this copy touches the same buffers: on
            # CUDA the compute stream is ordered after it (no host sync), on the CPU device this
            # thread waits. An eviction whose free has not run keeps its bytes (Note [deferred free]).
            if self._pending is not None:
                order_after(self._pending)
                self._pending = None
            pend, self._free = self._free, None
            if pend is None or not self._memory.reclaim(pend):
                # allocated on the compute (current) stream/thread before the copy is queued; the
                # consumer waits on the copy's event before reading. Host-side work still running on
                # the source goes to the copy engine as ``after``: the copy, not this thread, waits.
                self._grow_device()
            src = self._host_buf  # the copy engine holds the host bytes until done
            # a pinned buffer stays for the next trip; a plain one goes unless kept as a clean copy
            self._host_buf = src if keep_host or self._host_pinned else None
            self._host_valid = keep_host
            self._host_version = version(self.chunk_id) if keep_host and version is not None else None
            if self._file_valid:
                self._file_version = version(self.chunk_id) if version is not None else None
            self._pending = copies.to_device(self._device_buf, src, prefetch=prefetch, after=self._work)
            self._work = None  # the copy lands after it
            self.location = ChunkLocation.DEVICE
            return True
        self.wait_ready()
        check_location_transition(repr(self), self.location, ChunkLocation.HOST)
        if self._host_valid and version is not None and version(self.chunk_id) != self._host_version:
            self._host_valid = False  # written in place since it came: the host copy is stale
        self.location = ChunkLocation.HOST
        if self._host_valid:  # clean: the host copy is the payload
            self._memory.free(self._device_buf.untyped_storage())
            # the copy that brought it may still be reading the host buffer on a copy stream:
            # host work on the payload (an update) waits for that copy, not for the whole device
            self._pending, self._host_read = self._host_read, None
            return False
        self._host_read = None
        self._file_valid = False  # the bytes copied back are newer than the file's, if any
        if self._host_buf is not None:
            host = self._host_buf
        elif into is not None:
            assert into.numel() == self.numel and into.dtype == self.dtype, (repr(self), into.shape, into.dtype)
            host, self._host_pinned = into, False  # lent: the lender takes it back (detach_host)
        else:
            host = self._new_host()
        self._pending = copies.to_host(host, self._device_buf)
        # the device bytes are freed once the copy has read them (Note [deferred free])
        self._free = self._memory.free_after(self._device_buf.untyped_storage(), self._pending)
        self._host_buf = host
        self._host_valid = True
        return True

    # ------------------------------------------------------------------ the disk tier (Note [disk tier])
    def place_on_disk(self) -> None:
        """First placement of a chunk whose list lives on disk: its file slot (zeros) is the payload."""
        check_location_transition(repr(self), self.location, ChunkLocation.DISK)
        self.location = ChunkLocation.DISK
        self._file_valid = True

    def attach_host(self, buf: torch.Tensor, filling: CopyEvent, *, as_work: bool = False) -> None:
        """DISK -> HOST: ``buf`` (1-D host, this chunk's numel and dtype), being filled from the
        file by ``filling``, becomes the payload; readers wait on it as on any pending copy.
        ``as_work``: the read counts as host-side work on the payload, which the next copy to
        the device is handed as ``after`` (its copy waits for it, not the calling thread)."""
        check_location_transition(repr(self), self.location, ChunkLocation.HOST)
        assert buf.numel() == self.numel and buf.dtype == self.dtype, (repr(self), buf.shape, buf.dtype)
        self._host_buf = buf
        self._host_pinned = False  # a staging buffer of the disk tier, lent
        self._host_valid = True
        self._file_valid = True
        # the read was ordered after this chunk's last write-behind
        if as_work:
            self._work = filling
        else:
            self._pending = filling
        self.location = ChunkLocation.HOST

    def file_clean(self, version: Callable[[int], int] | None = None) -> bool:
        """On the device, and its file holds the same bytes: nothing wrote the payload since it
        was read from the file (Note [param chunks on disk]); ``version`` as for :meth:`move_to`."""
        if self.location is not ChunkLocation.DEVICE or not self._file_valid:
            return False
        return version is None or self._file_version is None or version(self.chunk_id) == self._file_version

    def drop_to_disk(self) -> None:
        """DEVICE -> DISK for a chunk whose file holds its payload (:meth:`file_clean`): the
        device bytes are freed, nothing is copied or written."""
        assert self.file_clean(), repr(self)
        check_location_transition(repr(self), self.location, ChunkLocation.DISK)
        self.wait_ready()
        self._memory.free(self._device_buf.untyped_storage())
        self._host_read = None
        self.location = ChunkLocation.DISK

    def detach_host(self) -> tuple[torch.Tensor, CopyEvent | None]:
        """HOST -> DISK: the host payload leaves; returns it and the event of the last work on
        it still running (an update), which a write-behind must follow. The caller writes the
        buffer back (or drops it, when the file already holds these bytes) and hands the
        write's event to :meth:`set_disk_write`."""
        check_location_transition(repr(self), self.location, ChunkLocation.DISK)
        assert self._host_buf is not None
        buf, last = self._host_buf, self._work or self._pending
        self._host_buf = None
        self._host_pinned = False
        self._host_valid = False
        self._work = None
        self._pending = None
        self.location = ChunkLocation.DISK
        return buf, last

    def set_disk_write(self, event: CopyEvent) -> None:
        """The write-behind of this (DISK) chunk's bytes: the next read of its file waits for it."""
        assert self.location is ChunkLocation.DISK, repr(self)
        self._pending = event
        self._file_valid = True

    def set_pending(self, event: CopyEvent) -> None:
        """Something else now writes (or reads) the device payload asynchronously (an
        all-gather in flight): readers, moves and releases wait for ``event`` first."""
        self._wait_copy()
        self._pending = event

    def materialize_on_device(self) -> torch.Tensor:
        """Give a released (remote) chunk its device bytes, uninitialised; the caller
        fills them (an all-gather). Returns the device tensor."""
        check_location_transition(repr(self), self.location, ChunkLocation.DEVICE)
        self._grow_device()
        self.location = ChunkLocation.DEVICE
        return self._device_buf

    def release(self) -> None:
        """Drop the device copy without keeping it anywhere (a remote chunk after use)."""
        check_location_transition(repr(self), self.location, ChunkLocation.RELEASED)
        self.wait_ready()
        self._memory.free(self._device_buf.untyped_storage())
        self.location = ChunkLocation.RELEASED

    def wait_ready(self) -> None:
        """Wait for the pending copy of this chunk (on CUDA: order the compute stream after
        it) and for host-side work on it."""
        self._wait_copy()
        if self._work is not None:
            self._work.wait()
            self._work = None

    def _wait_copy(self) -> None:
        if self._pending is not None:
            event = self._pending
            event.wait()
            self._pending = None
            for_host = getattr(event, "for_host", None)  # a CUDA copy to the device (device/copy_engine.py)
            self._host_read = for_host() if for_host is not None else None

    @property
    def pending_copy(self) -> CopyEvent | None:
        """The event of this chunk's last copy if nobody has waited on it yet (work that
        reads the landed bytes is ordered after it)."""
        return self._pending
