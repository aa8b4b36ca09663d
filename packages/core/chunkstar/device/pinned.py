"""Exactly-sized pinned host buffers for the chunks that travel to a CUDA device.

Mechanism only. PyTorch's ``pin_memory=True`` goes through its caching host
allocator, which rounds every allocation up to a power of two: chunks of the
searched ("auto") size would pin up to twice their bytes (measured by reading
the allocator: 115 GiB instead of 84 for the 6.16B GPT-2 of
``benchmarks/gpu_check.py``). A :class:`PinnedBuffers` instead maps host
memory of the size rounded up to whole pages and registers those pages with
the driver (``cudaHostRegister``, as ``torch.cuda._pin_memory_utils`` does), so
asynchronous copies can read and write it; the tensor handed out is a view of
exactly the requested elements at the start of the mapping.

Note [registered pages]: the driver pins whole pages, so every buffer is an
anonymous ``mmap`` of its own (page-aligned, a whole number of pages; where
``mmap`` cannot map anonymous memory, an over-allocated tensor's page-aligned
middle): no two registrations share a page (``cudaHostRegister`` refuses
memory whose pages are already registered, or pins a neighbour's bytes), and
unregistering one buffer cannot unpin another's page.

Note [failed registration]: ``cudaHostRegister`` returns an error code, and the
CUDA runtime also keeps it as the thread's "last error", which the next kernel
launch check (``cudaGetLastError`` after every launch in PyTorch) would report
as that unrelated kernel's failure. After a failed registration the error is
consumed at once (``cudaGetLastError`` on the already loaded ``libcudart``,
the instance PyTorch itself uses; ``torch.cuda.cudart()`` does not bind it)
and the buffer comes from PyTorch's pinned allocator (power-of-two sizes)
instead. Where no loaded ``libcudart`` can be found (a build that links the
runtime statically), no registration is tried: every buffer comes from
PyTorch's allocator.

Registered memory must be unregistered before it is freed, and only once no
copy reads or writes it. The pool keeps a reference to every buffer it made
and, when it is closed (or collected, or at exit), synchronises the device
(copies still in flight read or write those pages) and then unregisters them
all, so no buffer can be freed while registered; chunks that travel keep their
host buffer for life on CUDA (Note [clean host copy] in chunk/chunk.py), so
nothing is ever handed back in between. A buffer still referenced after
:meth:`PinnedBuffers.close` stays valid, as ordinary pageable memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref
from typing import Any, Callable

import torch

__all__ = ["PinnedBuffers", "registration_available"]

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process
PAGE = mmap.PAGESIZE

# buffers whose unregistering could not be made safe (the device sync failed): kept referenced
# for the life of the process, so their pages are never freed while they may still be registered
_KEPT: list[torch.Tensor] = []


def _page_aligned(numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """Host memory for ``numel`` elements of ``dtype`` on pages of its own (Note [registered
    pages]): (the exact 1-D view, the address of its first page, the mapped bytes)."""
    nbytes = numel * dtype.itemsize
    size = -(-nbytes // PAGE) * PAGE
    if hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MAP_PRIVATE"):
        # zero-filled and page-aligned; unmapped once its last view is gone
        mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        t = torch.frombuffer(mm, dtype=dtype, count=numel)
        return t, t.data_ptr(), size
    raw = torch.empty(size + PAGE, dtype=torch.uint8)  # its page-aligned middle is ours alone
    start = -raw.data_ptr() % PAGE
    t = raw[start : start + nbytes].view(dtype)
    return t, t.data_ptr(), size


def _torch_pinned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """PyTorch's pinned allocator (power-of-two sizes): the fallback."""
    return torch.empty(numel, dtype=dtype, pin_memory=True)


