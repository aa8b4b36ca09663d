"""A loaded profile: run metadata and pandas tables, independent of the engine.

Tables (times are seconds since the profiler started):

``moments``     row, iteration, index, module, stage, t_start_s, t_end_s, duration_s
``moves``       t_start_s, t_end_s, duration_s, chunk_id, chunk_list, nbytes, src, dst,
                reason, moment_row, module, stage, iteration
``memory``      t_s, tier, total_bytes, chunk_bytes, non_model_bytes, budget_bytes,
                moment_row, module, stage, iteration
``stages``      stage, iteration, t_start_s, t_end_s
``placements``  chunk_id, chunk_list, tier, t_start_s, t_end_s  (a chunk payload's stay in a tier)

Tiers are ``TIERS`` (device, host, disk: the values of ``chunkstar.events.Tier``);
move reasons are ``MOVE_REASONS`` (``chunkstar.events.MoveReason``). With the
disk tier (Note [disk tier] in ``chunkstar.runtime.disk_tier``) a state chunk's
moves are ``stage_in`` (disk -> host: read into a host staging buffer) and
``stage_out`` (host -> disk: written back, ``nbytes`` 0 when dropped unchanged);
their I/O runs on I/O threads, so ``t_start_s == t_end_s`` is when it was
issued and the duration is 0. A disk stay in ``placements`` is the time the
chunk's bytes were only in its file (not staged in); its host stays are the
staging buffer's. ``meta["disk_stats"]`` holds the engine's ``disk_*`` stats
over the recording (see :mod:`chunkstar_profiler.recorder`).

``moment_row`` is the ``row`` of the moment during which a move was issued or a
sample taken (the "operator" that caused it), -1 when none was open (module "").
``iteration`` counts micro-steps (forward passes), so with gradient accumulation
several iterations make one optimizer step. String columns have dtype object.

A *predicted* profile (:mod:`chunkstar_profiler.predicted`: a dry run's step on
the time model's clock, nothing measured) has ``meta["predicted"]``, an object;
:attr:`Profile.prediction` gives its fields type-checked, ``None`` for a measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["META", "MOVE_REASONS", "PREDICTION_FIELDS", "Profile", "TIERS", "build_profile", "TABLES"]

TIERS = ("device", "host", "disk")
"""The tiers a profile knows, fastest first (the values of ``chunkstar.events.Tier``)."""
MOVE_REASONS = ("access", "eviction", "prefetch", "optimizer", "offload", "stage_in", "stage_out")
"""The move reasons a profile knows (the values of ``chunkstar.events.MoveReason``)."""

# name -> column -> storage kind ("i8" int64, "i4" int32, "str" dictionary-encoded, "time" int64 ns)
TABLES: dict[str, dict[str, str]] = {
    "moments": {"iteration": "i4", "index": "i4", "module": "str", "stage": "str", "t_start": "time", "t_end": "time"},
    "moves": {
        "t_start": "time", "t_end": "time", "chunk_id": "i4", "chunk_list": "str", "nbytes": "i8",
        "src": "str", "dst": "str", "reason": "str", "moment_row": "i4",
    },
    "memory": {
        "t": "time", "tier": "str", "chunk_bytes": "i8", "non_model_bytes": "i8", "budget_bytes": "i8", "moment_row": "i4",
    },
    "stages": {"stage": "str", "iteration": "i4", "t_start": "time", "t_end": "time"},
    "placements": {"chunk_id": "i4", "chunk_list": "str", "tier": "str", "t_start": "time", "t_end": "time"},
}  # fmt: skip

# meta key -> the JSON type its value must have ("int" excludes booleans; "list[str]" a list of strings).
# The keys the recorder writes; a file may omit any of them, but one it has must have this type, since
# the summary and the dashboard format them as such. Other keys are kept as they are.
META: dict[str, str] = {
    "model_name": "str", "n_params": "int", "config": "dict", "versions": "dict", "device": "str",
    "precision": "str", "budget_bytes": "int", "chunk_size": "int", "n_chunks": "int", "chunk_lists": "list[str]",
    "model_data_bytes": "int", "iterations": "int", "host": "str", "platform": "str", "pid": "int", "tiers": "list[str]",
    "disk_stats": "dict[number]", "predicted": "dict",
}  # fmt: skip

PREDICTION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "seconds_per_step": (int, float), "binding": str, "flops": (int, float), "world_size": int, "rank": int,
}  # fmt: skip
"""The fields of ``meta["predicted"]`` that :attr:`Profile.prediction` keeps, and their types (plus ``busy``:
seconds per resource)."""


def _prediction(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    raw = meta.get("predicted")
    if not isinstance(raw, dict):
        return None
    out: dict[str, Any] = {}
    for key, kind in PREDICTION_FIELDS.items():
        value = raw.get(key)
        if isinstance(value, kind) and not isinstance(value, bool) and (not isinstance(value, float) or math.isfinite(value)):
            out[key] = value
    busy = raw.get("busy")
    if isinstance(busy, dict):
        out["busy"] = {
            str(k): float(v) for k, v in busy.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }  # fmt: skip
    return out


@dataclass
class Profile:
    meta: dict[str, Any]
    moments: pd.DataFrame
    moves: pd.DataFrame
    memory: pd.DataFrame
    stages: pd.DataFrame
    placements: pd.DataFrame
    source: str | None = field(default=None)

    @property
    def prediction(self) -> dict[str, Any] | None:
        """``None`` for a measured profile; for a predicted one (a dry run's step on the time model's
        clock), the fields of ``meta["predicted"]`` that have their type (``PREDICTION_FIELDS``, and
        ``busy``: resource -> seconds), the others left out: the file may come from anywhere."""
        return _prediction(self.meta)

    def __repr__(self) -> str:
        return (
            f"Profile({self.meta.get('model_name')!r}, {len(self.moments)} moments, {len(self.moves)} moves, "
            f"{len(self.memory)} memory samples, {self.meta.get('iterations')} iterations)"
        )


def _seconds(ns: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ns, dtype=np.int64).astype(np.float64) / 1e9


def build_profile(columns: Mapping[str, Mapping[str, Any]], meta: dict[str, Any], source: str | None = None) -> Profile:
    """Turn stored columns (times in ns since the start) into the public tables."""
    mo = columns["moments"]
    n_mo = len(mo["t_start"])
    moments = pd.DataFrame(
        {
            "row": np.arange(n_mo, dtype=np.int64),
            "iteration": np.asarray(mo["iteration"], dtype=np.int64),
            "index": np.asarray(mo["index"], dtype=np.int64),
            "module": pd.Series(mo["module"], dtype=object),
            "stage": pd.Series(mo["stage"], dtype=object),
            "t_start_s": _seconds(mo["t_start"]),
            "t_end_s": _seconds(mo["t_end"]),
        }
    )
    moments["duration_s"] = moments["t_end_s"] - moments["t_start_s"]

    def by_moment(rows: Any) -> dict[str, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64)
        ok = (rows >= 0) & (rows < n_mo)
        safe = np.where(ok, rows, 0)
        if n_mo == 0:
            return {"module": np.full(len(rows), "", dtype=object), "stage": np.full(len(rows), "", dtype=object),
                    "iteration": np.full(len(rows), -1, dtype=np.int64)}  # fmt: skip
        return {
            "module": np.where(ok, moments["module"].to_numpy()[safe], ""),
            "stage": np.where(ok, moments["stage"].to_numpy()[safe], ""),
            "iteration": np.where(ok, moments["iteration"].to_numpy()[safe], -1),
        }

    mv = columns["moves"]
    moves = pd.DataFrame(
        {
            "t_start_s": _seconds(mv["t_start"]),
            "t_end_s": _seconds(mv["t_end"]),
            "chunk_id": np.asarray(mv["chunk_id"], dtype=np.int64),
            "chunk_list": pd.Series(mv["chunk_list"], dtype=object),
            "nbytes": np.asarray(mv["nbytes"], dtype=np.int64),
            "src": pd.Series(mv["src"], dtype=object),
            "dst": pd.Series(mv["dst"], dtype=object),
            "reason": pd.Series(mv["reason"], dtype=object),
            "moment_row": np.asarray(mv["moment_row"], dtype=np.int64),
        }
    )
    moves.insert(2, "duration_s", moves["t_end_s"] - moves["t_start_s"])
    for k, v in by_moment(moves["moment_row"]).items():
        moves[k] = pd.Series(v, dtype=object) if k != "iteration" else v

    me = columns["memory"]
    memory = pd.DataFrame(
        {
            "t_s": _seconds(me["t"]),
            "tier": pd.Series(me["tier"], dtype=object),
            "chunk_bytes": np.asarray(me["chunk_bytes"], dtype=np.int64),
            "non_model_bytes": np.asarray(me["non_model_bytes"], dtype=np.int64),
            "budget_bytes": np.asarray(me["budget_bytes"], dtype=np.int64),
            "moment_row": np.asarray(me["moment_row"], dtype=np.int64),
        }
    )
    memory.insert(2, "total_bytes", memory["chunk_bytes"] + memory["non_model_bytes"])
    for k, v in by_moment(memory["moment_row"]).items():
        memory[k] = pd.Series(v, dtype=object) if k != "iteration" else v

    st = columns["stages"]
    stages = pd.DataFrame(
        {
            "stage": pd.Series(st["stage"], dtype=object),
            "iteration": np.asarray(st["iteration"], dtype=np.int64),
            "t_start_s": _seconds(st["t_start"]),
            "t_end_s": _seconds(st["t_end"]),
        }
    )
    pl = columns["placements"]
    placements = pd.DataFrame(
        {
            "chunk_id": np.asarray(pl["chunk_id"], dtype=np.int64),
            "chunk_list": pd.Series(pl["chunk_list"], dtype=object),
            "tier": pd.Series(pl["tier"], dtype=object),
            "t_start_s": _seconds(pl["t_start"]),
            "t_end_s": _seconds(pl["t_end"]),
        }
    )
    return Profile(dict(meta), moments, moves, memory, stages, placements, source)
