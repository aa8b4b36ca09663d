"""The dry run at the paper's scale: its cost as models grow, and a predicted profile.

What it does
    Dry-runs PatrickStar's GPT models (vocabulary 50257, sequence 1024, activation
    checkpointing, bf16) on the paper's 8 x A100 80 GB node (``a100x8_1tb``), batch 8
    per GPU, for each size given (default: 1B, 12B and 68B), with the ranks given
    (default: rank 0 and the last; ``--all-ranks`` for all 8), and prints per size:
    whether it fits, the smallest per-GPU budget, the chunks and moments, the dry
    run's own wall time per rank and per moment (bookkeeping growth: at most linear in
    moments is the target), the process's peak RSS, and the predicted s/step with the
    resource that binds it. ``--profile DIR`` writes each size's predicted step of its
    first simulated rank in the profiler's format (``chunkstar-profile view FILE``).

Run: ``python benchmarks/dry_run_scale.py [--sizes 1B,12B,68B] [--all-ranks] [--profile DIR]``
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

import chunkstar

_SIZES = {  # hidden, layers (docs: paper_models.csv of the bench package)
    "1B": (2048, 20),
    "12B": (4096, 60),
    "68B": (9216, 66),
}


def _gpt(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=hidden, n_layer=layers, n_head=16, n_positions=1024))
    m.gradient_checkpointing_enable()
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1B,12B,68B", help=f"comma-separated, of {', '.join(_SIZES)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--all-ranks", action="store_true", help="simulate all 8 ranks (default: the first and the last)")
    ap.add_argument("--profile", default=None, help="write each size's predicted profile into this directory")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in _SIZES]
    if unknown:
        ap.error(f"unknown sizes {unknown}; known: {', '.join(_SIZES)}")
    ids = torch.zeros(args.batch, 1024, dtype=torch.long)
    world = 8
    ranks = None if args.all_ranks else [0, world - 1]
    rows = []
    for name in sizes:
        hidden, layers = _SIZES[name]
        t0 = time.perf_counter()
        report = chunkstar.dry_run(
            lambda: _gpt(hidden, layers), {"bf16": {"enabled": True}}, {"input_ids": ids, "labels": ids},
            world_size=world, hardware="a100x8_1tb", ranks=ranks, progress=lambda s: print(f"  {name}: {s}", file=sys.stderr),
        )  # fmt: skip
        wall = time.perf_counter() - t0
        first = report.ranks[0]
        s = first.stats
        moments = int(s.get("moments_per_micro_step") or 0)
        per_rank = wall / len(report.ranks)
        pred = report.prediction
        rows.append((
            name, s.get("n_params", 0) / 1e9, report.fits, report.minimum_budget / (1 << 30), s.get("n_chunks", 0), moments,
            per_rank, 1e3 * first.seconds / max(1, moments * 3), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            pred.seconds if pred else float("nan"), pred.binding if pred else "-",
        ))  # fmt: skip
        if args.profile and report.fits:
            from chunkstar_profiler.predicted import write_predicted_profile

            os.makedirs(args.profile, exist_ok=True)
            path = write_predicted_profile(report, os.path.join(args.profile, f"gpt_{name}_a100x8_rank{first.rank}.csprof"), first.rank)
            print(f"  {name}: predicted profile {path}", file=sys.stderr)
    print("| model | params (B) | fits | min budget (GiB) | chunks | moments/step | dry run s/rank | ms/moment | peak RSS (MiB) | predicted s/step | binds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.2f} | {'yes' if r[2] else 'no'} | {r[3]:.1f} | {r[4]} | {r[5]} | {r[6]:.1f} | {r[7]:.2f} | {r[8]:.0f} | {r[9]:.2f} | {r[10]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
