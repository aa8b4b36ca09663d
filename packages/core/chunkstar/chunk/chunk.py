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
has read them. Parameters are views of the device tensor: a module reads them
only after the runtime made the chunk resident and waited (``make_resident``).
"""

from __future__ import annotations

import torch

from chunkstar.chunk.state import ChunkLocation, check_location_transition
from chunkstar.device.copy_engine import CopyEngine, CopyEvent
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
        # the last copy of this chunk's payload, until someone has waited on it (Note [pending copy])
        self._pending: CopyEvent | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.list_name}[{self.chunk_id}], {self.numel} x {self.dtype}, {self.location.name})"

    @property
    def device_view(self) -> torch.Tensor:
        """The persistent device tensor (valid data only while on the device)."""
        return self._device_buf

    @property
    def payload(self) -> torch.Tensor:
        """The buffer holding the chunk's data now, wherever it is (once its last copy has landed)."""
        self.wait_ready()
        if self.location is ChunkLocation.DEVICE:
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

    def move_to(self, tier: Tier, copies: CopyEngine, *, prefetch: bool = False) -> None:
        """Copy the payload to ``tier`` and free it in the other one, through ``copies``.

        The copy may still be running when this returns (Note [pending copy]): the
        chunk keeps its event, and every reader of the payload waits on it first
        (:attr:`payload`, :meth:`wait_ready`). An eviction frees the device bytes
        once its copy is done (a deferred free, run by the copy engine).
        """
        self.wait_ready()  # the previous move of this chunk must have landed (buffers, freed bytes)
        if tier is Tier.DEVICE:
            check_location_transition(repr(self), self.location, ChunkLocation.DEVICE)
            assert self._host_buf is not None
            # The storage is allocated on the compute (current) stream/thread before the
            # copy is queued, and the consumer waits on the copy's event before reading.
            self._grow_device()
            src, self._host_buf = self._host_buf, None  # the copy engine holds the host bytes until done
            self._pending = copies.copy(self._device_buf, src, prefetch=prefetch)
            self.location = ChunkLocation.DEVICE
        else:
            check_location_transition(repr(self), self.location, ChunkLocation.HOST)
            host = self._new_host()
            storage = self._device_buf.untyped_storage()
            # the device bytes are freed after the copy has read them (deferred free)
            self._pending = copies.copy(host, self._device_buf, then=lambda: storage.resize_(0))
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
        """Wait for the pending copy of this chunk (on CUDA: order the compute stream after it)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    @property
    def copy_pending(self) -> bool:
        return self._pending is not None and not self._pending.done()
