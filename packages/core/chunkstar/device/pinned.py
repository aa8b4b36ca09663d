"""Exactly-sized pinned host buffers for the chunks that travel to a CUDA device.

Mechanism only. PyTorch's ``pin_memory=True`` goes through its caching host
allocator, which rounds every allocation up to a power of two: chunks of the
searched ("auto") size would pin up to twice their bytes (measured by reading
the allocator: 115 GiB instead of 84 for the 6.16B GPT-2 of
``benchmarks/gpu_check.py``). A :class:`PinnedBuffers` instead allocates
ordinary host memory of the exact size and registers its pages with the
driver (``cudaHostRegister``, as ``torch.cuda._pin_memory_utils`` does), so
asynchronous copies can read and write it.

Registered memory must be unregistered before it is freed. The pool keeps a
reference to every buffer it made and unregisters them all when it is closed
(or collected), so no buffer can be freed while registered; chunks that
travel keep their host buffer for life on CUDA (Note [clean host copy] in
chunk/chunk.py), so nothing is ever handed back in between.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["PinnedBuffers"]

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def _unregister(buffers: list[torch.Tensor]) -> None:
    if not buffers:
        return
    cudart = torch.cuda.cudart()
    for t in buffers:
        cudart.cudaHostUnregister(t.data_ptr())
    buffers.clear()


class PinnedBuffers:
    """Host buffers of exactly ``numel`` elements, pinned by registering their pages."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self.pinned_bytes = 0
        self._finalizer = weakref.finalize(self, _unregister, self._buffers)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return t
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _PORTABLE))
        if err != 0:
            # the driver refused (a limit on locked memory, say): PyTorch's pinned allocator
            # still works, at its power-of-two sizes
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        self._buffers.append(t)
        self.pinned_bytes += nbytes
        return t

    def close(self) -> None:
        self._finalizer()
