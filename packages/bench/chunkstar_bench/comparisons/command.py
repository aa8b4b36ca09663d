"""``chunkstar-bench step-time``, ``overlap`` and ``activations``: parse the rows and rounds, run, print the table.

Entry points only: the rows and targets are :mod:`~chunkstar_bench.comparisons.step_time`'s,
:mod:`~chunkstar_bench.comparisons.overlap`'s and :mod:`~chunkstar_bench.comparisons.activations`',
the running and pooling :mod:`~chunkstar_bench.comparisons.rounds`'. The exit status is 0
whenever the comparison ran: a failed row or a missed target is a finding, printed in the
table. With ``--db`` every run is appended to a results database (suite ``step-time``,
``overlap`` or ``activations``, its row name in the record's details); ``--json`` writes the
whole comparison to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from chunkstar_bench.comparisons import activations, overlap, step_time
from chunkstar_bench.comparisons.rounds import Pooled, Row, Target, Unrunnable, Verdict, judge, run_rows
from chunkstar_bench.runner import RunRecord, git_commit, versions
from chunkstar_bench.units import GIB, MIB

__all__ = ["add_activations_command", "add_overlap_command", "add_step_time_command"]


def _names(parser: argparse.ArgumentParser, text: str, known: Sequence[str]) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        parser.error(f"--systems: unknown {unknown}; choose from {','.join(known)}")
    return [n for n in known if n in names]  # fixed order, no repeats


def _common(p: argparse.ArgumentParser, known: Sequence[str], default: Sequence[str], rounds: int) -> None:
    p.add_argument("--systems", default=",".join(default), help=f"comma-separated rows, of {','.join(known)} (default %(default)s)")
    p.add_argument("--rounds", type=int, default=rounds,
                   help="run the rows round-robin this many times, a fresh process each, and pool the timed steps (default %(default)s)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run (default %(default)s)")
    p.add_argument("--db", type=Path, help="also append every run to this results SQLite")
    p.add_argument("--json", type=Path, metavar="OUT", help="also write the comparison here as JSON")
    p.add_argument("--hardware", default="cpu", help="label for this machine in the records (default %(default)s)")


def _check_counts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")


def add_step_time_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``step-time``."""
    p = sub.add_parser(
        "step-time",
        help="step time and peak RSS of PyTorch, chunkstar (with and without pressure) and DeepSpeed side by side, with ratio targets",
        description=step_time.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _common(p, step_time.ROW_NAMES, step_time.DEFAULT_ROWS, rounds=1)
    d = step_time.StepTimeSettings()
    p.add_argument("--model", default=d.model, help="zoo model (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per row and round (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps before timing (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step (default %(default)s)")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, help="torch threads in every run (default: the cores)")
    p.add_argument("--free-budget-gib", type=float, default=d.free_budget_bytes / GIB,
                   help="chunkstar's device budget without pressure (default %(default)s)")
    p.add_argument("--pressure-fraction", type=float, default=d.pressure_fraction,
                   help="chunkstar-pressure: room for chunks, as a fraction of the bf16 parameter bytes, on top of the "
                   "non-model peak the chunkstar row measured (default %(default)s)")
    p.add_argument("--pressure-budget-mib", type=float, help="chunkstar-pressure's device budget in MiB; overrides --pressure-fraction")
    p.add_argument("--overhead-model", default=d.overhead_model,
                   help="the overhead case's zoo model (rows pytorch-overhead, chunkstar-overhead; default %(default)s)")
    p.add_argument("--overhead-batch", type=int, default=d.overhead_batch, help="the overhead case's sequences per step (default %(default)s)")
    p.add_argument("--overhead-seq", type=int, default=d.overhead_seq, help="the overhead case's tokens per sequence (default %(default)s)")

    def go(args: argparse.Namespace) -> int:
        _check_counts(p, args)
        settings = step_time.StepTimeSettings(
            model=args.model, batch=args.batch, seq=args.seq, steps=args.steps, warmup=args.warmup, seed=args.seed,
            threads=args.threads, free_budget_bytes=int(args.free_budget_gib * GIB),
            pressure_fraction=args.pressure_fraction, hardware=args.hardware,
            pressure_budget_bytes=None if args.pressure_budget_mib is None else int(args.pressure_budget_mib * MIB),
            overhead_model=args.overhead_model, overhead_batch=args.overhead_batch, overhead_seq=args.overhead_seq,
        )  # fmt: skip
        try:
            rows = step_time.rows(settings, _names(p, args.systems, step_time.ROW_NAMES))
        except (KeyError, ValueError) as err:  # an unknown model, a seq past its positions
            p.error(str(err.args[0]))
        return _compare("step-time", args, rows, step_time.TARGETS, dataclasses.asdict(settings),
                        lambda pooled, verdicts: step_time.report(settings, pooled, verdicts, args.rounds))  # fmt: skip

    p.set_defaults(func=go)


