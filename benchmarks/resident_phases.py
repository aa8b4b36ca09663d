"""The resident step of plain PyTorch and chunkstar, phase by phase: seconds and page faults.

What it measures
    The overhead case of ``chunkstar-bench step-time`` (zoo ``gpt2-49m-v8k``: hidden
    768, 6 layers, vocab 8192; batch 4 x 128 by default, bf16, AdamW as
    :data:`chunkstar_bench.harness.ADAMW`, no clipping), chunkstar with a budget far above
    the model data so every chunk stays resident. For each system, in its own child
    process: the median over the timed steps of forward, backward and optimizer step
    (``step()`` plus ``zero_grad``), in wall seconds or, with ``--cpu-time``, in the
    process's CPU seconds (all threads; on a shared VM less disturbed by other guests
    than wall time), and the minor page faults per step (``ru_minflt``), which show the
    host heap's pages going back to the system and faulting in again (Note [host heap]
    in :mod:`chunkstar.memory.host_heap`).

    PyTorch: fp32 parameters under ``torch.autocast(bfloat16)``, fused AdamW, as the
    bench's ``pytorch`` rows. The ratios to compare are those of one run; this script
    is for finding where a difference lies, ``chunkstar-bench step-time`` for the figure.

Usage
    python benchmarks/resident_phases.py [--steps 8] [--batch 4] [--seq 128] [--cpu-time]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable


def _child(system: str, steps: int, batch: int, seq: int, cpu_time: bool) -> dict[str, Any]:
    import torch

    from chunkstar_bench.harness import ADAMW
    from chunkstar_bench.zoo import build_hf, get

    spec = get("gpt2-49m-v8k")
    clock = time.process_time if cpu_time else time.perf_counter
    g = torch.Generator().manual_seed(0)
    warm = 2
    batches = [torch.randint(0, spec.vocab, (batch, seq), generator=g) for _ in range(steps + warm)]
    torch.manual_seed(0)
    forward: Callable[[Any], Any]
    if system == "pytorch":
        model = build_hf(spec)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True)

        def forward(x: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=x, labels=x).loss

        def backward(loss: Any) -> None:
            loss.backward()

        def step() -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        import chunkstar

        config = {
            "optimizer": {"type": "AdamW", "params": ADAMW}, "bf16": {"enabled": True}, "gradient_clipping": 0.0,
            "device": "cpu", "default_chunk_size": "auto", "device_memory_budget": 16 << 30,
        }  # fmt: skip
        engine, copt = chunkstar.initialize_engine(lambda: build_hf(spec), 0, config)

        def forward(x: Any) -> Any:
            return engine(input_ids=x, labels=x).loss

        backward = engine.backward

        def step() -> None:
            copt.step()
            copt.zero_grad()

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    faults: list[int] = []
    for i, x in enumerate(batches):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = clock()
        loss = forward(x)
        t1 = clock()
        backward(loss)
        t2 = clock()
        step()
        t3 = clock()
        loss.item()
        if i >= warm:
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["step"].append(t3 - t2)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {
        "system": system, **{k: statistics.median(v) for k, v in phases.items()},
        "faults": statistics.median(faults),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per system (after 2 untimed)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--cpu-time", action="store_true", help="CPU seconds of the process instead of wall seconds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.steps, args.batch, args.seq, args.cpu_time)))
        return 0
    unit = "CPU s" if args.cpu_time else "s"
    rows = []
    for system in ("pytorch", "chunkstar"):
        cmd = [sys.executable, __file__, "--child", system, "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq", str(args.seq)] + (["--cpu-time"] if args.cpu_time else [])  # fmt: skip
        print(f"[resident_phases] {system} ...", file=sys.stderr)
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        rows.append(json.loads(out))
    print(f"{'system':10}  {'forward ' + unit:>14}  {'backward ' + unit:>14}  {'step ' + unit:>12}  {'total':>7}  {'faults/step':>11}")
    for r in rows:
        total = r["forward"] + r["backward"] + r["step"]
        print(f"{r['system']:10}  {r['forward']:14.4f}  {r['backward']:14.4f}  {r['step']:12.4f}  {total:7.4f}  {r['faults']:11.0f}")
    base = sum(rows[0][k] for k in ("forward", "backward", "step"))
    mine = sum(rows[1][k] for k in ("forward", "backward", "step"))
    print(f"\nchunkstar / pytorch: {mine / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
