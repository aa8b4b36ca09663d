"""The traps (docs/design.md, 'The traps'): modules called twice, activation checkpointing,
no-grad evaluation, dict outputs, integer inputs, a model with no parameters.

Each case trains under a budget that forces eviction and compares with plain
PyTorch on the same seed and data.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import chunkstar

from tests.core._budget import measured_budget


class Twice(nn.Module):
    """Uses one block twice per forward and returns a dict; takes integer ids."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.other = nn.Linear(32, 32)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(ids)
        h = h + self.block(h)
        h = h + self.other(h)
        h = h + self.block(h)
        return {"logits": self.head(h)}


class Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(4))
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + checkpoint(layer, x, use_reentrant=False)
        return self.out(x)


def _build(cls: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _loss(model_out: object, target: torch.Tensor) -> torch.Tensor:
    if isinstance(model_out, dict):
        logits = model_out["logits"]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    assert isinstance(model_out, torch.Tensor)
    return (model_out.squeeze(-1) - target).square().mean()


def _data(cls: type[nn.Module], steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if cls is Twice:
        return [(torch.randint(0, 50, (4, 8), generator=g), torch.randint(0, 50, (4, 8), generator=g)) for _ in range(steps)]
    return [(torch.randn(16, 32, generator=g), torch.randn(16, generator=g)) for _ in range(steps)]


def _config(budget: int) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": 1100,
    }


@pytest.mark.parametrize("cls", [Twice, Checkpointed])
def test_traps_match_pytorch_under_eviction(cls: type[nn.Module]) -> None:
    steps = 5
    data = _data(cls, steps)
    ref = _build(cls)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    want = []
    for x, y in data:
        loss = _loss(ref(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())

    # measure non-model memory once, then allow only half the parameter bytes on top of it
    budget = measured_budget(lambda: _build(cls), _config, lambda e, _o: e.backward(_loss(e(data[0][0]), data[0][1])))

    engine, optimizer = chunkstar.initialize_engine(lambda: _build(cls), 0, _config(budget))
    got = []
    for i, (x, y) in enumerate(data):
        if i == 2:  # an evaluation pass between training steps must not disturb anything
            with torch.no_grad():
                engine(x)
        loss = _loss(engine(x), y)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0
    assert stats["device_chunk_bytes_peak"] <= stats["device_budget_bytes"]
    assert got == pytest.approx(want, rel=1e-5)


def test_events_reach_subscribers_and_cost_nothing_without() -> None:
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(Twice), 0, _config(1 << 30))
    seen: list[object] = []
    unsubscribe = engine.events.subscribe(seen.append)
    x, y = _data(Twice, 1)[0]
    engine.backward(_loss(engine(x), y))
    optimizer.step()
    kinds = {type(e).__name__ for e in seen}
    assert {"StageChanged", "MomentBegin", "MomentEnd", "ChunkMoved", "MemorySample"} <= kinds
    moved = sum(e.nbytes for e in seen if type(e).__name__ == "ChunkMoved" and e.dst is chunkstar.Tier.DEVICE)
    assert moved == engine.stats()["bytes_to_device"]
    unsubscribe()
    n = len(seen)
    engine.backward(_loss(engine(x), y))
    assert len(seen) == n and not engine.events.active


def test_engine_stays_usable_after_a_device_memory_error() -> None:
    """A batch too big for the budget raises; the same engine then trains a smaller
    batch exactly like a fresh engine does."""
    small_x, small_y = torch.randn(4, 32), torch.randn(4)
    big_x, big_y = torch.randn(4096, 32), torch.randn(4096)
    param_bytes = sum(p.numel() * 4 for p in _build(Checkpointed).parameters())

    def run(engine: chunkstar.ChunkEngine, optimizer: chunkstar.ChunkAdam) -> list[float]:
        out = []
        for _ in range(3):
            loss = _loss(engine(small_x), small_y)
            engine.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    config = _config(param_bytes + 64 * 1024)
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(Checkpointed), 0, config)
    with pytest.raises(chunkstar.DeviceMemoryError):
        engine.backward(_loss(engine(big_x), big_y))
    assert engine.stats()["moments_per_micro_step"] == 0  # the failed warm-up left no trace behind
    fresh = run(*chunkstar.initialize_engine(lambda: _build(Checkpointed), 0, config))
    assert run(engine, optimizer) == fresh
