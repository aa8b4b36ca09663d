"""Shared pieces of the core acceptance tests: tiny models, batches, training loops.

Every numerical test trains the same model twice from the same seed on the same
batches, once with plain PyTorch (``torch.optim.AdamW(fused=True)`` +
``clip_grad_norm_``) and once with the chunkstar engine, and compares per-step
losses. This module holds the parts both runs share. It imports only torch and
transformers (no chunkstar, no pytest) so that subprocess workers can import it
by path as well.

Note: why the models are shaped as they are. The tests want a device budget
that forces chunk eviction (a fraction of the parameter bytes) and still holds
one module's working set plus the activations. Activations grow with tokens x
hidden, parameters with hidden^2, so the models are wide-ish (n_embd 128) and
the batches are short (2 x 8 tokens); dropout is 0 so runs are deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CASES",
    "EVICTION_BUDGET_FRACTION",
    "ModelCase",
    "assert_losses_close",
    "build_bert",
    "build_gpt2",
    "build_mlp",
    "engine_config",
    "eviction_budget",
    "n_unique_params",
    "train_engine",
    "train_reference",
]

SEED = 1234
VOCAB = 512
N_EMBD = 128
SEQ = 8
BATCH = 2
LR = 1e-3
WEIGHT_DECAY = 0.01
CLIP = 1.0
EVICTION_BUDGET_FRACTION = 0.6
"""Device budget as a fraction of the compute-dtype parameter bytes."""
SMALL_CHUNK = 4096
"""Elements per chunk: small, so the tiny models span many chunks."""

Batch = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------
# models (each builder seeds itself, so any caller gets identical weights)


def build_gpt2(n_layer: int = 4, seed: int = SEED) -> nn.Module:
    """GPT-2 LM head model with tied wte / lm_head, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=N_EMBD, n_layer=n_layer, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=True, activation_function="gelu_pytorch_tanh",
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def build_bert(n_layer: int = 4, seed: int = SEED) -> nn.Module:
    """BERT masked-LM (decoder tied to the word embeddings), no dropout."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=VOCAB, hidden_size=N_EMBD, num_hidden_layers=n_layer, num_attention_heads=4,
        intermediate_size=4 * N_EMBD, max_position_embeddings=32, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    torch.manual_seed(seed)
    return BertForMaskedLM(cfg)


MLP_IN, MLP_CLASSES = 64, 10


def build_mlp(seed: int = SEED, width: int = 128, depth: int = 16) -> nn.Module:
    """A plain ``nn.Sequential`` classifier; the test computes the loss from its output."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(MLP_IN, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    layers.append(nn.Linear(width, MLP_CLASSES))
    return nn.Sequential(*layers)


def n_unique_params(model: nn.Module) -> int:
    """Parameter count with tied parameters counted once (``parameters()`` dedups)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# batches (a deterministic function of the step index, never of global RNG)


def _pattern_ids(g: torch.Generator, batch: int, seq: int, low: int) -> torch.Tensor:
    """Rows of ``low + (start + t * stride) % 64``: a learnable stream over 64 tokens."""
    start = torch.randint(0, 64, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return low + (start + torch.arange(seq) * stride) % 64


def gpt2_batch(step: int, batch: int = BATCH, seq: int = SEQ) -> Batch:
    g = torch.Generator().manual_seed(10_000 + step)
    ids = _pattern_ids(g, batch, seq, low=0)
    return {"input_ids": ids, "labels": ids.clone()}


def bert_batch(step: int, batch: int = BATCH, seq: int = SEQ) -> Batch:
    g = torch.Generator().manual_seed(20_000 + step)
    ids = _pattern_ids(g, batch, seq, low=5)
    masked = torch.rand(batch, seq, generator=g) < 0.3
    masked[:, 0] = True  # at least one masked position per row
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    inputs = torch.where(masked, torch.full_like(ids, 4), ids)  # 4 plays [MASK]
    return {
        "input_ids": inputs,
        "attention_mask": torch.ones_like(ids),
        "token_type_ids": torch.zeros_like(ids),
        "labels": labels,
    }


_TEACHER = torch.Generator().manual_seed(99)
_TEACHER_W = torch.randn(MLP_IN, MLP_CLASSES, generator=_TEACHER)


def mlp_batch(step: int, batch: int = 4) -> Batch:
    g = torch.Generator().manual_seed(30_000 + step)
    x = torch.randn(batch, MLP_IN, generator=g)
    return {"x": x, "y": (x @ _TEACHER_W).argmax(dim=1)}


# ---------------------------------------------------------------------------
# how each model turns a batch into a loss


def hf_loss(model: Callable[..., Any], batch: Batch, input_dtype: torch.dtype) -> torch.Tensor:
    del input_dtype  # integer inputs only
    return model(**batch).loss


def mlp_loss(model: Callable[..., Any], batch: Batch, input_dtype: torch.dtype) -> torch.Tensor:
    # The engine's param chunks are in the compute dtype, so its input is cast to
    # it; the reference passes fp32 and lets autocast cast.
    out = model(batch["x"].to(input_dtype))
    return F.cross_entropy(out.float(), batch["y"])


@dataclass(frozen=True)
class ModelCase:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[Callable[..., Any], Batch, torch.dtype], torch.Tensor]


CASES: dict[str, ModelCase] = {
    "gpt2": ModelCase("gpt2", build_gpt2, gpt2_batch, hf_loss),
    "bert": ModelCase("bert", build_bert, bert_batch, hf_loss),
    "mlp": ModelCase("mlp", build_mlp, mlp_batch, mlp_loss),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------
# configs


def eviction_budget(model: nn.Module, dtype: torch.dtype, fraction: float = EVICTION_BUDGET_FRACTION) -> int:
    """A device budget of ``fraction`` x the model's parameter bytes in ``dtype``."""
    return int(fraction * n_unique_params(model) * dtype.itemsize)


def engine_config(
    dtype: str = "fp32",
    *,
    budget: int | str,
    chunk_size: int | str = SMALL_CHUNK,
    lr: float = LR,
    weight_decay: float = WEIGHT_DECAY,
    clip: float = CLIP,
    accum: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay}},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": accum,
        "default_chunk_size": chunk_size,
        "device": "cpu",
        "device_memory_budget": budget,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    cfg.update(extra)
    return cfg


# ---------------------------------------------------------------------------
# training loops; both return one loss per micro-batch


LrSchedule = Callable[[int], float]  # optimizer step index -> lr


def train_reference(
    case: ModelCase,
    steps: int,
    *,
    dtype: str = "fp32",
    accum: int = 1,
    lr: float = LR,
    weight_decay: float = WEIGHT_DECAY,
    clip: float = CLIP,
    lr_schedule: LrSchedule | None = None,
    keep: list[nn.Module] | None = None,
) -> list[float]:
    """Plain PyTorch: fp32 weights, bf16 via autocast, fused AdamW, global-norm clipping.
    ``keep``, if given, receives the trained model."""
    model = case.build()
    if keep is not None:
        keep.append(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay, fused=True)
    losses: list[float] = []
    for step in range(steps):
        if lr_schedule is not None:
            for group in opt.param_groups:
                group["lr"] = lr_schedule(step)
        for micro in range(accum):
            batch = case.batch(step * accum + micro)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
                loss = case.loss(model, batch, torch.float32)
            (loss / accum).backward()
            losses.append(loss.item())
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses


def train_engine(
    engine: Any,
    optimizer: Any,
    case: ModelCase,
    steps: range | int,
    *,
    dtype: str = "fp32",
    accum: int = 1,
    lr_schedule: LrSchedule | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """The same loop through the chunkstar engine (steps may start past 0 when resuming)."""
    losses: list[float] = []
    for step in range(steps) if isinstance(steps, int) else steps:
        if lr_schedule is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_schedule(step)
        for micro in range(accum):
            batch = case.batch(step * accum + micro)
            loss = case.loss(engine, batch, DTYPES[dtype])
            engine.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step)
    return losses


def assert_losses_close(got: list[float], want: list[float], rtol: float, what: str = "") -> None:
    """Per-step relative comparison with a table of every step on failure."""
    assert len(got) == len(want), f"{what}: {len(got)} losses vs {len(want)} in the reference"
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not (math.isfinite(g) and abs(g - w) <= rtol * abs(w))]
    if bad:
        rows = "\n".join(
            f"  step {i}: engine {g:.9g}  reference {w:.9g}  rel {abs(g - w) / abs(w):.3g}{'  <--' if i in bad else ''}"
            for i, (g, w) in enumerate(zip(got, want))
        )
        raise AssertionError(f"{what}: losses differ beyond rtol={rtol} at steps {bad}\n{rows}")
