"""Plotly figures built from the frames in ``data``; no Streamlit here.

Each function returns a ``go.Figure`` (and, where it drops data, says so) so
tests can check a figure's traces without a browser.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from chunkstar_profiler import Profile

from .data import (
    MAX_POINTS_PER_TRACE, TIERS, PlacementGrid, activation_series, clock_label, duration_s, format_duration, memory_series,
    tiers_present, time_axis,
)  # fmt: skip

__all__ = [
    "ACTIVATION_TRACES", "STAGE_COLOURS", "STAGE_NAMES", "TIER_COLOURS", "chunk_map", "memory_timeline", "operator_bytes",
    "step_times_chart",
]  # fmt: skip

MIB = 2.0**20
BUDGET_OFF_SCALE = 2.0
"""A budget more than this many times the peak is drawn off scale (named in the legend)."""
STAGE_COLOURS = {"fwd": "rgba(31,119,180,0.16)", "bwd": "rgba(255,127,14,0.20)", "optim": "rgba(44,160,44,0.26)"}
"""Band fill per stage: light enough that the memory lines read over them, strong enough to tell apart."""
STAGE_NAMES = {"fwd": "forward", "bwd": "backward", "optim": "optimizer"}
MAX_ITERATION_LABELS = 40
"""Past this many iterations in view, the bands are not numbered (the labels would overlap)."""
TIER_COLOURS = {"device": "#e4572e", "host": "#2e86ab", "disk": "#8c564b"}
"""One colour per tier, on every page: the chunk map, the operator bars, the memory panels' titles."""
TIER_TITLES = {"device": "device memory", "host": "host memory", "disk": "disk: chunk files"}
"""Panel (y-axis) titles of the memory timeline: the disk tier's bytes are its chunk files."""
ACTIVATION_TRACES = {
    # direction (the tier the copy went to) -> legend name, marker colour (that tier's), marker symbol
    "host": ("activations to host", TIER_COLOURS["host"], "triangle-down"),
    "device": ("activations to device", TIER_COLOURS["device"], "triangle-up"),
}
"""The memory timeline's activation-move traces: markers, never lines, so they read apart from the memory
lines; the symbol points the way the bytes went (down off the device, up onto it)."""
ACTIVATION_PANEL_PX = 170
"""Height of the timeline's activation-moves panel (under the tiers'), when the profile has activation moves."""
_SERIES = (
    # column, legend name, line style
    ("total_bytes", "total", dict(color="#222222", width=1.6)),
    ("chunk_bytes", "chunks", dict(color="#e4572e", width=1.2)),
    ("non_model_bytes", "non-model", dict(color="#7b2cbf", width=1.2)),
)


def _stage_band_traces(stages: pd.DataFrame, y_top: float, scale: float, show_legend: bool) -> list[go.Scatter]:
    """One filled trace per stage (all its iterations joined by gaps), under the memory lines; x in units of ``scale`` s."""
    out = []
    for stage, colour in STAGE_COLOURS.items():
        bands = stages[stages["stage"] == stage]
        if bands.empty:
            continue
        n = len(bands)
        xs = np.empty(n * 5)
        ys = np.empty(n * 5)
        xs[0::5], xs[1::5] = bands["t_start_s"] / scale, bands["t_start_s"] / scale
        xs[2::5], xs[3::5] = bands["t_end_s"] / scale, bands["t_end_s"] / scale
        xs[4::5] = np.nan
        ys[0::5], ys[1::5], ys[2::5], ys[3::5], ys[4::5] = 0.0, y_top, y_top, 0.0, np.nan
        out.append(
            go.Scatter(
                x=xs, y=ys, fill="toself", fillcolor=colour, line=dict(width=0), mode="lines",
                name=STAGE_NAMES.get(stage, stage), legendgroup=f"stage-{stage}", showlegend=show_legend, hoverinfo="skip",
            )
        )  # fmt: skip
    return out


