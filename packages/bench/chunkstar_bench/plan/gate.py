"""The dry-run table's figures in a results database, and its regression gate against the last run's.

:func:`store` appends a ``chunkstar-bench plan --dry-run`` run to a results
SQLite (:class:`chunkstar_bench.results.ResultsDB`, the bench's one layout) as
rows like any other figure, one per dry run:

* suite :data:`POINT_SUITE`: every dry run of the paper table, status ``ok``
  when it fits, ``oom`` when it does not (the message says where), ``error``
  when the dry run failed; ``step_time_s`` and ``tflops_per_gpu_patrickstar``
  are the *predicted* step and TFLOPS, ``peak_device_bytes`` the smallest budget
  per GPU that fits, ``peak_host_bytes`` the node's host need;
* suite :data:`LARGEST_SUITE`: per node, the largest model that fits (status
  ``ok``; ``oom`` with the smallest model when none does).

Every row says it is a prediction (``config_json``: ``details.kind`` is
``"dry-run prediction"``, ``peak_device_kind`` the dry run's minimum budget). Keep
them in a file of their own (the nightly job's ``results/dryrun.sqlite``), not
beside measurements: the report and the dashboard read every ``ok`` row of a
file as measured.

:func:`gate` compares the newest run in the file with the one before it (rows of
one run share ``created_utc``): a point that fitted and no longer does, a
predicted TFLOPS more than ``threshold`` below the last run's, and a largest
model smaller than the last run's are regressions.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from chunkstar_bench.plan.dryrun import DryRunPoint, DryRunSettings
from chunkstar_bench.plan.paper import LargestRow, PaperRow

__all__ = ["LARGEST_SUITE", "POINT_SUITE", "THRESHOLD", "Regression", "gate", "store"]

POINT_SUITE = "plan-dryrun-paper"
"""Suite name of the paper table's dry runs."""
LARGEST_SUITE = "plan-dryrun-largest"
"""Suite name of the largest model per node."""
THRESHOLD = 0.10
"""A predicted TFLOPS this much below the last run's (relative) is a regression (the nightly trend check's 10%)."""
KIND = "dry-run prediction"


def _record(point: DryRunPoint, settings: DryRunSettings, *, created: str, commit: str, extra: dict[str, Any]) -> Any:
    from chunkstar_bench.runner import RunRecord, RunSpec, versions

    spec = RunSpec(
        system="chunkstar", model=point.model, batch=point.batch, steps=settings.steps, warmup=0, nprocs=point.gpus,
        device="cuda", hardware=point.hardware,
    )  # fmt: skip
    status: Literal["ok", "oom", "error"] = "error" if point.failed else "ok" if point.fits else "oom"
    why = point.why_not
    message = "" if status == "ok" else f"{why}: {point.error}" if point.error else f"{why}"
    if why == "host":
        message = f"host: needs {point.host_need} of {point.host_memory} bytes"
    tflops = point.tflops_per_gpu if point.fits else None
    details = {
        "kind": KIND, "settings": dataclasses.asdict(settings), "chunk_size": point.chunk_size,
        "chunk_elements": point.chunk_elements, "binding": point.binding, "busy": point.busy, "ranks": list(point.ranks),
        "minimum_budget": point.minimum_budget, "host_need": point.host_need, "host_memory": point.host_memory,
        "device_memory": point.device_memory, "tries": list(point.tries), "disk": point.disk, **extra,
    }  # fmt: skip
    return RunRecord(
        spec=spec, status=status, message=message, step_time_s=point.seconds if point.fits else None,
        tokens_per_s=(point.batch * point.seq_len * point.gpus / point.seconds) if point.fits and point.seconds else None,
        tflops_per_gpu_patrickstar=tflops, flops_formulas={"tflops_per_gpu_patrickstar": "patrickstar: 8*N*B*s (predicted step)"},
        peak_device_bytes=point.minimum_budget or None, peak_device_kind="dry-run minimum budget (predicted)",
        peak_host_bytes=point.host_need or None, n_params=point.n_params, wall_s=point.wall_s, created_utc=created,
        versions=versions(), git_commit=commit, host=socket.gethostname(), details=details,
    )  # fmt: skip


