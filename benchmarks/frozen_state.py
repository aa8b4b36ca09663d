"""Optimizer state kept for a LoRA model: chunkstar's master/Adam bytes against what the
trainable parameters need (12 bytes each: fp32 master + two fp32 moments).

    python benchmarks/frozen_state.py            # a 56M Llama (GQA), LoRA r=8 on q/v: 0.2% trainable

Frozen parameters (requires_grad=False) are laid out in chunks of their own with no master
and no Adam state (Note [frozen chunks] in chunkstar/chunk/layout.py). Needs peft.
"""

from __future__ import annotations

import argparse

import torch

import chunkstar


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (default %(default)s)")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (default %(default)s)")
    args = ap.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    def build() -> torch.nn.Module:
        cfg = LlamaConfig(
            vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        )  # fmt: skip
        torch.manual_seed(0)
        lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"])
        return get_peft_model(LlamaForCausalLM(cfg), lora)

    config = {"device": "cpu", "device_memory_budget": "2GB", "bf16": {"enabled": True}, "optimizer": {"type": "AdamW"}}
    engine, _ = chunkstar.initialize_engine(build, 0, config)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.module.parameters())
    kept = engine.stats()["master_and_adam_bytes"]
    print(f"model: {total / 1e6:.1f}M parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%)")
    print(f"optimizer state needed (12 B per trainable parameter): {12 * trainable / 1e6:.2f} MB")
    print(f"optimizer state kept by chunkstar: {kept / 1e6:.2f} MB ({kept / (12 * trainable):.2f}x; padding of the trainable chunks)")


if __name__ == "__main__":
    main()
