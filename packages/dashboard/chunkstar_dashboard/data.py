"""Pure data shaping for the dashboard: a profile's tables in, plot- and table-ready frames out.

The profile is the profiler's own ``chunkstar_profiler.Profile`` (tests build
one from hand-written frames). Nothing here imports Streamlit or plotly, so
every function is unit-tested on plain DataFrames; the pages only render what
these functions return.

Units: the profile's tables carry seconds and bytes; so do the frames returned
here. Conversion to MiB / ms happens at the edge (charts and tables), through
``format_bytes``, ``format_duration`` and ``time_axis``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from chunkstar_profiler import MOVE_REASONS, TIERS, Profile

from .text import escape_markdown

__all__ = [
    "ACTIVATION_DIRECTIONS",
    "DIRECTIONS",
    "MAX_CHUNK_ROWS",
    "MAX_POINTS_PER_TRACE",
    "MOVE_REASONS",
    "OUTSIDE_MOMENTS",
    "STAGES",
    "TIERS",
    "MoveFilter",
    "PlacementGrid",
    "activation_moves_by_block",
    "activation_series",
    "activation_totals",
    "compare_table",
    "clock_label",
    "display_name",
    "downsample_minmax",
    "duration_s",
    "filter_moves",
    "format_bytes",
    "format_duration",
    "iteration_span",
    "memory_series",
    "has_activation_moves",
    "has_disk_tier",
    "move_totals",
    "moves_by_operator",
    "peak_bytes",
    "placement_grid",
    "prediction_note",
    "round_significant",
    "step_time_comparison",
    "step_times",
    "summary_figures",
    "tiers_present",
    "time_axis",
]

STAGES = ("fwd", "bwd", "optim")
# TIERS (device, host, disk) and MOVE_REASONS are the profile format's own (chunkstar_profiler)
MAX_POINTS_PER_TRACE = 5000
"""Longest memory trace sent to the browser; longer ones are min/max downsampled."""
MAX_CHUNK_ROWS = 320
"""Most rows the chunk map draws (all lists together): past it, consecutive chunks share a row (a band), since
the map is at most 1,400 px tall and a row under ~3 px is not seen (a 68B GPT's predicted profile has 275)."""
OUTSIDE_MOMENTS = "(outside moments)"
"""Label for moves and samples that no module's moment caused (module == "")."""

_MEMORY_SERIES = ("total_bytes", "chunk_bytes", "non_model_bytes")
_DISK_REASONS = ("stage_in", "stage_out")
"""Move reasons of the disk tier only."""


def display_name(p: Profile) -> str:
    """The file name a page shows for ``p``: the last part of the path or upload name it was read from."""
    return Path(p.source).name if p.source else "(unnamed profile)"


def clock_label(p: Profile) -> str:
    """What a time axis measures: a measured profile's seconds since its start, a predicted one's on the time model's clock."""
    return "predicted time since step start" if p.prediction is not None else "time since profile start"


def prediction_note(p: Profile) -> str | None:
    """For a predicted profile (``Profile.prediction``), the markdown a page shows above its figures: not measured,
    whose step (rank, world), on which machine, the predicted step time and what binds it. ``None`` for a measured one.
    Strings from the file are escaped."""
    pred = p.prediction
    if pred is None:
        return None
    who = ""
    if "rank" in pred and "world_size" in pred:
        who = f" of rank {pred['rank']:,} of {pred['world_size']:,}"
    platform = p.meta.get("platform")
    on = f" on {escape_markdown(platform)}" if isinstance(platform, str) and platform.strip() else ""
    figures = []
    if "seconds_per_step" in pred:
        figures.append(f"{format_duration(float(pred['seconds_per_step']))} per step")
    if "binding" in pred:
        figures.append(f"bound by {escape_markdown(pred['binding'])}")
    return (
        f"**Predicted profile, not measured**: a dry run's step{who}{on}, on the time model's clock "
        f"(`chunkstar.dry_run`). Every time and duration here is the model's"
        + (f" ({', '.join(figures)})" if figures else "")
        + "; the moves, chunk placements and memory are the real engine's, run on the meta device."
    )


def duration_s(p: Profile) -> float:
    """Seconds from the profile start to the last recorded event."""
    ends = [
        frame[col].max()
        for frame, col in (
            (p.memory, "t_s"), (p.moves, "t_end_s"), (p.stages, "t_end_s"), (p.placements, "t_end_s"), (p.activation_moves, "t_end_s"),
        )
        if len(frame)
    ]  # fmt: skip
    return float(max(ends)) if ends else 0.0


def _module_labels(modules: pd.Series) -> pd.Series:
    """Module names for display: empty or missing (no moment open) becomes ``OUTSIDE_MOMENTS``."""
    labels = modules.astype(object).fillna("").astype(str)
    return labels.where(labels != "", OUTSIDE_MOMENTS)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units with three significant figures: ``1.97 MiB``, ``14.1 MiB``, ``0 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.3g} {unit}" if abs(n) / scale < 1000 else f"{n / scale:,.0f} {unit}"
    return f"{n:,.0f} B"


