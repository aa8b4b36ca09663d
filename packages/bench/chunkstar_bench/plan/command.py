"""``chunkstar-bench plan``: parse the node and workload from the command line, print the plan.

Entry point only: the figures are :mod:`~chunkstar_bench.plan.model`'s, the
rows :mod:`~chunkstar_bench.plan.rows`', the text :mod:`~chunkstar_bench.plan.format`'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from chunkstar_bench.plan.format import format_plan
from chunkstar_bench.plan.model import DISK_SYSTEMS, HARDWARE, SYSTEMS, Hardware, Workload, default_systems, models_named
from chunkstar_bench.plan.rows import plan
from chunkstar_bench.published import system_info
from chunkstar_bench.results import ResultsFileError
from chunkstar_bench.units import GIB, parse_size

__all__ = ["add_plan_command", "main", "run_plan"]

_DESCRIPTION = (
    "Predict the largest zoo model each system fits on a node, from bytes-per-parameter accounting, beside the "
    "paper's published maxima (and, with --db, the largest model measured). A PREDICTION, not a measurement."
)


def add_plan_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``plan`` to a ``chunkstar-bench`` argparse sub-parser set (dispatch: ``args.func(args)``)."""
    p = subparsers.add_parser(
        "plan",
        help="predict the largest zoo model each system fits on a node (a prediction, not a measurement)",
        description=_DESCRIPTION,
    )
    p.add_argument("--hardware", default="v100x8_240gb", choices=[*HARDWARE, "custom"])
    p.add_argument("--gpus", type=int, default=None, help="GPUs (default: the preset's; required for custom)")
    p.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU (custom, or override the preset)")
    p.add_argument("--host-mem", type=float, default=None, help="host GiB (custom, or override the preset)")
    p.add_argument("--disk", type=parse_size, default=None,
                   help="free disk for chunkstar-disk's chunk files, e.g. 2TB or 1800GiB (default: none, so no chunkstar-disk row)")
    p.add_argument("--staging", type=parse_size, default=None,
                   help="chunkstar-disk: host staging budget per process, e.g. 4GiB (default: the engine's auto)")
    p.add_argument("--batch", type=int, default=Workload.batch, help="micro-batch per GPU (default %(default)s)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: each model's own)")
    p.add_argument("--checkpointing", choices=("on", "off", "both"), default="both", help="activation checkpointing")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all; {', '.join(DISK_SYSTEMS)} only with --disk)")
    p.add_argument("--models", default="paper", help="paper (default), cpu, all, or comma-separated zoo names")
    p.add_argument("--chunk-size", type=int, default=None, help="chunkstar elements per chunk (default: the engine's auto)")
    p.add_argument("--db", default=None, help="results SQLite: add the largest model measured ok per system")
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


def run_plan(args: argparse.Namespace) -> int:
    """The ``plan`` subcommand: print the prediction table; exit status 0."""
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
