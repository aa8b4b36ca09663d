"""Gradients as PyTorch keeps them: several backwards before one step sum, and any module's
``zero_grad()`` drops them (issue 30, items 3 and 4; Note [gradients kept across a forward]
in chunkstar/runtime/gradients.py).

The loops are the ones users copy: PyTorch's DCGAN tutorial (two discriminator backwards
before its step, ``netD.zero_grad()`` on the module, the generator's backward leaving
gradients in the discriminator) run unchanged on two engines; accumulation written by hand;
an evaluation between a backward and the step. Each against plain PyTorch on the same seed
and data under a budget that forces evictions (fp32, 1e-5).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chunkstar

from tests.core._budget import measured_budget

NZ = 16


def _generator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.ConvTranspose2d(NZ, 32, 4, 1, 0, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
        nn.ConvTranspose2d(32, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
        nn.ConvTranspose2d(32, 1, 4, 2, 1, bias=False), nn.Tanh(),
    )  # fmt: skip


def _discriminator() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(1, 32, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(32, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(32, 32, 3, 1, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(32, 1, 4, 1, 0, bias=False), nn.Sigmoid(),
    )  # fmt: skip


def _dcgan_loop(netD: Any, netG: Any, optimizerD: Any, optimizerG: Any, steps: int = 5) -> list[tuple[float, float, float]]:
    """The training loop of PyTorch's DCGAN tutorial (16x16 images), line for line."""
    g = torch.Generator().manual_seed(3)
    criterion = nn.BCELoss()
    out = []
    for _ in range(steps):
        real = torch.rand(4, 1, 16, 16, generator=g) * 2 - 1
        netD.zero_grad()
        label = torch.full((4,), 1.0)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        errD_real.backward()
        noise = torch.randn(4, NZ, 1, 1, generator=g)
        fake = netG(noise)
        label.fill_(0.0)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        errD_fake.backward()
        optimizerD.step()
        netG.zero_grad()
        label.fill_(1.0)
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        errG.backward()
        optimizerG.step()
        out.append((errD_real.item(), errD_fake.item(), errG.item()))
    return out


def _adam_config(budget: int) -> dict[str, Any]:
    return {
        "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "betas": [0.5, 0.999]}},
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": 4096,
    }


def _dcgan_budgets(fraction: float = 0.8) -> tuple[int, int]:
    """The non-model peak two probe engines measured over two steps of the loop, plus
    ``fraction`` of each model's fp32 parameter bytes."""
    probes = [chunkstar.initialize_engine(build, 0, _adam_config(1 << 30)) for build in (_discriminator, _generator)]
    _dcgan_loop(probes[0][0], probes[1][0], probes[0][1], probes[1][1], steps=2)
    budgets = []
    for (engine, _), build in zip(probes, (_discriminator, _generator)):
        params = sum(p.numel() * 4 for p in build().parameters())
        budgets.append(int(engine.stats()["warmup_non_model_peak_bytes"]) + int(fraction * params))
        engine.close()
    return budgets[0], budgets[1]


def test_the_dcgan_tutorial_loop_runs_unchanged_on_two_engines() -> None:
    d, g = _discriminator(), _generator()
    want = _dcgan_loop(
        d, g, torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=True),
        torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999), fused=True),
    )  # fmt: skip
    budget_d, budget_g = _dcgan_budgets()
    netD, optimizerD = chunkstar.initialize_engine(_discriminator, 0, _adam_config(budget_d))
    netG, optimizerG = chunkstar.initialize_engine(_generator, 0, _adam_config(budget_g))
    got = _dcgan_loop(netD, netG, optimizerD, optimizerG)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {a} vs {b}"
    stats_d, stats_g = netD.stats(), netG.stats()
    assert stats_d["chunk_moves_to_host"] > 0 and stats_g["chunk_moves_to_host"] > 0, "the budgets should force evictions"
    assert stats_d["kept_gradient_forwards"] == 5  # errD_fake's forward found errD_real's gradients
    for (name, p), q in zip(netD.module.state_dict().items(), d.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"D {name}: {m}")


# ---------------------------------------------------------------------------- by hand

VOCAB = 40
WIDTH = 32


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.side = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, ids: torch.Tensor, side: bool = True) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.block(h)
        if side:
            h = h + self.side(h)
        return F.linear(self.norm(h), self.emb.weight)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + i)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)


def _ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def _config(budget: int, **extra: Any) -> dict[str, Any]:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0, "device": "cpu", "device_memory_budget": budget, "default_chunk_size": 1100, **extra,
    }  # fmt: skip


def _budget() -> int:
    return measured_budget(Tied, _config, lambda e, _o: e.backward(_ce(e(_batch(0)[0]), _batch(0)[1])), fraction=0.7)


Loop = Callable[[Any, Any, Callable[[torch.Tensor], None], int], float]


def _run(loop: Loop, engine: bool, steps: int = 5, **extra: Any) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    if engine:
        model, opt = chunkstar.initialize_engine(Tied, 0, _config(_budget(), **extra))
        backward: Callable[[torch.Tensor], None] = model.backward
    else:
        model = Tied()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        backward = lambda loss: loss.backward()  # noqa: E731
    losses = []
    for step in range(steps):
        losses.append(loop(model, opt, backward, step))
        if not engine:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    stats = model.stats() if engine else {}
    state = (model.module if engine else model).state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}, stats


