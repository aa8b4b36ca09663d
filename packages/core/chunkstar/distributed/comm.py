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

from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistributedError", "PendingCollective", "PendingReduce"]


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group broke."""


class PendingCollective:
    """A collective in flight (``async_op``), as a chunk's pending event (chunk/chunk.py's
    Note [pending copy]): :meth:`wait` returns once it is done (under NCCL: orders the
    current stream after it); the buffers it reads and writes stay referenced until then."""

    def __init__(self, work: Any, keep: tuple[torch.Tensor, ...], comm: Comm, what: str) -> None:
        self._work = work
        self._keep = keep
        self._comm = comm
        self._what = what

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> None:
        try:
            self._work.wait()
        except Exception as e:
            raise self._comm._fail(self._what, e) from e
        self._keep = ()


class PendingReduce:
    """A gradient reduction in flight (``async_op``): :meth:`wait` returns this rank's
    own chunk of the sum; the buffers it reads and writes stay referenced until then."""

    def __init__(self, work: Any, result: torch.Tensor, keep: tuple[torch.Tensor, ...], comm: Comm, what: str) -> None:
        self._work = work
        self._result = result
        self._keep = keep
        self._comm = comm
        self._what = what

    def done(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self) -> torch.Tensor:
        try:
            self._work.wait()
        except Exception as e:
            raise self._comm._fail(f"gradient reduction of {self._what}", e) from e
        self._keep = ()
        return self._result


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

    def all_gather_group_async(self, outputs: Sequence[torch.Tensor], own: torch.Tensor, what: str) -> PendingCollective:
        """Start :meth:`all_gather_group` and return at once; readers of ``outputs`` (and
        writers of ``own``) wait on the result first."""
        try:
            work = dist.all_gather(list(outputs), own, async_op=True)
        except Exception as e:
            raise self._fail(f"all-gather of {what}", e) from e
        return PendingCollective(work, (*outputs, own), self, f"all-gather of {what}")

    def reduce_group_async(self, chunks: Sequence[torch.Tensor], what: str) -> PendingReduce:
        """Start summing ``chunks`` (this rank's copy of every chunk of a group) over ranks
        and return at once; the pending result's ``wait()`` gives this rank's own chunk of
        the sum, on ``exchange_device`` of the own chunk's device (a copy that is not on
        it, say an evicted chunk, is moved there first). The chunks are copied into one
        buffer first, so they may change or go away while the collective runs."""
        where = self.exchange_device(chunks[self.rank].device)
        try:
            flat = torch.cat([c.reshape(-1).to(where) for c in chunks])
            n = chunks[self.rank].numel()
            if self.backend == "nccl":
                out = torch.empty(n, dtype=flat.dtype, device=where)
                work = dist.reduce_scatter_tensor(out, flat, async_op=True)
                return PendingReduce(work, out, (flat,), self, what)
            work = dist.all_reduce(flat, async_op=True)
            return PendingReduce(work, flat[self.rank * n : (self.rank + 1) * n], (flat,), self, what)
        except Exception as e:
            raise self._fail(f"gradient reduction of {what}", e) from e

    def all_gather_ints(self, values: Sequence[int], what: str, device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (int64s, the same count on every rank), indexed by rank.

        For small agreements (start-up fingerprints, checkpoint identities): one
        all-gather of an int64 tensor, on ``device`` under NCCL (it only moves CUDA
        tensors), on the CPU under gloo. World size 1 returns ``[values]``."""
        if not self.distributed:
            return [list(values)]
        own = torch.tensor(list(values), dtype=torch.int64, device=self.exchange_device(device))
        outs = [torch.empty_like(own) for _ in range(self.world_size)]
        self.all_gather_group(outs, own, what)
        return [[int(v) for v in t.tolist()] for t in outs]

    def exchange_device(self, device: torch.device) -> torch.device:
        """Where a tensor must be to take part in a collective: ``device`` under NCCL, else the CPU."""
        return device if self.backend == "nccl" else torch.device("cpu")

    def all_reduce_sum(self, t: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
        """Sum ``t`` over ranks; the sum lies on ``exchange_device(device)`` (``device``
        is the engine's: NCCL reduces CUDA tensors only, gloo here CPU ones)."""
        if not self.distributed:
            return t
        t = t.to(self.exchange_device(device))
        try:
            dist.all_reduce(t)
        except Exception as e:
            raise self._fail(f"all-reduce of {what}", e) from e
        return t

    def all_reduce_max(self, t: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
        """Element-wise maximum of ``t`` over ranks (flags and figures every rank must agree on)."""
        if not self.distributed:
            return t
        t = t.to(self.exchange_device(device))
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        except Exception as e:
            raise self._fail(f"all-reduce of {what}", e) from e
        return t
