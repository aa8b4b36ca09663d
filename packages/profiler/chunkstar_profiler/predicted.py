"""A predicted profile: a dry run's step on the time model's clock, in the profiler's own format.

``chunkstar.dry_run`` keeps every event of one rank's last step (moments, chunk
moves, allocations, memory samples, stages) as the real engine emitted them on
the meta device, and the time model (``chunkstar.dryrun.timing``) says when each
moment's compute and each move would run on the hardware. :func:`predicted_profile`
feeds those events through the recorder with their times replaced by the
predicted ones, so the viewer's memory timeline, chunk map and per-operator moves,
the summary and the Perfetto export show a run no machine here could hold.

Times: a move takes its predicted start and end; a moment begins at its predicted
compute start; every other event (samples, allocations, stage changes, the
moment's end, an activation move's start and end: the time model has no copies
of activations) sits at the same fraction of its moment on the predicted clock as
on the dry run's own (the moments' recorded and predicted starts, and the step's
ends, are matched and everything between is placed linearly).
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from typing import Any

from chunkstar.dryrun import DryRunReport, predict
from chunkstar.dryrun.record import StepRecord
from chunkstar.dryrun.timing import Prediction
from chunkstar.events import ActivationMoved, ChunkMoved, Event, MomentBegin

from chunkstar_profiler.profile import Profile, build_profile
from chunkstar_profiler.recorder import Profiler, _jsonable, _versions

__all__ = ["predicted_profile", "write_predicted_profile"]

_NS = 1_000_000_000


class _Replay(Profiler):
    """The recorder, fed a recorded step's events instead of an engine's."""

    def __init__(self, report: DryRunReport, rank: int, record: StepRecord, prediction: Prediction) -> None:
        self.report = report
        self.rank_report = report.ranks[rank]
        self.record = record
        self.prediction = prediction
        self.model_name = "dry run"
        self._init_columns()

    def meta(self) -> dict[str, Any]:
        s = self.rank_report.stats
        hw = self.report.hardware
        return {
            "model_name": f"dry run, rank {self.rank_report.rank} of {self.report.world_size}",
            "n_params": int(s["n_params"]),
            "config": _jsonable(dict(self.report.config)),
            "versions": _versions(),
            "device": f"{self.report.target} (predicted on {hw.name if hw else '?'})",
            "precision": str(s["precision"]),
            "budget_bytes": int(s["device_budget_bytes"]),
            "chunk_size": int(s["chunk_size"]),
            "n_chunks": int(s["n_chunks"]),
            "chunk_lists": ["param", "master", "exp_avg", "exp_avg_sq"],
            "model_data_bytes": int(s["model_data_bytes"]),
            "iterations": self._iteration + 1,
            "host": "dry run",
            "platform": hw.description if hw else "",
            "pid": 0,
            "tiers": ["device", "host", *(["disk"] if s.get("disk_bytes_read") is not None else [])],
            "predicted": {
                "seconds_per_step": self.prediction.seconds,
                "binding": self.prediction.binding,
                "busy": dict(self.prediction.busy),
                "flops": self.prediction.flops,
                "world_size": self.report.world_size,
                "rank": self.rank_report.rank,
            },
        }


def _clock(events: list[Event], prediction: Prediction) -> Any:
    """Recorded ns -> predicted ns, linear between matched points: each moment's begin
    (its predicted compute start) and the step's first and last events (0 and the
    predicted step time)."""
    begins = [e.t_ns for e in events if isinstance(e, MomentBegin)]
    first = min((_t(e) for e in events), default=0)
    last = max((_t(e) for e in events), default=0)
    src = [first, *begins, max(last, begins[-1] + 1 if begins else first + 1)]
    dst = [0.0, *prediction.moment_starts[: len(begins)], prediction.seconds]
    pairs = sorted(zip(src, dst))
    xs = [p[0] for p in pairs]
    ys = [p[1] for p in pairs]

    def at(t: int) -> int:
        i = max(1, min(len(xs) - 1, bisect.bisect_right(xs, t)))
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        y = y0 if x1 == x0 else y0 + (y1 - y0) * (t - x0) / (x1 - x0)
        return int(round(max(y0, min(y, max(y0, y1))) * _NS))

    return at


def _t(e: Event) -> int:
    return e.t_start_ns if isinstance(e, (ChunkMoved, ActivationMoved)) else e.t_ns


def _replayed(report: DryRunReport, rank: int) -> tuple[_Replay, int]:
    index = {r.rank: i for i, r in enumerate(report.ranks)}
    if rank not in index:
        raise ValueError(f"the dry run simulated ranks {sorted(index)}, not {rank}")
    rr = report.ranks[index[rank]]
    if rr.record is None:
        raise ValueError(f"rank {rank} recorded no step (it does not fit: {rr.error.splitlines()[0] if rr.error else '?'})")
    if report.hardware is None:
        raise ValueError("a predicted profile needs the dry run's hardware= (the time model's clock)")
    prediction = predict(rr.record, report.hardware, overlap=report.overlap)
    replay = _Replay(report, index[rank], rr.record, prediction)
    events = rr.record.events
    at = _clock(events, prediction)
    for list_name, cid, tier in rr.record.placements_at_start:
        replay._placement_open[(list_name, cid, tier)] = 0
    moves = iter(rr.record.moves())
    for e in events:
        if isinstance(e, ChunkMoved):
            mv = next(moves)
            start, end = prediction.move_spans.get(mv.seq, (at(e.t_start_ns) / _NS, at(e.t_end_ns) / _NS))
            replay._on_event(dataclasses.replace(e, t_start_ns=int(start * _NS), t_end_ns=int(end * _NS)))
        elif isinstance(e, ActivationMoved):
            replay._on_event(dataclasses.replace(e, t_start_ns=at(e.t_start_ns), t_end_ns=at(e.t_end_ns)))
        else:
            replay._on_event(dataclasses.replace(e, t_ns=at(e.t_ns)))
    end = max(int(prediction.seconds * _NS), *replay.moves["t_end"], *replay.activation_moves["t_end"], 0)
    replay.stop_at(end)
    return replay, end


def predicted_profile(report: DryRunReport, rank: int = 0) -> Profile:
    """Rank ``rank``'s last dry-run step as a :class:`Profile` on the predicted clock
    (needs a report with ``hardware``; see the module's docstring)."""
    replay, end = _replayed(report, rank)
    return build_profile(replay._columns(end), replay.meta())


def write_predicted_profile(report: DryRunReport, path: str | os.PathLike[str], rank: int = 0) -> str:
    """:func:`predicted_profile` written to ``path`` in the profiler's file format
    (``chunkstar-profile view PATH`` opens it)."""
    from chunkstar_profiler.fileformat import write_profile

    replay, end = _replayed(report, rank)
    return write_profile(path, replay._columns(end), replay.meta())