def _same(got: tuple[list[float], dict[str, torch.Tensor], dict[str, Any]], want: tuple[list[float], dict[str, torch.Tensor], Any]) -> None:
    assert got[2]["chunk_moves_to_host"] > 0, "the budget should force evictions"
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for k, v in want[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _two_tasks(model: Any, _opt: Any, backward: Callable[[torch.Tensor], None], step: int) -> float:
    """A multi-task loop: each loss backwarded in turn, the second forward skipping a branch."""
    (x, y), (x2, y2) = _batch(2 * step), _batch(2 * step + 1)
    first = _ce(model(x), y)
    backward(first)
    second = _ce(model(x2, side=step % 2 == 0), y2) * 0.5
    backward(second)
    return first.item() + second.item()


def _evaluate_between(model: Any, _opt: Any, backward: Callable[[torch.Tensor], None], step: int) -> float:
    """A backward, an evaluation under no_grad, a gradient read, then the step."""
    x, y = _batch(step)
    loss = _ce(model(x), y)
    backward(loss)
    with torch.no_grad():
        model(_batch(99)[0])
    net = model.module if hasattr(model, "module") else model
    assert net.side.weight.grad is not None  # kept, and still visible
    return loss.item()


@pytest.mark.parametrize("loop", [_two_tasks, _evaluate_between], ids=["two_backwards", "eval_between"])
def test_gradients_of_several_backwards_sum_as_in_pytorch(loop: Loop) -> None:
    got = _run(loop, engine=True)
    _same(got, _run(loop, engine=False))
    assert got[2]["kept_gradient_forwards"] == 5 and got[2]["kept_gradient_bytes"] > 0


def test_several_backwards_with_gradient_accumulation_steps() -> None:
    """Two backwards per micro-batch, two micro-batches per step: the engine divides each loss
    by gradient_accumulation_steps, as the reference does by hand."""

    def loop(model: Any, opt: Any, backward: Callable[[torch.Tensor], None], step: int) -> float:
        total = 0.0
        for micro in range(2):
            (x, y), (x2, y2) = _batch(4 * step + 2 * micro), _batch(4 * step + 2 * micro + 1)
            for a, b in ((x, y), (x2, y2)):
                loss = _ce(model(a), b)
                backward(loss if hasattr(model, "backward") else loss / 2)
                total += loss.item()
        return total

    _same(_run(loop, engine=True, gradient_accumulation_steps=2), _run(loop, engine=False))


# ---------------------------------------------------------------------------- zero_grad on modules


def _zero_some(model: Any, opt: Any, backward: Callable[[torch.Tensor], None], step: int) -> float:
    """Gradients a module's zero_grad() must drop: a first backward whose gradients the whole
    model's zero_grad() drops, a second whose side branch's are dropped alone, kept as zeros
    once (set_to_none=False)."""
    net = model.module if hasattr(model, "module") else model
    x, y = _batch(step)
    backward(_ce(model(x), y) * 3.0)
    net.zero_grad()
    loss = _ce(model(_batch(step + 50)[0]), _batch(step + 50)[1])
    backward(loss)
    net.side.zero_grad(set_to_none=step % 2 == 0)
    return loss.item()


def test_module_zero_grad_drops_the_engines_gradients_as_pytorch_does() -> None:
    _same(_run(_zero_some, engine=True), _run(_zero_some, engine=False))


def test_engine_zero_grad_drops_them_as_deepspeeds_does() -> None:
    engine, optimizer = chunkstar.initialize_engine(Tied, 0, _config(1 << 30))
    x, y = _batch(0)
    engine.backward(_ce(engine(x), y))
    assert engine.module.block[0].weight.grad is not None
    engine.zero_grad()
    assert all(p.grad is None for p in engine.parameters())
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    optimizer.step()  # no gradients: nothing changes, as torch.optim's step after zero_grad
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    engine.backward(_ce(engine(x), y))
    optimizer.step()
    assert engine.stats()["optimizer_steps"] == 2


# ---------------------------------------------------------------------------- the accumulators' buffers


class _Pool:
    """The engine's pinned buffers as the CUDA path sees them (device/pinned.py's take), made of
    NaNs: a range read before it was written would spoil the run."""

    def __init__(self) -> None:
        self.taken: list[int] = []

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        self.taken.append(numel)
        return torch.full((numel,), float("nan"), dtype=dtype)


def test_accumulators_come_from_the_pinned_buffers_once_and_are_never_zero_filled() -> None:
    """Note [accumulator buffers]: on CUDA each chunk's accumulator is taken from the engine's
    exactly sized pinned buffers once and reused every cycle; torch's pinned allocator would
    round each up to a power of two and keep it. The CUDA path (stream-ordered copies) is run
    here on the CPU device with a pool that counts what it hands out."""

    def loop(model: Any, _opt: Any, backward: Callable[[torch.Tensor], None], step: int) -> float:
        total = 0.0
        for micro in range(3):
            x, y = _batch(3 * step + micro)
            loss = _ce(model(x), y)
            backward(loss if hasattr(model, "backward") else loss / 3)
            total += loss.item()
        return total

    engine, optimizer = chunkstar.initialize_engine(Tied, 0, _config(_budget(), gradient_accumulation_steps=3))
    pool = _Pool()
    engine.mgr.chunks.pinned_buffers = pool  # type: ignore[assignment]
    engine._gradients._async = True
    got = []
    for step in range(4):
        got.append(loop(engine, optimizer, engine.backward, step))
        optimizer.step()
        optimizer.zero_grad()
    want = _run(loop, engine=False, steps=4)
    assert got == pytest.approx(want[0], rel=1e-5)
    n_chunks = engine.mgr.layout.n_chunks
    assert sorted(pool.taken) == sorted(engine.mgr.layout.chunk_sizes[c] for c in range(n_chunks)), "one buffer per chunk, for the run"
