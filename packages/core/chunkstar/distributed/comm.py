"""Collectives over torch.distributed for chunk groups (DESIGN §7).

A chunk *group* is ``world_size`` consecutive chunks of equal size; rank r
owns chunk ``group_start + r``. Before a group is used its param chunks are
all-gathered (every rank contributes its own chunk); after its backward the
gradients are reduced and each rank keeps its own chunk's share.

NCCL has ``reduce_scatter_tensor``; gloo (CPU) has no reduce-scatter, so there
the group is all-reduced and each rank keeps its own part (twice the traffic,
same result). Every collective runs under the process group's timeout: a rank
that died or hangs makes the others fail with :class:`DistributedError`
instead of waiting forever.

This module is mechanism only: *when* to gather or reduce is decided by the
runtime, identically on every rank (from the module order and the warm-up
trace, never from per-rank measurements), so the ranks always agree.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistributedError"]


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group broke."""


class Comm:
    """The process group as the engine sees it; a single process is world size 1."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend

    @classmethod
    def from_environment(cls) -> Comm:
        """World size 1 unless torch.distributed is initialised (e.g. under torchrun)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def _fail(self, what: str, err: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank}/{self.world_size}: {what} failed: a peer rank probably died or hangs "
            f"({type(err).__name__}: {err}). Stopping this rank too; see the other ranks' logs for the first error."
        )

    def all_gather_group(self, outputs: Sequence[torch.Tensor], own: torch.Tensor, what: str) -> None:
        """``outputs[r]`` receives rank r's ``own`` (all the same size)."""
        try:
            dist.all_gather(list(outputs), own)
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses of their own
            raise self._fail(f"all-gather of {what}", e) from e

    def reduce_group(self, chunks: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """Sum ``chunks`` (this rank's copy of every chunk of a group) over ranks;
        returns this rank's own chunk of the sum."""
        try:
            if self.backend == "nccl":
                out = torch.empty_like(chunks[self.rank])
                dist.reduce_scatter_tensor(out, torch.cat([c.reshape(-1) for c in chunks]))
                return out
            flat = torch.cat([c.reshape(-1) for c in chunks])
            dist.all_reduce(flat)
            n = chunks[self.rank].numel()
            return flat[self.rank * n : (self.rank + 1) * n]
        except Exception as e:
            raise self._fail(f"gradient reduction of {what}", e) from e

    def all_reduce_sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        if not self.distributed:
            return t
        try:
            dist.all_reduce(t)
        except Exception as e:
            raise self._fail(f"all-reduce of {what}", e) from e
        return t
