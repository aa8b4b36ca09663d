"""The recorder: subscribes to a chunk engine's events and keeps them as columns.

``Profiler(engine)`` is a context manager. While it is entered it holds the
engine's memory probe (so non-model memory is measured after warm-up too,
also on the CPU virtual device) and appends every event to plain Python lists,
one per column: an event costs a handful of list appends, nothing is
formatted or written until :meth:`Profiler.save`. Leaving the context
unsubscribes and releases the probe; the engine is then back to paying
nothing.

What it keeps (see :mod:`chunkstar_profiler.profile` for the tables):
moments (one per module pre-hook, plus one per optimizer step), chunk moves
with the moment that caused them, activation moves, stage bands, memory
samples per tier, and placement intervals (which tier held each chunk payload,
from when to when).
With the disk tier, also its stage-in/stage-out moves, its memory samples
(the chunk files' bytes), disk stays in the placements (a chunk's bytes only in
its file) and ``meta["disk_stats"]``: the engine's ``disk_*`` stats over the
recording, the counters (bytes and seconds of reads and writes, staging waits)
as their growth from start to stop, the sizes (chunk files, staging budget and
peak) as at the stop. Reads and writes still in flight at the stop count when
they finish, so not here.

Activation moves (``ActivationMoved``: a block's saved activations offloaded to
the host and brought back, Note [activation offload]) are kept in a table of
their own, never among the chunk moves. The core emits one once its copy is
known to be done, which may be after the moment that issued it has ended, so
it is attributed to the moment its event names (this micro-step's moment of that
index), not to the one open when it arrives. A copy the engine has not yet
found done when the recording stops is not in it.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from typing import Any

from chunkstar import ChunkEngine
from chunkstar.chunk.lists import ChunkList
from chunkstar.events import (
    ActivationMoved,
    ChunkAllocated,
    ChunkFreed,
    ChunkMoved,
    Event,
    MemorySample,
    MomentBegin,
    MomentEnd,
    Stage,
    StageChanged,
    Tier,
)

from chunkstar_profiler.profile import Profile, build_profile

__all__ = ["Profiler"]

_PROBE_HOLDER = "chunkstar_profiler"
_TIME_COLUMNS = frozenset({"t", "t_start", "t_end"})  # perf_counter ns; stored relative to the start
_DISK_COUNTERS = frozenset(
    {"disk_bytes_read", "disk_bytes_written", "disk_read_s", "disk_write_s", "disk_staging_wait_s", "disk_busy_s"}
)
"""``engine.stats()`` disk keys that only grow: ``meta["disk_stats"]`` holds their growth over the recording."""


def _disk_stats(stats: dict[str, Any]) -> dict[str, float | int]:
    """The numeric ``disk_*`` entries of ``engine.stats()`` (none without the disk tier)."""
    return {
        k: int(v) if isinstance(v, bool) else v
        for k, v in stats.items()
        if k.startswith("disk_") and isinstance(v, (int, float))
    }


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("chunkstar", "torch", "transformers", "numpy", "pandas"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


class Profiler:
    """Record a chunk engine's moments, moves and memory; save them to a file."""

    def __init__(self, engine: ChunkEngine, *, model_name: str | None = None) -> None:
        if not isinstance(engine, ChunkEngine):
            raise TypeError(f"Profiler needs a chunkstar engine, got {type(engine).__name__}")
        self.engine = engine
        self.model_name = model_name or _model_name(engine)
        self._init_columns()

    def _init_columns(self) -> None:
        """The tables, empty, and what the event handler keeps between events."""
        self._unsubscribe: Any = None
        self._t0 = 0
        self._t_end: int | None = None
        self._iteration = -1
        self._open_moment = -1  # row of the moment that moves are attributed to
        self._open_by_index: dict[int, int] = {}  # moment index within the micro-step -> row
        self._stage_open: tuple[str, int, int] | None = None  # (stage, iteration, t_start)
        self.moments: dict[str, list[Any]] = {k: [] for k in ("iteration", "index", "module", "stage", "t_start", "t_end")}
        self.moves: dict[str, list[Any]] = {
            k: [] for k in ("t_start", "t_end", "chunk_id", "chunk_list", "nbytes", "src", "dst", "reason", "moment_row")
        }
        self.activation_moves: dict[str, list[Any]] = {
            k: [] for k in ("t_start", "t_end", "block", "nbytes", "src", "dst", "prefetch", "moment_row")
        }
        self.memory: dict[str, list[Any]] = {
            k: [] for k in ("t", "tier", "chunk_bytes", "non_model_bytes", "budget_bytes", "moment_row")
        }
        self.stages: dict[str, list[Any]] = {k: [] for k in ("stage", "iteration", "t_start", "t_end")}
        self.placements: dict[str, list[Any]] = {k: [] for k in ("chunk_id", "chunk_list", "tier", "t_start", "t_end")}
        self._placement_open: dict[tuple[str, int, str], int] = {}  # (list, id, tier) -> t_start
        self._disk_at_start: dict[str, float | int] = {}
        self._disk_at_stop: dict[str, float | int] | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Profiler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._unsubscribe is not None:
            raise RuntimeError("this Profiler is already recording")
        if self._t_end is not None:
            raise RuntimeError("a Profiler records once; make a new one for another recording")
        self._t0 = time.perf_counter_ns()
        for which in ChunkList:
            for c in self.engine.mgr.chunks.chunks_of(which):
                if c.tier is not None:
                    self._placement_open[(which.value, c.chunk_id, c.tier.value)] = self._t0
        self._disk_at_start = _disk_stats(self.engine.stats())
        self.engine.memory_probe.acquire(_PROBE_HOLDER)
        self._unsubscribe = self.engine.events.subscribe(self._on_event)

    def stop(self) -> None:
        if self._unsubscribe is None:
            return
        disk = self.engine.mgr.chunks.disk
        if disk is not None:
            # the disk tier's step thread records its staging moves as it issues them (Note [the
            # step issued behind] in chunkstar.runtime.disk_tier): the recording ends once it is done
            try:
                disk.settle()
            except Exception:  # noqa: BLE001 - a failed step is the training loop's to raise, not the profile's
                pass
        self._unsubscribe()
        self._unsubscribe = None
        self.engine.memory_probe.release(_PROBE_HOLDER)
        self._t_end = time.perf_counter_ns()
        self._disk_at_stop = _disk_stats(self.engine.stats())
        self._close_stage(self._t_end)
        for (list_name, cid, tier), t_start in self._placement_open.items():
            self._add_placement(cid, list_name, tier, t_start, self._t_end)
        self._placement_open.clear()

    def stop_at(self, end: int) -> None:
        """Close what is open at ``end`` (ns): the stage, the chunks' stays (a replay's stop)."""
        self._t_end = end
        self._end_open_moment(end)
        self._close_stage(end)
        for (list_name, cid, tier), t_start in self._placement_open.items():
            self._add_placement(cid, list_name, tier, t_start, end)
        self._placement_open.clear()

    # ------------------------------------------------------------------ events
    def _on_event(self, e: Event) -> None:
        if isinstance(e, ChunkMoved):
            m = self.moves
            m["t_start"].append(e.t_start_ns)
            m["t_end"].append(e.t_end_ns)
            m["chunk_id"].append(e.chunk_id)
            m["chunk_list"].append(e.chunk_list)
            m["nbytes"].append(e.nbytes)
            m["src"].append(e.src.value)
            m["dst"].append(e.dst.value)
            m["reason"].append(e.reason.value)
            m["moment_row"].append(self._open_moment)
            # a disk stay is the time the chunk's bytes are only in its file: it ends at a
            # stage-in (the host stay of its staging buffer begins) and begins at a stage-out
            if e.src is Tier.DISK:
                self._close_placement(e.chunk_list, e.chunk_id, Tier.DISK.value, e.t_start_ns)
            elif e.dst is Tier.DISK:
                self._placement_open[(e.chunk_list, e.chunk_id, Tier.DISK.value)] = e.t_start_ns
        elif isinstance(e, ActivationMoved):
            a = self.activation_moves
            a["t_start"].append(e.t_start_ns)
            a["t_end"].append(e.t_end_ns)
            a["block"].append(e.block)
            a["nbytes"].append(e.nbytes)
            a["src"].append(e.src.value)
            a["dst"].append(e.dst.value)
            a["prefetch"].append(int(e.prefetch))
            a["moment_row"].append(self._moment_row(e.moment, e.t_start_ns))
        elif isinstance(e, MomentBegin):
            self._begin_moment(e.index, e.module, e.stage.value, e.t_ns)
        elif isinstance(e, MomentEnd):
            row = self._open_by_index.get(e.index)
            if row is not None and self.moments["module"][row] == e.module:
                self.moments["t_end"][row] = e.t_ns
        elif isinstance(e, MemorySample):
            mem = self.memory
            mem["t"].append(e.t_ns)
            mem["tier"].append(e.tier.value)
            mem["chunk_bytes"].append(e.chunk_bytes)
            mem["non_model_bytes"].append(e.non_model_bytes)
            mem["budget_bytes"].append(e.budget_bytes)
            mem["moment_row"].append(self._open_moment)
        elif isinstance(e, ChunkAllocated):
            self._placement_open[(e.chunk_list, e.chunk_id, e.tier.value)] = e.t_ns
        elif isinstance(e, ChunkFreed):
            self._close_placement(e.chunk_list, e.chunk_id, e.tier.value, e.t_ns)
        elif isinstance(e, StageChanged):
            self._close_stage(e.t_ns)
            if e.stage is Stage.FWD:
                self._iteration += 1
                self._open_by_index.clear()
            if e.stage is not Stage.IDLE:
                self._stage_open = (e.stage.value, max(self._iteration, 0), e.t_ns)
            if e.stage is Stage.OPTIM:
                # the optimizer step is one moment of its own, so its moves have an owner
                self._begin_moment(-1, "optimizer", Stage.OPTIM.value, e.t_ns)
            elif e.stage is Stage.IDLE:
                self._end_open_moment(e.t_ns)

    def _begin_moment(self, index: int, module: str, stage: str, t: int) -> None:
        self._end_open_moment(t)
        mo = self.moments
        mo["iteration"].append(max(self._iteration, 0))
        mo["index"].append(index)
        mo["module"].append(module)
        mo["stage"].append(stage)
        mo["t_start"].append(t)
        mo["t_end"].append(None)
        self._open_moment = len(mo["t_start"]) - 1
        self._open_by_index[index] = self._open_moment

    def _moment_row(self, index: int, t: int) -> int:
        """The row of this micro-step's moment ``index`` if it had begun by ``t`` (-1 otherwise: outside
        moments, or a moment of that index that began later, in a micro-step after the one meant)."""
        row = self._open_by_index.get(index, -1) if index >= 0 else -1
        return row if row >= 0 and self.moments["t_start"][row] <= t else -1

    def _end_open_moment(self, t: int) -> None:
        """A backward moment has no end hook: it ends where the next moment begins."""
        row = self._open_moment
        if row >= 0 and self.moments["t_end"][row] is None:
            self.moments["t_end"][row] = t

    def _close_stage(self, t: int) -> None:
        if self._stage_open is not None:
            stage, it, t_start = self._stage_open
            self.stages["stage"].append(stage)
            self.stages["iteration"].append(it)
            self.stages["t_start"].append(t_start)
            self.stages["t_end"].append(t)
            self._stage_open = None

    def _close_placement(self, list_name: str, cid: int, tier: str, t: int) -> None:
        t_start = self._placement_open.pop((list_name, cid, tier), None)
        if t_start is not None:
            self._add_placement(cid, list_name, tier, t_start, t)

    def _add_placement(self, cid: int, list_name: str, tier: str, t_start: int, t_end: int) -> None:
        p = self.placements
        p["chunk_id"].append(cid)
        p["chunk_list"].append(list_name)
        p["tier"].append(tier)
        p["t_start"].append(max(t_start, self._t0))
        p["t_end"].append(t_end)

    # ------------------------------------------------------------------ results
    def disk_stats(self) -> dict[str, float | int]:
        """The engine's ``disk_*`` stats over the recording (so far, while recording); empty
        without the disk tier. Counters as their growth since the start, sizes as now."""
        now = self._disk_at_stop if self._disk_at_stop is not None else _disk_stats(self.engine.stats())
        out = {k: v - self._disk_at_start.get(k, 0) if k in _DISK_COUNTERS else v for k, v in now.items()}
        if out and self._t0:  # the recording's wall time, which disk_busy_s is a part of
            out["disk_recorded_s"] = ((self._t_end or time.perf_counter_ns()) - self._t0) / 1e9
        return out

    def meta(self) -> dict[str, Any]:
        eng = self.engine
        stats = eng.stats()
        disk = self.disk_stats()
        return {
            "model_name": self.model_name,
            "n_params": stats["n_params"],
            "config": _jsonable(dict(eng.config.raw)),
            "versions": _versions(),
            "device": str(eng.device),
            "precision": stats["precision"],
            "budget_bytes": stats["device_budget_bytes"],
            "chunk_size": stats["chunk_size"],
            "n_chunks": stats["n_chunks"],
            "chunk_lists": [which.value for which in ChunkList],
            "model_data_bytes": stats["model_data_bytes"],
            "iterations": self._iteration + 1,
            "host": platform.node(),
            "platform": platform.platform(),
            "pid": os.getpid(),
            "tiers": [t.value for t in Tier if t is not Tier.DISK or disk],  # the tiers this run has
            **({"disk_stats": disk} if disk else {}),
        }

    def profile(self) -> Profile:
        """The recording so far as a :class:`Profile` (DataFrames), without a file."""
        end = self._t_end if self._t_end is not None else time.perf_counter_ns()
        return build_profile(self._columns(end), self.meta())

    def _columns(self, end: int) -> dict[str, dict[str, list[Any]]]:
        moments = dict(self.moments)
        moments["t_end"] = [end if t is None else t for t in moments["t_end"]]
        placements = {k: list(v) for k, v in self.placements.items()}
        for (list_name, cid, tier), t_start in self._placement_open.items():  # still recording
            placements["chunk_id"].append(cid)
            placements["chunk_list"].append(list_name)
            placements["tier"].append(tier)
            placements["t_start"].append(max(t_start, self._t0))
            placements["t_end"].append(end)
        shift = self._t0
        tables = {
            "moments": moments, "moves": self.moves, "memory": self.memory, "stages": self.stages, "placements": placements,
            "activation_moves": self.activation_moves,
        }  # fmt: skip
        out: dict[str, dict[str, list[Any]]] = {}
        for name, cols in tables.items():
            out[name] = {k: ([t - shift for t in v] if k in _TIME_COLUMNS else list(v)) for k, v in cols.items()}
        return out

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the recording to ``path`` (see :mod:`chunkstar_profiler.fileformat`)."""
        from chunkstar_profiler.fileformat import write_profile

        end = self._t_end if self._t_end is not None else time.perf_counter_ns()
        return write_profile(path, self._columns(end), self.meta())


def _model_name(engine: ChunkEngine) -> str:
    mod = engine.module
    cfg = getattr(mod, "config", None)
    kind = getattr(cfg, "model_type", None)
    return f"{type(mod).__name__} ({kind})" if kind else type(mod).__name__


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