def memory_timeline(
    p: Profile,
    tiers: Sequence[str] = TIERS,
    max_points: int = MAX_POINTS_PER_TRACE,
    y_max_mib: dict[str, float] | None = None,
    height_per_tier: int = 320,
    iterations: tuple[int, int] | None = None,
    activations: bool = True,
) -> tuple[go.Figure, bool]:
    """Memory per tier over time: total, chunks, non-model, budget, over forward/backward/optimizer bands.

    With ``activations`` and a profile that has activation moves (saved activations across the host
    link), a panel under the tiers' shows each copy as a marker at its start, its size in MiB, one trace
    per direction (``ACTIVATION_TRACES``): their own legend entries, apart from the memory lines; chunk
    moves are not drawn here (they are the chunk map's and the operator page's).

    Returns the figure and whether any trace was downsampled. Hovering a
    sample names the module (operator) whose moment boundary it was taken at.
    Tiers without samples are left out (``TIERS`` holds the disk tier, which
    most runs do not have); one panel per tier, titled in the tier's colour.
    ``iterations`` (inclusive) narrows the view to those iterations' stages;
    each iteration in view is numbered above its bands. Time is in ms, s or
    min, whichever suits the span shown (``data.time_axis``); a predicted
    profile's axis says it is the time model's (``data.clock_label``).
    """
    present = set(tiers_present(p.memory))
    tiers = [t for t in tiers if t in present] or list(tiers)[:1]
    stages = p.stages
    window: tuple[float, float] | None = None
    if iterations is not None and len(stages):
        stages = stages[stages["iteration"].between(*iterations)]
        if len(stages):
            window = (float(stages["t_start_s"].min()), float(stages["t_end_s"].max()))
    span = window[1] - window[0] if window else duration_s(p)
    unit, scale = time_axis(span)
    moved = {dst: activation_series(p.activation_moves, dst, max_points, window) for dst in ACTIVATION_TRACES} if activations else {}
    moved = {dst: rows for dst, rows in moved.items() if len(rows[0])}
    panels_px = height_per_tier * len(tiers) + (ACTIVATION_PANEL_PX if moved else 0)
    # each panel is named by its y-axis title, in the tier's colour; the strip above the top panel numbers the iterations
    fig = make_subplots(
        rows=len(tiers) + bool(moved), cols=1, shared_xaxes=True,
        vertical_spacing=0.06 * height_per_tier * max(len(tiers), 1) / panels_px,  # the gap the tiers' panels always had
        row_heights=[height_per_tier] * len(tiers) + ([ACTIVATION_PANEL_PX] if moved else []),
    )  # fmt: skip
    downsampled = False
    for row, tier in enumerate(tiers, start=1):
        rows, dropped = memory_series(p.memory, tier, max_points, window)
        downsampled |= dropped
        budget = p.memory.loc[p.memory["tier"] == tier, ["t_s", "budget_bytes"]].sort_values("t_s")
        budget_changes = budget[budget["budget_bytes"].diff().ne(0)]
        if len(budget):
            budget_changes = pd.concat([budget_changes, budget.iloc[[-1]]])
        has_budget = bool((budget["budget_bytes"] > 0).any())
        peak = float(rows["total_bytes"].max()) if len(rows) else 0.0
        budget_max = float(budget["budget_bytes"].max()) if has_budget else 0.0
        # a budget far above the data (an unconstrained run) would flatten the lines: leave it off scale
        fits = has_budget and budget_max <= BUDGET_OFF_SCALE * max(peak, 1.0)
        top = max(peak, budget_max if fits else 0.0)
        top = (y_max_mib or {}).get(tier, top / MIB * 1.05) or 1.0
        budget_on_scale = has_budget and budget_max / MIB <= top
        for trace in _stage_band_traces(stages, top, scale, show_legend=row == 1):
            fig.add_trace(trace, row=row, col=1)
        custom = np.column_stack([rows["module"].astype(str), rows["stage"].astype(str), rows["iteration"].astype(str)])
        for col, label, line in _SERIES:
            fig.add_trace(
                go.Scatter(
                    x=rows["t_s"] / scale, y=rows[col] / MIB, name=label, legendgroup=label, showlegend=row == 1,
                    mode="lines", line=dict(shape="hv", **line), customdata=custom,
                    hovertemplate=f"{label} %{{y:,.2f}} MiB<br>t %{{x:,.4~g}} {unit}<br>module %{{customdata[0]}}"
                    f"<br>%{{customdata[1]}}, iteration %{{customdata[2]}}<extra>{tier}</extra>",
                ),
                row=row, col=1,
            )  # fmt: skip
        if has_budget:
            fig.add_trace(
                go.Scatter(
                    x=budget_changes["t_s"] / scale, y=budget_changes["budget_bytes"] / MIB, legendgroup="budget",
                    name="budget" if budget_on_scale else f"budget ({budget_max / MIB:,.0f} MiB, off scale)",
                    showlegend=row == 1, mode="lines", line=dict(shape="hv", color="#d00000", dash="dash", width=1.2),
                    hovertemplate="budget %{y:,.2f} MiB<extra>" + tier + "</extra>",
                ),
                row=row, col=1,
            )  # fmt: skip
        fig.update_yaxes(
            title_text=f"{TIER_TITLES.get(tier, tier)} (MiB)", title_font=dict(color=TIER_COLOURS.get(tier, "#222222")),
            range=[0, top], row=row, col=1,
        )  # fmt: skip
    if moved:
        row = len(tiers) + 1
        top = max(float(rows["nbytes"].max()) for rows, _ in moved.values()) / MIB * 1.15
        for trace in _stage_band_traces(stages, top, scale, show_legend=False):
            fig.add_trace(trace, row=row, col=1)
        for dst, (rows, dropped) in moved.items():
            downsampled |= dropped
            name, colour, symbol = ACTIVATION_TRACES[dst]
            custom = np.column_stack([
                rows["block"].astype(str), rows["module"].astype(str), rows["stage"].astype(str), rows["iteration"].astype(str),
                np.where(rows["prefetch"].astype(bool), ", prefetched", ""), [format_duration(d) for d in rows["duration_s"]],
            ])  # fmt: skip
            fig.add_trace(
                go.Scatter(
                    x=rows["t_start_s"] / scale, y=rows["nbytes"] / MIB, name=name, legendgroup=name, mode="markers",
                    marker=dict(color=colour, symbol=symbol, size=8, line=dict(width=0.5, color="#222222")), customdata=custom,
                    hovertemplate=f"block %{{customdata[0]}}: %{{y:,.2f}} MiB to {dst}%{{customdata[4]}}<br>t %{{x:,.4~g}} {unit}, "
                    "found done after %{customdata[5]}<br>issued in %{customdata[1]}<br>%{customdata[2]}, "
                    f"iteration %{{customdata[3]}}<extra>{name}</extra>",
                ),
                row=row, col=1,
            )  # fmt: skip
        fig.update_yaxes(title_text="activation moves (MiB)", range=[0, top], row=row, col=1)
    starts = stages.groupby("iteration")["t_start_s"].min() if len(stages) else pd.Series(dtype=float)
    if 0 < len(starts) <= MAX_ITERATION_LABELS:
        for iteration, t in starts.items():  # numbered just above the top panel's bands
            fig.add_annotation(
                x=t / scale, y=1.0, xref="x", yref="paper", yanchor="bottom", xanchor="left", showarrow=False,
                text=f"iter {int(iteration)}", font=dict(size=11, color="#555555"), name="iteration",
            )  # fmt: skip
    if window is not None:
        fig.update_xaxes(range=[window[0] / scale, window[1] / scale])
    fig.update_xaxes(title_text=f"{clock_label(p)} ({unit})", row=len(tiers) + bool(moved), col=1)
    fig.update_layout(
        height=panels_px + 100, margin=dict(l=10, r=10, t=80, b=10),
        legend=dict(orientation="h", yanchor="bottom", y=1.0 + 45 / panels_px, x=0),
        hovermode="closest",
    )  # fmt: skip
    return fig, downsampled