def format_duration(seconds: float) -> str:
    """``seconds`` in the unit a person reads: ``850 µs``, ``113 ms``, ``2.35 s``, ``4 min 05 s``, ``1 h 03 min``."""
    if not math.isfinite(seconds):
        return "n/a"
    s = abs(seconds)
    sign = "-" if seconds < 0 else ""
    if s == 0:
        return "0 s"
    if s < 1e-3:
        return f"{seconds * 1e6:.3g} µs"
    if s < 1:
        return f"{seconds * 1e3:.3g} ms"
    if s < 59.95:
        return f"{seconds:.3g} s"
    if s < 3600:
        minutes, rest = divmod(round(s), 60)
        return f"{sign}{minutes} min {rest:02d} s"
    hours, rest = divmod(round(s), 3600)
    return f"{sign}{hours} h {rest // 60:02d} min"


def time_axis(span_s: float) -> tuple[str, float]:
    """The unit of a time axis spanning ``span_s`` seconds and seconds per unit: ms below 2 s, min past 5 min."""
    if span_s < 2.0:
        return "ms", 1e-3
    if span_s > 300.0:
        return "min", 60.0
    return "s", 1.0


def round_significant(values: Sequence[float] | np.ndarray | pd.Series, digits: int = 3) -> np.ndarray:
    """Each value to ``digits`` significant figures, never dropping integer digits: 4096 stays 4096,
    21.6875 -> 21.7, 0.11342 -> 0.113; NaN and inf stay as they are."""
    v = np.asarray(values, dtype=float)
    out = v.copy()
    finite = np.isfinite(v) & (v != 0)
    magnitude = np.floor(np.log10(np.abs(v[finite])))
    decimals = np.clip(digits - 1 - magnitude, 0, None).astype(int)
    out[finite] = [round(x, int(d)) for x, d in zip(v[finite], decimals)]
    return out


def tiers_present(memory: pd.DataFrame) -> list[str]:
    """The tiers ``memory`` has samples of: the known ones fastest first (``TIERS``), then any other."""
    seen = {str(t) for t in memory["tier"]}
    return [t for t in TIERS if t in seen] + sorted(seen - set(TIERS))


def has_disk_tier(p: Profile) -> bool:
    """Whether the run had the disk tier: disk samples, stage moves or disk stats in the profile."""
    return bool(
        (p.memory["tier"] == "disk").any()
        or (p.moves["src"] == "disk").any()
        or (p.moves["dst"] == "disk").any()
        or p.meta.get("disk_stats")
    )


def has_activation_moves(p: Profile) -> bool:
    """Whether the run moved saved activations across the host link (an offload policy); a profile older
    than format version 3 has none."""
    return len(p.activation_moves) > 0


# ---------------------------------------------------------------------------
# memory timeline


