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
"""

from __future__ import annotations

import torch

from chunkstar.chunk.state import ChunkLocation, check_location_transition
from chunkstar.events import Tier

__all__ = ["Chunk"]


class Chunk:
    def __init__(self, chunk_id: int, list_name: str, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.chunk_id = chunk_id
        self.list_name = list_name
        self.numel = numel
        self.dtype = dtype
        self.device = device
        self.nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.location = ChunkLocation.RELEASED
        self._pin = device.type == "cuda"
        # 1-D, on `device`; storage is 0 bytes unless location is DEVICE (Note [persistent device storage])
        self._device_buf = torch.empty(numel, dtype=dtype, device=device)
        self._device_buf.untyped_storage().resize_(0)
        # 1-D, host (pinned when the device is CUDA); exists only while location is HOST
        self._host_buf: torch.Tensor | None = None
        # CUDA event recorded on the copy stream by a prefetch; None when no copy is pending
        self._ready: torch.cuda.Event | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.list_name}[{self.chunk_id}], {self.numel} x {self.dtype}, {self.location.name})"

    @property
    def device_view(self) -> torch.Tensor:
        """The persistent device tensor (valid data only while on the device)."""
        return self._device_buf

    @property
    def payload(self) -> torch.Tensor:
        """The buffer holding the chunk's data now, wherever it is."""
        if self.location is ChunkLocation.DEVICE:
            self.wait_ready()
            return self._device_buf
        if self.location is ChunkLocation.HOST:
            assert self._host_buf is not None
            return self._host_buf
        raise RuntimeError(f"{self!r} has no payload")

    @property
    def tier(self) -> Tier | None:
        if self.location is ChunkLocation.DEVICE:
            return Tier.DEVICE
        if self.location is ChunkLocation.HOST:
            return Tier.HOST
        return None

    def device_views(self, spans: list[tuple[int, int, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Views ``(offset, end, shape)`` into the persistent device tensor.

        Views can only be created while the storage has its bytes, so a
        non-resident chunk's storage is grown for the moment and shrunk again
        (one chunk at a time, so creating all views never needs more than one
        chunk of device memory). The views stay valid across later resizes.
        """
        resident = self.location is ChunkLocation.DEVICE
        if not resident:
            self._grow_device()
        try:
            return [self._device_buf[a:b].view(shape) for a, b, shape in spans]
        finally:
            if not resident:
                self._device_buf.untyped_storage().resize_(0)

    def _grow_device(self) -> None:
        self._device_buf.untyped_storage().resize_(self.nbytes)

    def _new_host(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, pin_memory=self._pin)

    def allocate(self, tier: Tier) -> None:
        """First placement: zero-filled payload in ``tier``."""
        new = ChunkLocation.DEVICE if tier is Tier.DEVICE else ChunkLocation.HOST
        check_location_transition(repr(self), self.location, new)
        if tier is Tier.DEVICE:
            self._grow_device()
            self._device_buf.zero_()
        else:
            self._host_buf = self._new_host()
            self._host_buf.zero_()
        self.location = new

    def move_to(self, tier: Tier, copy_stream: torch.cuda.Stream | None = None) -> None:
        """Copy the payload to ``tier`` and free it in the other one.

        With ``copy_stream`` (CUDA only, for prefetch) the host-to-device copy
        runs on that stream and the chunk remembers an event; :meth:`wait_ready`
        makes the compute stream wait for it before the chunk is used.
        """
        if tier is Tier.DEVICE:
            check_location_transition(repr(self), self.location, ChunkLocation.DEVICE)
            assert self._host_buf is not None
            # The storage is allocated on the compute (current) stream, so the caching
            # allocator ties the block to it; the copy stream waits for that stream
            # before writing, and the compute stream waits for the copy (wait_ready)
            # before reading, so the block is never reused while a copy is in flight.
            self._grow_device()
            if copy_stream is not None:
                copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(copy_stream):
                    # overlaps with the compute stream's kernels of the current moment
                    self._device_buf.copy_(self._host_buf, non_blocking=True)
                    self._ready = torch.cuda.Event()
                    self._ready.record(copy_stream)
            else:
                # H2D from pinned memory is asynchronous on the current stream; later
                # kernels on that stream are ordered after it, and the caching host
                # allocator keeps the pinned block alive until the copy is done.
                self._device_buf.copy_(self._host_buf, non_blocking=self._pin)
            self._host_buf = None
            self.location = ChunkLocation.DEVICE
        else:
            check_location_transition(repr(self), self.location, ChunkLocation.HOST)
            self.wait_ready()
            host = self._new_host()
            # D2H is synchronous: the host side (CPU Adam, state_dict) reads it next.
            host.copy_(self._device_buf)
            self._device_buf.untyped_storage().resize_(0)
            self._host_buf = host
            self.location = ChunkLocation.HOST

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
        self._device_buf.untyped_storage().resize_(0)
        self.location = ChunkLocation.RELEASED

    def wait_ready(self) -> None:
        """Order the compute stream after a pending prefetch copy of this chunk."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None
