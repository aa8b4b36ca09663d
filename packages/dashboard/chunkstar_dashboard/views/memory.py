"""Memory per tier over time: total, chunks, non-model and the budget, over forward/backward/optimizer bands;
the activation moves (saved activations across the host link) in a panel of their own."""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import charts, loading
from chunkstar_dashboard.data import (
    MAX_POINTS_PER_TRACE, activation_totals, format_bytes, format_duration, has_activation_moves, iteration_span, peak_bytes,
    tiers_present,
)  # fmt: skip

st.title("Memory timeline")
p = loading.current_profile()

present = tiers_present(p.memory)
budget = int(p.meta.get("budget_bytes") or 0)
cols = st.columns(5 if "disk" in present else 4)
cols[0].metric("Peak device memory", format_bytes(peak_bytes(p.memory, "device")), help="Chunks + non-model, as sampled.")
cols[1].metric("Peak device chunks", format_bytes(peak_bytes(p.memory, "device", "chunk_bytes")))
cols[2].metric("Device budget", format_bytes(budget) if budget else "unbounded")
cols[3].metric("Peak host memory", format_bytes(peak_bytes(p.memory, "host")))
if "disk" in present:
    cols[4].metric(
        "Disk (chunk files)", format_bytes(peak_bytes(p.memory, "disk")),
        help="The disk tier's chunk files: the optimizer state kept on disk, staged through host buffers.",
    )  # fmt: skip

left, right = st.columns([3, 2])
tiers = left.multiselect("Tiers", present, default=present, key="memory_tiers")
iterations: tuple[int, int] | None = None  # None: the whole recording, before the first stage and after the last too
if len(p.stages):
    lo, hi = int(p.stages["iteration"].min()), int(p.stages["iteration"].max())
    if hi > lo:
        picked = right.slider("Iterations", lo, hi, (lo, hi), key="memory_iters", help="Zoom to these iterations (inclusive).")
        if (int(picked[0]), int(picked[1])) != (lo, hi):
            iterations = (int(picked[0]), int(picked[1]))
if not tiers:
    st.warning("Pick at least one tier.")
    st.stop()
fig, downsampled = charts.memory_timeline(p, tiers, iterations=iterations)
st.plotly_chart(fig, key="memory_timeline")

if iterations is not None:
    t0, t1 = iteration_span(p.stages, *iterations)
    shown = p.memory[p.memory["tier"].isin(tiers) & p.memory["t_s"].between(t0, t1)]
    what = f"iteration {iterations[0]}" if iterations[0] == iterations[1] else f"iterations {iterations[0]}-{iterations[1]}"
    where = f"{what} ({format_duration(t1 - t0)})"
else:
    shown = p.memory[p.memory["tier"].isin(tiers)]
    where = "the whole recording"
if downsampled:
    st.caption(
        f"Long run: {len(shown):,} samples in {where}; each trace is downsampled to at most {MAX_POINTS_PER_TRACE:,} "
        "points (minimum and maximum of every bucket kept), so every peak is exact but short dips between them may merge."
        + (" The activation moves likewise keep the smallest and largest copy of every bucket." if has_activation_moves(p) else "")
    )
else:
    st.caption(f"All {len(shown):,} samples shown: {where}, one per moment boundary and tier.")
st.caption(
    "Shaded bands: forward (blue), backward (orange), optimizer (green), each iteration numbered above them. "
    "Hover a line for the module (operator) whose moment boundary the sample was taken at. Non-model memory is "
    "what the tier's probe measured minus chunk payloads."
    + (
        " Disk: the chunk files of the state on disk (their size is fixed for the run); host memory includes the "
        "staging buffers that state chunks pass through."
        if "disk" in present
        else ""
    )
)
if any(t.name in {name for name, _, _ in charts.ACTIVATION_TRACES.values()} for t in fig.data):  # none in view: no panel
    act = activation_totals(p.activation_moves)
    st.caption(
        "Bottom panel: activation moves, a block's saved activations copied to the host in its forward (down triangles, "
        "blue) and back to the device for its backward (up triangles, red); one marker per copy, at its start, its size "
        "in MiB; hover one for its block. They are not chunk moves (those are on the Chunk locations and Operator "
        f"movements pages). Over the recording: {act['to_host']:,} copies to the host "
        f"({format_bytes(act['bytes_to_host'])}), {act['to_device']:,} back ({format_bytes(act['bytes_to_device'])}"
        + (f", {act['prefetched']:,} prefetched ahead of the backward" if act["prefetched"] else "")
        + ")."
    )
