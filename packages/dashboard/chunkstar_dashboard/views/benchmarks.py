"""Benchmark results: TFLOPS against model size, max-scale bars, nightly trends with regressions flagged.

Reads a chunkstar-bench results SQLite (``--bench-db PATH`` or the sidebar box).
Without one it still shows the paper's published figures and the capacity
planner's predictions, each labelled as such.
"""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import bench_charts, bench_data, bench_loading

st.title("Benchmarks")
path = st.sidebar.text_input("Results database (SQLite)", key="bench_db_path", placeholder="results/nightly.sqlite")

try:
    published = bench_loading.load_published()
except ImportError as err:
    st.error(f"The Benchmarks page needs the chunkstar_bench package: {err}")
    st.stop()

runs = bench_data.empty_runs()
if path and path.strip():
    try:
        runs = bench_loading.load_runs(path.strip())
    except bench_loading.BenchLoadError as err:
        st.error(str(err))
        st.stop()
else:
    st.info(
        "No results database loaded: showing the paper's published figures and the planner's predictions only. "
        "Give a path in the sidebar or start the app with `streamlit run dashboards/app.py -- --bench-db PATH` "
        "(written by `chunkstar-bench run --db PATH`)."
    )

ok = bench_data.ok_runs(runs)
flagged = bench_data.regressions(bench_data.trends(runs))
if len(runs):
    cols = st.columns(4)
    cols[0].metric("Runs", f"{len(runs):,}")
    cols[1].metric("OK", f"{len(ok):,}")
    cols[2].metric("Out of memory / error", f"{int((runs['status'] == 'oom').sum())} / {int((runs['status'] == 'error').sum())}")
    cols[3].metric("Regressions flagged", f"{flagged['id'].nunique() if len(flagged) else 0}")

# ------------------------------------------------------------------ throughput
st.subheader("Throughput: TFLOPS per GPU against model size")
published_nodes = sorted(published["hardware"].unique())
measured_nodes = sorted(ok["hardware"].unique()) if len(ok) else []
left, mid, right = st.columns([2, 2, 1])
hardware = left.selectbox("Measured on", measured_nodes, key="bench_hardware") if measured_nodes else None
overlay_options = [*published_nodes, "(none)"]
default_overlay = overlay_options.index(hardware) if hardware in overlay_options else 0
overlay = mid.selectbox("Published overlay", overlay_options, index=default_overlay, key="bench_overlay")
log_axes = right.checkbox("log axes", value=hardware is not None and overlay != hardware, key="bench_log_axes")
points = bench_data.throughput_points(
    ok[ok["hardware"] == hardware] if hardware else ok.iloc[0:0], published, None if overlay == "(none)" else overlay
)
if points.empty:
    st.info("Nothing to draw: no successful runs on this node and no published overlay.")
else:
    fig = bench_charts.tflops_vs_size(points)
    if log_axes:  # CPU-sized measurements beside a GPU node's published figures span decades
        fig.update_xaxes(type="log", dtick=1)
        fig.update_yaxes(type="log", rangemode="normal", dtick=1)
    st.plotly_chart(fig, key="bench_tflops")
st.caption(
    f"FLOPs counted as {bench_data.FLOP_FORMULA} on both sides (the count of the published figures). Dashed lines "
    "and hollow markers are the paper's **published** figures (read off its plots), the bar to beat, not our "
    "measurements; solid lines are runs from the results database (best run per point)."
)

# ------------------------------------------------------------------ max scale
st.subheader("Max scale: the largest model trained")
planned = bench_loading.planned_max(tuple(sorted(set(published_nodes) | set(measured_nodes))))
scale = bench_data.max_scale(ok, published, planned)
nodes = sorted(scale["hardware"].unique())
default_nodes = [n for n in nodes if n in measured_nodes or n in ("v100x8_240gb", "a100x8_1tb")] or nodes
chosen = st.multiselect("Nodes", nodes, default=default_nodes, key="bench_scale_nodes")
scale = scale[scale["hardware"].isin(chosen)]
if scale.empty:
    st.info("Pick at least one node.")
else:
    st.plotly_chart(bench_charts.max_scale_bars(scale), key="bench_max_scale")
    with st.expander("Table"):
        st.dataframe(scale, hide_index=True, key="bench_scale_table")
st.caption(
    "**measured**: the largest model with a successful run in the database (any GPU count); **published**: the "
    "largest the paper reports (PatrickStar's bars stand beside chunkstar's); **planned**: a PREDICTION of "
    "`chunkstar-bench plan` (bytes per parameter, micro-batch 8 per GPU, activation checkpointing), not a measurement."
)

# ------------------------------------------------------------------ trends
st.subheader("Nightly trends")
suites = sorted(ok["suite"].unique()) if len(ok) else []
suite = st.selectbox("Suite", suites, index=suites.index("nightly") if "nightly" in suites else 0, key="bench_suite") if suites else None
trend = bench_data.trends(ok[ok["suite"] == suite]) if suite else bench_data.trends(ok)
if trend.empty:
    st.info("No successful runs to draw trends from.")
else:
    series = sorted(trend["series"].unique())
    picked = st.multiselect("Series", series, default=series, key="bench_series")
    st.plotly_chart(bench_charts.trend_chart(trend[trend["series"].isin(picked)]), key="bench_trends")
    st.caption(
        f"Each run is compared with the median of the previous {bench_data.REGRESSION_WINDOW} runs of the same "
        f"suite, system, model, node, GPU count and batch; a throughput drop or a peak-memory rise of more than "
        f"{bench_data.REGRESSION_THRESHOLD:.0%} is flagged (red cross)."
    )
    suite_flagged = bench_data.regressions(trend)
    if suite_flagged.empty:
        st.success("No regressions flagged.")
    else:
        st.warning(f"{suite_flagged['id'].nunique()} run(s) flagged as regressions ({len(suite_flagged)} metric(s)).")
        show = suite_flagged[["created_utc", "git_commit", "series", "metric", "value", "baseline", "change_pct"]]
        st.dataframe(
            show, hide_index=True, key="bench_regressions",
            column_config={"change_pct": st.column_config.NumberColumn("change", format="%+.1f%%")},
        )  # fmt: skip
