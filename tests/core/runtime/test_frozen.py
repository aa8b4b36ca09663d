"""Frozen parameters (requires_grad=False) cost no optimizer state (Note [frozen chunks]).

A Llama under peft LoRA and a GPT-2 with a frozen (tied) embedding train under
eviction exactly like plain PyTorch, while the engine keeps master and Adam
chunks only for the trainable parameters; turning requires_grad on afterwards is
a clear error; checkpoints and state dicts carry the frozen values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.chunk.lists import ChunkList
from tests.core._models import (
    ModelCase,
    assert_losses_close,
    build_gpt2,
    engine_config,
    eviction_budget,
    gpt2_batch,
    hf_loss,
    train_engine,
    train_reference,
)

pytest.importorskip("peft")

STEPS = 4


def build_lora_llama(seed: int = 1234) -> nn.Module:
    """A small Llama (GQA) with LoRA adapters on q_proj and v_proj: about 2% trainable."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return get_peft_model(model, lora)


def build_frozen_embedding_gpt2() -> nn.Module:
    """GPT-2 whose tied wte / lm_head and position embedding are frozen."""
    model = build_gpt2()
    model.transformer.wte.weight.requires_grad_(False)
    model.transformer.wpe.weight.requires_grad_(False)
    return model


LORA = ModelCase("lora-llama", build_lora_llama, gpt2_batch, hf_loss)
FROZEN_EMBED = ModelCase("frozen-embed-gpt2", build_frozen_embedding_gpt2, gpt2_batch, hf_loss)


def _engine(case: ModelCase, dtype: str = "fp32", **extra: Any) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    budget = eviction_budget(case.build(), torch.bfloat16 if dtype == "bf16" else torch.float32)
    return chunkstar.initialize_engine(case.build, 0, engine_config(dtype, budget=budget, **extra))


def _trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("case", [LORA, FROZEN_EMBED], ids=lambda c: c.name)
def test_trains_like_pytorch_under_eviction(case: ModelCase) -> None:
    trained: list[nn.Module] = []
    want = train_reference(case, STEPS, keep=trained)
    engine, optimizer = _engine(case)
    got = train_engine(engine, optimizer, case, STEPS)
    assert_losses_close(got, want, 1e-5, case.name)
    assert engine.stats()["chunk_moves_to_host"] > 0  # under eviction

    # the same final weights, trainable and frozen
    mine = engine.module.state_dict()
    for name, value in trained[0].state_dict().items():
        torch.testing.assert_close(mine[name], value, rtol=1e-4, atol=1e-5, msg=name)  # Adam amplifies ulps of tiny grads


def test_lora_keeps_master_and_adam_state_for_the_adapters_only() -> None:
    engine, _ = _engine(LORA, "bf16")
    model = engine.module
    trainable = _trainable(model)
    total = sum(p.numel() for p in model.parameters())
    assert trainable / total < 0.05
    stats = engine.stats()
    layout = engine.mgr.layout
    # state: 12 bytes (master + 2 moments, fp32) per trainable chunk element, nothing for the rest
    assert stats["master_and_adam_bytes"] == 12 * layout.trainable_elements
    trainable_chunks = layout.n_chunks - len(layout.frozen)
    assert 12 * trainable <= stats["master_and_adam_bytes"] <= 12 * (trainable + 64 * trainable_chunks)
    assert stats["n_frozen_params"] == total - trainable
    # frozen chunks hold frozen parameters only, and have a param chunk and nothing else
    for s in layout.slots:
        assert layout.is_frozen(s.chunk_id) == (not engine.parameter(s.index).requires_grad), s.name
    for cid in layout.frozen:
        assert engine.mgr.chunks.lists_of(cid) == (ChunkList.PARAM,)
        with pytest.raises(chunkstar.ChunkStateError, match="frozen"):
            engine.mgr.chunks.chunk(ChunkList.MASTER, cid)
    # the model-data figure counts param chunks (2 B/elem in bf16) plus that state
    assert stats["model_data_bytes"] == 2 * layout.total_elements + stats["master_and_adam_bytes"]


def test_a_model_without_frozen_parameters_is_laid_out_as_before() -> None:
    from chunkstar.chunk.layout import build_layout

    model = build_gpt2()
    names = [n for n, _ in model.named_parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    plain = build_layout(names, shapes, 4096)
    flagged = build_layout(names, shapes, 4096, frozen=[False] * len(names))
    assert plain == flagged and not plain.frozen


def test_turning_requires_grad_on_later_is_a_clear_error() -> None:
    engine, optimizer = _engine(FROZEN_EMBED)
    train_engine(engine, optimizer, FROZEN_EMBED, 1)
    engine.module.transformer.wpe.weight.requires_grad_(True)
    with pytest.raises(chunkstar.ChunkStateError, match="transformer.wpe.weight.*no\\s+fp32 master"):
        engine(**gpt2_batch(1))
    engine.module.transformer.wpe.weight.requires_grad_(False)
    train_engine(engine, optimizer, FROZEN_EMBED, range(1, 2))  # and the engine goes on


def test_frozen_values_reach_state_dicts_and_checkpoints(tmp_path: Path) -> None:
    engine, optimizer = _engine(LORA, "bf16")
    train_engine(engine, optimizer, LORA, 2, dtype="bf16")
    sd = engine.state_dict()
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert sd[base].dtype == torch.float32
    # the frozen value is its bf16 param slot (it has no fp32 master)
    s = engine.mgr.slots[engine.index_of(engine.module.get_parameter(base))]
    torch.testing.assert_close(sd[base].reshape(-1), engine.mgr.chunks.value_view(s).float(), rtol=0, atol=0)

    engine.save_checkpoint(str(tmp_path / "ck"))
    merged = chunkstar.checkpoint.merge_checkpoint(tmp_path / "ck")
    assert set(merged) >= {k for k in sd if k in dict(engine.module.named_parameters())}
    for k, v in merged.items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0, msg=k)

    losses_on = train_engine(engine, optimizer, LORA, range(2, 4), dtype="bf16")
    fresh, fresh_opt = _engine(LORA, "bf16")
    fresh.load_checkpoint(str(tmp_path / "ck"))
    assert fresh.state_dict()[base].equal(sd[base])
    losses_resumed = train_engine(fresh, fresh_opt, LORA, range(2, 4), dtype="bf16")
    assert losses_resumed == losses_on  # bit for bit
