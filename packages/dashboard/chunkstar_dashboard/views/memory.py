"""Memory per tier over time: total, chunks, non-model and the budget, over fwd/bwd/optim bands."""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import charts, loading
from chunkstar_dashboard.data import MAX_POINTS_PER_TRACE, format_bytes, peak_bytes, tiers_present

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

tiers = st.multiselect("Tiers", present, default=present, key="memory_tiers")
if not tiers:
    st.warning("Pick at least one tier.")
    st.stop()
fig, downsampled = charts.memory_timeline(p, tiers)
st.plotly_chart(fig, key="memory_timeline")

n = int(p.memory["tier"].isin(tiers).sum())
if downsampled:
    st.caption(
        f"Long run: {n:,} samples; each trace is downsampled to at most {MAX_POINTS_PER_TRACE:,} points "
        "(minimum and maximum of every bucket kept), so every peak is exact but short dips between them may merge."
    )
else:
    st.caption(f"All {n:,} samples shown (one per moment boundary and tier).")
st.caption(
    "Shaded bands: forward (blue), backward (orange), optimizer (green). Hover a line for the module (operator) "
    "whose moment boundary the sample was taken at. Non-model memory is what the tier's probe measured minus chunk payloads."
    + (
        " Disk: the chunk files of the state on disk (their size is fixed for the run); host memory includes the "
        "staging buffers that state chunks pass through."
        if "disk" in present
        else ""
    )
)
