"""Plain PyTorch, the baseline every ratio is taken against: fp32 params, bf16 autocast, fused AdamW.

Several processes train under DistributedDataParallel (NCCL on CUDA, gloo on
CPU). The step is the harness's (Note [what one step is] in
:mod:`chunkstar_bench.harness`); nothing is offloaded.
"""

from __future__ import annotations

from typing import Any

from chunkstar_bench.harness import ADAMW, Context, cuda_peak, init_process_group, time_steps

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
        loss.backward()
        if ctx.spec.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, ctx.spec.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    record = time_steps(ctx, step)
    peak, kind = cuda_peak(ctx)
    return {**record, "peak_device_bytes": peak, "peak_device_kind": kind, "optimizer": "torch.optim.AdamW(fused=True)"}
