"""A loaded profile: run metadata and pandas tables, independent of the engine.

Tables (times are seconds since the profiler started):

``moments``     row, iteration, index, module, stage, t_start_s, t_end_s, duration_s
``moves``       t_start_s, t_end_s, duration_s, chunk_id, chunk_list, nbytes, src, dst,
                reason, moment_row, module, stage, iteration
``memory``      t_s, tier, total_bytes, chunk_bytes, non_model_bytes, budget_bytes,
                moment_row, module, stage, iteration
``stages``      stage, iteration, t_start_s, t_end_s
``placements``  chunk_id, chunk_list, tier, t_start_s, t_end_s  (a chunk payload's stay in a tier)
``activation_moves``  t_start_s, t_end_s, duration_s, block, nbytes, src, dst, prefetch,
                moment_row, module, stage, iteration

``activation_moves`` holds the saved activations that crossed the host link
(``chunkstar.events.ActivationMoved``, Note [activation offload] in
``chunkstar.activations.offload``): one row per storage of a block's saved
tensors, to the host in the block's forward, back to the device for its
backward. They are not chunk moves (no chunk, list or reason; ``block`` is the
block's module name and ``prefetch`` whether a copy back was issued ahead of the
backward), so they are a table of their own and never counted in ``moves``.
``t_end_s`` is when the copy was found done, which may be later than it ended.
A profile of format version 1 or 2 (before the table) has it empty.

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

__all__ = ["META", "MOVE_REASONS", "PREDICTION_FIELDS", "Profile", "TIERS", "build_profile", "TABLES", "TABLES_SINCE"]

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
    "activation_moves": {
        "t_start": "time", "t_end": "time", "block": "str", "nbytes": "i8", "src": "str", "dst": "str",
        "prefetch": "i4", "moment_row": "i4",
    },
}  # fmt: skip
TABLES_SINCE: dict[str, int] = {"activation_moves": 3}
"""The format version that added a table (those not named: version 1); an older file has it empty."""

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
    activation_moves: pd.DataFrame = field(default_factory=lambda: _activation_moves({}, pd.DataFrame()))
    """Saved activations across the host link (see the module docstring); after ``source``, with a default,
    so a profile built from the five chunk tables (an older caller's) still builds, with none."""

    @property
    def prediction(self) -> dict[str, Any] | None:
        """``None`` for a measured profile; for a predicted one (a dry run's step on the time model's
        clock), the fields of ``meta["predicted"]`` that have their type (``PREDICTION_FIELDS``, and
        ``busy``: resource -> seconds), the others left out: the file may come from anywhere."""
        return _prediction(self.meta)

    def __repr__(self) -> str:
        return (
            f"Profile({self.meta.get('model_name')!r}, {len(self.moments)} moments, {len(self.moves)} moves, "
            f"{len(self.activation_moves)} activation moves, {len(self.memory)} memory samples, "
            f"{self.meta.get('iterations')} iterations)"
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
    for k, v in _attributed(moments, moves["moment_row"]).items():
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
    for k, v in _attributed(moments, memory["moment_row"]).items():
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
    activation_moves = _activation_moves(columns.get("activation_moves") or {}, moments)
    return Profile(dict(meta), moments, moves, memory, stages, placements, source, activation_moves)


def _attributed(moments: pd.DataFrame, rows: Any) -> dict[str, np.ndarray]:
    """The module, stage and iteration of the moment at each of ``rows`` ("", "", -1 for none)."""
    rows = np.asarray(rows, dtype=np.int64)
    n_mo = len(moments)
    if n_mo == 0:
        return {"module": np.full(len(rows), "", dtype=object), "stage": np.full(len(rows), "", dtype=object),
                "iteration": np.full(len(rows), -1, dtype=np.int64)}  # fmt: skip
    ok = (rows >= 0) & (rows < n_mo)
    safe = np.where(ok, rows, 0)
    return {
        "module": np.where(ok, moments["module"].to_numpy()[safe], ""),
        "stage": np.where(ok, moments["stage"].to_numpy()[safe], ""),
        "iteration": np.where(ok, moments["iteration"].to_numpy()[safe], -1),
    }


def _activation_moves(am: Mapping[str, Any], moments: pd.DataFrame) -> pd.DataFrame:
    """The ``activation_moves`` table from its stored columns; empty where there are none (a file
    older than the table: ``am`` is ``{}``)."""
    if not am:
        am = {col: [] for col in TABLES["activation_moves"]}
    out = pd.DataFrame(
        {
            "t_start_s": _seconds(am["t_start"]),
            "t_end_s": _seconds(am["t_end"]),
            "block": pd.Series(am["block"], dtype=object),
            "nbytes": np.asarray(am["nbytes"], dtype=np.int64),
            "src": pd.Series(am["src"], dtype=object),
            "dst": pd.Series(am["dst"], dtype=object),
            "prefetch": np.asarray(am["prefetch"], dtype=np.int64) != 0,
            "moment_row": np.asarray(am["moment_row"], dtype=np.int64),
        }
    )
    out.insert(2, "duration_s", out["t_end_s"] - out["t_start_s"])
    for k, v in _attributed(moments, out["moment_row"]).items():
        out[k] = pd.Series(v, dtype=object) if k != "iteration" else v
    return out
