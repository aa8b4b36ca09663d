"""The main job: train a Hugging Face GPT-2 with chunkstar under a device budget
smaller than the model's parameter bytes.

The model is built from a config (no download). The data is a synthetic but
learnable token stream (a fixed random Markov chain), so the loss visibly
falls. On a machine without a GPU the device is chunkstar's CPU virtual device:
the budget is enforced exactly as it would be on a GPU, and every chunk move is
a real copy.

    python examples/train_gpt2.py --steps 50
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar

try:  # the profiler is an extra; the demo trains without it
    import chunkstar_profiler
except ImportError:  # pragma: no cover
    chunkstar_profiler = None


def markov_batches(vocab: int, batch: int, seq: int, seed: int = 0, states: int = 256):  # type: ignore[no-untyped-def]
    """Endless batches from a random Markov chain over ``states`` of the vocabulary's
    tokens, each with 2 equally likely successors: the best possible loss is ln 2."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randperm(vocab, generator=g)[:states]
    successors = torch.randint(0, states, (states, 2), generator=g)
    while True:
        state = torch.randint(0, states, (batch,), generator=g)
        rows = [state]
        for _ in range(seq - 1):
            state = successors[state, torch.randint(0, 2, (batch,), generator=g)]
            rows.append(state)
        yield tokens[torch.stack(rows, dim=1)]


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--budget-fraction", type=float, default=0.8,
                    help="device budget as a fraction of the model's bf16 parameter bytes")  # fmt: skip
    ap.add_argument("--chunk-size", default="auto", help='elements per chunk, or "auto"')
    ap.add_argument("--device", default="cpu", help="cpu (virtual device) or cuda[:N]")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--profile", default="runs/demo.csprof",
                    help="write a chunkstar profile of the run here ('' to skip)")  # fmt: skip
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    cfg = GPT2Config(
        vocab_size=args.vocab, n_positions=max(args.seq, 128), n_embd=args.n_embd, n_layer=args.n_layer,
        n_head=max(1, args.n_embd // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip

    def model_func() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        # recompute activations in backward so they do not crowd the chunks out of the device
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model

    n_params = sum(p.numel() for p in model_func().parameters())
    param_bytes_bf16 = 2 * n_params
    budget = int(args.budget_fraction * param_bytes_bf16)
    chunk_size = args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size)
    engine, optimizer = chunkstar.initialize_engine(
        model_func=model_func,
        local_rank=0,
        config={
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "bf16": {"enabled": True},
            "gradient_clipping": 1.0,
            "device": args.device,
            "device_memory_budget": budget,
            "default_chunk_size": chunk_size,
        },
        param_groups_fn=chunkstar.no_decay_param_groups,
    )
    print(
        f"GPT-2 {n_params / 1e6:.1f}M params ({cfg.n_layer} layers, hidden {cfg.n_embd}, vocab {cfg.vocab_size}); "
        f"bf16 params {mib(param_bytes_bf16)}, device budget {mib(budget)} on {engine.device} "
        f"({args.budget_fraction:.0%} of the bf16 parameter bytes)"
    )
    # linear warm-up over the first 10 steps, through optimizer.param_groups like any torch optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    data = markov_batches(cfg.vocab_size, args.batch, args.seq)
    t0 = time.perf_counter()
    first_loss = last_loss = float("nan")
    profiler = None
    if args.profile and chunkstar_profiler is not None:
        profiler = chunkstar_profiler.Profiler(engine, model_name=f"GPT-2 {n_params / 1e6:.1f}M (demo)")
        profiler.start()
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for step in bar:
        ids = next(data).to(engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        last_loss = out.loss.item()
        if step == 0:
            first_loss = last_loss
        s = engine.stats()
        bar.set_postfix(loss=f"{last_loss:.3f}", moves=s["chunk_moves_to_device"] + s["chunk_moves_to_host"])
    elapsed = time.perf_counter() - t0
    if profiler is not None:
        profiler.stop()
        saved = profiler.save(args.profile)

    s = engine.stats()
    print("\nsummary")
    print(f"  loss                 {first_loss:.3f} -> {last_loss:.3f} over {args.steps} steps ({elapsed / args.steps:.2f} s/step)")
    print(f"  device budget        {mib(s['device_budget_bytes'])}")
    print(f"  device chunk peak    {mib(s['device_chunk_bytes_peak'])}  (model data never fits: {mib(s['model_data_bytes'])})")
    print(f"  non-model peak       {mib(s['warmup_non_model_peak_bytes'])}  (measured during warm-up)")
    print(f"  model data           {s['model_data_bytes'] / s['n_params']:.2f} bytes/param in {s['n_chunks']} chunks of {s['chunk_size']:,} elements")
    print(f"  chunk moves          {s['chunk_moves_to_device']} to device ({mib(s['bytes_to_device'])}), "
          f"{s['chunk_moves_to_host']} to host ({mib(s['bytes_to_host'])})")  # fmt: skip
    print(f"  moves by reason      {s['moves_by_reason']}")
    print(f"  Adam on the device   {s['device_adam_chunks']} of {s['n_chunks']} chunks")
    if profiler is not None:
        print(f"\nprofile written to {saved}; look at it with (in the environment ./dev set up, e.g. `. .venv/bin/activate`)")
        print(f"  chunkstar-profile summary {saved}")
        print(f"  chunkstar-profile export-chrome {saved} {saved}.trace.json   # then open it in ui.perfetto.dev")
        print(f"  streamlit run dashboards/app.py -- --profile {saved}")


if __name__ == "__main__":
    main()
