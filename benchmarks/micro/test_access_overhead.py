"""Access/release overhead per moment: the engine's hook path on a 64-layer tiny MLP.

Every ``Linear(32, 32)`` owns parameters, so a training micro-step is 128
moments (64 forward, 64 backward), each an access (chunks resident, tensors
COMPUTE) and a release. The device budget holds the whole model and the
engine is past its warm-up, so no chunk moves while timing (asserted): what
differs from plain PyTorch is the bookkeeping. Benchmarks:

* one training step (forward, backward, AdamW, zero_grad; fp32) of the plain
  model with fused AdamW (baseline) and of the same model in the engine;
  ``overhead_per_moment_us`` = (engine - plain) / moments per micro-step;
* one module's pre-forward access and post-forward release (its hooks around a call),
  called directly: the access + release path alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import chunkstar

LAYERS = 64
WIDTH = 32
GROUP = "train-step-mlp64"
PEDANTIC = dict(rounds=25, iterations=1, warmup_rounds=3)
CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "device": "cpu",
    "device_memory_budget": "256MB",
    "default_chunk_size": 4096,
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def trained_engine(batch: torch.Tensor) -> Any:
    engine, optimizer = chunkstar.initialize_engine(model_func=_mlp, config=CONFIG)
    for _ in range(3):  # past the warm-up: the schedule is frozen
        engine.backward(engine(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()
    return engine, optimizer


@pytest.mark.benchmark(group=GROUP)
def test_train_step_plain(benchmark: Any, ratio: Any, batch: torch.Tensor) -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step() -> None:
        model(batch).square().mean().backward()
        opt.step()
        opt.zero_grad()

    benchmark.pedantic(step, **PEDANTIC)
    ratio.median(GROUP, "baseline")


@pytest.mark.benchmark(group=GROUP)
def test_train_step_chunkstar(benchmark: Any, ratio: Any, trained_engine: Any, batch: torch.Tensor) -> None:
    engine, optimizer = trained_engine
    moves = engine.stats()["chunk_moves_to_device"]

    def step() -> None:
        engine.backward(engine(batch).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    benchmark.pedantic(step, **PEDANTIC)
    stats = engine.stats()
    assert stats["chunk_moves_to_device"] == moves, "chunks moved: the benchmark would time transfers, not bookkeeping"
    median, plain = ratio.median(GROUP, "chunkstar"), ratio.other(GROUP, "baseline")
    if median and plain:
        moments = int(stats["moments_per_micro_step"])
        ratio.derived(GROUP, "moments_per_step", float(moments))
        ratio.derived(GROUP, "overhead_per_moment_us", (median - plain) / moments * 1e6)


@pytest.mark.benchmark(group="access-release-one-module")
def test_access_release_one_module(benchmark: Any, ratio: Any, trained_engine: Any) -> None:
    engine, _ = trained_engine
    layer = engine.module[3]
    x = torch.zeros(1, layer.in_features)

    def access_release() -> None:
        # the module's own hooks (pre-forward access, post-forward release) around an empty call
        layer(x)

    with torch.no_grad():
        benchmark.pedantic(access_release, rounds=30, iterations=50, warmup_rounds=3)
    median = ratio.median("access-release-one-module", "chunkstar")
    if median:
        ratio.derived("access-release-one-module", "access_release_us", median * 1e6)
