"""Side-by-side comparisons: labelled runs interleaved over rounds, pooled, checked against ratio targets.

A comparison (``chunkstar-bench step-time``, ``overlap``, ``activations``) is a
list of :class:`Row` -- a name, a label and the :class:`~chunkstar_bench.runner.RunSpec`
it runs, each run its own process through :func:`chunkstar_bench.runner.run`
-- and a list of :class:`Target` ratios between rows. :func:`run_rows` runs
every row once per round, round-robin (so slow spells of a shared machine fall
on all rows alike), and pools each row's timed steps over the rounds
(:class:`Pooled`); :func:`judge` turns the targets into PASS / MISS verdicts. A
MISS is a finding, not an error.

This module runs and pools, and prints what every comparison prints alike (the
verdicts, the frame of the notes: :func:`notes`); which rows and targets a
comparison has, and what its notes say of a row, is its own module's
(:mod:`~chunkstar_bench.comparisons.step_time`,
:mod:`~chunkstar_bench.comparisons.overlap`,
:mod:`~chunkstar_bench.comparisons.activations`). A row whose spec is made from
another's record may find none to make it from (:class:`Unrunnable`): it is not
run, and its record says why.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.tables import text_table

__all__ = [
    "BUSY_CORES", "Pooled", "Row", "Target", "Unrunnable", "Verdict", "judge", "judge_value", "notes", "other_load", "run_rows",
    "text_table", "verdict_table",
]  # fmt: skip

BUSY_CORES = 0.25
"""Foreign CPU load (cores, the most over a row's rounds) above which a comparison warns."""


class Unrunnable(Exception):
    """Raised by a :attr:`Row.refine` that cannot make the row's spec (the run it is sized on
    failed): the row is not run, and its record for the round is an ``error`` with the reason."""


@dataclass(frozen=True)
class Row:
    """One line of a comparison: a spec, run once per round in its own process."""

    name: str
    """Its key on the command line (``--systems``) and in the targets."""
    label: str
    """Its name in the table."""
    spec: RunSpec
    refine: Callable[[RunSpec, Mapping[str, RunRecord]], RunSpec] | None = None
    """Called before each run with the latest record of every row run so far; the spec to run
    (how ``chunkstar-pressure`` sizes its budget on the non-model peak chunkstar measured),
    or :class:`Unrunnable` when there is none."""


@dataclass
class Pooled:
    """A row's records over the rounds, and its figures with the timed steps of every round pooled."""

    row: Row
    records: list[RunRecord] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.records) and all(r.status == "ok" for r in self.records)

    @property
    def failure(self) -> RunRecord | None:
        """The first record that is not ``ok``."""
        return next((r for r in self.records if r.status != "ok"), None)

    @property
    def step_times(self) -> list[float]:
        return [float(t) for r in self.records for t in r.details.get("step_times_s", [])]

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times)

    @property
    def peak_host_bytes(self) -> int:
        """The highest peak RSS of any round (``ru_maxrss``: imports, set-up and warm-up included)."""
        return max(r.peak_host_bytes or 0 for r in self.records)

    @property
    def other_load(self) -> float | None:
        """The most foreign CPU load (cores) any round saw during its timed steps; None when unmeasured."""
        loads = [r.details["other_load_cores"] for r in self.records if r.details.get("other_load_cores") is not None]
        return max(loads) if loads else None

    @property
    def losses(self) -> list[float]:
        """The first round's losses, warm-up included (every round trains the same steps from the same weights)."""
        return [float(v) for v in self.records[0].details.get("losses", [])] if self.records else []

    def metric(self, name: Literal["step", "rss"]) -> float:
        return self.median_s if name == "step" else float(self.peak_host_bytes)


def run_rows(
    rows: Sequence[Row], rounds: int, timeout_s: float, *, on_record: Callable[[Row, RunRecord], None] | None = None
) -> dict[str, Pooled]:
    """Every row once per round, round-robin, each in a fresh process; the pooled records by row name.

    ``on_record`` sees each record as soon as its run ends (to append it to a results DB)."""
    pooled = {row.name: Pooled(row) for row in rows}
    latest: dict[str, RunRecord] = {}
    total = rounds * len(rows)
    n = 0
    for round_no in range(1, rounds + 1):
        for row in rows:
            n += 1
            tag = f"[{n}/{total}]" + (f" round {round_no}" if rounds > 1 else "")
            try:
                spec = row.refine(row.spec, latest) if row.refine is not None else row.spec
            except Unrunnable as why:  # nothing to run: the row's failure says why
                print(f"{tag} {row.name}: not run: {why}", file=sys.stderr, flush=True)
                record = RunRecord(spec=row.spec, status="error", message=f"not run: {why}")
                record.details["row"] = row.name
                latest[row.name] = record
                pooled[row.name].records.append(record)
                continue
            print(f"{tag} {row.name} ...", file=sys.stderr, flush=True)
            record = run(spec, timeout_s)
            record.details["row"] = row.name
            latest[row.name] = record
            pooled[row.name].records.append(record)
            if on_record is not None:
                on_record(row, record)
            shown = f"{record.step_time_s:.3f} s/step" if record.status == "ok" else f"{record.status}: {record.message}"
            print(f"{tag} {row.name}: {shown} ({record.wall_s or 0:.0f} s in all)", file=sys.stderr, flush=True)
    return pooled


