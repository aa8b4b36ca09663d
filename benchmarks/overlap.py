"""Overlapped vs serial chunk copies under an emulated device link, beside plain PyTorch and DeepSpeed.

What it measures
    One training step of a GPT-2 of about 30M parameters (hidden 512, 8 layers,
    vocab 8192, batch 4 x seq 128, bf16, AdamW, clipping 1.0; one torch thread,
    so the other core is free for the copy thread), for these rows:

    ``pytorch``                PyTorch: fp32 params, autocast bf16, fused AdamW
    ``chunkstar-1gb-serial``   chunkstar, device budget of about half the bf16 parameter
    ``chunkstar-1gb-overlap``  bytes (``--budget-fraction``) plus the non-model memory,
    ``chunkstar-8gb-serial``   on the CPU virtual device with ``device_link_bandwidth``
    ``chunkstar-8gb-overlap``  1 GB/s or 8 GB/s (each chunk copy takes at least
                               bytes / bandwidth) and ``overlap`` false (the serial
                               reference) or true
    ``deepspeed``              DeepSpeed ZeRO-3, params and optimizer offloaded to CPU, bf16.
                               It runs WITHOUT the emulated link: its copies are plain
                               memcpy on this machine, so its time is for reference only
    ``chunkstar-free``         chunkstar with a budget that holds everything (no pressure):
                               with ``pytorch``, the pair the peak-RSS target compares

    Every row runs in its own process, and the rows are interleaved over
    ``--rounds`` (round-robin, a fresh process each), so slow spells of a shared
    machine fall on all rows alike. The runners, the timing, the batches and the
    peak-RSS measurement (``ru_maxrss`` of the child: imports, set-up and
    training included) are ``benchmarks/step_time_systems.py``'s, the ones
    ``benchmarks/step_time.py`` uses; this script picks the model, the budgets
    and the link.

How to read it
    ``median s/step`` pools the timed steps of every round. ``last loss`` should
    agree across rows to about 1e-2 (same weights, same batches). The three
    target lines check the issue's targets: overlapped/serial step time at
    1 GB/s <= 0.70, overlapped at 8 GB/s <= 1.10x PyTorch, chunkstar's peak RSS
    without pressure <= PyTorch's. A MISS is a finding, not an error: the exit
    status is 0 whenever the benchmark ran.

This is a script, not a timed test::

    python benchmarks/overlap.py                      # every row, 2 rounds
    python benchmarks/overlap.py --systems pytorch,chunkstar-1gb-serial,chunkstar-1gb-overlap --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from step_time_systems import RESULT_PREFIX, RunSpec, child_main, count_parameters, run_chunkstar

_NON_MODEL_BYTES = 200_000_000
"""Room the pressured budgets leave for activations and temporaries: the warm-up
non-model peak of this model and batch, measured at ~186 MB (``chunkstar-free``
prints what it measured)."""

_BASE = RunSpec(
    system="*", steps=6, warmup=3, batch=4, seq=128, seed=0, n_embd=512, n_layer=8, n_head=8, vocab_size=8192,
    n_positions=256, lr=1e-4, free_budget_bytes=16 * 2**30, pressure_fraction=0.5, threads=1,
)  # fmt: skip
"""The model and batches of every row; ``steps``, ``warmup``, ``pressure_fraction`` come from the command line."""


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration of the table, run in its own process."""

    name: str
    """Its ``--systems`` key."""
    label: str
    """Its name in the table."""
    system: str
    """The ``step_time_systems`` runner it uses when it has no link (``pytorch``, ``deepspeed``, ``chunkstar``)."""
    link: str | None = None
    """``device_link_bandwidth`` of a pressured chunkstar row; None for the others."""
    overlap: bool = True
    """chunkstar's ``overlap`` (a pressured row's; the others keep the default)."""


