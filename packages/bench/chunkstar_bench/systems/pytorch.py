"""Plain PyTorch, the baseline every ratio is taken against: fp32 params, bf16 autocast, fused AdamW.

Several processes train under DistributedDataParallel (NCCL on CUDA, gloo on
CPU). The step is the harness's (Note [what one step is] in
:mod:`chunkstar_bench.harness`); nothing is offloaded.
"""

from __future__ import annotations

from typing import Any

from chunkstar_bench.harness import ADAMW, Context, init_process_group, timed_record, torch_optim_step

__all__ = ["run"]


def run(ctx: Context) -> dict[str, Any]:
    """Train ``ctx``'s run with plain PyTorch; the per-rank record."""
    import torch

    model = ctx.build().to(ctx.torch_device())
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, **ADAMW, fused=True)
    wrapped: Any = model
    if ctx.world > 1:
        init_process_group(ctx)
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.local_rank] if ctx.device == "cuda" else None
        )

    def step(ids: Any) -> float:
        with torch.autocast(ctx.device, dtype=torch.bfloat16):
            loss = wrapped(input_ids=ids, labels=ids).loss
        return torch_optim_step(loss, params, optimizer, ctx.spec.clip)

    return timed_record(ctx, step, "torch.optim.AdamW(fused=True)")
