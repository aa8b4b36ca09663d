"""Step time and peak RSS of chunkstar against plain PyTorch and DeepSpeed, side by side.

What it measures
    One training step (forward, backward, clipping at 1.0, AdamW, zero_grad) of
    a Hugging Face GPT-2 of about 50M parameters, built from a config (nothing
    is downloaded), on this machine's CPU, for four systems:

    ``pytorch``             fp32 params, ``torch.autocast("cpu", bfloat16)``, fused AdamW
    ``chunkstar``           chunkstar, bf16, a device budget far above the model data
    ``chunkstar-pressure``  chunkstar, bf16, a device budget that leaves the chunks room
                            for about half the model's bf16 parameter bytes
                            (``--pressure-fraction``): the non-model peak measured
                            by the ``chunkstar`` run, plus that fraction (the device
                            holds activations too, so a budget of half the parameter
                            bytes alone could not even hold them)
    ``deepspeed``           DeepSpeed ZeRO-3, params and optimizer offloaded to CPU, bf16

    Every system runs in its own child process (this script re-invoked with
    ``--child``), so "peak RSS" is ``ru_maxrss`` of a process that ran that one
    system only: imports, model build, engine set-up and training included. All
    children build the model with the same seed (same initial weights) and see
    the same random token batches; the warm-up steps are run and left out.

How to read it
    ``median s`` is the median of the timed steps (``min``/``max`` show the
    spread; this machine is shared, so compare ratios from one run, not runs).
    ``first loss`` and ``last loss`` should agree across systems to about 1e-2
    (same weights, same data, same AdamW steps; bf16 rounding differs): a
    system whose losses drift trains something else and its time means
    nothing. ``other load`` is how many cores other processes kept busy during
    the timed steps; above 0.25 the report warns, because on 2 cores one
    foreign busy core can slow a 2-thread torch step several times over
    (``--threads 1`` or ``--rounds 3`` make a busy machine less harmful). The ratio table
    checks the targets of the benchmark issue: chunkstar at most 1.10x plain
    PyTorch's step time without pressure and 1.30x under pressure, DeepSpeed at
    least 1.8x slower than chunkstar, chunkstar's peak RSS below DeepSpeed's. A
    MISS is a finding, not an error: the exit status is 0 whenever the benchmark
    itself ran. A system that fails (for example chunkstar before its engine
    exists) prints ``error: ...`` in its row and the other rows still run.
    Run ``chunkstar`` together with ``chunkstar-pressure`` (or give
    ``--pressure-budget-mib``): the pressure budget is built on its measurement.

This is a script, not a timed test::

    python benchmarks/step_time.py                       # all four systems
    python benchmarks/step_time.py --systems pytorch,deepspeed --steps 4
    python benchmarks/step_time.py --json runs/step_time.json

The first DeepSpeed run on a machine also JIT-compiles DeepSpeed's C++ CPU Adam
and shared-memory comm ops (about a minute, cached under
``~/.cache/torch_extensions``); that time is outside every measured step.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from step_time_systems import PROGRESS_PREFIX, RESULT_PREFIX, SYSTEMS, RunSpec, child_main, count_parameters

_GIB = 1024**3

# (numerator, denominator, kind, target): the step-time targets of the
# benchmark issue; "max" means the ratio must be at most the target, "min" at
# least. RSS checks are (lower, higher): lower's peak RSS must be below higher's.
_TIME_TARGETS: tuple[tuple[str, str, str, float], ...] = (
    ("chunkstar", "pytorch", "max", 1.10),
    ("chunkstar-pressure", "pytorch", "max", 1.30),
    ("deepspeed", "chunkstar", "min", 1.80),
    ("deepspeed", "chunkstar-pressure", "min", 1.80),
    ("deepspeed", "pytorch", "info", 0.0),  # context only: no target
)
_BUSY_CORES = 0.25
"""Foreign CPU load (cores, averaged over a system's timed steps) above which the report warns."""

_RSS_TARGETS: tuple[tuple[str, str], ...] = (
    ("chunkstar", "deepspeed"),
    ("chunkstar-pressure", "deepspeed"),
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Step time and peak RSS of plain PyTorch, chunkstar (with and without "
        "budget pressure) and DeepSpeed ZeRO-3 offload on a ~50M-parameter GPT-2, on CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems round-robin this many times (a fresh process each) and pool the timed steps",
    )
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the results here as JSON")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--n-positions", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--free-budget-gib", type=float, default=16.0, help="chunkstar's device budget without pressure"
    )
    parser.add_argument(
        "--pressure-fraction",
        type=float,
        default=0.6,
        help="room for chunks under pressure, as a fraction of the bf16 parameter bytes (on top of the "
        "measured non-model peak). 0.6, not 0.5: the tied 50257x512 embedding alone is 52%% of the "
        "model's bf16 bytes and must sit on the device beside one block's chunk at lm_head",
    )
    parser.add_argument(
        "--pressure-budget-mib",
        type=float,
        help="chunkstar-pressure's device budget in MiB; overrides --pressure-fraction",
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads in every child (default: torch's own choice)"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per system")
    parser.add_argument("--verbose", action="store_true", help="echo every line the children print")
    parser.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child is None:
        systems = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = sorted(set(systems) - set(SYSTEMS))
        if unknown or not systems:
            parser.error(f"--systems: unknown {unknown}; choose from {','.join(SYSTEMS)}")
        args.systems = [s for s in SYSTEMS if s in systems]  # fixed order, no repeats
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
            parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
        if args.seq > args.n_positions:
            parser.error(f"--seq {args.seq} exceeds --n-positions {args.n_positions}")
    return args


def _spec_for(args: argparse.Namespace, system: str) -> RunSpec:
    return RunSpec(
        system=system,
        steps=args.steps,
        warmup=args.warmup,
        batch=args.batch,
        seq=args.seq,
        seed=args.seed,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        vocab_size=args.vocab_size,
        n_positions=args.n_positions,
        lr=args.lr,
        free_budget_bytes=int(args.free_budget_gib * _GIB),
        pressure_fraction=args.pressure_fraction,
        threads=args.threads,
        pressure_budget_bytes=None if args.pressure_budget_mib is None else int(args.pressure_budget_mib * 2**20),
    )


def _run_child(spec: RunSpec, *, timeout: float, verbose: bool) -> dict[str, Any]:
    """Run one system in a fresh interpreter; its result record, or an error record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", spec.system, "--spec", spec.to_json()]
    tail: collections.deque[str] = collections.deque(maxlen=30)  # shown if the child dies
    result: dict[str, Any] | None = None
    start = time.monotonic()
    # stderr folded into stdout: one pipe, read line by line, cannot deadlock.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        # Kills a hung child (killing it closes the pipe, which ends the loop below).
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
                continue
            if line.startswith(PROGRESS_PREFIX):
                print(f"  {line[len(PROGRESS_PREFIX):]}", file=sys.stderr, flush=True)
                continue
            tail.append(line)
            if verbose:
                print(f"  | {line}", file=sys.stderr, flush=True)
        returncode = proc.wait()
    watchdog.cancel()
    wall = time.monotonic() - start
    if result is None:
        if wall > timeout:
            reason = f"timed out after {timeout:.0f} s"
        elif returncode < 0:  # SIGKILL here is most often the kernel's OOM killer
            reason = f"child killed by signal {-returncode}"
        else:
            reason = f"child exited with status {returncode}"
        result = {"system": spec.system, "status": f"error: {reason}, no result"}
    if result["status"] != "ok" and not verbose:
        print(f"  {spec.system} failed; last lines of its output:", file=sys.stderr)
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    result["child_wall_s"] = wall
    return result


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One record per system: timed steps of all rounds pooled, the highest peak RSS.

    Any failed round makes the system failed (its first error is kept); the
    losses and counters are those of the first round (every round trains the
    same steps from the same weights).
    """
    if len(rounds) == 1:
        return rounds[0]
    failed = [r for r in rounds if r["status"] != "ok"]
    if failed:
        return {**failed[0], "round_statuses": [r["status"] for r in rounds]}
    times = [t for r in rounds for t in r["step_times_s"]]
    return {
        **rounds[0],
        "step_times_s": times,
        "median_step_s": statistics.median(times),
        "min_step_s": min(times),
        "max_step_s": max(times),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds),
        "other_load_cores": max((r.get("other_load_cores") or 0.0) for r in rounds),
        "round_medians_s": [r["median_step_s"] for r in rounds],
        "child_wall_s": sum(r["child_wall_s"] for r in rounds),
    }


def _versions() -> dict[str, str]:
    from chunkstar_bench.runner import versions

    return versions()


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def _ratios(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Step-time ratios and RSS comparisons with their targets; "n/a" where a side failed."""

    def ok(system: str) -> bool:
        return results.get(system, {}).get("status") == "ok"

    rows: list[dict[str, Any]] = []
    for num, den, kind, target in _TIME_TARGETS:
        if num not in results or den not in results:
            continue
        row: dict[str, Any] = {
            "name": f"step time {num} / {den}",
            "target": {"max": f"<= {target:.2f}x", "min": f">= {target:.2f}x"}.get(kind, "(none)"),
        }
        if ok(num) and ok(den):
            value = results[num]["median_step_s"] / results[den]["median_step_s"]
            met = value <= target if kind == "max" else value >= target
            verdict = "-" if kind == "info" else "PASS" if met else "MISS"
            row.update(value=value, shown=f"{value:.2f}x", verdict=verdict)
        else:
            row.update(value=None, shown="-", verdict="n/a")
        rows.append(row)
    for lower, higher in _RSS_TARGETS:
        if lower not in results or higher not in results:
            continue
        row = {"name": f"peak RSS {lower} / {higher}", "target": "< 1.00x"}
        if ok(lower) and ok(higher):
            value = results[lower]["peak_rss_mib"] / results[higher]["peak_rss_mib"]
            row.update(value=value, shown=f"{value:.2f}x", verdict="PASS" if value < 1.0 else "MISS")
        else:
            row.update(value=None, shown="-", verdict="n/a")
        rows.append(row)
    return rows


def _format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]], ratios: list[dict[str, Any]]) -> str:
    tokens = args.batch * args.seq
    n_params = next((r["n_params"] for r in results.values() if "n_params" in r), None)
    head = [
        "chunkstar step-time benchmark (CPU)",
        f"model: GPT-2 n_embd={args.n_embd} n_layer={args.n_layer} n_head={args.n_head} "
        f"vocab={args.vocab_size} n_positions={args.n_positions}, "
        + (f"{n_params:,} parameters ({n_params * 2 / 2**20:.1f} MiB in bf16)" if n_params else "parameters: unknown"),
        f"batch {args.batch} x seq {args.seq} = {tokens} tokens/step; {args.warmup} warm-up + {args.steps} timed steps"
        + (f" per round, {args.rounds} rounds pooled" if args.rounds > 1 else "")
        + f"; seed {args.seed}",
    ]
    rows: list[list[str]] = []
    for system, r in results.items():
        if r["status"] == "ok":
            rows.append(
                [
                    system,
                    "ok",
                    f"{r['median_step_s']:.3f}",
                    f"{r['min_step_s']:.3f}",
                    f"{r['max_step_s']:.3f}",
                    f"{tokens / r['median_step_s']:.0f}",
                    f"{r['peak_rss_mib']:.0f}",
                    f"{r['losses'][0]:.4f}",
                    f"{r['losses'][-1]:.4f}",
                    "?" if r.get("other_load_cores") is None else f"{r['other_load_cores']:.2f}",
                ]
            )
        else:
            rows.append([system, "error", *["-"] * 8])
    body = _format_table(
        [
            "system",
            "status",
            "median s",
            "min s",
            "max s",
            "tokens/s",
            "peak RSS MiB",
            "first loss",
            "last loss",
            "other load",
        ],
        rows,
    )
    busy = {
        system: r["other_load_cores"]
        for system, r in results.items()
        if (r.get("other_load_cores") or 0.0) > _BUSY_CORES
    }
    if busy:
        body += "\nWARNING: other processes kept the CPU busy during the timed steps of " + ", ".join(
            f"{system} ({load:.2f} cores)" for system, load in busy.items()
        ) + "; those step times and ratios are not trustworthy (rerun on a quiet machine, or with --threads 1 or --rounds 3)."
    ratio_table = _format_table(
        ["comparison", "measured", "target", "verdict"],
        [[r["name"], r["shown"], r["target"], r["verdict"]] for r in ratios],
    ) if ratios else "(no comparisons among the systems run)"

    extra: list[str] = []
    for system, r in results.items():
        if r["status"] != "ok":
            extra.append(f"{system}: {r['status']}")
        if "device_budget_bytes" in r:
            moves = r.get("chunkstar_moves_per_timed_step", {})
            moved = ", ".join(f"{k} {v:,.1f}" for k, v in moves.items())
            extra.append(f"{system}: budget {r['device_budget_bytes'] / 2**20:.1f} MiB; per timed step: {moved or 'no counters'}")
            extra.append(f"{system}: engine.stats() after the last step: {json.dumps(r.get('chunkstar_stats', {}))}")
        if "round_medians_s" in r:
            extra.append(f"{system}: median per round (s): " + ", ".join(f"{t:.3f}" for t in r["round_medians_s"]))
        if "optimizer" in r:
            extra.append(
                f"{system}: optimizer {r['optimizer']}; torch threads {r.get('torch_threads')}; "
                f"RSS after set-up {r.get('rss_after_setup_mib', -1):.0f} MiB"
            )
        for note in r.get("notes", []):
            extra.append(f"{system}: NOTE {note}")
    return "\n".join([*head, "", body, "", ratio_table, "", *extra])


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child is not None:
        return child_main(RunSpec.from_json(args.spec))

    # Round-robin: every round runs each system once, so slow spells of a shared
    # machine fall on all systems alike instead of on whichever ran then.
    runs: dict[str, list[dict[str, Any]]] = {system: [] for system in args.systems}
    non_model_peak: int | None = None  # measured by the unpressured chunkstar run
    total = args.rounds * len(args.systems)
    for n, (round_no, system) in enumerate(
        ((r, s) for r in range(1, args.rounds + 1) for s in args.systems), start=1
    ):
        label = f"[{n}/{total}]" + (f" round {round_no}" if args.rounds > 1 else "")
        print(f"{label} running {system} ...", file=sys.stderr, flush=True)
        spec = _spec_for(args, system)
        if system == "chunkstar-pressure" and args.pressure_budget_mib is None and non_model_peak is not None:
            # The device holds activations too: the pressure budget is the non-model peak
            # that chunkstar measured in its own warm-up plus the fraction of the bf16
            # parameter bytes, so the chunks get room for only that fraction of the model.
            n_params = count_parameters(spec)
            spec = dataclasses.replace(
                spec, pressure_budget_bytes=non_model_peak + int(args.pressure_fraction * 2 * n_params)
            )
        result = _run_child(spec, timeout=args.timeout, verbose=args.verbose)
        if system == "chunkstar" and result["status"] == "ok":
            non_model_peak = int(result["chunkstar_stats"]["warmup_non_model_peak_bytes"])
        runs[system].append(result)
        summary = f"{result['median_step_s']:.3f} s/step" if result["status"] == "ok" else result["status"]
        print(f"{label} {system}: {summary} ({result['child_wall_s']:.0f} s in all)", file=sys.stderr)
    results = {system: _merge_rounds(system_runs) for system, system_runs in runs.items()}

    ratios = _ratios(results)
    print(_report(args, results, ratios))
    if args.json is not None:
        document = {
            "benchmark": "step_time",
            "created_unix": time.time(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("child", "spec")},
            "spec": json.loads(_spec_for(args, "*").to_json()),
            "versions": _versions(),
            "machine": _machine(),
            "results": results,
            "comparisons": ratios,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