def downsample_minmax(df: pd.DataFrame, x: str, ys: list[str] | tuple[str, ...], max_points: int) -> pd.DataFrame:
    """At most ~``max_points`` rows of ``df`` (sorted by ``x``) that keep every peak.

    The rows are split into equal-count buckets along ``x``; from each bucket
    the rows holding the minimum and the maximum of each column in ``ys`` are
    kept (plus the first and last row overall), so the global and every local
    extreme survive and a line through the kept rows has the same envelope as
    the full trace. Whole rows are kept, so other columns (module, stage) stay
    true to the kept sample. Frames already short enough come back unchanged
    (sorted).
    """
    if max_points < 2 * len(ys) + 2:
        raise ValueError(f"max_points={max_points} is too small to keep min and max of {len(ys)} series")
    df = df.sort_values(x, kind="stable").reset_index(drop=True)
    n = len(df)
    if n <= max_points:
        return df
    n_buckets = max(1, (max_points - 2) // (2 * len(ys)))
    bucket = (np.arange(n) * n_buckets) // n
    keep = np.zeros(n, dtype=bool)
    keep[[0, n - 1]] = True
    grouped = df[list(ys)].groupby(bucket, sort=False)
    for col in ys:
        keep[grouped[col].idxmin().to_numpy()] = True
        keep[grouped[col].idxmax().to_numpy()] = True
    return df[keep].reset_index(drop=True)


def iteration_span(stages: pd.DataFrame, first: int, last: int) -> tuple[float, float]:
    """Seconds from the start of iteration ``first``'s first stage to the end of iteration ``last``'s last one
    (inclusive); ``(0, 0)`` when no stage of those iterations was recorded."""
    sel = stages[stages["iteration"].between(first, last)]
    if sel.empty:
        return 0.0, 0.0
    return float(sel["t_start_s"].min()), float(sel["t_end_s"].max())


def memory_series(
    memory: pd.DataFrame, tier: str, max_points: int = MAX_POINTS_PER_TRACE, window: tuple[float, float] | None = None
) -> tuple[pd.DataFrame, bool]:
    """The samples of one tier, downsampled for plotting; second item: whether rows were dropped.

    With ``window`` (seconds), only the samples inside it, plus the last one before it: a sample holds
    until the next, so that one is the memory at the window's start.
    """
    rows = memory[memory["tier"] == tier].sort_values("t_s", kind="stable")
    if window is not None:
        t0, t1 = window
        before = rows[rows["t_s"] < t0].tail(1)
        rows = pd.concat([before, rows[rows["t_s"].between(t0, t1)]])
    out = downsample_minmax(rows, "t_s", _MEMORY_SERIES, max_points)
    out = out.assign(module=_module_labels(out["module"]))
    return out, len(out) < len(rows)


def activation_series(
    activation_moves: pd.DataFrame, dst: str, max_points: int = MAX_POINTS_PER_TRACE, window: tuple[float, float] | None = None
) -> tuple[pd.DataFrame, bool]:
    """The activation moves to ``dst`` ("host" or "device") that began inside ``window`` (seconds; all without one),
    by start time, for plotting; second item: whether rows were dropped to stay within ``max_points`` (the
    smallest and largest copy of every bucket are kept, as :func:`downsample_minmax` does)."""
    rows = activation_moves[activation_moves["dst"] == dst].sort_values("t_start_s", kind="stable")
    if window is not None:
        rows = rows[rows["t_start_s"].between(*window)]
    out = downsample_minmax(rows, "t_start_s", ("nbytes",), max_points)
    out = out.assign(module=_module_labels(out["module"]))
    return out, len(out) < len(rows)


def peak_bytes(memory: pd.DataFrame, tier: str, column: str = "total_bytes") -> int:
    """Largest sampled ``column`` in ``tier`` (0 when the tier has no samples)."""
    values = memory.loc[memory["tier"] == tier, column]
    return int(values.max()) if len(values) else 0


# ---------------------------------------------------------------------------
# chunk location map


@dataclass(frozen=True)
class PlacementGrid:
    """Where each chunk's payload was, binned in time.

    ``device[r, k]``, ``host[r, k]`` and ``disk[r, k]`` are the fractions of
    time bin ``k`` that chunk row ``r``'s payload spent in each tier (0..1); a
    row whose payload was in no tier during a bin (not allocated yet, or freed)
    has 0 in all. A disk stay is the time the chunk's bytes were only in its file
    (not staged in to the host).

    A row is one chunk, or, when the profile has more chunks than a map can
    draw (``band > 1``), a band of up to ``band`` consecutive chunks of one list
    (``chunk_ids[r]`` to ``last_ids[r]``, ``band_sizes[r]`` of them): its
    fractions are the band's mean.
    """

    chunk_lists: list[str]
    """Chunk list of each row (rows grouped by list, in profile order)."""
    chunk_ids: list[int]
    """The (first) chunk of each row."""
    edges: np.ndarray = field(repr=False)
    """Bin edges in seconds, ``n_bins + 1`` of them."""
    device: np.ndarray = field(repr=False)
    host: np.ndarray = field(repr=False)
    disk: np.ndarray = field(repr=False)
    last_ids: list[int] = field(default_factory=list)
    """The last chunk of each row (``chunk_ids`` when each row is one chunk)."""
    band_sizes: list[int] = field(default_factory=list)
    """Chunks in each row (all 1 when each row is one chunk)."""
    band: int = 1
    """Most chunks a row holds."""

    @property
    def n_chunks(self) -> int:
        return int(sum(self.band_sizes)) if self.band_sizes else len(self.chunk_ids)

    @property
    def bin_s(self) -> float:
        return float(self.edges[1] - self.edges[0]) if len(self.edges) > 1 else 0.0

    @property
    def has_disk(self) -> bool:
        return bool(self.disk.any())

    def row_labels(self) -> list[str]:
        """Each row's name on the map: its chunk id, or a band's first and last ids."""
        last = self.last_ids or self.chunk_ids
        return [str(a) if a == b else f"{a}-{b}" for a, b in zip(self.chunk_ids, last)]

    def _share(self, weighted: np.ndarray) -> np.ndarray:
        present = self.device + self.host + self.disk
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(present > 0, weighted / np.where(present > 0, present, 1), np.nan)

    def device_share(self) -> np.ndarray:
        """Device fraction of the time the payload existed in a bin; NaN where it did not exist."""
        return self._share(self.device)

    def tier_level(self) -> np.ndarray:
        """Where the payload was in a bin on one scale, 0 disk, 0.5 host, 1 device (time-weighted
        over the tiers it was in); NaN where it did not exist. Without a disk stay it is
        ``0.5 + device_share() / 2``."""
        return self._share(self.device + 0.5 * self.host)


def _bin_fractions(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, n_rows: int, edges: np.ndarray) -> np.ndarray:
    """``out[r, k]``: the part of equal-width bin ``k`` (of ``edges``) covered by the intervals
    [starts, ends) of row ``r`` (intervals of one row must not overlap), summed per row.

    Vectorised over all intervals at once: an interval adds its partial first and last bins, and a
    run of whole bins through a difference array (one cumulative sum per row at the end)."""
    n_bins = len(edges) - 1
    out = np.zeros((n_rows, n_bins + 1))
    t0, t1 = float(edges[0]), float(edges[-1])
    width = (t1 - t0) / n_bins
    s = np.clip(starts, t0, t1)
    e = np.clip(ends, t0, t1)
    keep = e > s
    rows, ps, pe = rows[keep], (s[keep] - t0) / width, (e[keep] - t0) / width  # positions in bins
    i0 = np.minimum(np.floor(ps).astype(np.int64), n_bins - 1)
    i1 = np.minimum(np.floor(pe).astype(np.int64), n_bins - 1)
    i1 = np.maximum(i1, i0)
    same = i0 == i1
    whole = np.zeros((n_rows, n_bins + 1))  # difference array of the whole bins
    np.add.at(out, (rows[same], i0[same]), pe[same] - ps[same])
    r, a, b, pa, pb = rows[~same], i0[~same], i1[~same], ps[~same], pe[~same]
    np.add.at(out, (r, a), (a + 1) - pa)
    np.add.at(out, (r, b), pb - b)
    np.add.at(whole, (r, a + 1), 1.0)
    np.add.at(whole, (r, b), -1.0)
    return (out + np.cumsum(whole, axis=1))[:, :n_bins]


def placement_grid(
    placements: pd.DataFrame,
    chunk_list_order: list[str] | None = None,
    n_bins: int = 400,
    t_end: float | None = None,
    max_rows: int | None = None,
) -> PlacementGrid:
    """Bin ``placements`` (intervals of a chunk's payload in a tier) into a chunk x time grid.

    Within one chunk and tier the intervals must not overlap (a payload is in a
    tier or it is not), which the profiler guarantees. With ``max_rows``, a profile
    with more chunks than that gets bands of ``ceil(chunks / max_rows)`` consecutive
    chunks of one list per row (their mean); the grid never holds more than its rows.
    """
    order = list(chunk_list_order or [])
    order += [c for c in pd.unique(placements["chunk_list"]) if c not in order]
    if t_end is None:
        t_end = float(placements["t_end_s"].max()) if len(placements) else 0.0
    t_end = max(t_end, 1e-9)
    edges = np.linspace(0.0, t_end, n_bins + 1)
    keys = (
        placements[["chunk_list", "chunk_id"]]
        .drop_duplicates()
        .assign(_order=lambda d: d["chunk_list"].map({c: i for i, c in enumerate(order)}))
        .sort_values(["_order", "chunk_id"], kind="stable")
        .reset_index(drop=True)
    )
    n_chunks = len(keys)
    band = max(1, math.ceil(n_chunks / max_rows)) if max_rows else 1
    # rows are sorted by list, then chunk: a band starts at every ``band``-th chunk of a list
    within = keys.groupby("_order", sort=False).cumcount().to_numpy()
    band_of = np.cumsum(within % band == 0) - 1
    n_rows = int(band_of[-1]) + 1 if n_chunks else 0
    sizes = np.bincount(band_of, minlength=n_rows)
    chunk_ids = keys["chunk_id"].to_numpy(np.int64)
    first = np.full(n_rows, np.iinfo(np.int64).max, dtype=np.int64)
    last = np.full(n_rows, np.iinfo(np.int64).min, dtype=np.int64)
    np.minimum.at(first, band_of, chunk_ids)
    np.maximum.at(last, band_of, chunk_ids)
    lists = np.empty(n_rows, dtype=object)
    lists[band_of] = keys["chunk_list"].to_numpy(object)  # one list per band
    index = pd.MultiIndex.from_arrays([keys["chunk_list"], keys["chunk_id"]])
    row = band_of[index.get_indexer(pd.MultiIndex.from_arrays([placements["chunk_list"], placements["chunk_id"].astype(np.int64)]))]
    grids = {}
    for tier in TIERS:
        sel = (placements["tier"] == tier).to_numpy()
        sums = _bin_fractions(
            row[sel], placements["t_start_s"].to_numpy(float)[sel], placements["t_end_s"].to_numpy(float)[sel], n_rows, edges
        )
        grids[tier] = np.clip(sums / np.maximum(sizes, 1)[:, None], 0.0, 1.0)
    return PlacementGrid(
        chunk_lists=[str(c) for c in lists],
        chunk_ids=[int(i) for i in first],
        edges=edges,
        device=grids["device"],
        host=grids["host"],
        disk=grids["disk"],
        last_ids=[int(i) for i in last],
        band_sizes=[int(n) for n in sizes],
        band=band,
    )


# ---------------------------------------------------------------------------
# per-operator movements


@dataclass(frozen=True)
class MoveFilter:
    """Which moves to keep; ``None`` keeps everything for that field."""

    stages: tuple[str, ...] | None = None
    reasons: tuple[str, ...] | None = None
    chunk_lists: tuple[str, ...] | None = None
    iterations: tuple[int, int] | None = None
    """Inclusive range."""


DIRECTIONS = ("to_device", "to_host", "from_disk", "to_disk")
"""Directions of a move: to the device; device -> host; disk -> host (a stage-in); host -> disk (a stage-out)."""


def _directions(moves: pd.DataFrame) -> dict[str, pd.Series]:
    """A mask over ``moves`` per direction (``DIRECTIONS``). A move to a tier none of them names
    (a newer core's) is in none."""
    from_disk = moves["src"] == "disk"
    return {
        "to_device": moves["dst"] == "device",
        "to_host": (moves["dst"] == "host") & ~from_disk,
        "from_disk": from_disk,
        "to_disk": moves["dst"] == "disk",
    }


def filter_moves(moves: pd.DataFrame, flt: MoveFilter) -> pd.DataFrame:
    mask = pd.Series(True, index=moves.index)
    if flt.stages is not None:
        mask &= moves["stage"].isin(flt.stages)
    if flt.reasons is not None:
        mask &= moves["reason"].isin(flt.reasons)
    if flt.chunk_lists is not None:
        mask &= moves["chunk_list"].isin(flt.chunk_lists)
    if flt.iterations is not None:
        lo, hi = flt.iterations
        mask &= moves["iteration"].between(lo, hi)
    return moves[mask]


def moves_by_operator(moves: pd.DataFrame) -> pd.DataFrame:
    """One row per module: move counts, bytes each way, stall time, and moves per reason.

    Columns: ``module``, ``moves``, then counts by direction (``DIRECTIONS``:
    ``to_device``, ``to_host`` from the device, ``from_disk`` staged in to the
    host, ``to_disk`` staged out), the bytes of each (``bytes_to_device`` ...),
    ``stall_s`` (sum of move durations), then one count column per reason
    (``access`` ...). Sorted by stall time, longest first.
    """
    reasons = list(MOVE_REASONS) + sorted(set(moves["reason"]) - set(MOVE_REASONS))
    if moves.empty:
        cols = ["module", "moves", *DIRECTIONS, *(f"bytes_{d}" for d in DIRECTIONS), "stall_s", *reasons]
        return pd.DataFrame({c: pd.Series(dtype=object if c == "module" else "int64") for c in cols}).astype({"stall_s": float})
    way = _directions(moves)
    frame = pd.DataFrame(
        {
            "module": _module_labels(moves["module"]),
            "moves": 1,
            **{d: way[d].astype("int64") for d in DIRECTIONS},
            **{f"bytes_{d}": moves["nbytes"].where(way[d], 0).astype("int64") for d in DIRECTIONS},
            "stall_s": moves["duration_s"].astype(float),
        }
    )
    for reason in reasons:
        frame[reason] = (moves["reason"] == reason).astype("int64")
    out = frame.groupby("module", sort=False).sum().reset_index()
    return out.sort_values(["stall_s", "moves"], ascending=False, kind="stable").reset_index(drop=True)


def move_totals(moves: pd.DataFrame) -> dict[str, float]:
    """Totals over ``moves``: count, count and bytes by direction (``DIRECTIONS``), stall seconds."""
    way = _directions(moves)
    out: dict[str, float] = {"moves": int(len(moves))}
    out.update({d: int(way[d].sum()) for d in DIRECTIONS})
    out.update({f"bytes_{d}": int(moves.loc[way[d], "nbytes"].sum()) for d in DIRECTIONS})
    out["stall_s"] = float(moves["duration_s"].sum())
    return out


ACTIVATION_DIRECTIONS = ("to_host", "to_device")
"""Directions of an activation move: a block's saved activations to the host (its forward), back to the device (its backward)."""


def _activation_frame(am: pd.DataFrame) -> pd.DataFrame:
    """One row per activation move: 1 in its direction's column, its bytes in that direction's bytes column."""
    ways = {"to_host": am["dst"] == "host", "to_device": am["dst"] == "device"}
    return pd.DataFrame(
        {
            "block": am["block"].astype(object).astype(str),
            "moves": 1,
            **{d: ways[d].astype("int64") for d in ACTIVATION_DIRECTIONS},
            **{f"bytes_{d}": am["nbytes"].where(ways[d], 0).astype("int64") for d in ACTIVATION_DIRECTIONS},
            "prefetched": (am["prefetch"].astype(bool) & ways["to_device"]).astype("int64"),
            "copy_s": am["duration_s"].astype(float),
        },
        index=am.index,
    )


def activation_moves_by_block(activation_moves: pd.DataFrame) -> pd.DataFrame:
    """One row per block whose saved activations crossed the host link, in the order they first did.

    Columns: ``block``, ``moves``, counts by direction (``ACTIVATION_DIRECTIONS``), the bytes of each
    (``bytes_to_host``, ``bytes_to_device``), ``prefetched`` (copies back issued ahead of the backward)
    and ``copy_s`` (the copies' time from issue to found done). Activation moves only: chunk moves are
    :func:`moves_by_operator`'s.
    """
    frame = _activation_frame(activation_moves)
    if frame.empty:
        return frame.reset_index(drop=True)
    return frame.groupby("block", sort=False).sum().reset_index()


def activation_totals(activation_moves: pd.DataFrame) -> dict[str, float]:
    """Totals over the activation moves: count, count and bytes by direction, prefetched copies, copy seconds."""
    frame = _activation_frame(activation_moves)
    out: dict[str, float] = {"moves": int(len(frame))}
    out.update({c: int(frame[c].sum()) for c in (*ACTIVATION_DIRECTIONS, *(f"bytes_{d}" for d in ACTIVATION_DIRECTIONS), "prefetched")})
    out["copy_s"] = float(frame["copy_s"].sum())
    return out


# ---------------------------------------------------------------------------
# comparison of two profiles


def step_times(stages: pd.DataFrame) -> pd.Series:
    """Seconds per iteration: first stage start to last stage end (fwd through optim)."""
    if stages.empty:
        return pd.Series(dtype=float, name="step_s")
    g = stages.groupby("iteration")
    out = (g["t_end_s"].max() - g["t_start_s"].min()).rename("step_s")
    out.index = out.index.astype(int)
    return out


def summary_figures(p: Profile) -> dict[str, float]:
    """The key figures of one profile, by display name (units in the name).

    Peaks and settings are as recorded; traffic (moves, bytes, move time) is per iteration, the
    total over the recording divided by its iterations (those with a recorded stage), so two runs
    of different lengths compare. NaN where the profile recorded no iteration. Chunk moves and
    activation moves are counted apart ("moves ..." are chunk moves; "activation ..." rows only
    for a profile that has activation moves).
    """
    mib = 2.0**20
    totals = move_totals(p.moves)
    steps = step_times(p.stages)
    n = float(len(steps)) if len(steps) else float("nan")
    figures: dict[str, float] = {
        "iterations": float(len(steps)),
        "chunk size (elements)": float(p.meta.get("chunk_size") or np.nan),
        "chunks": float(p.meta.get("n_chunks") or np.nan),
        "device budget (MiB)": float(p.meta.get("budget_bytes") or 0) / mib,
        "peak device memory (MiB)": peak_bytes(p.memory, "device") / mib,
        "peak device chunk memory (MiB)": peak_bytes(p.memory, "device", "chunk_bytes") / mib,
        "peak device non-model memory (MiB)": peak_bytes(p.memory, "device", "non_model_bytes") / mib,
        "peak host memory (MiB)": peak_bytes(p.memory, "host") / mib,
        "mean step time (ms)": float(steps.mean() * 1e3) if len(steps) else np.nan,
        "median step time (ms)": float(steps.median() * 1e3) if len(steps) else np.nan,
        "moves per iteration": totals["moves"] / n,
        "moved to device per iteration (MiB)": totals["bytes_to_device"] / mib / n,
        "moved to host per iteration (MiB)": totals["bytes_to_host"] / mib / n,
        "move time per iteration (ms)": totals["stall_s"] * 1e3 / n,
    }
    if has_disk_tier(p):  # only then: a run without the disk tier shows these as n/a, not 0
        stats = p.meta.get("disk_stats") or {}
        figures["disk chunk files (MiB)"] = peak_bytes(p.memory, "disk") / mib
        figures["staged in from disk per iteration (MiB)"] = totals["bytes_from_disk"] / mib / n
        figures["staged out to disk per iteration (MiB)"] = totals["bytes_to_disk"] / mib / n
        for key, seconds, label in (("disk_bytes_read", "disk_read_s", "read"), ("disk_bytes_written", "disk_write_s", "write")):
            secs = stats.get(seconds, 0)
            figures[f"disk {label} bandwidth (MiB/s)"] = stats.get(key, 0) / secs / mib if secs else np.nan
    if has_activation_moves(p):  # only then, as for the disk tier: n/a beside a run that offloaded none
        act = activation_totals(p.activation_moves)
        figures["activation moves per iteration"] = act["moves"] / n
        figures["activations to host per iteration (MiB)"] = act["bytes_to_host"] / mib / n
        figures["activations to device per iteration (MiB)"] = act["bytes_to_device"] / mib / n
    counts = p.moves["reason"].value_counts()
    known = [r for r in MOVE_REASONS if has_disk_tier(p) or r not in _DISK_REASONS]  # no stage rows without the tier
    for reason in known + sorted(set(counts.index) - set(MOVE_REASONS)):
        figures[f"{reason} moves per iteration"] = float(counts.get(reason, 0)) / n
    return figures


def compare_table(a: Profile, b: Profile) -> pd.DataFrame:
    """Key figures of ``a`` and ``b`` side by side, with ``delta`` = b - a and ``delta_pct`` relative to a."""
    fa, fb = summary_figures(a), summary_figures(b)
    names = list(fa) + [n for n in fb if n not in fa]
    va = np.array([fa.get(n, np.nan) for n in names], dtype=float)
    vb = np.array([fb.get(n, np.nan) for n in names], dtype=float)
    delta = vb - va
    with np.errstate(invalid="ignore", divide="ignore"):
        pct = np.where(va != 0, 100.0 * delta / np.abs(va), np.nan)
    return pd.DataFrame({"figure": names, "A": va, "B": vb, "delta": delta, "delta_pct": pct})


def step_time_comparison(a: Profile, b: Profile) -> pd.DataFrame:
    """Per-iteration step time (ms) of both profiles; iterations only one has are NaN in the other."""
    sa, sb = step_times(a.stages) * 1e3, step_times(b.stages) * 1e3
    out = pd.concat([sa.rename("A"), sb.rename("B")], axis=1).sort_index()
    out.index.name = "iteration"
    out["delta"] = out["B"] - out["A"]
    return out.reset_index()
