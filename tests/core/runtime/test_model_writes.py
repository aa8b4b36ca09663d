"""What a model writes into its own parameters, against plain PyTorch on the same seed and data.

Three rules of PyTorch the engine keeps (issue 30, items 1, 2 and 5):

* a write through ``.data`` inside a forward (``self.weight.data.clamp_(...)``,
  ``.copy_(normalize(...))``, ``self.weight.data = torch.renorm(...)``: the max-norm and
  non-negativity constraints of older code) reaches the fp32 master, whoever writes it: the
  module itself, a parent that owns parameters, or code outside every module that owns some
  (Note [data aliases] in chunkstar/hooks/param_guard.py);
* Gemma3n's AltUp clips a child's weight that way inside the model's own forward;
* a model that casts its own parameters in its forward (Switch Transformers' and NLLB-MoE's
  fp32 routers) trains under bf16 as under autocast (Note [a model casting its parameters]).

Each case trains under a budget that forces evictions (fp32 within 1e-5, bf16 as the other
bf16 tests compare: fp32 weights under autocast, 3e-2), and between steps ``p.data`` writes
reach the parameter or are refused naming it, never dropped.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import chunkstar
from chunkstar.errors import ChunkStateError

from tests.core._budget import measured_budget
from tests.core._models import ModelCase, assert_losses_close, engine_config, train_engine, train_reference

VOCAB = 40
WIDTH = 32
LIMIT = 0.05  # the constraint the models keep their gain weight within
LR = 1e-2


def _data(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + step)
    return {"ids": torch.randint(0, VOCAB, (4, 8), generator=g), "y": torch.randint(0, VOCAB, (4, 8), generator=g)}


def _loss(model: Callable[..., Any], batch: dict[str, torch.Tensor], _dtype: torch.dtype) -> torch.Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), batch["y"].reshape(-1))


class ClampedLinear(nn.Linear):
    """Clamps its own weight through .data at the start of its forward (old max-norm code)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.data.clamp_(-LIMIT, LIMIT)
        return super().forward(x)


class Base(nn.Module):
    def __init__(self, gain: type[nn.Linear] = nn.Linear) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.gain = gain(WIDTH, WIDTH)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.gain(self.emb(ids)))))


class OwnClamp(Base):
    """The module clamps its own weight (its parameters are in COMPUTE: the watched class)."""

    def __init__(self) -> None:
        super().__init__(ClampedLinear)


class ChildClampOutsideModules(Base):
    """A parent that owns no parameters clamps a child's weight (an op outside every module)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.gain.weight.data.clamp_(-LIMIT, LIMIT)
        return super().forward(ids)


class ParentClampAfterUse(Base):
    """A parent that owns a parameter uses the child and then clamps the child's weight: the
    write comes after the weight was used in this forward, as PyTorch allows."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(WIDTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.gain(self.emb(ids)) * self.scale
        self.gain.weight.data.copy_(F.normalize(self.gain.weight.data, dim=1) * LIMIT)
        return self.head(torch.tanh(self.body(h)))


