"""Collectives get tensors on the device their backend requires (no process group needed).

NCCL reduces CUDA tensors only; gloo here gets CPU tensors. The gradient norm
is reduced through ``Comm.all_reduce_sum`` on ``Comm.exchange_device(engine
device)``. The collective itself is monkeypatched to record what it was
handed, and the ``meta`` device stands in for the engine's GPU: a non-CPU
device that needs no accelerator.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chunkstar.distributed.comm import Comm, DistributedError
from chunkstar.optim.adam import global_grad_norm, range_norms

GPU_STAND_IN = torch.device("meta")


class _Stop(RuntimeError):
    pass


def _record_all_reduce(monkeypatch: pytest.MonkeyPatch, seen: list[torch.Tensor]) -> None:
    def fake(t: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        seen.append(t)
        if t.is_meta:
            raise _Stop("a meta tensor cannot be read back; what was handed over is recorded")
        t.mul_(2)  # the other rank holds the same gradients

    monkeypatch.setattr(dist, "all_reduce", fake)


def test_exchange_device_by_backend() -> None:
    gpu = torch.device("cuda", 1)
    assert Comm(0, 2, "nccl").exchange_device(gpu) == gpu
    assert Comm(0, 2, "gloo").exchange_device(gpu) == torch.device("cpu")
    assert Comm().exchange_device(torch.device("cpu")) == torch.device("cpu")


def test_gradient_norm_goes_to_the_engine_device_under_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    _record_all_reduce(monkeypatch, seen)
    norms = [range_norms([torch.ones(4), torch.ones(5)])]  # host-Adam chunks: their norms start on the CPU
    with pytest.raises(DistributedError, match="gradient norm"):
        global_grad_norm(norms, Comm(0, 2, "nccl"), GPU_STAND_IN)
    assert len(seen) == 1
    assert seen[0].device == GPU_STAND_IN and seen[0].dtype == torch.float32


def test_gradient_norm_stays_on_the_cpu_under_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    _record_all_reduce(monkeypatch, seen)
    total = global_grad_norm([range_norms([torch.ones(4), torch.ones(5)])], Comm(0, 2, "gloo"), GPU_STAND_IN)
    assert [t.device.type for t in seen] == ["cpu"] and seen[0].dtype == torch.float32
    assert total.device.type == "cpu" and total.dim() == 0
    assert float(total) == pytest.approx(math.sqrt(2 * 9))  # both ranks' squares


def test_a_rank_without_gradients_still_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[torch.Tensor] = []
    _record_all_reduce(monkeypatch, seen)
    assert float(global_grad_norm([], Comm(1, 2, "gloo"), torch.device("cpu"))) == 0.0
    assert len(seen) == 1


def test_gradient_norm_of_one_process_matches_torch() -> None:
    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(7, generator=g), torch.randn(3, generator=g)], [torch.randn(11, generator=g).bfloat16()]]
    want = torch.linalg.vector_norm(torch.cat([t.float() for rs in groups for t in rs]))
    total = global_grad_norm([range_norms(rs) for rs in groups], Comm(), torch.device("cpu"))
    assert total.device.type == "cpu" and total.dtype == torch.float32
    torch.testing.assert_close(total, want)
    assert math.isinf(float(global_grad_norm([range_norms([torch.tensor([1.0, math.inf])])], Comm(), torch.device("cpu"))))
    assert math.isnan(float(global_grad_norm([range_norms([torch.tensor([math.nan])])], Comm(), torch.device("cpu"))))
