"""Cost of recording with chunkstar_profiler, measured side by side in one process.

One chunkstar engine trains the benchmark model (the ~50M-parameter GPT-2 of
``chunkstar-bench step-time``, bf16, a device budget that forces chunk moves) and
alternates blocks of steps with and without a ``Profiler`` attached, so both
see the same machine state. Prints the median step time of each and their
ratio; the target is at most 1.05x.

    python benchmarks/profiler_overhead.py [--rounds 4] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar
from chunkstar.config import host_memory_bytes
import chunkstar_profiler


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="alternations of (plain block, profiled block)")
    ap.add_argument("--steps", type=int, default=3, help="steps per block")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--room-fraction", type=float, default=0.6,
                    help="chunk room beyond the non-model peak, as a fraction of the bf16 parameter bytes")  # fmt: skip
    args = ap.parse_args()

    cfg = GPT2Config(n_embd=512, n_layer=8, n_head=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)

    def model_func() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(cfg)

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
    base = {"bf16": {"enabled": True}, "gradient_clipping": 1.0, "device": "cpu"}

    def run_step(engine: chunkstar.ChunkEngine, optimizer: chunkstar.ChunkAdam) -> float:
        t = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)  # `out` (the logits) stays alive through backward
        engine.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t

    # measure the non-model peak of this very step once, then budget it plus a fraction of the parameters
    probe_engine, probe_opt = chunkstar.initialize_engine(model_func, 0, {**base, "device_memory_budget": host_memory_bytes()})
    run_step(probe_engine, probe_opt)
    stats = probe_engine.stats()
    budget = stats["warmup_non_model_peak_bytes"] + int(args.room_fraction * 2 * stats["n_params"])
    del probe_engine, probe_opt

    engine, optimizer = chunkstar.initialize_engine(model_func, 0, {**base, "device_memory_budget": budget})

    def step() -> float:
        return run_step(engine, optimizer)

    for _ in range(2):  # warm-up, traced
        step()
    plain: list[float] = []
    profiled: list[float] = []
    n_moves = 0
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            plain += [step() for _ in range(args.steps)]
            with chunkstar_profiler.Profiler(engine) as prof:
                profiled += [step() for _ in range(args.steps)]
            n_moves += len(prof.profile().moves)
            prof.save(Path(tmp) / f"round{r}.csprof")
    p, q = statistics.median(plain), statistics.median(profiled)
    print(f"model: GPT-2 {stats['n_params']:,} params, batch {args.batch} x seq {args.seq}, bf16, device budget "
          f"{budget / 2**20:,.0f} MiB ({args.room_fraction:.0%} of the bf16 params beside the activations)")  # fmt: skip
    print(f"without profiler  median {p:.3f} s/step over {len(plain)} steps")
    print(f"with profiler     median {q:.3f} s/step over {len(profiled)} steps ({n_moves} chunk moves recorded)")
    verdict = "PASS" if q / p <= 1.05 else "MISS"
    print(f"overhead          {q / p:.3f}x  (target <= 1.05x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