def add_overlap_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``overlap``."""
    p = sub.add_parser(
        "overlap",
        help="chunkstar's copies overlapped vs serial under an emulated 1 and 8 GB/s link, beside PyTorch and DeepSpeed",
        description=overlap.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _common(p, overlap.ROW_NAMES, overlap.ROW_NAMES, rounds=2)
    d = overlap.OverlapSettings()
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per run (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps first (default %(default)s)")
    p.add_argument("--budget-fraction", type=float, default=d.budget_fraction,
                   help="the pressured rows' room for chunks, of the bf16 parameter bytes (default %(default)s)")
    p.add_argument("--no-predict", action="store_true",
                   help="skip the time model's prediction of the chunkstar rows (a calibration of this machine and a dry "
                   "run per row, after the rows ran)")

    def go(args: argparse.Namespace) -> int:
        _check_counts(p, args)
        settings = overlap.OverlapSettings(
            steps=args.steps, warmup=args.warmup, budget_fraction=args.budget_fraction, hardware=args.hardware
        )
        rows = overlap.rows(settings, _names(p, args.systems, overlap.ROW_NAMES))
        predicted: dict[str, overlap.Predicted] = {}

        def report(pooled: dict[str, Pooled], verdicts: list[Verdict]) -> str:
            if not args.no_predict:  # after the rows, so the calibration and dry runs never run beside them
                predicted.update(overlap.predict_rows([p.row for p in pooled.values() if p.ok]))
            return overlap.report(settings, pooled, verdicts, args.rounds, predicted)

        return _compare("overlap", args, rows, overlap.TARGETS, dataclasses.asdict(settings), report,
                        extra_json=lambda: {"predictions": {name: pred.as_dict() for name, pred in predicted.items()}})  # fmt: skip

    p.set_defaults(func=go)


def add_activations_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``activations``."""
    p = sub.add_parser(
        "activations",
        help="keep, HF checkpointing, offload and auto activation policies under one pressured device budget, "
        "and the longest sequence each trains, with the issue's targets",
        description=activations.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    _common(p, activations.ROW_NAMES, activations.ROW_NAMES, rounds=1)
    d = activations.ActivationsSettings()
    p.add_argument("--model", default=d.model, help="zoo model (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per step (default %(default)s)")
    p.add_argument("--seq", type=int, default=d.seq, help="tokens per sequence (default %(default)s)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=d.precision,
                   help="chunks and compute; fp32 here, where bf16 matmuls are slow (default %(default)s)")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per row and round (default %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="untimed steps before timing, fixed policies (default %(default)s)")
    p.add_argument("--auto-warmup", type=int, default=d.auto_warmup,
                   help="untimed steps before timing, the auto rows: measured, planned, traced (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, help="torch threads in every run (default: the cores)")
    p.add_argument("--link", default=d.link, help="the emulated device link of every row (default %(default)s)")
    p.add_argument("--free-budget-gib", type=float, default=d.free_budget_bytes / GIB,
                   help="the free rows' device budget (default %(default)s)")
    p.add_argument("--pressure-fraction", type=float, default=d.pressure_fraction,
                   help="the pressured budget: HF checkpointing's measured need plus this fraction of the gap to "
                   "keep's (default %(default)s)")
    p.add_argument("--pressure-budget-mib", type=float, help="the pressured budget in MiB; overrides --pressure-fraction")
    p.add_argument("--search-seqs", default=",".join(str(s) for s in d.search_seqs),
                   help="sequence lengths of the longest-sequence search, comma-separated; 'none' for no search "
                   "(default %(default)s)")

    def go(args: argparse.Namespace) -> int:
        _check_counts(p, args)
        if args.auto_warmup < 0:
            p.error("--auto-warmup must be >= 0")
        try:
            seqs = () if args.search_seqs.strip() == "none" else tuple(int(s) for s in args.search_seqs.split(",") if s.strip())
        except ValueError:
            p.error(f"--search-seqs: not a list of integers: {args.search_seqs!r}")
        settings = activations.ActivationsSettings(
            model=args.model, batch=args.batch, seq=args.seq, precision=args.precision, steps=args.steps,
            warmup=args.warmup, auto_warmup=args.auto_warmup, seed=args.seed, threads=args.threads, link=args.link,
            free_budget_bytes=int(args.free_budget_gib * GIB), pressure_fraction=args.pressure_fraction,
            pressure_budget_bytes=None if args.pressure_budget_mib is None else int(args.pressure_budget_mib * MIB),
            search_seqs=seqs, hardware=args.hardware,
        )  # fmt: skip
        try:
            rows = activations.rows(settings, _names(p, args.systems, activations.ROW_NAMES))
        except (KeyError, ValueError) as err:  # an unknown model, a seq past its positions, no sizing rows
            p.error(str(err.args[0]))
        chosen: list[activations.Sizing] = []
        found: dict[str, list[activations.Attempt]] = {}

        def after_rows(pooled: dict[str, Pooled], on_record: Callable[[Row, RunRecord], None] | None) -> list[Verdict]:
            latest = {name: p.records[0] for name, p in pooled.items() if p.records}
            try:
                chosen.append(activations.sizing(settings, latest))
            except Unrunnable:
                return []  # no pressured budget: no search (the rows' notes say why)
            if settings.search_seqs:
                found.update(activations.search(settings, chosen[0].budget, pooled, args.timeout, on_record))
            verdict = activations.judge_search(found)
            return [] if verdict is None else [verdict]

        def report(pooled: dict[str, Pooled], verdicts: list[Verdict]) -> str:
            return activations.report(settings, pooled, verdicts, args.rounds, chosen[0] if chosen else None, found)

        def extra() -> dict[str, Any]:
            sized = dataclasses.asdict(chosen[0]) if chosen else None
            return {"pressured_budget": sized, "longest_sequence": {n: [a.as_dict() for a in t] for n, t in found.items()}}

        return _compare("activations", args, rows, activations.TARGETS, dataclasses.asdict(settings), report,
                        extra_json=extra, after_rows=after_rows)  # fmt: skip

    p.set_defaults(func=go)


def _compare(
    suite: str, args: argparse.Namespace, rows: Sequence[Row], targets: Sequence[Target], settings: Mapping[str, Any],
    report: Callable[[dict[str, Pooled], list[Verdict]], str], *, extra_json: Callable[[], Mapping[str, Any]] | None = None,
    after_rows: Callable[[dict[str, Pooled], Callable[[Row, RunRecord], None] | None], list[Verdict]] | None = None,
) -> int:  # fmt: skip
    """Run the rows, print ``report``'s table; with ``--json`` write the comparison, and what
    ``extra_json()`` returns once the report is made (the overlap table's predictions).
    ``after_rows(pooled, on_record)`` runs once the rows ran (the activations table's sequence
    search, whose runs go to ``--db`` through ``on_record`` too) and returns verdicts of its own."""
    on_record: Callable[[Row, RunRecord], None] | None = None
    appended = 0
    if args.db is not None:
        from chunkstar_bench.results import ResultsDB

        db = ResultsDB(args.db)

        def on_record(_row: Row, record: RunRecord) -> None:
            nonlocal appended
            db.append(record, suite=suite)
            appended += 1

    pooled = run_rows(rows, args.rounds, args.timeout, on_record=on_record)
    verdicts = judge(targets, pooled)
    if after_rows is not None:
        verdicts += after_rows(pooled, on_record)
    print(report(pooled, verdicts))
    if args.db is not None:
        print(f"\n{appended} runs appended to {args.db} (suite {suite!r})", file=sys.stderr)
    if args.json is not None:
        document = {
            "benchmark": suite,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "settings": dict(settings),
            "rounds": args.rounds,
            "versions": versions(),
            "git_commit": git_commit(),
            "rows": {
                name: {"label": p.row.label, "records": [dataclasses.asdict(r) for r in p.records]} for name, p in pooled.items()
            },
            "comparisons": [
                {"name": v.target.name, "value": v.value, "target": v.target.bound, "verdict": v.verdict} for v in verdicts
            ],
            **(extra_json() if extra_json is not None else {}),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0
