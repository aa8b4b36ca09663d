"""Compiled blocks under chunkstar: step time of eager and compiled runs, side by side in one process.

Four runs of one GPT-2 train in alternating rounds, so all see the same machine
state: plain PyTorch eager, plain PyTorch with every block compiled
(``block.compile()``), chunkstar eager and chunkstar with the blocks compiled,
both chunkstar runs under one device budget that forces chunk moves. Prints the
median step time of each, the ratios, the graphs Dynamo captured and the
largest loss difference between compiled and eager (dropout off).

    python benchmarks/compiled_blocks.py [--backend inductor] [--rounds 3] [--steps 3]

The first steps (compilation, chunkstar's two measured warm-up iterations) are
not timed. On a CPU the inductor backend needs a C++ compiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar
from chunkstar.config import host_memory_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the four runs (default %(default)s)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run per round (default %(default)s)")
    ap.add_argument("--layers", type=int, default=6, help="GPT-2 blocks (default %(default)s)")
    ap.add_argument("--hidden", type=int, default=384, help="hidden size (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default %(default)s)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step (default %(default)s)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default %(default)s)")
    ap.add_argument("--room-fraction", type=float, default=0.5,
                    help="chunk room beyond the non-model peak, as a fraction of the parameter bytes (default %(default)s)")  # fmt: skip
    args = ap.parse_args()

    cfg = GPT2Config(
        vocab_size=args.vocab, n_embd=args.hidden, n_layer=args.layers, n_head=6, n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip

    def build(compiled: bool) -> GPT2LMHeadModel:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(cfg)
        if compiled:
            for block in model.transformer.h:
                block.compile(backend=args.backend)
        return model

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g) for _ in range(4)]
    adam = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    base: dict[str, Any] = {"optimizer": {"type": "AdamW", "params": adam}, "device": "cpu"}

    def plain(compiled: bool) -> Callable[[torch.Tensor], float]:
        model = build(compiled)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-8, weight_decay=0.0)

        def step(ids: torch.Tensor) -> float:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step

    # the non-model peak of this step, then a budget of it plus a fraction of the parameters
    probe, probe_opt = chunkstar.initialize_engine(lambda: build(False), 0, {**base, "device_memory_budget": host_memory_bytes()})
    for ids in batches[:2]:  # the warm-up's two iterations: the second sees what the first leaves alive
        probe.backward(probe(input_ids=ids, labels=ids).loss)
        probe_opt.step()
        probe_opt.zero_grad()
    stats = probe.stats()
    budget = stats["warmup_non_model_peak_bytes"] + int(args.room_fraction * 4 * stats["n_params"])
    del probe, probe_opt
    engines: dict[bool, chunkstar.ChunkEngine] = {}

    def chunked(compiled: bool) -> Callable[[torch.Tensor], float]:
        engine, opt = chunkstar.initialize_engine(lambda: build(compiled), 0, {**base, "device_memory_budget": budget})
        engines[compiled] = engine

        def step(ids: torch.Tensor) -> float:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step

    runs = {
        "PyTorch eager": plain(False),
        "PyTorch compiled": plain(True),
        "chunkstar eager": chunked(False),
        "chunkstar compiled": chunked(True),
    }
    losses: dict[str, list[float]] = {name: [] for name in runs}
    times: dict[str, list[float]] = {name: [] for name in runs}
    n = 0
    for name, step in runs.items():  # untimed: compilation and chunkstar's warm-up (two iterations, eager)
        print(f"warming up {name}", file=sys.stderr, flush=True)
        for _ in range(3):
            losses[name].append(step(batches[n % len(batches)]))
            n += 1
        n -= 3
    n += 3
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        for name, step in runs.items():
            for k in range(args.steps):
                ids = batches[(n + k) % len(batches)]
                t = time.perf_counter()
                losses[name].append(step(ids))
                times[name].append(time.perf_counter() - t)
        n += args.steps

    med = {name: statistics.median(ts) for name, ts in times.items()}
    c = engines[True].stats()
    print(f"model: GPT-2 {stats['n_params'] / 1e6:.1f}M params ({args.layers} blocks), batch {args.batch} x seq {args.seq}, "
          f"fp32, backend {args.backend}; chunkstar device budget {budget / 2**20:,.0f} MiB "
          f"({c['chunk_moves_to_host']} chunk evictions in the compiled run)")  # fmt: skip
    for name, m in med.items():
        print(f"  {name:<20} median {m:.3f} s/step over {len(times[name])} steps")
    print(f"compiled / eager, PyTorch    {med['PyTorch compiled'] / med['PyTorch eager']:.3f}x")
    print(f"compiled / eager, chunkstar  {med['chunkstar compiled'] / med['chunkstar eager']:.3f}x  (target <= 1.00x)")
    print(f"chunkstar / PyTorch, compiled {med['chunkstar compiled'] / med['PyTorch compiled']:.3f}x")
    print(f"compiled units {c['compiled_units']}, calls that ran compiled {c['compiled_calls']}")
    for a, b in (("chunkstar compiled", "chunkstar eager"), ("chunkstar compiled", "PyTorch compiled")):
        worst = max(abs(x - y) / abs(y) for x, y in zip(losses[a], losses[b]))
        print(f"largest relative loss difference, {a} vs {b}: {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
