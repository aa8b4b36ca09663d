"""``chunkstar-bench plan``: parse the node and workload from the command line, print the plan.

Entry point only: the figures are :mod:`~chunkstar_bench.plan.model`'s (the
formula) or :mod:`~chunkstar_bench.plan.dryrun`'s and
:mod:`~chunkstar_bench.plan.deepspeed`'s (``--dry-run``), the rows
:mod:`~chunkstar_bench.plan.rows`' and :mod:`~chunkstar_bench.plan.paper`'s, the
text :mod:`~chunkstar_bench.plan.format`'s, the stored figures and their gate
:mod:`~chunkstar_bench.plan.gate`'s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from chunkstar_bench.plan.dryrun import RANK_CHOICES, DryRunPoint, DryRunSettings, dry_run_point
from chunkstar_bench.plan.format import format_dry_run_head, format_largest, format_paper_table, format_plan
from chunkstar_bench.plan.gate import THRESHOLD, gate, store
from chunkstar_bench.plan.model import DISK_SYSTEMS, HARDWARE, SYSTEMS, Hardware, Workload, default_systems, models_named
from chunkstar_bench.plan.nodes import ALIASES, NODE_NAMES, aliases_help, node_named
from chunkstar_bench.plan.paper import LARGEST_NODES, PAPER_NODES, largest_rows, paper_points, paper_rows
from chunkstar_bench.plan.rows import plan
from chunkstar_bench.zoo import ModelSpec
from chunkstar_bench.published import system_info
from chunkstar_bench.results import ResultsFileError
from chunkstar_bench.units import GIB, parse_size

__all__ = ["add_plan_command", "main", "run_plan"]

_DESCRIPTION = (
    "Predict the largest zoo model each system fits on a node, from bytes-per-parameter accounting, beside the "
    "paper's published maxima (and, with --db, the largest model measured). A PREDICTION, not a measurement. "
    "With --dry-run: run chunkstar's real engine on the meta device (chunkstar.dry_run) for every published point "
    "of the paper (fits? smallest budget? predicted TFLOPS per GPU against the published) with DeepSpeed's own "
    "memory estimator beside it, and find the largest model each paper node and each single-GPU anchor fits. "
    "The formula stays the default: it answers in a second for any node (and --hardware custom), while the dry run "
    "costs 10-70 s per model and simulated rank on a 2-core machine (the paper table and the largest models: 66 dry runs, "
    "about 50 minutes, under 0.5 GiB of memory); the dry run is the "
    "engine's own verdict, so it is the one to trust where the two differ, and the formula's answer is printed "
    "beside its largest models as a cross-check."
)


def add_plan_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to a ``chunkstar-bench`` argparse sub-parser set (dispatch: ``args.func(args)``)."""
    p = subparsers.add_parser(
        "plan",
        help="predict the largest zoo model each system fits on a node (a prediction, not a measurement)",
        description=_DESCRIPTION,
    )
    nodes = [n for n in NODE_NAMES if n not in ALIASES]
    p.add_argument(
        "--hardware", default=None, choices=[*NODE_NAMES, "custom"],
        help="the node (default: v100x8_240gb; with --dry-run: the paper's two nodes and the two single-GPU anchors): "
        f"{', '.join(nodes)} (chunkstar.dryrun.HARDWARE, for the formula and --dry-run alike), or custom (the formula "
        f"only: --gpus, --gpu-mem, --host-mem). Aliases: {aliases_help()}",
    )
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs (default: the preset's; required for custom). With --dry-run: only the published points "
                   "on this many GPUs, and the largest model on this many")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (custom, or override the preset)")
    p.add_argument("--host-mem", type=float, default=None, help="host GiB (custom, or override the preset)")
    with_disk = [n for n in nodes if node_named(n).disk_read > 0]
    p.add_argument("--disk", type=parse_size, default=None,
                   help="free disk for chunkstar-disk's chunk files, e.g. 2TB or 1800GiB (default: none, so no chunkstar-disk row; "
                   f"also on {', '.join(with_disk) or 'a node'} whose disk chunkstar.dryrun.HARDWARE describes by its speed, "
                   "not its free space)")
    p.add_argument("--staging", type=parse_size, default=None,
                   help="chunkstar-disk: host staging budget per process, e.g. 4GiB (default: the engine's auto)")
    p.add_argument("--batch", type=int, default=Workload.batch,
                   help="micro-batch per GPU (default %(default)s: the paper suites' choice; the paper's figures show the best "
                   "of 4, 8 and 16 per point without recording which)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: each model's own)")
    p.add_argument("--checkpointing", choices=("on", "off", "both"), default="both", help="activation checkpointing")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; {', '.join(DISK_SYSTEMS)} only with --disk)")
    p.add_argument("--models", default="paper",
                   help="paper (default), cpu, all, or comma-separated zoo names. With --dry-run: the ladder of the "
                   "largest-model search, and (unless paper) only these models' published points")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="chunkstar elements per chunk (default: the engine's auto; with --dry-run, where auto does not fit "
                   "the GPU, a second try with PatrickStar's 256M)")
    p.add_argument("--db", default=None, help="results SQLite: add the largest model measured ok per system")
    d = p.add_argument_group("dry run (--dry-run)")
    d.add_argument("--dry-run", action="store_true",
                   help="dry-run chunkstar's engine for the paper's published points and the largest model per node "
                   "(minutes to an hour; progress on stderr) instead of the bytes-per-parameter formula")
    d.add_argument("--ranks", choices=RANK_CHOICES, default="ends",
                   help="ranks simulated per dry run: rank 0, rank 0 and the last (default), or all")
    d.add_argument("--steps", type=int, default=3, help="steps per dry run, the two warm-up iterations included (default 3)")
    d.add_argument("--markdown", action="store_true", help="print the tables as Markdown (for docs/benchmarks.md)")
    d.add_argument("--skip-table", action="store_true", help="only the largest model per node")
    d.add_argument("--skip-largest", action="store_true", help="only the paper's published points")
    d.add_argument("--dry-run-db", default=None,
                   help="results SQLite (its own file, not one of measurements) to append the dry runs' figures to")
    d.add_argument("--gate", action="store_true",
                   help="with --dry-run-db: compare this table with the one stored before it; exit status 1 on a "
                   "regression (a point that no longer fits, predicted TFLOPS down, a smaller largest model)")
    d.add_argument("--gate-threshold", type=float, default=THRESHOLD,
                   help="relative drop of predicted TFLOPS that is a regression (default %(default)s)")
    d.add_argument("--commit", default=None, help="the commit stored with the figures (default: $GITHUB_SHA, else git's HEAD)")
    p.set_defaults(func=run_plan)
    return p


