"""A process group the dry run simulates: one rank of ``world_size``, collectives that move nothing.

Note [simulated ranks]: a dry run of ``world_size`` ranks runs the real engine once
per rank, in turn, each with a :class:`SimulatedComm` that says which rank it is.
Everything a rank decides from its rank and the world size (which chunk of each
group it owns, where its Adam state lives, its gathers and reductions, the
device scratch a collective holds) is then the real engine's decision. What a
collective would carry has no values on the meta device, so a collective
completes at once and records its bytes; a small agreement (the schedule's
flags, the start-up fingerprints) returns this rank's own figures as every
rank's. That is exact when the ranks see the same shapes, which is what a dry
run gives them (every rank runs the same batch shape): the ranks' traces, hence
their decisions, are the same except where the rank itself enters. Torch's fake
process group would serve too, but it keeps the collective's device rules (a
meta tensor in an NCCL collective) and records nothing; simulating in turn
keeps one rank's engine in memory at a time.

The backend is the target's: ``"nccl"`` for a CUDA target (collectives run on the
device and hold the flat temporaries :meth:`Comm.gather_scratch_bytes` and
:meth:`Comm.reduce_scratch_bytes` say, counted against the budget as on a real
GPU), ``"gloo"`` for the CPU device (no device scratch).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from chunkstar.distributed.comm import Comm, PendingCollective, PendingReduce

__all__ = ["CollectiveBytes", "SimulatedComm"]


class _Done:
    """The work object of a collective that completed when it started."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class CollectiveBytes:
    """What one rank's collectives carried: ring algorithms move ``(world - 1) / world``
    of a group's bytes in and out of every rank, for a gather and a reduce-scatter alike."""

    all_gathers: int = 0
    gather_bytes: int = 0
    """Bytes this rank received in group all-gathers (the other ranks' chunks)."""
    reductions: int = 0
    reduce_bytes: int = 0
    """Bytes this rank sent in gradient reductions (the other ranks' chunks of its sum)."""
    small: int = 0
    """Agreements (flags, fingerprints, norms): a handful of bytes each."""

    def as_dict(self) -> dict[str, int]:
        return {
            "collective_all_gathers": self.all_gathers,
            "collective_gather_bytes": self.gather_bytes,
            "collective_reductions": self.reductions,
            "collective_reduce_bytes": self.reduce_bytes,
            "collective_agreements": self.small,
        }


class SimulatedComm(Comm):
    """Rank ``rank`` of ``world_size``, simulated (Note [simulated ranks])."""

    def __init__(self, rank: int, world_size: int, backend: str) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of {world_size} ranks")
        super().__init__(rank, world_size, backend if world_size > 1 else "")
        self.bytes = CollectiveBytes()

    def exchange_device(self, device: torch.device) -> torch.device:
        return torch.device(device)  # no bytes to move through the host: everything stays on meta

    def all_gather_group_async(
        self, outputs: Sequence[torch.Tensor | None], own: torch.Tensor, what: str
    ) -> PendingCollective:
        n = own.numel()
        self.bytes.all_gathers += 1
        self.bytes.gather_bytes += (self.world_size - 1) * n * own.element_size()
        if self.distributed and self.on_device(own.device):  # the flat temporary a real NCCL gather holds
            with self.scratch_edge():
                flat = torch.empty(self.world_size * n, dtype=own.dtype, device=own.device)
                return PendingCollective(_Done(), (own, flat), self, f"all-gather of {what}", self.world_size * n * own.element_size())
        return PendingCollective(_Done(), (own,), self, f"all-gather of {what}")

    def reduce_group_async(
        self, chunks: Sequence[torch.Tensor], what: str, dtype: torch.dtype | None = None
    ) -> PendingReduce:
        own = chunks[self.rank]
        dtype = own.dtype if dtype is None else dtype
        n = own.numel()
        self.bytes.reductions += 1
        self.bytes.reduce_bytes += (self.world_size - 1) * n * dtype.itemsize
        where = own.device
        edge = self.scratch_edge() if self.on_device(where) else contextlib.nullcontext()
        with edge:
            flat = torch.empty(len(chunks) * n, dtype=dtype, device=where)
            out = torch.empty(n, dtype=dtype, device=where)
            scratch = (len(chunks) + 1) * n * dtype.itemsize if self.on_device(where) else 0
            return PendingReduce(_Done(), out, (flat,), self, what, scratch)

    def all_gather_ints(self, values: Sequence[int], what: str, device: torch.device) -> list[list[int]]:
        self.bytes.small += 1
        return [list(values) for _ in range(self.world_size)]

    def _all_reduce(self, t: torch.Tensor, what: str, device: torch.device, op: Any) -> torch.Tensor:
        if self.distributed:
            self.bytes.small += 1
        return t
