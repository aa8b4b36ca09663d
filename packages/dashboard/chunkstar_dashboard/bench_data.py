"""Pure data shaping for the Benchmarks page: result runs and published figures in, chart-ready frames out.

The inputs are plain DataFrames: the runs of a results database
(``chunkstar_bench.results.ResultsDB(path).runs()``: one row per run, columns
``id, created_utc, suite, system, model, n_params, hardware, nprocs, batch,
seq_len, status, ..., tokens_per_s, tflops_per_gpu_patrickstar, ...,
peak_device_bytes, peak_host_bytes, git_commit, ...``) and the paper's published
figures (``paper_results.csv``). Nothing here imports Streamlit, plotly or the
bench package, so every function is unit-tested on hand-made frames.

Every frame that mixes our measurements with the paper's carries a ``source``
column (``measured``, ``published``, ``planned``): published numbers are the
reference to beat, never a result of this project, and the charts keep them
visibly apart.

TFLOPS use PatrickStar's FLOP count (``8 * params * batch * seq``) on both
sides, since that is the count the published figures use (``FLOP_FORMULA``).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = [
    "FLOP_FORMULA",
    "REGRESSION_THRESHOLD",
    "REGRESSION_WINDOW",
    "SOURCES",
    "TREND_METRICS",
    "RUN_COLUMNS",
    "empty_runs",
    "label_params",
    "max_scale",
    "ok_runs",
    "published_frame",
    "regressions",
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
SERIES_KEYS = ("suite", "system", "model", "hardware", "nprocs", "batch", "seq_len")
"""What makes two runs the same measurement taken at different commits."""

RUN_COLUMNS = (
    "id", "created_utc", "suite", "system", "model", "n_params", "hardware", "nprocs", "batch", "seq_len", "status",
    "message", "step_time_s", "tokens_per_s", "tflops_per_gpu_patrickstar", "tflops_per_gpu_megatron", "mfu",
    "peak_device_bytes", "peak_host_bytes", "config_json", "versions_json", "git_commit", "host",
)  # fmt: skip
"""The columns of ``ResultsDB.runs()``."""

PUBLISHED_SYSTEM_NAMES = {"patrickstar": "PatrickStar", "deepspeed": "DeepSpeed", "pytorch": "PyTorch"}
PUBLISHED_AS = {"patrickstar": "chunkstar"}
"""Published system -> the system of ours its bars stand beside (chunkstar re-creates PatrickStar)."""


def empty_runs() -> pd.DataFrame:
    """A runs frame with no rows (no database loaded)."""
    return pd.DataFrame(columns=list(RUN_COLUMNS))


def label_params(label: str) -> float:
    """A size label of the paper's figures in parameters: ``"18B"`` -> 1.8e10; NaN when unreadable."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMBT])\s*", str(label), re.IGNORECASE)
    if not m:
        return float("nan")
    return float(m.group(1)) * {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[m.group(2).upper()]


def published_frame(csv_text: str, label_to_params: Mapping[str, int] | None = None) -> pd.DataFrame:
    """The published results (``paper_results.csv`` text, ``#`` lines are comments) as a frame.

    Columns: ``hardware, system, gpus, model, n_params, tflops_total,
    tflops_per_gpu, read, source``. ``n_params`` is the exact count of the zoo
    model carrying that label when ``label_to_params`` has it (``"18B"`` ->
    GPT3_18B's 18.3e9), otherwise the label's nominal value.
    """
    lines = [ln for ln in csv_text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    df = pd.DataFrame(rows, columns=["hardware", "system", "gpus", "model", "tflops_total", "read"])
    df["gpus"] = df["gpus"].astype(int)
    df["tflops_total"] = df["tflops_total"].astype(float)
    mapping = dict(label_to_params or {})
    df["n_params"] = [float(mapping[m]) if m in mapping else label_params(m) for m in df["model"]]
    df["tflops_per_gpu"] = df["tflops_total"] / df["gpus"]
    df["source"] = "published"
    return df[["hardware", "system", "gpus", "model", "n_params", "tflops_total", "tflops_per_gpu", "read", "source"]]


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that finished (``status == "ok"``), oldest first."""
    if runs.empty:
        return runs
    out = runs[runs["status"] == "ok"]
    return out.sort_values(["created_utc", "id"], kind="stable").reset_index(drop=True)


def throughput_points(
    runs: pd.DataFrame, published: pd.DataFrame | None = None, published_hardware: str | None = None
) -> pd.DataFrame:
    """TFLOPS per GPU against model size, one row per (source, system, GPU count, model).

    Measured: the ok runs, their ``tflops_per_gpu_patrickstar`` (several runs
    of one point: the best, as the paper reports the best batch). Published:
    the rows of ``published`` for ``published_hardware`` (none when None).
    Columns: ``source, system, hardware, gpus, model, n_params, params_b,
    tflops_per_gpu``; sorted for line plots.
    """
    cols = ["source", "system", "hardware", "gpus", "model", "n_params", "params_b", "tflops_per_gpu"]
    parts = []
    ok = ok_runs(runs)
    if not ok.empty:
        m = ok.dropna(subset=["tflops_per_gpu_patrickstar"])
        m = m.assign(source="measured", gpus=m["nprocs"].astype(int), tflops_per_gpu=m["tflops_per_gpu_patrickstar"])
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


def max_scale(
    runs: pd.DataFrame, published: pd.DataFrame | None = None, planned: pd.DataFrame | None = None
) -> pd.DataFrame:
    """The largest model per hardware and system: measured (ok runs), published, planned.

    ``planned`` is a frame with ``hardware, system, model, n_params`` (the
    capacity planner's predictions). Published PatrickStar bars stand in
    chunkstar's group (``PUBLISHED_AS``), their text naming the paper's system
    and size label ("18B (PatrickStar)"). Columns: ``hardware, system, source,
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
            system=published["system"].map(lambda s: PUBLISHED_AS.get(s, s)),
            model=[f"{m} ({PUBLISHED_SYSTEM_NAMES.get(s, s)})" for m, s in zip(published["model"], published["system"])],
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
    Columns: ``series``, the key columns, ``created_utc, git_commit, id,
    metric, value, baseline, change, regression``.
    """
    keys = [k for k in SERIES_KEYS if k in runs.columns]
    cols = ["series", *keys, "created_utc", "git_commit", "id", "metric", "value", "baseline", "change", "regression"]
    ok = ok_runs(runs)
    if ok.empty:
        return pd.DataFrame(columns=cols)
    ok = ok.assign(created_utc=pd.to_datetime(ok["created_utc"], utc=True, errors="coerce"))
    out = []
    for key, group in ok.groupby(keys, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        label = dict(zip(keys, key))
        series = f"{label.get('system')} {label.get('model')} x{label.get('nprocs')} b{label.get('batch')} ({label.get('hardware')})"
        group = group.sort_values(["created_utc", "id"], kind="stable")
        for metric in metrics:
            if metric not in group.columns:
                continue
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
