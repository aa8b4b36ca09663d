"""Train a tiny Hugging Face GPT-2 with the Hugging Face ``Trainer`` and chunkstar.

``ChunkstarTrainer`` is ``transformers.Trainer`` with the model's parameters,
gradients and Adam state in chunkstar's chunks, under a device budget smaller
than the model (on a machine without a GPU, chunkstar's CPU virtual device). The
usual TrainingArguments drive it: learning rate, schedule, clipping, gradient
accumulation, bf16, logging, evaluation, checkpoints. The data is built in code
(no download): character-level arithmetic, ``"17+25=42;"`` sentences, so the
loss visibly falls as the model learns the format and some sums.

    python examples/train_trainer.py                                   # 60 steps, well under a minute on a CPU
    python examples/train_trainer.py --save-steps 20 --output-dir runs/trainer          # interrupted after a checkpoint?
    python examples/train_trainer.py --save-steps 20 --output-dir runs/trainer --resume # the same command goes on exactly
    python examples/train_trainer.py --lora                            # LoRA adapters on a frozen base (peft)
    torchrun --standalone --nproc_per_node 2 examples/train_trainer.py --grad-accum 1 --budget 16MB

At the end the saved model is loaded back with ``GPT2LMHeadModel.from_pretrained``
(or ``PeftModel.from_pretrained`` with ``--lora``) and evaluated by the plain
``transformers.Trainer``, without chunkstar: its held-out loss is the one above.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from chunkstar.integrations.transformers import ChunkstarTrainer

CHARS = "0123456789+=; "
"""The vocabulary: one token per character."""
SEED = 0


class Arithmetic(Dataset):  # type: ignore[type-arg]
    """``n`` rows of ``seq`` characters of ``"a+b=c;"`` sentences (a, b < 100), row ``i``
    drawn from its own generator (seed ``offset + i``): the same rows on every run and rank."""

    def __init__(self, n: int, seq: int, offset: int = 0) -> None:
        self.rows = []
        for i in range(n):
            g = torch.Generator().manual_seed(offset + i)
            text = ""
            while len(text) < seq:
                a, b = (int(x) for x in torch.randint(0, 100, (2,), generator=g))
                text += f"{a}+{b}={a + b};"
            self.rows.append(torch.tensor([CHARS.index(c) for c in text[:seq]]))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    cfg = GPT2Config(
        vocab_size=len(CHARS), n_positions=args.seq, n_embd=args.n_embd, n_layer=args.n_layer, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(SEED)  # the same weights on every rank (chunkstar checks)
    model = GPT2LMHeadModel(cfg)
    if args.lora:
        import peft

        lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                               fan_in_fan_out=True)  # fmt: skip
        model = peft.get_peft_model(model, lora)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (TrainingArguments.max_steps)")
    p.add_argument("--batch", type=int, default=4, help="rows per device and micro-batch (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=32, help="characters per row")
    p.add_argument("--n-layer", type=int, default=4, help="GPT-2 blocks")
    p.add_argument("--n-embd", type=int, default=256, help="GPT-2 hidden size")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up, then linear decay)")
    p.add_argument("--warmup", type=int, default=6, help="warm-up steps")
    p.add_argument("--budget", default="10MB", help="chunkstar's device_memory_budget (the CPU virtual device's size, "
                   "or a cap on the GPU); the default is below the model's fp32 parameter bytes plus its activations, "
                   "so chunks move every step. Several processes gather each module's chunk groups whole: give them "
                   "more (16MB for two). Too small a budget fails with the smallest one that fits")  # fmt: skip
    p.add_argument("--chunk-size", default="auto", help="chunkstar's default_chunk_size: elements per chunk, or auto")
    p.add_argument("--bf16", action="store_true", help="bf16 param chunks (TrainingArguments.bf16)")
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false",
                   help="keep every block's activations (TrainingArguments.activation_checkpointing is on by default "
                   "here: it keeps the non-model memory small beside the chunks)")  # fmt: skip
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) on a frozen base: no optimizer state for it")
    p.add_argument("--output-dir", default="runs/train_trainer", help="checkpoints and the final model")
    p.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps (0: only the final model)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir (the "
                   "same flags otherwise: the schedule is the run's)")  # fmt: skip
    p.add_argument("--eval-steps", type=int, default=30, help="evaluate every N steps")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    train, held_out = Arithmetic(512, args.seq), Arithmetic(32, args.seq, offset=10**6)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=args.batch, gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr,
        warmup_steps=args.warmup, lr_scheduler_type="linear", weight_decay=0.01, max_grad_norm=1.0, bf16=args.bf16,
        activation_checkpointing=args.activation_checkpointing,
        logging_steps=10, eval_strategy="steps", eval_steps=args.eval_steps,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[], disable_tqdm=True, seed=42, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = ChunkstarTrainer(
        model=build_model(args), args=training_args, train_dataset=train, eval_dataset=held_out,
        chunkstar_config={
            "device_memory_budget": args.budget,
            "default_chunk_size": args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size),
        },
    )  # fmt: skip
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    after = trainer.evaluate()["eval_loss"]
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)  # every rank: the full state dict is gathered from all of them
    trainer.accelerator.wait_for_everyone()  # the main process wrote it

    # the saved model without chunkstar: loaded as any Hugging Face model, evaluated by the plain Trainer
    if args.lora:
        import peft

        base = build_model(argparse.Namespace(**{**vars(args), "lora": False}))
        reloaded = peft.PeftModel.from_pretrained(base, final)
    else:
        reloaded = GPT2LMHeadModel.from_pretrained(final)
    plain_args = TrainingArguments(output_dir=os.path.join(args.output_dir, "plain_eval"), per_device_eval_batch_size=args.batch,
                                   report_to=[], disable_tqdm=True, use_cpu=not torch.cuda.is_available())  # fmt: skip
    again = Trainer(model=reloaded, args=plain_args, eval_dataset=held_out).evaluate()["eval_loss"]
    if not trainer.is_world_process_zero():
        return
    stats = trainer.engine.stats()
    param_bytes = stats["n_params"] * torch.finfo(torch.bfloat16 if args.bf16 else torch.float32).bits // 8
    print()
    print(f"held-out loss: {before:.4f} before, {after:.4f} after {trainer.state.global_step} steps "
          f"(uniform guess: {math.log(len(CHARS)):.4f})")  # fmt: skip
    print(f"chunkstar: {stats['n_params']:,} parameters ({param_bytes / 2**20:.2f} MiB in {stats['precision']}) "
          f"under a {stats['device_budget_bytes'] / 2**20:.2f} MiB device budget ({stats['device']}, "
          f"{stats['world_size']} process(es)); {stats['chunk_moves_to_device']:,} chunk moves to the device, "
          f"{stats['moves_by_reason'].get('eviction', 0):,} evictions; fp32 master and Adam state on this rank "
          f"{stats['master_and_adam_bytes'] / 2**20:.2f} MiB")  # fmt: skip
    print(f"saved to {final}; from_pretrained + the plain Trainer: held-out loss {again:.4f}")
    if args.save_steps:
        print(f"checkpoints in {args.output_dir} (each with its chunkstar/ shard): after an interruption, the same "
              "command with --resume goes on from the last one")  # fmt: skip


if __name__ == "__main__":
    main()