class Renorm(Base):
    """``p.data = ...`` inside the forward (the setter, not an in-place op)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.gain.weight.data = torch.renorm(self.gain.weight.data, 2, 0, LIMIT * 4)
        self.body.weight.data.mul_(0.99).clamp_(min=-LIMIT * 4)  # a chain of writes on one alias
        return super().forward(ids)


WRITERS = {c.__name__: c for c in (OwnClamp, ChildClampOutsideModules, ParentClampAfterUse, Renorm)}


def _case(cls: type[nn.Module]) -> ModelCase:
    return ModelCase(cls.__name__, cls, _data, _loss)


def _budget(cls: type[nn.Module], dtype: str) -> int:
    def first(engine: Any, _opt: Any) -> None:
        engine.backward(_loss(engine, _data(0), torch.float32))

    return measured_budget(cls, lambda b: engine_config(dtype, budget=b, chunk_size=600, lr=LR), first, fraction=0.8,
                           itemsize=2 if dtype == "bf16" else 4)  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_writes_through_data_in_a_forward_reach_the_master(name: str, dtype: str) -> None:
    cls = WRITERS[name]
    case = _case(cls)
    keep: list[nn.Module] = []
    want = train_reference(case, 5, dtype=dtype, lr=LR, keep=keep)
    engine, optimizer = chunkstar.initialize_engine(cls, 0, engine_config(dtype, budget=_budget(cls, dtype), chunk_size=600, lr=LR))
    got = train_engine(engine, optimizer, case, 5, dtype=dtype)
    assert engine.stats()["chunk_moves_to_host"] > 0, "the budget should force evictions"
    assert_losses_close(got, want, 1e-5 if dtype == "fp32" else 3e-2, f"{name}/{dtype}")
    state, ref = engine.module.state_dict(), keep[0].state_dict()
    if dtype == "fp32":
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # sharper than any loss tolerance in bf16: the master kept the constraint of every forward
    # (a lost write leaves the initial weights, up to 0.18, drifting with Adam)
    bound = LIMIT * 4 if name == "Renorm" else LIMIT
    assert state["gain.weight"].abs().max() <= bound * 1.01 + 6 * LR, f"{name}/{dtype}: the constraint never reached the master"


def test_writes_through_data_between_steps_reach_the_parameter_or_are_refused_naming_it() -> None:
    """WGAN's weight clipping (``for p in D.parameters(): p.data.clamp_(-c, c)`` after the
    step) writes through; a write to a view of such a copy could never reach the parameter,
    so it is refused, naming it."""
    case = _case(Base)
    ref = Base()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, fused=True)
    engine, optimizer = chunkstar.initialize_engine(Base, 0, engine_config("fp32", budget=_budget(Base, "fp32"), chunk_size=600, lr=LR))
    want, got = [], []
    for step in range(5):
        for model, o, out in ((ref, opt, want), (engine, optimizer, got)):
            loss = _loss(model, _data(step), torch.float32)
            model.backward(loss) if model is engine else loss.backward()
            if model is ref:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            o.step()
            o.zero_grad()
            for p in (model.module if model is engine else model).parameters():
                p.data.clamp_(-LIMIT, LIMIT)
            out.append(loss.item())
    assert_losses_close(got, want, 1e-5, "clipping through .data between steps")
    assert engine.stats()["chunk_moves_to_host"] > 0
    w = engine.module.gain.weight
    with pytest.raises(ChunkStateError, match=r"'gain\.weight'.*gathered_parameters"):
        w.data[0].zero_()
    with pytest.raises(ChunkStateError, match=r"'gain\.weight'"):
        w.view(-1).mul_(2.0)


# ---------------------------------------------------------------------------- families


def _ids_batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, 128, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _gemma3n() -> nn.Module:
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    torch.manual_seed(0)
    return Gemma3nForCausalLM(Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, laurel_rank=4, altup_num_inputs=2,
        num_kv_shared_layers=0, activation_sparsity_pattern=[0.0, 0.0], max_position_embeddings=64,
    ))  # fmt: skip


def _switch() -> nn.Module:
    from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration

    torch.manual_seed(0)
    return SwitchTransformersForConditionalGeneration(SwitchTransformersConfig(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, num_experts=4,
        expert_capacity=8, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1, decoder_start_token_id=0,
        pad_token_id=0,
    ))  # fmt: skip


def _nllb_moe() -> nn.Module:
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    torch.manual_seed(0)
    return NllbMoeForConditionalGeneration(NllbMoeConfig(
        vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_experts=4, expert_capacity=8,
        encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=64, decoder_start_token_id=2,
        pad_token_id=1,
    ))  # fmt: skip


# (builder, precision, parameters the model casts itself)
FAMILIES = {
    "gemma3n_altup_clip": (_gemma3n, "fp32", 0),
    "gemma3n_altup_clip_bf16": (_gemma3n, "bf16", 0),
    "switch_transformers_fp32_router": (_switch, "bf16", 2),
    "nllb_moe_fp32_router": (_nllb_moe, "bf16", 4),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_families_that_write_or_cast_their_own_parameters_train_like_pytorch(name: str) -> None:
    pytest.importorskip("transformers")
    build, dtype, casts = FAMILIES[name]
    case = ModelCase(name, build, _ids_batch, lambda m, b, d: m(**b).loss)
    want = train_reference(case, 4, dtype=dtype)
    param_bytes = sum(p.numel() for p in build().parameters()) * (2 if dtype == "bf16" else 4)
    budget = int(0.6 * param_bytes)
    try:
        engine, optimizer = chunkstar.initialize_engine(build, 0, engine_config(dtype, budget=budget, chunk_size=2048))
        got = train_engine(engine, optimizer, case, 4, dtype=dtype)
    except chunkstar.DeviceMemoryError as e:  # activations first: the budget the error names
        assert e.minimum is not None and e.minimum > budget, str(e)
        engine, optimizer = chunkstar.initialize_engine(build, 0, engine_config(dtype, budget=e.minimum, chunk_size=2048))
        got = train_engine(engine, optimizer, case, 4, dtype=dtype)
    assert_losses_close(got, want, 1e-5 if dtype == "fp32" else 3e-2, name)
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0
    assert stats["modules_cast_by_model"] == casts
    # outside the forward every parameter is the engine's again, in the compute dtype
    assert all(p.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32) for p in engine.parameters())


def test_a_cast_outside_the_forward_is_still_refused() -> None:
    engine, _ = chunkstar.initialize_engine(Base, 0, engine_config("bf16", budget=1 << 30, chunk_size=600))
    with pytest.raises(ChunkStateError, match=r"'gain\.weight'.*model\.half\(\)"):
        engine.module.gain.float()