def chunk_map(grid: PlacementGrid, time_label: str = "time since profile start") -> go.Figure:
    """Chunks x time, coloured by where the payload was; one panel per chunk list.

    Without the disk tier the colour is the device share of each bin (host blue,
    mixed pale, device red). With it, one scale runs disk (brown) -> host (blue)
    -> device (red), :meth:`PlacementGrid.tier_level`: a state chunk on disk is
    brown, staged in blue, half of a bin each in between. A grid of bands
    (``grid.band > 1``) names each row by its first and last chunk; rows too thin
    for a 1 px gap between them are drawn without one. ``time_label``: what the x-axis measures.
    """
    lists = list(dict.fromkeys(grid.chunk_lists))
    counts = [grid.chunk_lists.count(c) for c in lists]
    sizes = np.array(grid.band_sizes or [1] * len(grid.chunk_ids))
    chunks = [int(sizes[np.array(grid.chunk_lists, dtype=object) == c].sum()) for c in lists]
    titles = [
        f"{c} ({n:,} chunks)" if grid.band == 1 else f"{c} ({n:,} chunks, {grid.band} a row)" for c, n in zip(lists, chunks)
    ]
    fig = make_subplots(
        rows=max(1, len(lists)), cols=1, shared_xaxes=True, vertical_spacing=0.04,
        row_heights=[max(c, 1) for c in counts] or [1], subplot_titles=titles,
    )  # fmt: skip
    unit, scale = time_axis(float(grid.edges[-1]) if len(grid.edges) else 0.0)
    centres = (grid.edges[:-1] + grid.edges[1:]) / 2 / scale
    lists_arr = np.array(grid.chunk_lists, dtype=object)
    labels = np.array(grid.row_labels(), dtype=object)
    height = max(300, min(1400, 120 * len(lists) + 14 * len(grid.chunk_ids)))
    row_px = (height - 120 * len(lists)) / max(1, len(grid.chunk_ids))
    # float32 and uint8 below: fewer bytes to the browser
    if grid.has_disk:
        z = grid.tier_level().astype(np.float32)
        colourscale = [[0.0, TIER_COLOURS["disk"]], [0.5, TIER_COLOURS["host"]], [1.0, TIER_COLOURS["device"]]]
        colorbar = dict(title="where", tickvals=[0, 0.5, 1], ticktext=["disk", "host", "device"], len=0.5, y=1, yanchor="top")
        parts, hover = [grid.device, grid.host, grid.disk], "device %{customdata[0]}%, host %{customdata[1]}%, disk %{customdata[2]}%"
    else:
        z = grid.device_share().astype(np.float32)
        colourscale = [[0.0, TIER_COLOURS["host"]], [0.5, "#efe6f5"], [1.0, TIER_COLOURS["device"]]]
        colorbar = dict(title="on device", tickvals=[0, 0.5, 1], ticktext=["host", "mixed", "device"], len=0.5, y=1, yanchor="top")
        parts, hover = [grid.device, grid.host], "device %{customdata[0]}%, host %{customdata[1]}%"
    what = "chunk" if grid.band == 1 else "chunks"
    of = "of the bin" if grid.band == 1 else "of the bin, mean over the row's chunks"
    for row, name in enumerate(lists, start=1):
        sel = lists_arr == name
        custom = np.rint(100 * np.dstack([part[sel] for part in parts])).astype(np.uint8)  # percent
        fig.add_trace(
            go.Heatmap(
                x=centres, y=list(labels[sel]), z=z[sel], zmin=0.0, zmax=1.0, colorscale=colourscale,
                showscale=row == 1, customdata=custom, xgap=0, ygap=1 if row_px >= 4 else 0, colorbar=colorbar,
                hovertemplate=f"{name} {what} %{{y}}<br>t %{{x:,.4~g}} {unit}<br>{hover} {of}<extra></extra>",
            ),
            row=row, col=1,
        )  # fmt: skip
        fig.update_yaxes(title_text=what, type="category", row=row, col=1)
    fig.update_xaxes(title_text=f"{time_label} ({unit})", row=max(1, len(lists)), col=1)
    fig.update_layout(height=height, margin=dict(l=10, r=10, t=40, b=10))
    return fig


