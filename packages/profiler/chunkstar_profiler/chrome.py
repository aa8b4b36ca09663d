"""Export a profile as Chrome trace JSON, which Perfetto (ui.perfetto.dev) opens.

Tracks (all in one process "chunkstar"):

* ``stages``            complete (``X``) events per fwd/bwd/optim band;
* ``moments``           one ``X`` event per moment (module pre-hook to its end);
* ``moves to device`` / ``moves to host``  one ``X`` event per chunk move, one
  track per direction (on CUDA, prefetches run on the copy stream);
* ``disk stage in/out`` the disk tier's moves (stage-in disk -> host, stage-out
  host -> disk), present only when the profile has them. Their I/O runs on the
  disk tier's threads, so each is a zero-length ``X`` event at the time it was
  issued;
* ``moves (other)``     moves to a tier this exporter does not know (a newer
  core's), present only when there are some;
* ``activations to host`` / ``activations to device``  the activation moves
  (saved activations across the host link), one ``X`` event each named by its
  block (``h.3 -> host``, category ``activation``, args ``bytes``, ``block``,
  ``prefetch``, ...), present only when the profile has some. A copy's slice
  runs until it was found done, so two copies of one direction may overlap
  partly; Perfetto misdraws that on one track, so such a slice goes to a
  second lane, ``activations to host (2)``, and so on;
* counters (``C``)      ``device memory`` and ``host memory`` with series
  chunk / non-model, plus ``device budget``; with the disk tier, ``disk memory``
  with one series, chunk files;
* flows (``s``/``f``)   from each moment to every move it caused (activation
  moves too).

Times are microseconds, as the format wants.
"""

from __future__ import annotations

import heapq
import json
import os
from typing import Any

import pandas as pd

from chunkstar_profiler.profile import Profile

__all__ = ["export_chrome_trace", "chrome_trace_events"]

_PID = 1
_TID = {"stages": 1, "moments": 2, "device": 3, "host": 4, "disk": 5, "other": 6}
_TRACK_NAMES = {
    "stages": "stages", "moments": "moments (modules)", "device": "moves to device", "host": "moves to host",
    "disk": "disk stage in/out", "other": "moves (other)",
}  # fmt: skip
_OPTIONAL_TRACKS = ("disk", "other")
"""Tracks named only when some move is on them."""


_ACTIVATION_DIRECTIONS = ("host", "device")
"""The activation tracks' order (offloads happen first); a direction to another tier follows them."""


def _lanes(spans: list[tuple[float, float]]) -> list[int]:
    """A lane for each (start, end) so that no two slices of one lane overlap (touching is fine),
    with as few lanes as that takes: greedy in start order, reusing the lane that frees first."""
    lanes = [0] * len(spans)
    free: list[tuple[float, int]] = []  # (end of its last slice, lane)
    for i in sorted(range(len(spans)), key=lambda i: spans[i]):
        start, end = spans[i]
        if free and free[0][0] <= start:
            lane = heapq.heappop(free)[1]
        else:
            lane = len(free)
        lanes[i] = lane
        heapq.heappush(free, (end, lane))
    return lanes


def _activation_tracks(am: pd.DataFrame, first_tid: int) -> tuple[list[tuple[int, str]], list[int]]:
    """The activation moves' tracks (tid, name), from ``first_tid`` on, and each move's tid."""
    directions = [d for d in _ACTIVATION_DIRECTIONS if d in set(am["dst"])] + sorted(set(am["dst"]) - set(_ACTIVATION_DIRECTIONS))
    tracks: list[tuple[int, str]] = []
    tids = [0] * len(am)
    # as the slices will be written: rounded to the format's microseconds
    starts = [_us(t) for t in am["t_start_s"]]
    ends = [t + _us(max(d, 0.0)) for t, d in zip(starts, am["duration_s"])]
    for dst in directions:
        rows = [i for i, d in enumerate(am["dst"]) if d == dst]
        spans = [(starts[i], ends[i]) for i in rows]
        lanes = _lanes(spans)
        base = first_tid + len(tracks)
        for lane in range(max(lanes) + 1):
            tracks.append((base + lane, f"activations to {dst}" + (f" ({lane + 1})" if lane else "")))
        for i, lane in zip(rows, lanes):
            tids[i] = base + lane
    return tracks, tids


