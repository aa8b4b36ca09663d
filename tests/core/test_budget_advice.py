"""What a too-small device budget error tells the user, checked by doing what it says.

- the smallest budget the warm-up's error names trains, and evaluates after training:
  an evaluation forward (``torch.no_grad``) between steps budgets each moment with
  the traced forward's (Note [evaluation budgets]), not with the trace's largest
  non-model peak, which comes in backward and would deny the embedding's chunk the
  room it had in training; an evaluation on larger inputs still gets the largest;
- a moment that fails because one parameter (a chunk of its own) is larger than the
  room its non-model peak leaves is not told to lower ``default_chunk_size``.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar

BATCH = 2


def _build(vocab: int, n_embd: int, n_layer: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64), n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _train_then_evaluate(shape: tuple[int, int, int], budget: int, steps: int = 3, seq: int = 64) -> None:
    """``steps`` training steps on ``BATCH`` x ``seq`` tokens, then one evaluation forward
    (the demo's pattern) on a GPT-2 of ``shape`` (vocabulary, hidden size, layers)."""
    transformers.logging.set_verbosity_error()
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": "auto",
    }
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(*shape, seq), 0, config)
    ids = torch.randint(0, shape[0], (BATCH, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
    assert engine.stats()["schedule"] == "frozen"
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)


def test_the_named_minimum_trains_and_then_evaluates() -> None:
    # the largest non-model peak comes in backward; the tied embedding's chunk is needed in forward
    shape = (2048, 256, 4)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate(shape, budget=2 * 1024 * 1024)
    minimum = info.value.minimum
    assert minimum is not None, str(info.value)
    _train_then_evaluate(shape, budget=minimum)  # planned with the largest peak, the evaluation failed here


def test_an_evaluation_on_larger_inputs_is_planned_with_the_largest_peak() -> None:
    """Its moments' traced peaks do not bound it: the trace's largest peak does, as before."""
    transformers.logging.set_verbosity_error()
    config = {"optimizer": {"type": "AdamW"}, "device": "cpu", "device_memory_budget": "64MB", "default_chunk_size": 4096}
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(512, 64, 2, 64), 0, config)
    ids = torch.randint(0, 512, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    cursor = engine.mgr._cur
    seen: list[bool] = []
    hook = engine.module.transformer.h[1].register_forward_pre_hook(lambda *_: seen.append(cursor.evaluation_follows))
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)  # the traced inputs: budgeted moment by moment
        engine(input_ids=torch.cat([ids, ids]), labels=torch.cat([ids, ids]))  # twice the batch: the largest peak
    hook.remove()
    assert seen == [True, False]
    assert not cursor.evaluation_follows and cursor.on_schedule


def test_a_parameter_too_big_for_its_moment_does_not_suggest_smaller_chunks() -> None:
    # the demo's vocabulary and sequences: the tied embedding (8192 x 512, 8 MiB in bf16, a chunk of its
    # own) must sit beside the loss's ~30 MiB at 'lm_head' (fwd); 34 MiB leaves it ~3.5 MiB, though the
    # embedding is under half the device (the old rule of thumb then suggested smaller chunks)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate((8192, 512, 1), budget=34 * 1024 * 1024, steps=1, seq=128)
    msg = str(info.value)
    assert "'lm_head' (fwd)" in msg and "'transformer.wte.weight'" in msg, msg
    assert "smaller chunks cannot help" in msg and "lower 'default_chunk_size'" not in msg, msg