def _loaded_cudart() -> Any:
    """The ``libcudart`` this process has already loaded (PyTorch's), or None: never a second
    copy (a fresh instance would not share PyTorch's error state)."""
    if not sys.platform.startswith("linux"):
        return None
    noload = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    names = []
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        names.append(f"libcudart.so.{major}")
    names += ["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"]
    try:  # the paths of what is mapped: finds it under any name
        with open("/proc/self/maps") as f:
            names += sorted({line.split()[-1] for line in f if "libcudart" in line and "/" in line})
    except OSError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name, mode=noload)  # RTLD_NOLOAD: only if already loaded
        except OSError:
            continue
    return None


_LAST_ERROR: list[Callable[[], int] | None] = []  # the cached answer of _get_last_error_fn


def _get_last_error_fn() -> Callable[[], int] | None:
    """``cudaGetLastError`` of the loaded ``libcudart`` (returns and resets the thread's last
    error), or None when there is none (Note [failed registration]). Looked up once (a miss
    is remembered only once CUDA is initialised: before, the runtime may not be loaded yet)."""
    if _LAST_ERROR:
        return _LAST_ERROR[0]
    fn: Any = None
    lib = _loaded_cudart()
    if lib is not None:
        try:
            fn = lib.cudaGetLastError
            fn.restype = ctypes.c_int
            fn.argtypes = []
        except AttributeError:
            fn = None
    if fn is not None or torch.cuda.is_initialized():
        _LAST_ERROR.append(fn)
    return fn  # type: ignore[no-any-return]


def _consume_cuda_error() -> int:
    """Reset this thread's CUDA last error after a failed runtime call; returns it (0: none)."""
    fn = _get_last_error_fn()
    return int(fn()) if fn is not None else 0


def registration_available() -> bool:
    """Buffers are registered (exact sizes) rather than taken from PyTorch's pinned allocator:
    a loaded ``libcudart`` was found to consume a failed registration's error with (Note
    [failed registration]). For ``gpu-check``'s report; call it once CUDA is initialised."""
    return _get_last_error_fn() is not None


def _synchronize(device: torch.device | None) -> None:
    if device is None:
        torch.cuda.synchronize()
    else:
        torch.cuda.synchronize(device)


def _unregister(buffers: list[tuple[torch.Tensor, int]], device: torch.device | None) -> None:
    if not buffers:
        return
    try:
        _synchronize(device)  # a copy in flight may still read or write a buffer
    except Exception:
        # the device is in trouble (or gone): unregistering now could race a copy, so keep the
        # buffers for the life of the process instead of freeing pages that may stay registered
        _KEPT.extend(t for t, _ in buffers)
        buffers.clear()
        return
    cudart = torch.cuda.cudart()
    for _, address in buffers:
        if int(cudart.cudaHostUnregister(address)) != 0:
            _consume_cuda_error()  # Note [failed registration]: not a later kernel's error
    buffers.clear()


class PinnedBuffers:
    """Host buffers of exactly ``numel`` elements, pinned by registering their pages.

    ``device``: the CUDA device whose copies use the buffers (synchronised before they are
    unregistered; default: the current device)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = torch.device(device) if device is not None else None
        # (the view handed out, the registered address); each buffer's mapping lives as long as its view
        self._buffers: list[tuple[torch.Tensor, int]] = []
        self.pinned_bytes = 0  # bytes registered (whole pages) and not yet unregistered
        self._finalizer = weakref.finalize(self, _unregister, self._buffers, self._device)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel * dtype.itemsize == 0:
            return torch.empty(numel, dtype=dtype)
        if _get_last_error_fn() is None:  # a failure could not be consumed: do not try
            return _torch_pinned(numel, dtype)
        t, address, size = _page_aligned(numel, dtype)
        err = int(torch.cuda.cudart().cudaHostRegister(address, size, _PORTABLE))
        if err != 0:
            # the driver refused (a limit on locked memory, say): consume the error so that no later
            # launch check reports it (Note [failed registration]); PyTorch's pinned allocator still
            # works, at its power-of-two sizes
            _consume_cuda_error()
            return _torch_pinned(numel, dtype)
        self._buffers.append((t, address))
        self.pinned_bytes += size
        return t

    def close(self) -> None:
        self._finalizer()
        self.pinned_bytes = 0
