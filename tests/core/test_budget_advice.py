"""What a too-small device budget error tells the user, checked by doing what it says.

- the warm-up's error names the budget a run *with evaluation forwards* needs: an
  evaluation forward after the warm-up (``torch.no_grad``) plans every moment with
  the largest non-model peak of the trace, so it can need more than the training
  moments did. With the training minimum the training steps run and the evaluation
  fails asking for exactly that figure; with that figure both run;
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


def test_the_warm_up_error_names_the_budget_an_evaluation_needs() -> None:
    # the largest non-model peak comes in backward; the tied embedding's chunk is needed in forward
    shape = (2048, 256, 4)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate(shape, budget=2 * 1024 * 1024)
    err = info.value
    assert err.minimum is not None and err.evaluation_minimum is not None, str(err)
    assert err.evaluation_minimum > err.minimum
    assert str(err.evaluation_minimum) in str(err) and "torch.no_grad" in str(err), str(err)

    # the training minimum: the steps run, the evaluation after them does not, and asks for the same figure
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate(shape, budget=err.minimum)
    assert "transformer.wte" in str(info.value), str(info.value)
    assert info.value.minimum == err.evaluation_minimum, (info.value.minimum, err.evaluation_minimum)

    _train_then_evaluate(shape, budget=err.evaluation_minimum)


def test_a_parameter_too_big_for_its_moment_does_not_suggest_smaller_chunks() -> None:
    # the demo's vocabulary and sequences: the tied embedding (8192 x 512, 8 MiB in bf16, a chunk of its
    # own) must sit beside the loss's ~30 MiB at 'lm_head' (fwd); 34 MiB leaves it ~3.5 MiB, though the
    # embedding is under half the device (the old rule of thumb then suggested smaller chunks)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate((8192, 512, 1), budget=34 * 1024 * 1024, steps=1, seq=128)
    msg = str(info.value)
    assert "'lm_head' (fwd)" in msg and "'transformer.wte.weight'" in msg, msg
    assert "smaller chunks cannot help" in msg and "lower 'default_chunk_size'" not in msg, msg
