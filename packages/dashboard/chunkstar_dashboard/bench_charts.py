"""Plotly figures of the Benchmarks page, built from the frames in ``bench_data``; no Streamlit here.

Published figures are always drawn apart from ours: dashed lines and hollow
markers in the throughput chart, a hatched bar in the max-scale chart, and the
word "published" in every legend entry that shows them. A CPU run is drawn in
tokens/s (:func:`tokens_vs_size`), never in TFLOPS per GPU beside a GPU node's.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .bench_data import FLOP_FORMULA, METRIC_LABELS, SOURCES, TREND_METRICS, format_metric, system_label
from .data import format_duration

__all__ = ["SYSTEM_COLOURS", "max_scale_bars", "series_styles", "tflops_vs_size", "tokens_vs_size", "trend_chart"]

SYSTEM_COLOURS = {
    "chunkstar": "#e4572e", "patrickstar": "#e4572e",  # chunkstar re-creates PatrickStar: one colour
    "chunkstar-disk": "#8c564b",
    "deepspeed": "#2e86ab", "deepspeed-mp2": "#5fa8d3", "deepspeed-mp4": "#94c5e3", "deepspeed-nvme": "#1b4f72",
    "fsdp2": "#7b2cbf", "pytorch": "#444444", "pytorch-fsdp": "#999999",
}  # fmt: skip
"""One colour per system (canonical names, ``chunkstar_bench.published.SYSTEMS``), on every chart."""
SOURCE_STYLE = {
    "measured": dict(colour="#e4572e", pattern=""),
    "published": dict(colour="#8d99ae", pattern="/"),
    "planned": dict(colour="#a8dadc", pattern="."),
}
"""Bar colour and fill pattern per source: published and planned bars are hatched, never solid."""
_DASHES = ("solid", "dot", "dash", "longdash", "dashdot", "longdashdot")
_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "star")
_OTHER_COLOURS = ("#ff9f1c", "#2ec4b6", "#6a994e", "#bc4749", "#3a86ff", "#8338ec")
"""Colours of systems :data:`SYSTEM_COLOURS` does not name, in turn."""


def _colour(system: str, others: dict[str, str] | None = None) -> str:
    if system in SYSTEM_COLOURS:
        return SYSTEM_COLOURS[system]
    if others is None:
        return "#999999"
    return others.setdefault(system, _OTHER_COLOURS[len(others) % len(_OTHER_COLOURS)])


def _system_label(system: str, source: str) -> str:
    if source == "published":
        return f"{system_label(system)} (published)"
    return system_label(system) if source == "measured" else f"{system_label(system)} ({source})"


def tflops_vs_size(points: pd.DataFrame) -> go.Figure:
    """TFLOPS per GPU against model size (billions of parameters), one panel per GPU count.

    ``points`` is :func:`bench_data.throughput_points`. Measured systems are
    solid lines with filled markers; published ones dashed with hollow markers,
    named "... (published)".
    """
    gpus = sorted(int(g) for g in points["gpus"].unique()) if len(points) else [1]
    fig = make_subplots(rows=1, cols=len(gpus), shared_yaxes=True, subplot_titles=[f"{g} GPU{'s' * (g > 1)}" for g in gpus])
    shown: set[str] = set()
    for col, g in enumerate(gpus, start=1):
        for (source, system), grp in points[points["gpus"] == g].groupby(["source", "system"], sort=True):
            published = source == "published"
            name = _system_label(str(system), str(source))
            fig.add_trace(
                go.Scatter(
                    x=grp["params_b"], y=grp["tflops_per_gpu"], name=name, legendgroup=name, showlegend=name not in shown,
                    mode="lines+markers", text=grp["model"],
                    line=dict(color=_colour(str(system)), dash="dash" if published else "solid", width=1.4 if published else 2.2),
                    marker=dict(symbol="circle-open" if published else "circle", size=8 if published else 9),
                    hovertemplate=f"{name}<br>%{{text}} (%{{x:.2f}}B params)<br>%{{y:.1f}} TFLOPS/GPU<extra>{g} GPU(s)</extra>",
                ),
                row=1, col=col,
            )  # fmt: skip
            shown.add(name)
        fig.update_xaxes(title_text="model size (B params)", row=1, col=col)
    fig.update_yaxes(title_text="TFLOPS per GPU", row=1, col=1, rangemode="tozero")
    fig.update_layout(
        height=420, margin=dict(l=10, r=10, t=90, b=10), hovermode="closest",
        title=dict(text=f"FLOPs: {FLOP_FORMULA}", font=dict(size=12), x=0, y=0.98),
        legend=dict(orientation="h", yanchor="bottom", y=1.12, x=0),
    )  # fmt: skip
    return fig


def tokens_vs_size(points: pd.DataFrame, hardware: str) -> go.Figure:
    """Measured tokens/s against model size on one node, a line per system and process count.

    ``points`` is :func:`bench_data.measured_throughput`; hover gives the time
    per step too. For CPU runs, where TFLOPS per GPU does not apply; the title
    names the node and its device.
    """
    small = len(points) == 0 or float(points["params_b"].max()) < 1.0
    scale, unit = (1e3, "M") if small else (1.0, "B")
    devices = sorted(set(points["device"])) if len(points) else []
    kind = "CPU" if devices == ["cpu"] else "GPU" if devices == ["cuda"] else "/".join(d.upper() for d in devices)
    fig = go.Figure()
    for (system, nprocs), grp in points.groupby(["system", "nprocs"], sort=True):
        name = system_label(str(system)) + (f" x{int(nprocs)}" if int(nprocs) > 1 else "")
        custom = list(zip(grp["model"], [format_duration(float(t)) if pd.notna(t) else "n/a" for t in grp["step_time_s"]]))
        fig.add_trace(
            go.Scatter(
                x=grp["params_b"] * scale, y=grp["tokens_per_s"], name=name, mode="lines+markers", customdata=custom,
                line=dict(color=_colour(str(system)), width=2.2), marker=dict(size=9),
                hovertemplate=f"{name}<br>%{{customdata[0]}} (%{{x:,.3~g}}{unit} params)<br>%{{y:,.0f}} tokens/s, "
                "%{customdata[1]} per step<extra></extra>",
            )
        )  # fmt: skip
    fig.update_xaxes(title_text=f"model size ({unit} params)", type="log")
    rates = points["tokens_per_s"].astype(float) if len(points) else pd.Series([1.0])
    if rates.max() > 20 * max(rates.min(), 1e-12):  # sizes a hundredfold apart: rates too, best read on a log axis
        fig.update_yaxes(title_text="tokens/s (log)", type="log")
    else:
        fig.update_yaxes(title_text="tokens/s", rangemode="tozero")
    fig.update_layout(
        height=400, margin=dict(l=10, r=10, t=70, b=10), hovermode="closest",
        title=dict(text=f"Measured on {hardware} ({kind})", font=dict(size=13), x=0, y=0.98),
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
    )  # fmt: skip
    return fig


def max_scale_bars(table: pd.DataFrame, cols: int = 3) -> go.Figure:
    """Largest model per hardware and system, one bar per source (measured, published, planned).

    ``table`` is :func:`bench_data.max_scale`. One panel per node, each with
    its own y-axis (a CPU machine's models are 100x smaller than an A100
    node's); bars grouped by system, coloured by source, the bar text naming
    the model.
    """
    nodes = list(dict.fromkeys(table["hardware"])) if len(table) else ["(no data)"]
    cols = max(1, min(cols, len(nodes)))
    rows = -(-len(nodes) // cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=nodes, vertical_spacing=0.22 if rows > 1 else 0.1)
    for i, node in enumerate(nodes):
        r, c = i // cols + 1, i % cols + 1
        sub = table[table["hardware"] == node]
        systems = list(dict.fromkeys(sub["system"]))
        for source in SOURCES:
            part = sub[sub["source"] == source]
            if part.empty:
                continue
            style = SOURCE_STYLE[source]
            fig.add_trace(
                go.Bar(
                    x=part["system"], y=part["params_b"], name=source, legendgroup=source,
                    showlegend=source not in {t.name for t in fig.data}, text=part["model"], textposition="outside",
                    cliponaxis=False, marker=dict(color=style["colour"], pattern=dict(shape=style["pattern"])),
                    hovertemplate=f"{source}: %{{text}}, %{{y:.2f}}B params<br>{node} / %{{x}}<extra></extra>",
                ),
                row=r, col=c,
            )  # fmt: skip
        fig.update_xaxes(categoryorder="array", categoryarray=systems, row=r, col=c)
        fig.update_yaxes(rangemode="tozero", title_text="B params" if c == 1 else None, row=r, col=c)
    fig.update_layout(
        barmode="group", height=330 * rows + 90, margin=dict(l=10, r=10, t=70, b=10), uniformtext_minsize=8,
        legend=dict(orientation="h", yanchor="bottom", y=1.0 + 40 / (330 * rows), x=0, title_text="source: "),
    )  # fmt: skip
    return fig


def series_styles(series: pd.DataFrame) -> dict[str, tuple[str, str, str]]:
    """Colour, dash and marker of each trend series: the colour of its system, then dash and marker in turn
    among that system's series, so no two series look alike. ``series`` has ``series`` and ``system`` columns."""
    styles: dict[str, tuple[str, str, str]] = {}
    per_system: dict[str, int] = {}
    others: dict[str, str] = {}
    pairs = series[["series", "system"]].drop_duplicates("series").sort_values("series", kind="stable")
    for name, system in zip(pairs["series"], pairs["system"]):
        k = per_system.get(str(system), 0)
        per_system[str(system)] = k + 1
        styles[str(name)] = (_colour(str(system), others), _DASHES[k % len(_DASHES)], _SYMBOLS[(k // len(_DASHES)) % len(_SYMBOLS)])
    return styles


def trend_chart(trend: pd.DataFrame, metrics: tuple[str, ...] = ("tokens_per_s", "peak_device_bytes", "peak_host_bytes")) -> go.Figure:
    """Each metric over time, one line per series, regressions marked with a red cross.

    ``trend`` is :func:`bench_data.trends`; bytes are drawn in MiB. A series
    keeps one colour, dash and marker (:func:`series_styles`) in every panel,
    the ones its legend entry shows. Hover names the git commit, the baseline
    and the change.
    """
    metrics = tuple(m for m in metrics if (trend["metric"] == m).any()) or metrics[:1]
    fig = make_subplots(
        rows=len(metrics), cols=1, shared_xaxes=True, vertical_spacing=0.07,
        subplot_titles=[_panel_title(m) for m in metrics],
    )  # fmt: skip
    styles = series_styles(trend) if len(trend) else {}
    shown: set[str] = set()
    flagged_shown = False
    for row, metric in enumerate(metrics, start=1):
        rows = trend[trend["metric"] == metric]
        scale = 2.0**20 if metric.endswith("_bytes") else 1.0
        for series, grp in rows.groupby("series", sort=True):
            colour, dash, symbol = styles[str(series)]
            change = (grp["change"] * 100).round(1).astype(str).where(grp["change"].notna(), "n/a")
            value = [format_metric(metric, v) for v in grp["value"]]
            baseline = [format_metric(metric, v) for v in grp["baseline"]]
            custom = list(zip(grp["git_commit"].str.slice(0, 10), baseline, change, value))
            fig.add_trace(
                go.Scatter(
                    x=grp["created_utc"], y=grp["value"] / scale, name=str(series), legendgroup=str(series),
                    showlegend=series not in shown, mode="lines+markers", customdata=custom,
                    line=dict(color=colour, dash=dash, width=2), marker=dict(color=colour, symbol=symbol, size=7),
                    hovertemplate="%{customdata[3]} at commit %{customdata[0]}<br>baseline %{customdata[1]}, "
                    "change %{customdata[2]}%<extra>" + str(series) + "</extra>",
                ),
                row=row, col=1,
            )  # fmt: skip
            shown.add(str(series))
        bad = rows[rows["regression"]]
        if len(bad):
            direction = "drop" if TREND_METRICS.get(metric, "lower") == "lower" else "rise"
            fig.add_trace(
                go.Scatter(
                    x=bad["created_utc"], y=bad["value"] / scale, mode="markers", name="regression",
                    legendgroup="regression", showlegend=not flagged_shown,
                    marker=dict(symbol="x", size=14, color="#d00000", line=dict(width=2)),
                    text=bad["series"] + " @ " + bad["git_commit"].str.slice(0, 10),
                    hovertemplate=f"regression ({direction}): %{{text}}<extra></extra>",
                ),
                row=row, col=1,
            )  # fmt: skip
            flagged_shown = True
        fig.update_yaxes(title_text=_axis_title(metric), rangemode="tozero", row=row, col=1)
    fig.update_xaxes(title_text="run time (UTC)", row=len(metrics), col=1)
    # The legend (one entry per series, long names) goes under the x-axis title (the dates take two lines of
    # ticks), in a margin sized for its rows.
    entries = len(shown) + flagged_shown
    margin = dict(l=10, r=10, t=40, b=90 + 24 * -(-entries // 2))
    plot_px = 260 * len(metrics)
    fig.update_layout(
        height=plot_px + margin["t"] + margin["b"], margin=margin, hovermode="closest",
        legend=dict(orientation="h", yanchor="top", y=-78 / plot_px, x=0),
    )  # fmt: skip
    return fig


def _panel_title(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _axis_title(metric: str) -> str:
    label = METRIC_LABELS.get(metric, metric)
    return f"{label} (MiB)" if metric.endswith("_bytes") else label
