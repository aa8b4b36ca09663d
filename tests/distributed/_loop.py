"""The per-rank training loop the distributed workers share: each rank trains on its own
slice of the global batch; the loss is averaged over ranks per micro-batch (comparable with
one process on the whole batch)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


def _loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return engine(**batch).loss


def train_slices(
    engine: Any,
    optimizer: Any,
    batch_of: Callable[[int], dict[str, torch.Tensor]],
    steps: Iterable[int],
    *,
    loss_of: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor] = _loss,
    accum: int = 1,
) -> list[float]:
    """``batch_of(i)`` is the global batch of micro-batch ``i`` (``step * accum + micro``; the step
    itself without accumulation); ``loss_of(engine, slice)`` its loss (default: ``engine(**slice).loss``).
    Each step is ``accum`` forwards and backwards, then one optimizer step; returns the mean loss
    over ranks of every micro-batch, in order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        micro_losses = []
        for micro in range(accum):
            full = batch_of(step * accum + micro)
            per_rank = next(iter(full.values())).shape[0] // world
            loss = loss_of(engine, {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in full.items()})
            engine.backward(loss)
            micro_losses.append(loss.detach().clone())
        optimizer.step()
        optimizer.zero_grad()
        for mean in micro_losses:
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
    return losses