def _move_track(src: str, dst: str) -> str:
    if src == "disk" or dst == "disk":
        return "disk"
    return dst if dst in ("device", "host") else "other"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace_events(profile: Profile) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": f"chunkstar: {profile.meta.get('model_name', '')}"}}
    ]
    tracks = [_move_track(src, dst) for src, dst in zip(profile.moves["src"], profile.moves["dst"])]
    for key, tid in _TID.items():
        if key in _OPTIONAL_TRACKS and key not in tracks:
            continue
        ev.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": _TRACK_NAMES[key]}})
        ev.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    am = profile.activation_moves
    am_tracks, am_tids = _activation_tracks(am, max(_TID.values()) + 1)
    for tid, name in am_tracks:
        ev.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": name}})
        ev.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})

    for r in profile.stages.itertuples(index=False):
        ev.append({"ph": "X", "pid": _PID, "tid": _TID["stages"], "name": r.stage, "cat": "stage",
                   "ts": _us(r.t_start_s), "dur": _us(r.t_end_s - r.t_start_s), "args": {"iteration": int(r.iteration)}})  # fmt: skip

    mo_start = profile.moments["t_start_s"].to_numpy()
    mo_end = profile.moments["t_end_s"].to_numpy()
    for r in profile.moments.itertuples(index=False):
        ev.append({"ph": "X", "pid": _PID, "tid": _TID["moments"], "name": r.module, "cat": r.stage,
                   "ts": _us(r.t_start_s), "dur": _us(max(r.t_end_s - r.t_start_s, 0.0)),
                   "args": {"iteration": int(r.iteration), "index": int(r.index), "stage": r.stage}})  # fmt: skip

    def flow(i: int, row: int, tid: int, ts: float) -> None:
        if 0 <= row < len(mo_start):
            # flow arrow: the moment (operator) that caused this move -> the move; the
            # start sits inside the moment's slice so Perfetto binds it there
            start_ts = min(max(ts, _us(mo_start[row])), _us(mo_end[row]))
            ev.append({"ph": "s", "pid": _PID, "tid": _TID["moments"], "id": i, "name": "caused", "cat": "cause", "ts": start_ts})
            ev.append({"ph": "f", "bp": "e", "pid": _PID, "tid": tid, "id": i, "name": "caused", "cat": "cause", "ts": ts})

    for i, (r, track) in enumerate(zip(profile.moves.itertuples(index=False), tracks)):
        tid = _TID[track]
        name = f"{r.chunk_list}[{r.chunk_id}] " + (r.reason.replace("_", "-") if track == "disk" else f"-> {r.dst}")
        ts = _us(r.t_start_s)
        ev.append({"ph": "X", "pid": _PID, "tid": tid, "name": name, "cat": r.reason, "ts": ts,
                   "dur": _us(max(r.duration_s, 0.0)),
                   "args": {"bytes": int(r.nbytes), "reason": r.reason, "chunk_list": r.chunk_list,
                            "chunk_id": int(r.chunk_id), "module": r.module, "src": r.src, "dst": r.dst}})  # fmt: skip
        flow(i, int(r.moment_row), tid, ts)

    for i, (a, tid) in enumerate(zip(am.itertuples(index=False), am_tids), start=len(profile.moves)):  # flow ids after the moves'
        ts = _us(a.t_start_s)
        ev.append({"ph": "X", "pid": _PID, "tid": tid, "name": f"{a.block} -> {a.dst}", "cat": "activation", "ts": ts,
                   "dur": _us(max(a.duration_s, 0.0)),
                   "args": {"bytes": int(a.nbytes), "block": a.block, "prefetch": bool(a.prefetch), "module": a.module,
                            "src": a.src, "dst": a.dst}})  # fmt: skip
        flow(i, int(a.moment_row), tid, ts)

    for r in profile.memory.itertuples(index=False):
        ts = _us(r.t_s)
        if r.tier == "disk":  # the chunk files: nothing else is measured there
            args = {"chunk files": int(r.chunk_bytes)}
        else:
            args = {"chunk": int(r.chunk_bytes), "non-model": int(r.non_model_bytes)}
        ev.append({"ph": "C", "pid": _PID, "name": f"{r.tier} memory", "ts": ts, "args": args})
        if r.tier == "device" and r.budget_bytes > 0:
            ev.append({"ph": "C", "pid": _PID, "name": "device budget", "ts": ts, "args": {"budget": int(r.budget_bytes)}})
    return ev


def export_chrome_trace(profile: Profile, out: str | os.PathLike[str]) -> str:
    """Write ``profile`` as Chrome trace JSON to ``out``; returns the path."""
    out = os.fspath(out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    doc = {"traceEvents": chrome_trace_events(profile), "displayTimeUnit": "ms", "metadata": {"chunkstar": profile.meta}}
    with open(out, "w", encoding="utf-8") as f:
        json.dump(doc, f, default=str)
    return out
