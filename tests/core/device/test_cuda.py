"""CUDA path: the same parity as on the CPU virtual device, on a real GPU.

Skipped cleanly on machines without CUDA (CI here has none).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.chunk.lists import ChunkList

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)], nn.Linear(256, 1))


def _reference_losses(
    ref: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> list[float]:
    """Plain PyTorch on the same batches (fused AdamW, lr 1e-3, clipping 1.0): its losses."""
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    want = []
    for x, y in data:
        loss = loss_fn(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    return want


def test_cuda_mlp_matches_pytorch_under_a_budget_smaller_than_the_params() -> None:
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 256, generator=g).to(dev), torch.randn(64, 1, generator=g).to(dev)) for _ in range(5)]
    ref = _mlp().to(dev)
    want = _reference_losses(ref, data, lambda out, y: (out - y).square().mean())
    param_bytes = sum(p.numel() * 4 for p in ref.parameters())
    base = torch.cuda.memory_allocated(dev)
    engine, optimizer = chunkstar.initialize_engine(
        _mlp,
        0,
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "gradient_clipping": 1.0,
            "device": "cuda",
            "device_memory_budget": base + param_bytes // 2 + (8 << 20),
            "default_chunk_size": 70_000,
        },
    )
    got = []
    for x, y in data:
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0
    assert stats["device_chunk_bytes_peak"] <= stats["device_budget_bytes"]
    assert got == pytest.approx(want, rel=1e-5)


def test_cuda_parameters_read_outside_modules_and_between_steps() -> None:
    """nn.TransformerEncoder (MultiheadAttention reads out_proj.weight) under eviction on
    the GPU, then reads between steps (values on the device), p.grad, module.state_dict()."""
    dev = torch.device("cuda")

    def build() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), nn.Linear(128, 10))

    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(2, 16, 128, generator=g).to(dev), torch.randint(0, 10, (2, 16), generator=g).to(dev)) for _ in range(4)]
    ref = build().to(dev)
    want = _reference_losses(ref, data, lambda out, y: nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1)))
    param_bytes = sum(p.numel() * 4 for p in ref.parameters())
    base = torch.cuda.memory_allocated(dev)
    engine, optimizer = chunkstar.initialize_engine(
        build, 0,
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0, "device": "cuda",
         "device_memory_budget": base + int(param_bytes * 0.8) + (16 << 20), "default_chunk_size": 40_000},
    )  # fmt: skip
    got = []
    for x, y in data:
        loss = nn.functional.cross_entropy(engine(x).reshape(-1, 10), y.reshape(-1))
        engine.backward(loss)
        if len(got) == 0:
            assert all(p.grad is not None and p.grad.device.type == "cuda" for p in engine.module.parameters())
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5)
    assert engine.stats()["chunk_moves_to_host"] > 0
    masters = engine.module.state_dict()
    for (name, p), q in zip(engine.module.named_parameters(), ref.parameters()):
        with torch.no_grad():
            v = p.detach().clone()
        assert v.device.type == "cuda"
        torch.testing.assert_close(v, q.detach(), rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(masters[name], q.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)


def test_cuda_overlapped_and_serial_paths_agree_and_use_exact_pinned_buffers() -> None:
    """Copy streams each way, deferred frees, gradients offloaded in backward and host Adam on
    the worker (overlap on) against the same work on the compute stream (overlap off): the
    same bits. Param chunks' host buffers are pinned at their exact size (device payloads
    come from the allocator the activations use: there is no private pool)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(64, 256, generator=g).to(dev), torch.randn(64, 1, generator=g).to(dev)) for _ in range(5)]
    param_bytes = sum(p.numel() * 2 for p in _mlp().parameters())
    runs = []
    for overlap in (True, False):
        base = torch.cuda.memory_allocated(dev)
        engine, optimizer = chunkstar.initialize_engine(
            _mlp, 0,
            {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0, "bf16": {"enabled": True},
             "device": "cuda", "device_memory_budget": base + param_bytes // 2 + (8 << 20), "default_chunk_size": 70_001,
             "overlap": overlap},
        )  # fmt: skip
        losses = []
        for x, y in data:
            loss = (engine(x).float() - y).square().mean()
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        mgr = engine.mgr
        assert engine.stats()["moves_by_reason"]["offload"] > 0
        assert mgr.chunks.pinned_buffers is not None
        assert mgr.chunks.pinned_buffers.pinned_bytes == sum(c.nbytes for c in mgr.chunks.chunks_of(ChunkList.PARAM)
                                                      if c.has_host_buffer)  # fmt: skip
        runs.append((losses, engine.state_dict()))
        del engine, optimizer
    assert runs[0][0] == runs[1][0]
    for k, v in runs[0][1].items():
        assert torch.equal(v, runs[1][1][k]), k
