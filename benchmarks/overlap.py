"""Overlapped vs serial chunk copies under an emulated device link, beside plain PyTorch.

Runs one GPT-2 (bf16, about 30M parameters) under a device budget of about half
its bf16 parameter bytes plus its measured non-model memory, on the CPU virtual
device with ``device_link_bandwidth`` 1 GB/s and 8 GB/s, ``overlap`` false (the
serial reference) and true, and plain PyTorch (autocast bf16, fused AdamW) on
the same batches, each configuration in its own process, interleaved over
``--rounds``. Prints median seconds per step and the ratios the runtime-v2
issue asks for (overlapped/serial at 1 GB/s, overlapped/PyTorch at 8 GB/s).

    python benchmarks/overlap.py --rounds 2

DeepSpeed is not run here: its copies are plain memcpy on this machine, with no
emulated link (benchmarks/step_time.py has it, labelled so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
_RESULT = "OVERLAP_RESULT "


def _child(system: str, link: str | None, overlap: bool, steps: int, warmup: int, budget_frac: float) -> None:
    sys.path.insert(0, str(_REPO / "packages" / "core"))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)  # one core computes, the other is the copy engine's

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=8192, n_positions=256, n_embd=512, n_layer=8, n_head=8,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return GPT2LMHeadModel(cfg)

    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 8192, (4, 128), generator=g) for _ in range(warmup + steps)]
    times: list[float] = []
    extra: dict[str, object] = {}
    if system == "pytorch":
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        for ids in data:
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
    else:
        import chunkstar

        bf16_bytes = sum(p.numel() for p in build().parameters()) * 2
        non_model = 200_000_000  # measured: the warm-up peak of this model and batch is ~186 MB
        config = {
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "bf16": {"enabled": True},
            "gradient_clipping": 1.0, "device": "cpu", "device_memory_budget": int(bf16_bytes * budget_frac) + non_model,
            "overlap": overlap, "device_link_bandwidth": link,
        }  # fmt: skip
        engine, opt = chunkstar.initialize_engine(build, 0, config)
        for ids in data:
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        stats = engine.stats()
        extra = {"moves_per_step": stats["chunk_moves_to_device"] / len(data), "schedule": stats["schedule"]}
    timed = times[warmup:]
    print(_RESULT + json.dumps({"times": timed, "last_loss": float(loss.item()), **extra}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds, a fresh process each (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--budget-fraction", type=float, default=0.5, help="of the bf16 parameter bytes (default 0.5)")
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "LINK", "OVERLAP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        system, link, overlap = args.child
        _child(system, None if link == "-" else link, overlap == "1", args.steps, args.warmup, args.budget_fraction)
        return 0
    runs = [("pytorch", "-", "0")] + [("chunkstar", link, ov) for link in ("1GB/s", "8GB/s") for ov in ("0", "1")]
    got: dict[tuple[str, str, str], list[float]] = {r: [] for r in runs}
    losses: dict[tuple[str, str, str], float] = {}
    for rnd in range(args.rounds):
        for run in runs:
            cmd = [sys.executable, __file__, "--child", *run, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--budget-fraction", str(args.budget_fraction)]  # fmt: skip
            print(f"[round {rnd + 1}/{args.rounds}] {run[0]} link={run[1]} overlap={run[2]}", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            line = next((x for x in out.stdout.splitlines() if x.startswith(_RESULT)), None)
            if line is None:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            rec = json.loads(line[len(_RESULT):])
            got[run] += rec["times"]
            losses[run] = rec["last_loss"]
    med = {r: statistics.median(t) for r, t in got.items()}
    print(f"{'system':<34} {'median s/step':>14} {'vs PyTorch':>11} {'last loss':>10}")
    for r in runs:
        name = "PyTorch (autocast bf16)" if r[0] == "pytorch" else f"chunkstar link {r[1]} overlap {'on' if r[2] == '1' else 'off'}"
        print(f"{name:<34} {med[r]:>14.3f} {med[r] / med[runs[0]]:>10.2f}x {losses[r]:>10.4f}")
    slow = ("chunkstar", "1GB/s", "1"), ("chunkstar", "1GB/s", "0")
    fast = ("chunkstar", "8GB/s", "1")
    print(f"overlapped / serial at 1 GB/s: {med[slow[0]] / med[slow[1]]:.2f} (target <= 0.70)")
    print(f"overlapped at 8 GB/s / PyTorch: {med[fast] / med[runs[0]]:.2f}x (target <= 1.10x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
