"""Shared pieces of the Lightning tests: a LightningModule around the core tests' tiny
models (GPT-2, Llama, a small CNN), its data, the Trainer both strategies get, and the
engine config.

It imports torch, lightning, transformers and :mod:`tests.core._models` only (no
pytest), so the two-process worker imports it too.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.core._models import SEED, SMALL_CHUNK, VOCAB, build_gpt2, gpt2_batch

KINDS = ("gpt2", "llama", "cnn")
ROWS = 14  # with batch 2: 7 batches an epoch, so accumulate_grad_batches=2 ends each epoch on a window of 1
EVAL_ROWS = 4
BATCH = 2


def build_llama() -> nn.Module:
    """A two-layer Llama (grouped-query attention, RoPE, RMSNorm, SwiGLU), untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(SEED)
    return LlamaForCausalLM(cfg)


def build_cnn() -> nn.Module:
    """Two conv blocks with batch norm and a linear classifier over 10 classes. The convs have
    no bias, as usual before batch norm: the loss does not depend on one, so its gradient is
    rounding noise that Adam scales up to full steps, a different one in any two summation
    orders, and the running means (and validation) would follow that noise."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
        nn.Flatten(), nn.Linear(128, 10),
    )  # fmt: skip


def build(kind: str) -> nn.Module:
    return {"gpt2": lambda: build_gpt2(n_layer=2), "llama": build_llama, "cnn": build_cnn}[kind]()


class Rows(Dataset):  # type: ignore[type-arg]
    """Rows of a deterministic stream: token rows (labels = ids) or 3x8x8 images with labels."""

    def __init__(self, kind: str, n: int, offset: int = 0) -> None:
        self.rows: list[dict[str, torch.Tensor]] = []
        for i in range(offset, offset + n):
            if kind == "cnn":
                g = torch.Generator().manual_seed(20_000 + i)
                self.rows.append({"x": torch.randn(3, 8, 8, generator=g), "y": torch.randint(0, 10, (), generator=g)})
            else:
                self.rows.append({k: v[0] for k, v in gpt2_batch(i, batch=1).items()})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def loader(kind: str, n: int = ROWS, offset: int = 0, batch: int = BATCH) -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(Rows(kind, n, offset), batch_size=batch, shuffle=False)


class Case(L.LightningModule):
    """A LightningModule as users write them: the loss from ``training_step``, AdamW with
    decay / no-decay groups and a warm-up schedule from ``configure_optimizers``,
    validation and predict steps. It records each micro-batch's loss, each step's lr and
    each validation loss."""

    def __init__(self, kind: str, *, schedule: bool = True, lr: float = 1e-3, freeze_first: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build(kind)
        if freeze_first:
            next(iter(self.net.parameters())).requires_grad_(False)
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.lrs: list[float] = []

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.hparams["kind"] == "cnn":
            return F.cross_entropy(self.net(batch["x"]), batch["y"])
        return self.net(**batch).loss  # type: ignore[no-any-return]

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._loss(batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self(batch)
        self.val_losses.append(float(loss))
        self.log("val_loss", loss)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.hparams["kind"] == "cnn":
            return self.net(batch["x"]).float()
        return self.net(input_ids=batch["input_ids"]).logits.float()

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))

    def configure_optimizers(self) -> Any:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if p.ndim >= 2]
        no_decay = [p for n, p in named if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams["lr"], betas=(0.9, 0.95), eps=1e-8,
        )  # fmt: skip
        if not self.hparams["schedule"]:
            return opt
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


BUDGETS = {"gpt2": 1_310_000, "llama": 540_000, "cnn": 76_000}
"""Device budgets (bytes) about 15% above the least each model's warm-up needs (its
non-model memory beside the largest module's chunks) and below its parameters plus that
non-model memory, so chunks are evicted and brought back every step."""


def engine_config(kind: str, scale: float = 1.0) -> dict[str, Any]:
    """The device budget (times ``scale``: two ranks gather whole chunk groups) and small chunks."""
    return {"device_memory_budget": int(BUDGETS[kind] * scale), "default_chunk_size": 1024 if kind == "cnn" else SMALL_CHUNK}


def trainer(strategy: Any, root: str | os.PathLike[str], **kw: Any) -> L.Trainer:
    """A quiet CPU Trainer: no logger, progress bar or summary; checkpoints only where asked.
    The loaders' own order (no sampler Lightning adds): ChunkstarStrategy, a DDPStrategy,
    would otherwise shuffle the training rows as DDP does, unlike the single-device strategy."""
    args: dict[str, Any] = dict(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(root), deterministic=True,
        use_distributed_sampler=False,
    )  # fmt: skip
    args.update(kw)
    return L.Trainer(**args)