ROWS: tuple[Row, ...] = (
    Row("pytorch", "PyTorch (autocast bf16)", "pytorch"),
    Row("chunkstar-1gb-serial", "chunkstar link 1GB/s overlap off", "chunkstar-pressure", "1GB/s", False),
    Row("chunkstar-1gb-overlap", "chunkstar link 1GB/s overlap on", "chunkstar-pressure", "1GB/s", True),
    Row("chunkstar-8gb-serial", "chunkstar link 8GB/s overlap off", "chunkstar-pressure", "8GB/s", False),
    Row("chunkstar-8gb-overlap", "chunkstar link 8GB/s overlap on", "chunkstar-pressure", "8GB/s", True),
    Row("deepspeed", "DeepSpeed ZeRO-3 offload (no emulated link)", "deepspeed"),
    Row("chunkstar-free", "chunkstar, no pressure (budget holds all)", "chunkstar"),
)
"""Every row, in the order they run in a round and are printed."""
_BY_NAME = {row.name: row for row in ROWS}


# --------------------------------------------------------------------------- child side


def _run_linked(spec: RunSpec, row: Row, budget_fraction: float) -> dict[str, Any]:
    """A pressured chunkstar row: budget = ``budget_fraction`` of the bf16 parameter bytes + the non-model room."""
    budget = int(count_parameters(spec) * 2 * budget_fraction) + _NON_MODEL_BYTES
    extra = {"overlap": row.overlap, "device_link_bandwidth": row.link}
    return run_chunkstar(dataclasses.replace(spec, pressure_budget_bytes=budget), pressure=True, extra_config=extra)


def _child(row: Row, spec: RunSpec) -> int:
    if row.link is None:
        return child_main(dataclasses.replace(spec, system=row.system))
    runner = functools.partial(_run_linked, row=row, budget_fraction=spec.pressure_fraction)
    return child_main(dataclasses.replace(spec, system=row.name), runner)


# --------------------------------------------------------------------------- parent side


def _run_child(row: Row, spec: RunSpec, timeout: float) -> dict[str, Any]:
    """One row in a fresh interpreter: its ``step_time_systems`` record, or an error record."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", row.name, "--spec", spec.to_json()]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"error: timed out after {timeout:.0f} s"}
    line = next((x for x in out.stdout.splitlines() if x.startswith(RESULT_PREFIX)), None)
    if line is None:
        record: dict[str, Any] = {"status": f"error: child exited with status {out.returncode}, no result"}
    else:
        record = json.loads(line[len(RESULT_PREFIX) :])
    if record["status"] != "ok":
        print(out.stderr[-3000:], file=sys.stderr)
    return record


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One record per row: timed steps of every round pooled, the highest peak RSS, the first failure if any."""
    failed = [r for r in rounds if r["status"] != "ok"]
    if failed:
        return failed[0]
    times = [t for r in rounds for t in r["step_times_s"]]
    return {
        **rounds[0],
        "step_times_s": times,
        "median_step_s": statistics.median(times),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in rounds),
        "other_load_cores": max((r.get("other_load_cores") or 0.0) for r in rounds),
    }


def _ok(results: dict[str, dict[str, Any]], name: str) -> bool:
    return results.get(name, {}).get("status") == "ok"


def targets(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's three targets as lines ending in PASS or MISS ("n/a" where a side did not run or failed)."""
    checks = (
        ("overlapped / serial step time at 1 GB/s", "chunkstar-1gb-overlap", "chunkstar-1gb-serial",
         "median_step_s", 0.70),
        ("overlapped at 8 GB/s / PyTorch step time", "chunkstar-8gb-overlap", "pytorch", "median_step_s", 1.10),
        ("peak RSS chunkstar without pressure / PyTorch", "chunkstar-free", "pytorch", "peak_rss_mib", 1.00),
    )  # fmt: skip
    lines = []
    for text, num, den, key, limit in checks:
        if _ok(results, num) and _ok(results, den):
            ratio = results[num][key] / results[den][key]
            lines.append(f"{text}: {ratio:.2f} (target <= {limit:.2f}) {'PASS' if ratio <= limit else 'MISS'}")
        else:
            lines.append(f"{text}: - (target <= {limit:.2f}) n/a")
    return lines


def table(results: dict[str, dict[str, Any]]) -> str:
    """The rows run, in ``ROWS`` order: median s/step, ratio to PyTorch, peak RSS, last loss."""
    base = results["pytorch"]["median_step_s"] if _ok(results, "pytorch") else None
    lines = [f"{'system':<44} {'median s/step':>13} {'vs PyTorch':>10} {'peak RSS MiB':>12} {'last loss':>9}"]
    for row in ROWS:
        if row.name not in results:
            continue
        r = results[row.name]
        if r["status"] != "ok":
            lines.append(f"{row.label:<44} {r['status']}")
            continue
        ratio = f"{r['median_step_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{row.label:<44} {r['median_step_s']:>13.3f} {ratio:>10} {r['peak_rss_mib']:>12.0f} "
            f"{r['losses'][-1]:>9.4f}"
        )
    return "\n".join(lines)


