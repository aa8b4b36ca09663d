"""Where each chunk's payload was over time, grouped by chunk list."""

from __future__ import annotations

import math

import streamlit as st

from chunkstar_dashboard import charts, loading
from chunkstar_dashboard.data import MAX_CHUNK_ROWS, clock_label, duration_s, format_duration, placement_grid

# Largest chunk x bin grid sent to the browser (a few MB of plotly JSON). A comment, not a docstring:
# Streamlit would write a bare string onto the page (where magic is on).
MAX_CELLS = 600_000

st.title("Chunk locations")
p = loading.current_profile()

if p.placements.empty:
    st.info("This profile recorded no chunk placements.")
    st.stop()

order = list(p.meta.get("chunk_lists") or [])
present = [c for c in order if c in set(p.placements["chunk_list"])] + sorted(set(p.placements["chunk_list"]) - set(order))
lists = st.multiselect("Chunk lists", present, default=present, key="chunk_lists")
bins = st.slider("Time bins", min_value=50, max_value=1000, value=400, step=50, key="chunk_bins")
if not lists:
    st.warning("Pick at least one chunk list.")
    st.stop()

selected = p.placements[p.placements["chunk_list"].isin(lists)]
per_list = selected[["chunk_list", "chunk_id"]].drop_duplicates()["chunk_list"].value_counts()
n_chunks = int(per_list.sum())
band = max(1, math.ceil(n_chunks / MAX_CHUNK_ROWS))  # past MAX_CHUNK_ROWS, a row is a band of consecutive chunks
n_rows = sum(math.ceil(int(n) / band) for n in per_list)
n_bins = min(bins, max(50, MAX_CELLS // max(n_rows, 1)))
grid = placement_grid(selected, order, n_bins=n_bins, t_end=duration_s(p), max_rows=MAX_CHUNK_ROWS)
st.plotly_chart(charts.chunk_map(grid, clock_label(p)), key="chunk_map")
if grid.band > 1:
    st.caption(
        f"{n_chunks:,} chunks, more than the {MAX_CHUNK_ROWS:,} rows the map draws: each row is a band of {grid.band} "
        "consecutive chunks of one list (fewer in a list's last row), coloured by their mean; hover a row for its "
        "chunks. Pick fewer chunk lists for finer bands."
    )
if n_bins < bins:
    st.caption(f"{n_rows:,} rows: time bins reduced to {n_bins} to keep the map under {MAX_CELLS:,} cells.")
if grid.has_disk:
    st.caption(
        f"Each cell is a {format_duration(grid.bin_s)} time bin. Colour: where the payload spent the bin, on the device "
        "(red), the host (blue) or only on disk (brown: a state chunk in its file, not staged in); cells between "
        "two colours moved during the bin; blank cells had no payload (not yet allocated or freed)."
    )
else:
    st.caption(
        f"Each cell is a {format_duration(grid.bin_s)} time bin. Colour: share of the bin the payload spent on the device "
        "(red) versus the host (blue); pale cells moved during the bin; blank cells had no payload (not yet allocated or freed)."
    )
