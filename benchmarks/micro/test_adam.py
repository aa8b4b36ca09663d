"""Adam over one chunk: one fused ``torch._fused_adamw_`` call on a flat 4M-element chunk against
``torch.optim.AdamW(foreach=False)`` stepping the same 4M elements held as 100 separate tensors.

This is the case for chunks in the optimizer (docs/design.md, 'Chunks' and 'The optimizer step'): the same
arithmetic, one kernel launch over contiguous memory instead of a Python loop
of per-parameter kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

NUMEL = 4 * 2**20
N_TENSORS = 100
GROUP = "adamw-4M-elements"
HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8)
PEDANTIC = dict(rounds=15, iterations=1, warmup_rounds=2)


@pytest.mark.benchmark(group=GROUP)
def test_fused_adamw_one_chunk(benchmark: Any, ratio: Any) -> None:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(NUMEL, generator=g)
    grad = torch.randn(NUMEL, generator=g)
    m, v = torch.zeros(NUMEL), torch.zeros(NUMEL)
    step = torch.tensor(0.0)

    def adam_step() -> None:
        step.add_(1)
        torch._fused_adamw_([master], [grad], [m], [v], [], [step], amsgrad=False, maximize=False, **HP)

    benchmark.pedantic(adam_step, **PEDANTIC)
    assert torch.isfinite(master).all()
    mean = ratio.median(GROUP, "chunkstar")
    if mean:
        ratio.derived(GROUP, "fused_Gparams_per_s", NUMEL / mean / 1e9)


@pytest.mark.benchmark(group=GROUP)
def test_per_parameter_adamw_100_tensors(benchmark: Any, ratio: Any) -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [NUMEL // N_TENSORS] * (N_TENSORS - 1)
    sizes.append(NUMEL - sum(sizes))
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    opt = torch.optim.AdamW(params, lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)  # fmt: skip

    benchmark.pedantic(opt.step, **PEDANTIC)
    assert sum(p.numel() for p in params) == NUMEL
    mean = ratio.median(GROUP, "baseline")
    if mean:
        ratio.derived(GROUP, "per_param_Gparams_per_s", NUMEL / mean / 1e9)