_DIRECTION_BARS = (
    # column of data.moves_by_operator, legend name, colour (of the tier the bytes go to), hatching
    ("bytes_to_device", "to device", TIER_COLOURS["device"], ""),
    ("bytes_to_host", "to host", TIER_COLOURS["host"], ""),
    ("bytes_from_disk", "disk -> host (stage-in)", TIER_COLOURS["host"], "/"),
    ("bytes_to_disk", "host -> disk (stage-out)", TIER_COLOURS["disk"], ""),
)


def operator_bytes(table: pd.DataFrame, top: int = 20) -> go.Figure:
    """Stacked horizontal bars of MiB moved each way for the ``top`` modules by bytes.

    A bar's colour is the tier its bytes went to; stage-ins (disk -> host) are
    hatched host bars. The disk tier's bars appear only when it moved bytes.
    """
    bars = [b for b in _DIRECTION_BARS if b[0] in table.columns]
    t = table.assign(_bytes=table[[b[0] for b in bars]].sum(axis=1)).nlargest(top, "_bytes").iloc[::-1]
    fig = go.Figure(
        [
            go.Bar(y=t["module"], x=t[col] / MIB, name=name, orientation="h", marker=dict(color=colour, pattern_shape=hatch))
            for col, name, colour, hatch in bars
            if col in ("bytes_to_device", "bytes_to_host") or t[col].any()
        ]
    )
    # The legend sits under the x-axis title, in a bottom margin of its own: above the plot it covered the top bar.
    height, margin = max(280, 22 * len(t) + 150), dict(l=10, r=10, t=10, b=95)
    plot_px = height - margin["t"] - margin["b"]
    fig.update_layout(
        barmode="stack", height=height, margin=margin, xaxis_title="MiB moved",
        legend=dict(orientation="h", yanchor="top", y=-62 / plot_px, x=0),
    )  # fmt: skip
    return fig


def step_times_chart(steps: pd.DataFrame, names: tuple[str, str]) -> go.Figure:
    """Step time per iteration (ms) of two profiles, from ``data.step_time_comparison``."""
    fig = go.Figure(
        [go.Scatter(x=steps["iteration"], y=steps[col], name=name, mode="lines+markers") for col, name in zip(("A", "B"), names)]
    )
    fig.update_layout(
        height=320, margin=dict(l=10, r=10, t=50, b=10), xaxis_title="iteration", yaxis_title="step time (ms)",
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),  # in the top margin, over no point
        xaxis=dict(tickformat="d", dtick=1 if len(steps) <= 30 else None),  # whole iterations
    )  # fmt: skip
    return fig
