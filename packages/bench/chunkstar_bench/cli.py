"""``chunkstar-bench``: run suites and comparison tables, search the max scale, plan, print reports.

Entry point only: parses arguments and calls the library. Subcommands register
themselves through :data:`COMMANDS` (``name -> register(subparsers)``), so
another module can add one (``plan``, ``step-time``, ``activations``) without editing ``main``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from chunkstar_bench.units import GIB, parse_size

__all__ = ["COMMANDS", "main"]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- run


def _register_run(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from chunkstar_bench.suites import SUITES

    p = sub.add_parser(
        "run", help="run a suite, one subprocess per run, appending rows to a results DB, checked first "
        "(exit status 1 when a run failed, 2 for a bad argument or results file)",
    )  # fmt: skip
    p.add_argument("--suite", required=True, choices=sorted(SUITES))
    p.add_argument("--db", required=True, type=Path, help="SQLite results file (created if missing)")
    p.add_argument("--hardware", help="label for this machine (default: the suite's own, 'cpu' for CPU suites)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    p.add_argument("--system", action="append", help="only these systems (repeatable)")
    p.add_argument("--model", action="append", help="only these models (repeatable)")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
    from chunkstar_bench.report import runs_table
    from chunkstar_bench.results import ResultsDB, ResultsFileError, record_row, runs_frame, set_aside
    from chunkstar_bench.runner import run
    from chunkstar_bench.suites import get_suite, with_hardware

    specs = with_hardware(get_suite(args.suite), args.hardware)
    # a misspelled name would select nothing and exit 0: a nightly job would pass having run nothing
    for flag, asked, known in (("--system", args.system, {s.system for s in specs}), ("--model", args.model, {s.model for s in specs})):
        unknown = sorted(set(asked or ()) - known)
        if unknown:
            print(
                f"chunkstar-bench run: {flag} {', '.join(unknown)}: not in suite {args.suite!r}; it has {', '.join(sorted(known))}",
                file=sys.stderr,
            )
            return 2
    specs = [s for s in specs if (not args.system or s.system in args.system) and (not args.model or s.model in args.model)]
    if not specs:
        print(f"chunkstar-bench run: suite {args.suite!r} has no run of system {args.system} and model {args.model}", file=sys.stderr)
        return 2
    db = ResultsDB(args.db)  # checked here, before the first run: a bad file ends the command now (main), not after the suite
    rows: list[dict[str, Any]] = []  # this command's rows, appended or set aside
    aside: list[str] = []  # where each row that could not be appended went
    failed: Counter[str] = Counter()
    start = time.monotonic()
    for i, spec in enumerate(specs, 1):
        _progress(f"[{i}/{len(specs)}] {spec.system} {spec.model} x{spec.nprocs} batch {spec.batch} on {spec.hardware} ...")
        record = run(spec, args.timeout)
        row = record_row(record, suite=args.suite)
        try:
            row["id"] = db.append(record, suite=args.suite)
        except ResultsFileError as err:  # the file failed after the check: keep the measurement, say where
            where = set_aside(args.db, row)
            aside.append(str(where) if where is not None else "standard output")
            _progress(f"chunkstar-bench run: {err}; this run's row was written to {aside[-1]} instead")
            if where is None:
                print(json.dumps(row, sort_keys=True, default=str), flush=True)
        rows.append(row)
        if record.status != "ok":
            failed[record.status] += 1
        what = f"{record.step_time_s:.3f} s/step, {record.tokens_per_s:,.0f} tokens/s" if record.status == "ok" else record.message
        _progress(f"[{i}/{len(specs)}] {spec.system} {spec.model}: {record.status} {what} ({record.wall_s:.0f} s)")
    # the table is of this command's runs, in their order, whether stored or set aside (its ids are not shown)
    print(runs_table(runs_frame({**row, "id": i} for i, row in enumerate(rows))))
    saved = len(rows) - len(aside)
    print(f"\n{saved} runs of suite {args.suite!r} appended to {args.db} in {time.monotonic() - start:.0f} s")
    status = 0
    if failed:
        # a nightly job must fail when a run did, not only when the runner crashed
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(failed.items()))
        print(f"chunkstar-bench run: {sum(failed.values())} of {len(rows)} runs failed ({counts})", file=sys.stderr)
        status = 1
    if aside:
        print(
            f"chunkstar-bench run: {len(aside)} of {len(rows)} rows could not be appended to {args.db}; they are in "
            f"{', '.join(sorted(set(aside)))} (one JSON row per line, the columns of the runs table)",
            file=sys.stderr,
        )
        status = 2
    return status


# --------------------------------------------------------------------------- report


def _register_report(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("report", help="print tables shaped like the paper's, beside the published numbers")
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--hardware", help="only this hardware label")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from chunkstar_bench.report import report
    from chunkstar_bench.results import BadRowsError, ResultsDB

    db = ResultsDB(args.db, read_only=True)  # read-only: a report never creates or changes a file
    try:
        runs = db.runs()
    except BadRowsError as err:  # the other rows still make a report; which ones are missing is said once
        print(f"chunkstar-bench report: {err}; the report leaves them out", file=sys.stderr)
        runs = err.good
    print(report(runs, args.hardware))
    return 0


# --------------------------------------------------------------------------- max-scale


def _register_maxscale(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from chunkstar_bench.published import DISK_SYSTEMS, RUN_SYSTEMS

    p = sub.add_parser("max-scale", help="largest zoo model a system trains under a host-memory cap")
    p.add_argument("--system", required=True, choices=RUN_SYSTEMS)
    p.add_argument("--cap", required=True, type=parse_size, help="host-memory cap, e.g. 8GiB")
    p.add_argument("--db", required=True, type=Path)
    p.add_argument("--models", help="comma-separated ladder (default: the cpu-* models)")
    p.add_argument("--strategy", choices=("bisect", "ascending"), default="bisect")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--hardware", default="cpu")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per attempt")
    p.add_argument(
        "--disk-dir", type=Path,
        help=f"only for {', '.join(DISK_SYSTEMS)}: where attempts swap; each gets its own folder there, removed "
        "when it ends (default: the folder of --db; put it on the disk under test: a tmpfs is RAM the cap does not see)",
    )  # fmt: skip
    p.add_argument("--nvme-params", action="store_true",
                   help="deepspeed-nvme and chunkstar-disk: the parameters on disk too, not only the optimizer state "
                        "(chunkstar-disk without it leaves the param list to the engine's host memory plan)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per attempt (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default %(default)s)")
    p.add_argument("--chunkstar-budget", default=None,
                   help='chunkstar systems: the device budget, bytes, "2GiB" or "params:F" (default: params:0.6; chunkstar-disk: at most 1 GiB of params beside the activations)')
    p.add_argument("--staging", default=None,
                   help='chunkstar-disk only: the disk tier\'s host staging budget, e.g. "1GiB" (default: the engine\'s auto)')
    p.set_defaults(func=_cmd_maxscale)


def _cmd_maxscale(args: argparse.Namespace) -> int:
    from chunkstar_bench.maxscale import peaks, search
    from chunkstar_bench.published import DISK_SYSTEMS
    from chunkstar_bench.results import ResultsDB
    from chunkstar_bench.runner import CHUNKSTAR_SYSTEMS
    from chunkstar_bench.zoo import get, n_params

    disk_dir: Path | None = args.disk_dir
    if args.system in DISK_SYSTEMS:
        disk_dir = disk_dir or args.db.resolve().parent
    elif disk_dir is not None or args.nvme_params:
        print(f"chunkstar-bench max-scale: --disk-dir and --nvme-params are only for {', '.join(DISK_SYSTEMS)}",
              file=sys.stderr)
        return 2
    if args.staging is not None and args.system != "chunkstar-disk":
        print("chunkstar-bench max-scale: --staging is only for chunkstar-disk", file=sys.stderr)
        return 2
    if args.chunkstar_budget is not None and args.system not in CHUNKSTAR_SYSTEMS:
        print("chunkstar-bench max-scale: --chunkstar-budget is only for the chunkstar systems", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    best, records = search(
        args.system, models, args.cap, db=ResultsDB(args.db), strategy=args.strategy,
        batch=args.batch, seq_len=args.seq, hardware=args.hardware, timeout_s=args.timeout,
        disk_dir=None if disk_dir is None else str(disk_dir), nvme_params=args.nvme_params,
        steps=args.steps, warmup=args.warmup, chunkstar_budget=args.chunkstar_budget,
        chunkstar_staging=args.staging,
    )  # fmt: skip
    for r in records:
        print(f"  {r.spec.model:>10} {(r.n_params or 0) / 1e6:>8,.1f}M  {r.status:5}  {peaks(r)}  {r.message}")
    size = "none" if best is None else f"{best} ({n_params(get(best)) / 1e6:,.1f}M parameters)"
    print(f"max-scale {args.system} under a host-memory cap of {args.cap / GIB:.2f} GiB: largest trained = {size}")
    return 0


def _register_plan(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    # `plan` lives in its own package; imported here only when the CLI is built.
    # It needs chunkstar itself; when that import fails, `plan` says why and the other commands still work.
    try:
        from chunkstar_bench.plan.command import add_plan_command
    except ImportError as exc:
        broken = f"chunkstar-bench plan is unavailable: {type(exc).__name__}: {exc}"
        p = sub.add_parser("plan", help="(unavailable here; run it to see why)")
        p.set_defaults(func=lambda _args: (print(broken, file=sys.stderr), 2)[1])
        return
    add_plan_command(sub)


def _register_step_time(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from chunkstar_bench.comparisons.command import add_step_time_command

    add_step_time_command(sub)


def _register_overlap(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from chunkstar_bench.comparisons.command import add_overlap_command

    add_overlap_command(sub)


def _register_activations(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from chunkstar_bench.comparisons.command import add_activations_command

    add_activations_command(sub)


COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {  # type: ignore[type-arg]
    "run": _register_run,
    "step-time": _register_step_time,
    "overlap": _register_overlap,
    "activations": _register_activations,
    "report": _register_report,
    "max-scale": _register_maxscale,
    "plan": _register_plan,
}
"""Subcommand name -> function adding its parser to the subparsers (and ``set_defaults(func=...)``)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkstar-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in COMMANDS.values():
        register(sub)
    args = parser.parse_args(argv)
    from chunkstar_bench.results import ResultsFileError  # stdlib only: every command may take a --db

    try:
        return int(args.func(args))
    except ResultsFileError as err:  # a results file a command cannot use: one line, the status of a usage error
        print(f"chunkstar-bench {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
