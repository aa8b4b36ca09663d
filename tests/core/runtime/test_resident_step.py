"""The step does no work it does not need (issue 17, section 4; Note [norm only when needed] in
chunkstar/optim/adam.py).

* Without clipping and without fp16 the optimizer takes no gradient norm at all,
  neither in the step nor on the way during backward (counted through the torch
  functions that take one, on every thread), and ``last_grad_norm`` is None.
* Leaving it out changes no bit: with fp32 and no clipping the engine's losses and
  parameters are plain PyTorch's (fused AdamW) exactly, resident or evicting.
* Whoever wants the norm asks for it (``measure_grad_norm``, which the Trainer sets):
  then it is the global norm plain PyTorch measures, and the update is unchanged.
* Each step builds its fused kernel's step tensors once, shared by every call.

Speed is not asserted here: ``chunkstar-bench step-time`` prints the ratio to PyTorch
(rows ``pytorch-overhead`` and ``chunkstar-overhead``), measured side by side.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

import chunkstar

from tests.core._models import CASES, DTYPES, engine_config, eviction_budget, train_engine, train_reference

STEPS = 4


def _engine(name: str, dtype: str, budget: str, clip: float) -> tuple[Any, Any]:
    case = CASES[name]
    room: int | str = "1GB" if budget == "resident" else eviction_budget(case.build(), DTYPES[dtype])
    return chunkstar.initialize_engine(model_func=case.build, local_rank=0, config=engine_config(dtype, budget=room, clip=clip))


class _NormCalls:
    """Counts the calls of the torch functions that take a gradient norm (from any thread)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        for owner, name in ((torch, "_foreach_norm"), (torch.linalg, "vector_norm"), (torch, "norm")):
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name)))

    def _counting(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("budget", ["resident", "evicting"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_no_gradient_norm_without_clipping_or_fp16(dtype: str, budget: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES["gpt2"]
    engine, optimizer = _engine("gpt2", dtype, budget, clip=0.0)
    norms = _NormCalls(monkeypatch)
    train_engine(engine, optimizer, case, STEPS, dtype=dtype)
    assert norms.calls == 0
    assert optimizer.last_grad_norm is None and optimizer.step_count == STEPS
    if budget == "evicting":  # host Adam: the chunks were handed over during backward, with no norm job
        assert engine.stats()["chunk_moves_to_host"] > 0
    # the counter does count: with clipping the same run takes norms
    engine, optimizer = _engine("gpt2", dtype, budget, clip=1.0)
    train_engine(engine, optimizer, case, STEPS, dtype=dtype)
    assert norms.calls > 0 and optimizer.last_grad_norm is not None and math.isfinite(optimizer.last_grad_norm)


@pytest.mark.parametrize("budget", ["resident", "evicting"])
@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_no_clipping_trains_like_pytorch_bit_for_bit(name: str, budget: str) -> None:
    case = CASES[name]
    keep: list[torch.nn.Module] = []
    want = train_reference(case, STEPS, dtype="fp32", clip=0.0, keep=keep)
    engine, optimizer = _engine(name, "fp32", budget, clip=0.0)
    got = train_engine(engine, optimizer, case, STEPS, dtype="fp32")
    assert got == want
    ours, theirs = engine.state_dict(), keep[0].state_dict()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key


def _reference_norms(name: str, steps: int) -> list[float]:
    """Plain PyTorch's global gradient norm at each step (fp32, fused AdamW, no clipping)."""
    case = CASES[name]
    model = case.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    out = []
    for step in range(steps):
        case.loss(model, case.batch(step), torch.float32).backward()
        out.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("budget", ["resident", "evicting"])
def test_measure_grad_norm_gives_pytorchs_norm_and_the_same_update(budget: str) -> None:
    case = CASES["gpt2"]
    keep: list[torch.nn.Module] = []
    train_reference(case, STEPS, dtype="fp32", clip=0.0, keep=keep)
    want = _reference_norms("gpt2", STEPS)
    engine, optimizer = _engine("gpt2", "fp32", budget, clip=0.0)
    assert optimizer.measure_grad_norm is False  # the default: nobody asked
    got: list[float | None] = []
    for step in range(STEPS):
        loss = case.loss(engine, case.batch(step), torch.float32)
        engine.backward(loss)
        # asked for from the second step on, after the backward handed its chunks over
        optimizer.measure_grad_norm = step > 0
        optimizer.step()
        optimizer.zero_grad()
        got.append(optimizer.last_grad_norm)
    assert got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g is not None and g == pytest.approx(w, rel=1e-5), (got, want)
    ours, theirs = engine.state_dict(), keep[0].state_dict()
    for key, value in ours.items():
        assert torch.equal(value, theirs[key]), key  # measuring changed no bit of the update


def test_each_step_shares_one_step_tensor_per_step_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """One step tensor per (device, step count) and step, made before the updates: no tensor
    (on CUDA a copy from the host) per fused call."""
    case = CASES["gpt2"]
    engine, optimizer = _engine("gpt2", "bf16", "resident", clip=0.0)
    seen: list[tuple[torch.Tensor, float]] = []  # (step tensor, its value) of each fused call, kept alive (ids stay unique)
    fused = torch._fused_adamw_

    def spy(*args: Any, **kwargs: Any) -> None:
        seen.extend((t, float(t)) for t in args[5])
        fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", spy)
    monkeypatch.setattr(chunkstar.optim.adam, "_HOST_BATCH_ELEMENTS", 1 << 12)  # many fused calls per step
    train_engine(engine, optimizer, case, STEPS, dtype="bf16")
    engine.state_dict()  # the host-Adam updates of the warm-up's steps ran on the host worker: done by now
    assert {v for _, v in seen} == {float(n) for n in range(1, STEPS + 1)}
    for n in range(1, STEPS + 1):
        calls = [id(t) for t, v in seen if v == n]
        assert len(calls) > 3 and len(set(calls)) == 1, (n, len(calls), len(set(calls)))  # one tensor, shared


def test_the_trainer_logs_the_norm_without_clipping(tmp_path: Any) -> None:
    """The Trainer logs the global norm every step even with ``max_grad_norm`` 0 (its own
    ``_get_grad_norm``): ChunkstarTrainer asks the engine for it."""
    from transformers import Trainer

    from chunkstar.integrations.transformers import ChunkstarTrainer
    from tests.integrations._trainer_case import build_model, chunkstar_config, logged, train_rows, training_args

    kw: dict[str, Any] = dict(max_grad_norm=0.0, max_steps=3, gradient_accumulation_steps=1)
    plain = Trainer(model=build_model(), args=training_args(str(tmp_path / "plain"), **kw), train_dataset=train_rows())
    plain.train()
    ours = ChunkstarTrainer(
        model=build_model(), args=training_args(str(tmp_path / "ours"), **kw), train_dataset=train_rows(),
        chunkstar_config=chunkstar_config(),
    )  # fmt: skip
    assert ours.chunk_optimizer.measure_grad_norm
    ours.train()
    want, got = logged(plain), logged(ours)
    assert len(want) == len(got) == 3
    for w, g in zip(want, got):
        assert math.isfinite(g["grad_norm"]) and g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), (w, g)
