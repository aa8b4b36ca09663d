"""Two profiles side by side (say two chunk sizes or two budgets): key figures with deltas, both timelines."""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import charts, loading
from chunkstar_dashboard.data import compare_table, display_name, peak_bytes, round_significant, step_time_comparison
from chunkstar_dashboard.text import escape_markdown

MIB = 2**20

st.title("Compare profiles")
a = loading.current_profile()
st.caption(f"A: **{escape_markdown(display_name(a))}** (the profile picked in the sidebar)")
other = loading.profile_picker("compare", "Profile B")
if other.error is not None:
    loading.show_error(other.error)
    st.stop()
if other.profile is None:
    st.info("Give a second profile (path or upload) above to compare it with A.")
    st.stop()
b = other.profile
loading.show_prediction(b, "B: ")

name_a, name_b = display_name(a), display_name(b)
table = compare_table(a, b)
shown = table.assign(**{c: round_significant(table[c]) for c in ("A", "B", "delta")}, delta_pct=table["delta_pct"].round(1))
st.subheader("Key figures")
st.dataframe(
    shown.rename(columns={"A": f"A: {name_a}", "B": f"B: {name_b}", "delta": "B - A", "delta_pct": "B - A (%)"}),
    hide_index=True, key="compare_table", height=35 * (len(table) + 1) + 3,
    column_config={"B - A (%)": st.column_config.NumberColumn(format="%+.1f%%")},
)  # fmt: skip
st.caption(
    "Traffic (moves, bytes moved, move time) is per iteration, the recording's total divided by its iterations, "
    "so runs of different lengths compare; peaks are the highest sample. Three significant figures."
)

steps = step_time_comparison(a, b)
if not steps.empty:
    st.subheader("Step time per iteration")
    st.plotly_chart(charts.step_times_chart(steps, (f"A: {name_a}", f"B: {name_b}")), key="compare_steps")

st.subheader("Device memory")
peak = max(peak_bytes(a.memory, "device"), peak_bytes(b.memory, "device"), 1)
budgets = [int(x.meta.get("budget_bytes") or 0) for x in (a, b)]
top = max([peak] + [bud for bud in budgets if bud <= charts.BUDGET_OFF_SCALE * peak])
y_max = {"device": top / MIB * 1.05}
left, right = st.columns(2)
for col, p, label, key in ((left, a, "A", "compare_mem_a"), (right, b, "B", "compare_mem_b")):
    # device memory only, no activation panel: the two figures keep one layout, so heights compare
    fig, downsampled = charts.memory_timeline(p, ("device",), y_max_mib=y_max, height_per_tier=360, activations=False)
    col.markdown(f"**{label}: {escape_markdown(display_name(p))}**")
    col.plotly_chart(fig, key=key)
    if downsampled:
        col.caption("Downsampled (min/max per bucket, peaks exact).")
st.caption("Both timelines share the y-axis range, so heights compare directly.")
