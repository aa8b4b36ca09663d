"""Pure data shaping for the Benchmarks page: result runs and published figures in, chart-ready frames out.

The inputs are the runs of a results database
(``chunkstar_bench.results.ResultsDB(path).runs()``: one row per run, the
columns of ``chunkstar_bench.results.COLUMNS``) and the paper's published
figures (``chunkstar_bench.published.load_published()``, turned into a frame by
:func:`published_frame`). System names and labels are those of
``chunkstar_bench.published.SYSTEMS``. Nothing here imports Streamlit or
plotly, nor anything of the bench package beyond those two plain modules, so
every function is unit-tested on hand-made frames.

Every frame that mixes our measurements with the paper's carries a ``source``
column (``measured``, ``published``, ``planned``): published numbers are the
reference to beat, never a result of this project, and the charts keep them
visibly apart.

A run on a CPU (``device`` ``cpu``, :func:`run_devices`) is measured in tokens/s
and seconds per step (:func:`measured_throughput`); TFLOPS per GPU is a GPU
figure, drawn only for GPU runs and the published figures
(:func:`throughput_points`), with PatrickStar's FLOP count
(``8 * params * batch * seq``) on both sides, since that is the count the
published figures use (``FLOP_FORMULA``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
from chunkstar_bench.published import PublishedResult, system_info
from chunkstar_bench.results import COLUMNS

from .data import format_bytes, format_duration

__all__ = [
    "FLOP_FORMULA",
    "METRIC_LABELS",
    "REGRESSION_THRESHOLD",
    "REGRESSION_WINDOW",
    "RUN_COLUMNS",
    "SOURCES",
    "TREND_METRICS",
    "empty_runs",
    "format_metric",
    "max_scale",
    "measured_throughput",
    "ok_runs",
    "published_frame",
    "regressions",
    "run_devices",
    "system_label",
    "throughput_points",
    "trends",
]

FLOP_FORMULA = "PatrickStar's count, 8 x params x batch x seq"
SOURCES = ("measured", "published", "planned")
REGRESSION_WINDOW = 5
"""A run is compared with the median of up to this many earlier runs of the same series."""
REGRESSION_THRESHOLD = 0.10
"""Relative change past which a run is flagged: a throughput drop or a peak-memory rise."""
TREND_METRICS: dict[str, str] = {
    # metric column -> which direction is worse
    "tokens_per_s": "lower",
    "tflops_per_gpu_patrickstar": "lower",
    "peak_device_bytes": "higher",
    "peak_host_bytes": "higher",
}
METRIC_LABELS = {
    "tokens_per_s": "tokens/s",
    "step_time_s": "time per step",
    "tflops_per_gpu_patrickstar": "TFLOPS per GPU",
    "peak_device_bytes": "peak device memory",
    "peak_host_bytes": "peak host memory",
}
SERIES_KEYS = ("suite", "system", "model", "hardware", "nprocs", "batch", "seq_len")
"""What makes two runs the same measurement taken at different commits."""

RUN_COLUMNS = tuple(name for name, _ in COLUMNS)
"""The columns of ``ResultsDB.runs()``, in order (the results schema's own list)."""


def empty_runs() -> pd.DataFrame:
    """A runs frame with no rows (no database loaded)."""
    return pd.DataFrame(columns=list(RUN_COLUMNS))


def system_label(system: str) -> str:
    """The display name of ``system`` (``"deepspeed"`` -> ``"DeepSpeed"``); the name itself when unknown."""
    try:
        return system_info(system).label
    except KeyError:
        return system


def format_metric(metric: str, value: float) -> str:
    """``value`` of a trend metric for a table: bytes in MiB/GiB, times in ms/s/min, rates to 3 figures."""
    if value is None or not math.isfinite(float(value)):
        return "n/a"
    if metric.endswith("_bytes"):
        return format_bytes(float(value))
    if metric == "tokens_per_s":
        return f"{value:,.3g} tokens/s" if value < 1000 else f"{value:,.0f} tokens/s"
    if metric.endswith("time_s"):
        return format_duration(float(value))
    if metric.startswith("tflops"):
        return f"{value:.3g} TFLOPS"
    return f"{value:,.3g}"


def published_frame(rows: Iterable[PublishedResult]) -> pd.DataFrame:
    """The published results (``chunkstar_bench.published.load_published()``) as a frame.

    Columns: ``hardware, system, gpus, model, n_params, tflops_total,
    tflops_per_gpu, read, source``; ``model`` is the figure's size label
    (``"18B"``), ``n_params`` the exact count of the zoo model carrying it, or
    the label's nominal value where the zoo has none.
    """
    cols = ["hardware", "system", "gpus", "model", "n_params", "tflops_total", "tflops_per_gpu", "read", "source"]
    records = [
        (r.hardware, r.system, r.gpus, r.label, float(r.n_params), r.tflops_total, r.tflops_per_gpu, r.read, "published")
        for r in rows
    ]
    return pd.DataFrame(records, columns=cols).astype({"gpus": int, "n_params": float, "tflops_total": float, "tflops_per_gpu": float})


def run_devices(runs: pd.DataFrame) -> pd.Series:
    """``cpu`` or ``cuda`` per run: the device its spec names (``config_json``); for a row without one,
    ``cpu`` when the hardware label starts with "cpu", else ``cuda``."""

    def one(config: object, hardware: object) -> str:
        try:
            device = json.loads(str(config))["spec"]["device"]
        except (ValueError, KeyError, TypeError):
            device = None
        if device in ("cpu", "cuda"):
            return str(device)
        return "cpu" if str(hardware).lower().startswith("cpu") else "cuda"

    return pd.Series([one(c, h) for c, h in zip(runs["config_json"], runs["hardware"])], index=runs.index, dtype=object)


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that finished (``status == "ok"``), oldest first."""
    if runs.empty:
        return runs
    out = runs[runs["status"] == "ok"]
    return out.sort_values(["created_utc", "id"], kind="stable").reset_index(drop=True)


def measured_throughput(runs: pd.DataFrame, hardware: str) -> pd.DataFrame:
    """The ok runs on ``hardware``: the best (most tokens/s) per system, model and process count.

    Columns: ``system, label, model, n_params, params_b, nprocs, batch, device, tokens_per_s,
    step_time_s, tflops_per_gpu``; sorted by system and size for line plots.
    """
    cols = ["system", "label", "model", "n_params", "params_b", "nprocs", "batch", "device", "tokens_per_s", "step_time_s",
            "tflops_per_gpu"]  # fmt: skip
    ok = ok_runs(runs)
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok = ok[(ok["hardware"] == hardware)].dropna(subset=["tokens_per_s"])
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok = ok.assign(
        device=run_devices(ok), tokens_per_s=ok["tokens_per_s"].astype(float), nprocs=ok["nprocs"].astype(int),
        n_params=ok["n_params"].astype(float), tflops_per_gpu=pd.to_numeric(ok["tflops_per_gpu_patrickstar"], errors="coerce"),
        step_time_s=pd.to_numeric(ok["step_time_s"], errors="coerce"),
    )  # fmt: skip
    best = ok.sort_values("tokens_per_s", kind="stable").groupby(["system", "model", "nprocs"], as_index=False).tail(1)
    best = best.assign(params_b=best["n_params"] / 1e9, label=best["system"].map(system_label))
    return best[cols].sort_values(["system", "nprocs", "n_params"], kind="stable").reset_index(drop=True)


def throughput_points(
    runs: pd.DataFrame, published: pd.DataFrame | None = None, published_hardware: str | None = None
) -> pd.DataFrame:
    """TFLOPS per GPU against model size, one row per (source, system, GPU count, model).

    Measured: the ok runs on a GPU (a CPU run has no TFLOPS per GPU: see
    :func:`measured_throughput`), their ``tflops_per_gpu_patrickstar`` (several
    runs of one point: the best, as the paper reports the best batch).
    Published: the rows of ``published`` for ``published_hardware`` (none when
    None). Columns: ``source, system, hardware, gpus, model, n_params,
    params_b, tflops_per_gpu``; sorted for line plots.
    """
    cols = ["source", "system", "hardware", "gpus", "model", "n_params", "params_b", "tflops_per_gpu"]
    parts = []
    ok = ok_runs(runs)
    if not ok.empty:
        m = ok[run_devices(ok) == "cuda"].dropna(subset=["tflops_per_gpu_patrickstar"])
        m = m.assign(source="measured", gpus=m["nprocs"].astype(int), tflops_per_gpu=m["tflops_per_gpu_patrickstar"].astype(float))
        m = m.groupby(["source", "system", "hardware", "gpus", "model", "n_params"], as_index=False)["tflops_per_gpu"].max()
        parts.append(m)
    if published is not None and published_hardware:
        p = published[published["hardware"] == published_hardware]
        parts.append(p[["source", "system", "hardware", "gpus", "model", "n_params", "tflops_per_gpu"]])
    parts = [x for x in parts if len(x)]
    if not parts:
        return pd.DataFrame(columns=cols)
    out = pd.concat(parts, ignore_index=True)
    out = out.assign(params_b=out["n_params"].astype(float) / 1e9)
    return out[cols].sort_values(["source", "system", "gpus", "n_params"], kind="stable").reset_index(drop=True)


def _stands_beside(system: str) -> str:
    try:
        return system_info(system).stands_beside or system
    except KeyError:
        return system


def max_scale(
    runs: pd.DataFrame, published: pd.DataFrame | None = None, planned: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The largest model per hardware and system: measured (ok runs), published, planned.

    ``planned`` is a frame with ``hardware, system, model, n_params`` (the
    capacity planner's predictions). A published system's bars stand in the
    group of the system of ours it is compared with (``SystemInfo.stands_beside``:
    PatrickStar's in chunkstar's), their text naming the paper's system and
    size label ("18B (PatrickStar)"). Columns: ``hardware, system, source,
    model, n_params, params_b, gpus`` (gpus: the GPU count of that largest run;
    NaN for planned).
    """
    cols = ["hardware", "system", "source", "model", "n_params", "params_b", "gpus"]
    parts = []
    ok = ok_runs(runs)
    if not ok.empty:
        m = ok.assign(source="measured", gpus=ok["nprocs"].astype(float))
        parts.append(m[["hardware", "system", "source", "model", "n_params", "gpus"]])
    if published is not None and len(published):
        p = published.assign(
            gpus=published["gpus"].astype(float),
            system=published["system"].map(_stands_beside),
            model=[f"{m} ({system_label(s)})" for m, s in zip(published["model"], published["system"])],
        )
        parts.append(p[["hardware", "system", "source", "model", "n_params", "gpus"]])
    if planned is not None and len(planned):
        parts.append(planned.assign(source="planned", gpus=np.nan)[["hardware", "system", "source", "model", "n_params", "gpus"]])
    parts = [x for x in parts if len(x)]
    if not parts:
        return pd.DataFrame(columns=cols)
    both = pd.concat(parts, ignore_index=True)
    both["n_params"] = both["n_params"].astype(float)
    top = both.sort_values("n_params", kind="stable").groupby(["hardware", "system", "source"], as_index=False).tail(1)
    top = top.assign(params_b=top["n_params"] / 1e9)
    order = {s: i for i, s in enumerate(SOURCES)}
    top = top.assign(_o=top["source"].map(order)).sort_values(["hardware", "system", "_o"], kind="stable")
    return top[cols].reset_index(drop=True)


def trends(
    runs: pd.DataFrame,
    metrics: Sequence[str] = tuple(TREND_METRICS),
    window: int = REGRESSION_WINDOW,
    threshold: float = REGRESSION_THRESHOLD,
) -> pd.DataFrame:
    """Each metric of each series (same suite/system/model/hardware/GPUs/batch/seq) over its runs, oldest first.

    ``baseline`` is the median of up to ``window`` earlier ok runs of the series
    (NaN for the first run); ``change`` the relative change from it;
    ``regression`` is True when the change is worse than ``threshold`` in the
    metric's bad direction (``TREND_METRICS``): throughput down, memory up.
    A series of CPU runs has no TFLOPS-per-GPU rows.
    Columns: ``series``, the key columns, ``created_utc, git_commit, id,
    metric, value, baseline, change, regression``.
    """
    keys = [k for k in SERIES_KEYS if k in runs.columns]
    cols = ["series", *keys, "created_utc", "git_commit", "id", "metric", "value", "baseline", "change", "regression"]
    ok = ok_runs(runs)
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok = ok.assign(created_utc=pd.to_datetime(ok["created_utc"], utc=True, errors="coerce"), _device=run_devices(ok))
    out = []
    for key, group in ok.groupby(keys, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        label = dict(zip(keys, key))
        series = f"{label.get('system')} {label.get('model')} x{label.get('nprocs')} b{label.get('batch')} ({label.get('hardware')})"
        group = group.sort_values(["created_utc", "id"], kind="stable")
        on_cpu = bool((group["_device"] == "cpu").all())
        for metric in metrics:
            if metric not in group.columns or (on_cpu and metric.startswith("tflops_per_gpu")):
                continue  # a CPU run has no TFLOPS per GPU to trend
            values = pd.to_numeric(group[metric], errors="coerce")
            if values.isna().all():
                continue
            baseline = values.shift(1).rolling(window, min_periods=1).median()
            change = (values - baseline) / baseline
            worse = -change if TREND_METRICS.get(metric, "lower") == "lower" else change
            frame = pd.DataFrame(
                {
                    "series": series, **{k: group[k].to_numpy() for k in keys},
                    "created_utc": group["created_utc"].to_numpy(), "git_commit": group["git_commit"].astype(str).to_numpy(),
                    "id": group["id"].to_numpy(), "metric": metric, "value": values.to_numpy(),
                    "baseline": baseline.to_numpy(), "change": change.to_numpy(),
                    "regression": (worse > threshold).fillna(False).to_numpy(dtype=bool),
                }
            )  # fmt: skip
            out.append(frame)
    if not out:
        return pd.DataFrame(columns=cols)
    return pd.concat(out, ignore_index=True)[cols]


def regressions(trend: pd.DataFrame) -> pd.DataFrame:
    """The flagged rows of :func:`trends`, newest first, with the change in percent."""
    if trend.empty:
        return trend.assign(change_pct=pd.Series(dtype=float))
    flagged = trend[trend["regression"]]
    flagged = flagged.assign(change_pct=flagged["change"] * 100)
    return flagged.sort_values("created_utc", ascending=False, kind="stable").reset_index(drop=True)
