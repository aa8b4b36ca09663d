"""Where chunk payloads are allocated on a CUDA device: a memory pool of their own.

Mechanism only. Chunk payloads come and go every step (a load grows a chunk's
storage, an eviction frees it) in sizes unlike the activations'. Served from
PyTorch's caching allocator beside the activations, each kind splits the
other's cached segments and the device fragments as a run goes on; Gemini and
DeepSpeed keep model data apart for the same reason. A :class:`ChunkPool`
routes the chunks' allocations to a ``torch.cuda.MemPool`` of their own, so a
freed payload's block goes back to that pool and the next payload of its size
reuses it. Where the pool cannot be made (a torch without ``MemPool``, a
non-CUDA build), chunks allocate as any tensor does.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["ChunkPool"]


class ChunkPool:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool: Any = None
        try:
            self._pool = torch.cuda.MemPool()
        except (AttributeError, RuntimeError, TypeError):
            self._pool = None

    @property
    def active(self) -> bool:
        return self._pool is not None

    def allocating(self) -> contextlib.AbstractContextManager[Any]:
        """Allocations of the calling thread inside this block come from the chunks' pool."""
        if self._pool is None:
            return contextlib.nullcontext()
        return torch.cuda.use_mem_pool(self._pool, self.device)