def _hardware_from_args(args: argparse.Namespace) -> Hardware:
    if args.hardware == "custom":
        missing = [f"--{k}" for k in ("gpus", "gpu-mem", "host-mem") if getattr(args, k.replace("-", "_")) is None]
        if missing:
            raise SystemExit(f"chunkstar-bench plan --hardware custom needs {', '.join(missing)}")
        return Hardware("custom", args.gpus, int(args.gpu_mem * GIB), int(args.host_mem * GIB), "custom node", args.disk or 0)
    hw = HARDWARE[args.hardware]
    changes: dict[str, Any] = {}
    if args.disk is not None:
        changes["disk_bytes"] = args.disk
    if args.gpus is not None:
        changes["gpus"] = args.gpus
    if args.gpu_mem is not None:
        changes["gpu_mem_bytes"] = int(args.gpu_mem * GIB)
    if args.host_mem is not None:
        changes["host_mem_bytes"] = int(args.host_mem * GIB)
    return replace(hw, **changes) if changes else hw


def _systems_from_args(text: str) -> tuple[str, ...]:
    """``--systems``: canonical names (older spellings such as ``pytorch-ddp`` accepted), in the order given."""
    names: list[str] = []
    unknown: list[str] = []
    for raw in (s.strip() for s in text.split(",") if s.strip()):
        try:
            name = system_info(raw).name
        except KeyError:
            name = raw
        (names if name in SYSTEMS else unknown).append(name)
    if unknown:
        raise SystemExit(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return tuple(dict.fromkeys(names))


def _say(start: float) -> Any:
    def say(line: str) -> None:
        print(f"[{time.monotonic() - start:6.0f} s] {line}", file=sys.stderr, flush=True)

    return say


def run_dry_run(args: argparse.Namespace) -> int:
    """``plan --dry-run``: the paper table and the largest models, from dry runs; the gate with ``--gate``."""
    if args.hardware == "custom":
        raise SystemExit(
            "--hardware custom is the formula's: a dry run's time model needs a whole node description (links, compute, "
            f"CPU Adam), so choose one of {', '.join(NODE_NAMES)}"
        )
    if args.gate and not args.dry_run_db:
        raise SystemExit("--gate compares with the table stored before: give --dry-run-db")
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (two warm-up iterations, then the step the time model replays)")
    try:
        ladder = models_named(args.models)
    except KeyError as err:
        raise SystemExit(str(err.args[0])) from None
    settings = DryRunSettings(
        batch=args.batch, seq_len=args.seq, ranks=args.ranks, chunk_size=args.chunk_size, steps=args.steps,
        checkpointing=args.checkpointing != "off",  # the paper's runs recompute: "both" means on here
    )  # fmt: skip
    start = time.monotonic()
    say = _say(start)
    cache: dict[tuple[str, str, int], DryRunPoint] = {}
    costs: list[DryRunPoint] = []

    def run(spec: ModelSpec, hardware: str, gpus: int) -> DryRunPoint:
        key = (spec.name, hardware, gpus)
        if key not in cache:
            cache[key] = dry_run_point(
                spec, hardware, gpus, settings.batch, seq_len=settings.seq_len, chunk_size=settings.chunk_size, ranks=settings.ranks,
                steps=settings.steps, checkpointing=settings.checkpointing, progress=say,
            )  # fmt: skip
            costs.append(cache[key])
        return cache[key]

    hardware = (args.hardware,) if args.hardware else None
    rows = []
    if not args.skip_table:
        nodes = [h for h in (hardware or PAPER_NODES) if h in PAPER_NODES]
        only = None if args.models == "paper" else [m.name for m in ladder]
        points = paper_points(nodes, args.gpus, only)
        say(f"the paper table: {len(points)} published points on {', '.join(nodes) or 'no paper node'}")
        rows = paper_rows(points, run, say)
    largest = []
    if not args.skip_largest:
        if hardware is None:
            targets = [(h, args.gpus or g) for h, g in LARGEST_NODES]
        else:
            targets = [(hardware[0], args.gpus or node_named(hardware[0]).gpus_per_node)]
        largest = largest_rows(targets, ladder, run, settings.batch, say)
    out = format_dry_run_head(settings, args.markdown)
    if rows:
        out += ["", format_paper_table(rows, settings, args.markdown)]
    if largest:
        out += ["", format_largest(largest, args.markdown)]
    out += ["", _costs(costs, time.monotonic() - start)]
    print("\n".join(out), flush=True)
    status = 0
    if args.dry_run_db:
        commit = args.commit or os.environ.get("GITHUB_SHA") or _git_commit()
        n = store(args.dry_run_db, rows, largest, settings, commit=commit)
        say(f"{n} rows appended to {args.dry_run_db}")
    if args.gate:
        regressions, summary = gate(args.dry_run_db, args.gate_threshold)
        print(f"\n## Dry-run gate\n{summary}")
        annotate = os.environ.get("GITHUB_ACTIONS") == "true"
        for r in regressions:
            print(f"::warning::dry-run regression: {r}" if annotate else f"REGRESSION {r}")
        status = 1 if regressions else 0
    return status


def _costs(points: Sequence[DryRunPoint], elapsed: float) -> str:
    """What the dry runs cost here: their count and seconds, and the slowest."""
    if not points:
        return f"no dry run ({elapsed:.0f} s)."
    slow = max(points, key=lambda p: p.wall_s)
    per_rank = [p.wall_s / max(1, len(p.ranks)) for p in points]
    return (
        f"{len(points)} dry runs in {sum(p.wall_s for p in points):.0f} s ({elapsed:.0f} s in all): "
        f"{min(per_rank):.0f}-{max(per_rank):.0f} s per simulated rank; the slowest {slow.model} on {slow.hardware} "
        f"x{slow.gpus}, {slow.wall_s:.0f} s for {len(slow.ranks)} rank(s){' and ' + str(len(slow.tries)) + ' earlier try' if slow.tries else ''}."
    )


def _git_commit() -> str:
    from chunkstar_bench.runner import git_commit

    return git_commit()


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand: print the prediction table; exit status 0 (``--dry-run --gate``: 1 on a regression)."""
    if args.dry_run:
        return run_dry_run(args)
    for flag in ("dry_run_db", "gate"):
        if getattr(args, flag):
            raise SystemExit(f"--{flag.replace('_', '-')} goes with --dry-run")
    args.hardware = args.hardware or "v100x8_240gb"
    hw = _hardware_from_args(args)
    if hw.gpus < 1:
        raise SystemExit("--gpus must be at least 1")
    systems = default_systems(hw) if args.systems is None else _systems_from_args(args.systems)
    diskless = [s for s in systems if s in DISK_SYSTEMS] if hw.disk_bytes <= 0 else []
    if diskless:
        raise SystemExit(f"{', '.join(diskless)} keeps the optimizer state on disk: say how much is free with --disk SIZE (e.g. 2TB)")
    ckpt = {"on": (True,), "off": (False,), "both": (True, False)}[args.checkpointing]
    workloads = [Workload(args.batch, args.seq, c, args.chunk_size, args.staging) for c in ckpt]
    try:
        models = models_named(args.models)
    except KeyError as err:
        raise SystemExit(str(err.args[0])) from None
    try:
        rows = plan(hw, workloads, systems, db_path=args.db, models=models)
    except ResultsFileError as err:
        raise SystemExit(f"chunkstar-bench plan: {err}") from None
    print(format_plan(hw, rows, workloads[0]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m chunkstar_bench.plan plan ...``: the subcommand on its own (``chunkstar-bench plan`` is the same)."""
    ap = argparse.ArgumentParser(prog="chunkstar-bench")
    sub = ap.add_subparsers(dest="command", required=True)
    add_plan_command(sub)
    args = ap.parse_args(argv)
    return int(args.func(args))