def _notes(results: dict[str, dict[str, Any]]) -> list[str]:
    notes = []
    for name, r in results.items():
        if r["status"] != "ok":
            continue
        if "chunkstar_moves_per_timed_step" in r:
            moves = r["chunkstar_moves_per_timed_step"]
            notes.append(
                f"{name}: budget {r['device_budget_bytes'] / 2**20:.0f} MiB, per timed step "
                f"{moves.get('chunk_moves_to_device', 0):.1f} chunk moves to the device, "
                f"{moves.get('chunk_moves_to_host', 0):.1f} to the host"
            )
        if name == "chunkstar-free" and "warmup_non_model_peak_bytes" in r.get("chunkstar_stats", {}):
            measured = r["chunkstar_stats"]["warmup_non_model_peak_bytes"]
            notes.append(
                f"{name}: measured non-model peak {measured / 1e6:.0f} MB "
                f"(the pressured budgets leave {_NON_MODEL_BYTES / 1e6:.0f} MB)"
            )
        for note in r.get("notes", []):
            notes.append(f"{name}: NOTE {note}")
    load = {name: r["other_load_cores"] for name, r in results.items() if r.get("other_load_cores") is not None}
    if load:
        notes.append("other load (cores busy elsewhere during the timed steps, max over rounds): "
                     + ", ".join(f"{name} {v:.2f}" for name, v in load.items()))  # fmt: skip
    return notes


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds, a fresh process each (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    ap.add_argument("--budget-fraction", type=float, default=0.5, help="of the bf16 parameter bytes (default 0.5)")
    ap.add_argument("--systems", default=",".join(_BY_NAME), help=f"comma-separated subset of {','.join(_BY_NAME)}")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run (default 1800)")
    ap.add_argument("--child", choices=list(_BY_NAME), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is None:
        names = {s.strip() for s in args.systems.split(",") if s.strip()}
        unknown = sorted(names - set(_BY_NAME))
        if unknown or not names:
            ap.error(f"--systems: unknown {unknown}; choose from {','.join(_BY_NAME)}")
        args.systems = [row for row in ROWS if row.name in names]
        if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
            ap.error("--steps and --rounds must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child is not None:
        return _child(_BY_NAME[args.child], RunSpec.from_json(args.spec))
    spec = dataclasses.replace(_BASE, steps=args.steps, warmup=args.warmup, pressure_fraction=args.budget_fraction)
    rows: list[Row] = args.systems
    runs: dict[str, list[dict[str, Any]]] = {row.name: [] for row in rows}
    for rnd in range(1, args.rounds + 1):
        for row in rows:
            print(f"[round {rnd}/{args.rounds}] {row.name} ...", file=sys.stderr, flush=True)
            record = _run_child(row, spec, args.timeout)
            shown = f"{record['median_step_s']:.3f} s/step" if record["status"] == "ok" else record["status"]
            print(f"[round {rnd}/{args.rounds}] {row.name}: {shown}", file=sys.stderr, flush=True)
            runs[row.name].append(record)
    results = {name: _merge_rounds(records) for name, records in runs.items()}
    n_params = next((r["n_params"] for r in results.values() if "n_params" in r), None)
    print(
        f"GPT-2 n_embd={spec.n_embd} n_layer={spec.n_layer} vocab={spec.vocab_size}"
        + (f", {n_params:,} parameters ({n_params * 2 / 2**20:.1f} MiB in bf16)" if n_params else "")
        + f"; batch {spec.batch} x seq {spec.seq}; {spec.threads} torch thread; {args.warmup} warm-up + "
        f"{args.steps} timed steps x {args.rounds} rounds; pressured budgets: {args.budget_fraction:g} of the bf16 "
        f"parameter bytes + {_NON_MODEL_BYTES / 1e6:.0f} MB non-model"
    )
    print(table(results))
    print("\n".join(targets(results)))
    print("\n".join(_notes(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
