"""Offloading a block's saved tensors to host memory: the pack and unpack of ``saved_tensors_hooks``.

Note [activation offload]: inside an offloaded block's forward, every tensor
autograd saves goes through :meth:`HostOffload.pack`. A device tensor whose
storage is large enough (:data:`MIN_OFFLOAD_BYTES`) and is not model data has
its whole storage copied to host memory once per block call (several saved
views of one storage share the copy), and autograd keeps the host copy in its
place; the device storage is freed once the block's forward is over and
nothing else holds it (the block's own output, say, lives on in the next
block). It is held until then because a storage freed within the call could
lend its address, by which the call knows the storages it copied, to a new one. :meth:`HostOffload.unpack`
brings a storage back to the device once, at the first saved view the backward
reads, and rebuilds every view on it with its own size, stride and offset: the
bytes are the forward's, so the backward is bit-exact.

What is not offloaded, and why:

* model data: parameters, and views of a chunk's payload (a linear layer saves
  its weight). The chunks are placed by the engine; a copy would duplicate them.
* storages under :data:`MIN_OFFLOAD_BYTES` (1 MiB): a copy has a fixed cost
  (about 10 us to launch and order on a CUDA stream, the time 80 KB take at
  8 GB/s), and a small storage frees little; a block's large saved tensors (its
  hidden states, attention inputs and MLP activations) are megabytes each.
* tensors on other devices (a CPU scalar, an index on the host).

The copies are synchronous for now: the forward waits for each copy to the host
and the backward for each copy back, so a block's offload costs its bytes at
link speed on the compute's path. Overlapping them with compute (through the
copy engines, ahead of the block's backward on the prefetch path) is the next
step (issue 27).

On the CPU virtual device the host and the device are both this machine's
memory: the host copy is made with the memory probe paused, so it is not
counted as device memory, and the copy back is (Note [the meta device]'s
sibling for the CPU device: :mod:`chunkstar.memory.probes`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, ContextManager

import torch

from chunkstar.device.tiers import host_device

__all__ = ["MIN_OFFLOAD_BYTES", "HostOffload"]

MIN_OFFLOAD_BYTES = 1 << 20
"""The smallest storage offloaded (the module docstring says why)."""


class _HostStorage:
    """One device storage's bytes on the host, and its copy back once the backward asks."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host  # 1-D uint8, the whole storage
        self.device: torch.Tensor | None = None  # 1-D uint8 on the device, once brought back


class _Saved:
    """A saved tensor whose storage went to the host: where it sat in the storage."""

    __slots__ = ("storage", "size", "stride", "offset", "dtype")

    def __init__(self, storage: _HostStorage, t: torch.Tensor) -> None:
        self.storage = storage
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype


class HostOffload:
    """The pack and unpack hooks of offloaded blocks on ``device`` (Note [activation offload]).

    ``model_data(t)``: whether ``t`` views a chunk's payload (never offloaded); ``quiet()``:
    the memory probe paused around the host copies (model data of neither tier)."""

    def __init__(
        self,
        device: torch.device,
        model_data: Callable[[torch.Tensor], bool],
        quiet: Callable[[], ContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self.device = torch.device(device)
        self._host = host_device(self.device)  # the CPU, or meta in a dry run (no bytes anywhere)
        self._model_data = model_data
        self._quiet = quiet
        self._lock = threading.Lock()
        self._call = threading.local()  # the block call's storages already copied: storage key -> record
        self.bytes_to_host = 0
        """Bytes copied to the host so far (each storage once per block call)."""
        self.bytes_to_device = 0
        """Bytes copied back to the device so far."""

    @contextlib.contextmanager
    def block_call(self) -> Any:
        """Around one offloaded block's forward: its saved tensors go through pack/unpack, and
        views of one storage share one copy."""
        outer = getattr(self._call, "seen", None)
        self._call.seen = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._call.seen = outer

    def _offloadable(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.is_sparse or isinstance(t, torch.nn.Parameter):
            return False
        if type(t) is not torch.Tensor:  # a subclass (a guarded parameter view, a tensor wrapper) keeps its type
            return False
        if t.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES:
            return False
        return not self._model_data(t)

    def pack(self, t: torch.Tensor) -> Any:
        if not self._offloadable(t):
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
            with self._quiet():
                host = torch.empty(nbytes, dtype=torch.uint8, device=self._host, pin_memory=self.device.type == "cuda")
                host.copy_(t.new_empty(0, dtype=torch.uint8).set_(storage))
            rec = _HostStorage(host)
            seen[key] = (rec, t)
            with self._lock:
                self.bytes_to_host += nbytes
        return _Saved(rec, t)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed  # type: ignore[no-any-return]
        rec = packed.storage
        if rec.device is None:
            back = torch.empty(rec.host.numel(), dtype=torch.uint8, device=self.device)
            back.copy_(rec.host)
            rec.device = back
            with self._lock:
                self.bytes_to_device += rec.host.numel()
        return _typed(rec.device, packed.dtype).as_strided(packed.size, packed.stride, packed.offset)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D uint8 tensor's bytes as ``dtype`` elements (any tail shorter than one element cut)."""
    return raw[: raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
