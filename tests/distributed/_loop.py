"""The per-rank training loop the distributed workers share: each rank trains on its own
slice of the global batch; the loss is averaged over ranks per step (comparable with one
process on the whole batch)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist


def train_slices(
    engine: Any, optimizer: Any, batch_of: Callable[[int], dict[str, torch.Tensor]], steps: Iterable[int]
) -> list[float]:
    """``batch_of(step)`` is the global batch; returns the mean loss over ranks of every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        full = batch_of(step)
        per_rank = next(iter(full.values())).shape[0] // world
        loss = engine(**{k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in full.items()}).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses
