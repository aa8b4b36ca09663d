"""Shared pieces of the Trainer tests: the tiny GPT-2, its data, the TrainingArguments
and the engine config both trainers get, and what the Trainer logged.

It imports torch, transformers and :mod:`tests.core._models` only (no pytest, no
chunkstar), so the torchrun worker imports it as well. The model and the token
stream are the core tests' (``build_gpt2``, ``gpt2_batch``: dropout off, a
learnable pattern), so one definition of each serves both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from tests.core._models import SMALL_CHUNK, build_gpt2, eviction_budget, gpt2_batch

N_LAYER = 2
STEPS = 6
SAVE_AT = 3
TRAIN_ROWS = 48
EVAL_ROWS = 8
EVAL_OFFSET = 1000  # eval rows are stream rows no training batch uses


def build_model() -> torch.nn.Module:
    """The core tests' tiny GPT-2 (tied wte / lm_head, no dropout), always the same weights."""
    return build_gpt2(n_layer=N_LAYER)


class TokenRows(Dataset):  # type: ignore[type-arg]
    """Rows of the core tests' token stream as a map-style dataset (labels = input ids)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.rows = [gpt2_batch(offset + i, batch=1) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self.rows[i].items()}


def train_rows() -> TokenRows:
    return TokenRows(TRAIN_ROWS)


def eval_rows() -> TokenRows:
    return TokenRows(EVAL_ROWS, offset=EVAL_OFFSET)


def training_args(output_dir: str, **overrides: Any) -> TrainingArguments:
    """Gradient accumulation 2, a linear schedule with warm-up, clipping that bites
    (the grad norms are about 2), weight decay, a log entry per step."""
    kw: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
        learning_rate=1e-3, weight_decay=0.01, max_grad_norm=1.0, warmup_steps=2, lr_scheduler_type="linear",
        logging_steps=1, save_strategy="no", seed=42, report_to=[], disable_tqdm=True, use_cpu=True,
        log_level="error",
    )  # fmt: skip
    kw.update(overrides)
    return TrainingArguments(**kw)


BUDGET_FRACTION = 0.7
"""Of the parameter bytes. The Trainer's warm-up measures about 0.45 of them as non-model
memory (activations, gradients before they fold), so about a quarter of the parameters fit
beside it: chunks are evicted and brought back every step."""


TWO_RANK_BUDGET_FRACTION = 1.1
"""With two ranks a module's chunk groups are all-gathered whole (and reduced) on the
device: the warm-up asks for about 0.95 of the parameter bytes. Still below the
parameters plus that non-model memory, so chunks are evicted."""


def chunkstar_config(dtype: torch.dtype = torch.float32, fraction: float = BUDGET_FRACTION) -> dict[str, Any]:
    """The device budget (``fraction`` of the parameter bytes) and small chunks."""
    return {"device_memory_budget": eviction_budget(build_model(), dtype, fraction), "default_chunk_size": SMALL_CHUNK}


def logged(trainer: Trainer) -> list[dict[str, float]]:
    """The per-step training log entries (step, loss, grad_norm, learning_rate)."""
    keys = ("step", "loss", "grad_norm", "learning_rate")
    return [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]
