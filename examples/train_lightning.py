"""Train a tiny Hugging Face GPT-2 with PyTorch Lightning and chunkstar.

``Trainer(strategy=ChunkstarStrategy(...))`` trains an ordinary LightningModule with
its parameters, gradients and Adam state in chunkstar's chunks, under a device budget
smaller than the model (on a machine without a GPU, chunkstar's CPU virtual device).
The module is what a Lightning user writes: the loss from ``training_step``, AdamW
with a warm-up schedule from ``configure_optimizers``, a validation step; the Trainer
sets the precision, accumulation, clipping and checkpoints. The data is the Hugging
Face example's character-level arithmetic (``"17+25=42;"``), built in code.

    python examples/train_lightning.py                          # 60 steps, under a minute on a CPU
    python examples/train_lightning.py --resume                 # interrupted? goes on from the last epoch's checkpoint
    python examples/train_lightning.py --devices 2 --budget 16MB  # two processes (gloo on a CPU, NCCL on GPUs)

At the end the last checkpoint (a folder of every rank's shard) is converted to one
Lightning checkpoint file, loaded with ``LightningModule.load_from_checkpoint`` and
validated by Lightning's own single-device strategy, without chunkstar.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from chunkstar.integrations.lightning import ChunkstarStats, ChunkstarStrategy, convert_checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_trainer import CHARS, Arithmetic  # noqa: E402  (the Hugging Face example's data)


class ArithmeticLM(L.LightningModule):
    """GPT-2 on arithmetic text: AdamW (no decay for biases and norms), linear warm-up."""

    def __init__(self, n_layer: int = 4, n_embd: int = 256, seq: int = 32, lr: float = 3e-3, warmup: int = 6) -> None:
        super().__init__()
        self.save_hyperparameters()
        cfg = GPT2Config(
            vocab_size=len(CHARS), n_positions=seq, n_embd=n_embd, n_layer=n_layer, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(cfg)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self(batch), sync_dist=True)

    def configure_optimizers(self) -> dict[str, object]:
        named = list(self.named_parameters())
        groups = [
            {"params": [p for n, p in named if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.hparams["lr"], betas=(0.9, 0.95))
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / self.hparams["warmup"]))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (Trainer(max_steps=...))")
    p.add_argument("--epoch-steps", type=int, default=20, help="optimizer steps in an epoch (a checkpoint after each)")
    p.add_argument("--batch", type=int, default=4, help="rows per process and micro-batch")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step (accumulate_grad_batches)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT-2 blocks")
    p.add_argument("--n-embd", type=int, default=256, help="GPT-2 hidden size")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed", "16-mixed"], help="Trainer(precision=...)")
    p.add_argument("--budget", default="10MB", help="chunkstar's device_memory_budget (the CPU virtual device's size, "
                   "or a cap on the GPU): below the model's fp32 parameter bytes plus its activations, so chunks move "
                   "every step; two processes gather each module's chunk groups whole: give them more (16MB)")  # fmt: skip
    p.add_argument("--activations", default="checkpoint", choices=["keep", "checkpoint", "offload", "auto"],
                   help="chunkstar's activations policy per block: checkpoint recomputes each block's activations in "
                   "the backward, keeping the non-model memory small beside the chunks")  # fmt: skip
    p.add_argument("--devices", type=int, default=1, help="processes (one per GPU, or CPU processes over gloo)")
    p.add_argument("--output-dir", default="runs/train_lightning", help="checkpoints")
    p.add_argument("--resume", action="store_true", help="go on from --output-dir/last.ckpt, the last epoch's checkpoint "
                   "(the same flags otherwise): weights, Adam state, schedule and Lightning's loops, as Lightning's own "
                   "checkpoints restore them")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(0, verbose=False)  # the same weights on every rank
    module = ArithmeticLM(n_layer=args.n_layer, n_embd=args.n_embd)
    # Lightning's sampler reshuffles the rows each epoch
    train = DataLoader(Arithmetic(args.epoch_steps * args.batch * args.grad_accum, 32), batch_size=args.batch, shuffle=True)
    held_out = DataLoader(Arithmetic(32, 32, offset=10**6), batch_size=args.batch)
    # a checkpoint folder at the end of each epoch, last.ckpt the newest (inside an epoch Lightning
    # cannot restart a plain DataLoader where it was)
    checkpoints = ModelCheckpoint(dirpath=args.output_dir, every_n_epochs=1, save_last=True, save_top_k=-1)
    trainer = L.Trainer(
        strategy=ChunkstarStrategy(device_memory_budget=args.budget, activations={"policy": args.activations}),
        accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=args.devices,
        precision=args.precision, max_steps=args.steps, accumulate_grad_batches=args.grad_accum, gradient_clip_val=1.0,
        callbacks=[checkpoints, ChunkstarStats()],
        logger=False, enable_model_summary=False, enable_progress_bar=False, log_every_n_steps=10,
    )  # fmt: skip
    last = os.path.join(args.output_dir, "last.ckpt")
    trainer.fit(module, train, held_out, ckpt_path=last if args.resume and os.path.isdir(last) else None)
    metrics = {k: float(v) for k, v in trainer.logged_metrics.items()}
    # the module is still in the engine: validate() runs it there (every rank)
    val_loss = trainer.validate(module, held_out, verbose=False)[0]["val_loss"]
    if not trainer.is_global_zero:
        return
    strategy = trainer.strategy
    assert isinstance(strategy, ChunkstarStrategy)
    stats = strategy.engine.stats()
    print()
    print(f"held-out loss {val_loss:.4f} after {trainer.global_step} steps (uniform guess: "
          f"{math.log(len(CHARS)):.4f}); last training loss {metrics['train_loss']:.4f}")  # fmt: skip
    print(f"chunkstar: {stats['n_params']:,} parameters in {stats['precision']} under a "
          f"{stats['device_budget_bytes'] / 2**20:.2f} MiB device budget ({stats['device']}, {stats['world_size']} "
          f"process(es)); {stats['chunk_moves_to_device']:,} chunk moves to the device; grad norm of the last step "
          f"{metrics['chunkstar/grad_norm']:.3f}")  # fmt: skip

    # the last checkpoint as one file, validated by Lightning alone
    single = convert_checkpoint(last, os.path.join(args.output_dir, "final.ckpt"))
    plain = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    again = plain.validate(ArithmeticLM.load_from_checkpoint(single), held_out, verbose=False)[0]["val_loss"]
    print(f"{single}: load_from_checkpoint + Lightning's own strategy: held-out loss {again:.4f}")
    print(f"checkpoints in {args.output_dir}: the same command with --resume goes on from last.ckpt")


if __name__ == "__main__":
    main()