def store(
    db_path: str | Path,
    rows: Sequence[PaperRow],
    largest: Sequence[LargestRow],
    settings: DryRunSettings,
    *,
    commit: str,
    created_utc: str | None = None,
) -> int:
    """Append one dry-run table's figures to ``db_path`` (created when new); the rows appended."""
    from chunkstar_bench.results import ResultsDB

    db = ResultsDB(db_path)
    created = created_utc or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    n = 0
    for r in rows:
        if r.chunkstar is None:
            continue
        extra: dict[str, Any] = {}
        if r.point.published_tflops_per_gpu("patrickstar") is not None:
            extra["published_tflops_per_gpu_patrickstar"] = r.point.published_tflops_per_gpu("patrickstar")
        if r.deepspeed is not None:
            extra["deepspeed_estimator"] = dataclasses.asdict(r.deepspeed) | {"fits": r.deepspeed.fits}
        db.append(_record(r.chunkstar, settings, created=created, commit=commit, extra=extra), suite=POINT_SUITE)
        n += 1
    for lr in largest:
        best = lr.chunkstar.best
        point = best if best is not None else (lr.chunkstar.tried[0] if lr.chunkstar.tried else None)
        if point is None:
            continue
        extra = {
            "largest": best is not None, "blocked": lr.chunkstar.blocked.model if lr.chunkstar.blocked else None,
            "deepspeed_estimator_largest": lr.deepspeed_best.model if lr.deepspeed_best else None,
            "formula_largest": lr.formula.best.model if lr.formula.best else None,
        }  # fmt: skip
        db.append(_record(point, settings, created=created, commit=commit, extra=extra), suite=LARGEST_SUITE)
        n += 1
    return n


@dataclass(frozen=True)
class Regression:
    """One figure of the newest run worse than the same figure of the run before."""

    what: str
    """``"fit"``, ``"tflops"`` or ``"largest"``."""
    key: str
    """Which point or node ("a100x8_1tb x8 GPT_DS_68B b8")."""
    now: float
    before: float

    def __str__(self) -> str:
        if self.what == "fit":
            return f"{self.key}: fitted in the last run, does not fit now"
        if self.what == "largest":
            return f"{self.key}: the largest model that fits shrank from {self.before / 1e9:.2f}B to {self.now / 1e9:.2f}B parameters"
        change = (self.now - self.before) / self.before * 100 if self.before else 0.0
        return f"{self.key}: predicted TFLOPS/GPU {self.now:.1f}, was {self.before:.1f} ({change:+.1f}%)"


def _runs(db_path: str | Path) -> Any:
    from chunkstar_bench.results import ResultsDB

    return ResultsDB(db_path, read_only=True).runs(suite=[POINT_SUITE, LARGEST_SUITE])


def gate(db_path: str | Path, threshold: float = THRESHOLD) -> tuple[list[Regression], str]:
    """Regressions of the newest dry-run table in ``db_path`` against the one before, and a line on what
    was compared. No earlier run: nothing to compare (no regressions)."""
    runs = _runs(db_path)
    if runs.empty:
        return [], f"{db_path}: no dry-run table stored"
    stamps = list(dict.fromkeys(runs["created_utc"]))  # in id order: oldest first
    if len(stamps) < 2:
        return [], f"{db_path}: one dry-run table ({stamps[-1]}), nothing earlier to compare with"
    now, before = runs[runs["created_utc"] == stamps[-1]], runs[runs["created_utc"] == stamps[-2]]

    def key(r: Any) -> str:
        return f"{r.hardware} x{r.nprocs} {r.model} b{r.batch}"

    out: list[Regression] = []
    old = {key(r): r for r in before[before["suite"] == POINT_SUITE].itertuples()}
    compared = 0
    for r in now[now["suite"] == POINT_SUITE].itertuples():
        o = old.get(key(r))
        if o is None:
            continue
        compared += 1
        if o.status == "ok" and r.status != "ok":
            out.append(Regression("fit", key(r), 0.0, 1.0))
        elif o.status == "ok" and r.status == "ok":
            a, b = float(r.tflops_per_gpu_patrickstar), float(o.tflops_per_gpu_patrickstar)
            if b > 0 and (b - a) / b > threshold:
                out.append(Regression("tflops", key(r), a, b))
    old_largest = {(r.hardware, r.nprocs): r for r in before[before["suite"] == LARGEST_SUITE].itertuples()}
    nodes = 0
    for r in now[now["suite"] == LARGEST_SUITE].itertuples():
        o = old_largest.get((r.hardware, r.nprocs))
        if o is None:
            continue
        nodes += 1
        size_now = float(r.n_params) if r.status == "ok" else 0.0
        size_before = float(o.n_params) if o.status == "ok" else 0.0
        if size_now < size_before:
            out.append(Regression("largest", f"{r.hardware} x{r.nprocs}", size_now, size_before))
    summary = (
        f"dry-run table of {stamps[-1]} against {stamps[-2]}: {compared} points and {nodes} largest models compared, "
        f"{len(out)} regression(s) (TFLOPS threshold {threshold:.0%})"
    )
    return out, summary