@dataclass(frozen=True)
class Target:
    """A ratio between two rows' figures, and the bound it should meet."""

    numerator: str
    denominator: str
    metric: Literal["step", "rss", "seq"]
    """``step``: median step time; ``rss``: peak host RSS; ``seq``: the longest sequence that
    trained (a search the comparison runs itself and judges with :func:`judge_value`, not :func:`judge`)."""
    op: Literal["<=", ">=", "<"] | None
    """How the ratio must compare with ``limit``; None: shown for context, no target."""
    limit: float = 0.0
    text: str = ""
    """The comparison's name in the table; default ``"step time NUM / DEN"`` or ``"peak RSS NUM / DEN"``."""

    @property
    def name(self) -> str:
        what = {"step": "step time", "rss": "peak RSS", "seq": "longest sequence"}[self.metric]
        return self.text or f"{what} {self.numerator} / {self.denominator}"

    @property
    def bound(self) -> str:
        return "(none)" if self.op is None else f"{self.op} {self.limit:.2f}x"


@dataclass(frozen=True)
class Verdict:
    target: Target
    value: float | None
    """The ratio; None where a side did not run or failed."""
    verdict: Literal["PASS", "MISS", "n/a", "-"]


def judge(targets: Sequence[Target], pooled: Mapping[str, Pooled]) -> list[Verdict]:
    """One verdict per target whose two rows were run: PASS, MISS, ``n/a`` (a side failed) or ``-`` (no target)."""
    out: list[Verdict] = []
    for t in targets:
        num, den = pooled.get(t.numerator), pooled.get(t.denominator)
        if num is None or den is None or t.metric == "seq":  # not a pooled figure: judge_value's
            continue
        if not (num.ok and den.ok):
            out.append(Verdict(t, None, "n/a"))
            continue
        out.append(judge_value(t, num.metric(t.metric) / den.metric(t.metric)))
    return out


def judge_value(target: Target, value: float | None) -> Verdict:
    """The verdict of ``target`` on a ratio a comparison measured itself; None: a side did not run (``n/a``)."""
    if value is None:
        return Verdict(target, None, "n/a")
    if target.op is None:
        return Verdict(target, value, "-")
    t = target
    met = value <= t.limit if t.op == "<=" else value >= t.limit if t.op == ">=" else value < t.limit
    return Verdict(target, value, "PASS" if met else "MISS")


def other_load(pooled: Mapping[str, Pooled]) -> list[str]:
    """One line of the foreign CPU load every row saw (the tables have no column for it)."""
    load = {name: p.other_load for name, p in pooled.items() if p.other_load is not None}
    if not load:
        return []
    return [
        "other load (cores busy elsewhere during the timed steps, max over rounds): "
        + ", ".join(f"{name} {v:.2f}" for name, v in load.items())
    ]


def notes(pooled: Mapping[str, Pooled], details: Callable[[str, Pooled], Iterable[str]]) -> list[str]:
    """The lines under a comparison's tables, row by row: a failed row's status and message; for a row
    that ran, the comparison's own ``details(name, row)`` and then the NOTEs of its first record."""
    out: list[str] = []
    for name, p in pooled.items():
        if p.failure is not None:
            out.append(f"{name}: {p.failure.status}: {p.failure.message}")
            continue
        out.extend(details(name, p))
        out.extend(f"{name}: NOTE {note}" for note in p.records[0].details.get("notes", []))
    return out


def verdict_table(verdicts: Sequence[Verdict]) -> str:
    """The targets as a table: comparison, measured ratio, target, verdict."""
    if not verdicts:
        return "(no comparisons among the rows run)"
    return text_table(
        ["comparison", "measured", "target", "verdict"],
        [[v.target.name, _measured(v), v.target.bound, v.verdict] for v in verdicts],
    )


def _measured(v: Verdict) -> str:
    """The ratio to two places; to three where two would print the limit itself (0.853 against <= 0.85)."""
    if v.value is None:
        return "-"
    shown = f"{v.value:.2f}"
    return f"{v.value:.3f}x" if v.target.op is not None and shown == f"{v.target.limit:.2f}" and v.value != v.target.limit else f"{shown}x"
