"""The engine trains exactly like plain PyTorch while chunks are being evicted.

For each model x precision: same seed, same batches, AdamW (weight decay) with
global-norm clipping; the per-step losses must match the reference (fp32:
1e-5 relative; bf16: 3e-2 against fp32 weights under bf16 autocast), and the
run must really have moved chunks out of a device budget it never exceeded.
"""

from __future__ import annotations

import pytest

import chunkstar

from tests.core._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, n_unique_params, train_engine, train_reference

STEPS = 6
RTOL = {"fp32": 1e-5, "bf16": 3e-2}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["gpt2", "bert", "mlp"])
def test_losses_match_pytorch_under_eviction(name: str, dtype: str) -> None:
    case = CASES[name]
    model = case.build()
    budget = eviction_budget(model, DTYPES[dtype])
    assert n_unique_params(model) * DTYPES[dtype].itemsize > budget  # the params cannot all be resident
    want = train_reference(case, STEPS, dtype=dtype)

    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0, config=engine_config(dtype, budget=budget)
    )
    got = train_engine(engine, optimizer, case, STEPS, dtype=dtype)

    assert_losses_close(got, want, RTOL[dtype], f"{name}/{dtype}")
    stats = engine.stats()
    assert stats["device_budget_bytes"] == budget
    assert stats["chunk_moves_to_host"] > 0, f"budget {budget} B forced no eviction: {stats}"
    assert stats["bytes_to_host"] > 0, stats
    assert stats["chunk_moves_to_device"] > 0, stats
    assert 0 < stats["device_chunk_bytes_peak"] <= stats["device_budget_bytes"], stats


def test_lr_changes_through_param_groups() -> None:
    """A scheduler-style update of ``optimizer.param_groups[0]["lr"]`` takes effect each step."""
    case = CASES["gpt2"]
    schedule = lambda step: 1e-3 * (step + 1) / STEPS if step < 3 else 3e-4  # noqa: E731 warm-up, then drop
    want = train_reference(case, STEPS, lr_schedule=schedule)
    engine, optimizer = chunkstar.initialize_engine(
        model_func=case.build, local_rank=0,
        config=engine_config("fp32", budget=eviction_budget(case.build(), DTYPES["fp32"])),
    )
    assert len(optimizer.param_groups) >= 1 and "lr" in optimizer.param_groups[0]
    got = train_engine(engine, optimizer, case, STEPS, lr_schedule=schedule)
    assert_losses_close(got, want, RTOL["fp32"], "gpt2/fp32 with lr schedule")
    assert optimizer.param_groups[0]["lr"] == 3e-4


def test_no_decay_groups_and_a_torch_lr_scheduler_match_pytorch() -> None:
    """Two parameter groups (no weight decay for biases and norms) and a real
    ``torch.optim.lr_scheduler`` driving ``optimizer.param_groups``."""
    import torch

    from tests.core._models import hf_loss, gpt2_batch

    case = CASES["gpt2"]
    warmup = lambda step: min(1.0, (step + 1) / 3)  # noqa: E731

    ref = case.build()
    groups = chunkstar.no_decay_param_groups(ref)
    groups[0]["weight_decay"] = 0.1
    opt = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    want = []
    for step in range(STEPS):
        loss = hf_loss(ref, gpt2_batch(step), torch.float32)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        want.append(loss.item())

    config = engine_config("fp32", budget=eviction_budget(case.build(), DTYPES["fp32"]), weight_decay=0.1)
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config, param_groups_fn=chunkstar.no_decay_param_groups)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    got = []
    for step in range(STEPS):
        loss = hf_loss(engine, gpt2_batch(step), torch.float32)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        sched.step()
        got.append(loss.item())
    assert_losses_close(got, want, RTOL["fp32"], "gpt2/fp32 with no-decay groups and LambdaLR")
    assert engine.stats()["chunk_moves_to_host"] > 0
