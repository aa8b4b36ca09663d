"""PyTorch FSDP2 with CPU offload: ``fully_shard`` per block and at the root, bf16 params.

``CPUOffloadPolicy(pin_memory=False)`` on CPU (nothing to DMA to), pinned on
CUDA; ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; gloo on
CPU (a world of one is fine), NCCL on CUDA. The step is the harness's.
"""

from __future__ import annotations

from typing import Any

from chunkstar_bench.harness import ADAMW, Context, init_process_group, timed_record, torch_optim_step

__all__ = ["run"]


def run(ctx: Context) -> dict[str, Any]:
    """Train ``ctx``'s run with FSDP2 + CPUOffloadPolicy; the per-rank record."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    init_process_group(ctx)
    mesh = init_device_mesh(ctx.device, (ctx.world,))
    model = ctx.build()
    model.train()
    offload = CPUOffloadPolicy(pin_memory=ctx.device == "cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    params = list(model.parameters())
    # foreach, not fused: the sharded params are DTensors on the host.
    optimizer = torch.optim.AdamW(params, **ADAMW, foreach=True)

    def step(ids: Any) -> float:
        return torch_optim_step(model(input_ids=ids, labels=ids).loss, params, optimizer, ctx.spec.clip)

    return timed_record(ctx, step, "torch.optim.AdamW(foreach=True) over FSDP2 DTensor shards")
