"""Benchmark results: throughput against model size, max-scale bars, nightly trends with regressions flagged.

Reads a chunkstar-bench results SQLite (``--bench-db PATH`` or the sidebar box).
CPU runs are shown in tokens/s; the paper's published GPU figures (TFLOPS per
GPU) are a separate chart the user opts into. Without a database the page still
shows the published figures (on request) and the capacity planner's
predictions, each labelled as such.
"""

from __future__ import annotations

import streamlit as st

from chunkstar_dashboard import bench_charts, bench_data, bench_loading
from chunkstar_dashboard.text import escape_markdown

st.title("Benchmarks")
path = st.sidebar.text_input("Results database (SQLite)", key="bench_db_path", placeholder="results/nightly.sqlite")

published = bench_loading.load_published()

runs = bench_data.empty_runs()
if path and path.strip():
    try:
        runs, left_out = bench_loading.load_runs(path.strip())
    except bench_loading.BenchLoadError as err:
        st.error(escape_markdown(str(err)))
        st.stop()
    if left_out:
        st.warning(escape_markdown(f"{left_out}. The page shows the other {len(runs):,} runs."))
else:
    st.info(
        "No results database loaded: showing the planner's predictions and, on request, the paper's published figures. "
        "Give a path in the sidebar or start the app with `chunkstar-profile view RUN.csprof --bench-db PATH` "
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
st.subheader("Throughput")
published_nodes = sorted(published["hardware"].unique())
measured_nodes = sorted(ok["hardware"].unique()) if len(ok) else []
hardware = st.selectbox("Measured on", measured_nodes, key="bench_hardware") if measured_nodes else None
measured = bench_data.measured_throughput(ok, hardware) if hardware is not None else None
on_cpu = measured is not None and len(measured) > 0 and set(measured["device"]) == {"cpu"}
if hardware is None or measured is None or measured.empty:
    st.info("No successful runs with a throughput to draw." if hardware is None else f"No run on {hardware} recorded a throughput.")
else:
    if on_cpu:
        st.plotly_chart(bench_charts.tokens_vs_size(measured, hardware), key="bench_tokens")
        st.caption(
            f"Runs on {hardware}, a CPU machine: throughput in tokens/s (hover: time per step), the best run per "
            "system, model and process count. TFLOPS per GPU does not apply to a CPU, so these runs are never drawn "
            "beside the paper's GPU figures."
        )
    else:
        st.plotly_chart(bench_charts.tflops_vs_size(bench_data.throughput_points(ok[ok["hardware"] == hardware])), key="bench_tflops")
        st.caption(f"GPU runs on {hardware}: TFLOPS per GPU, FLOPs counted as {bench_data.FLOP_FORMULA}; best run per point.")

compare_published = st.checkbox(
    "Compare with the paper's published GPU figures", value=False, key="bench_show_published",
    help="PatrickStar's and DeepSpeed's TFLOPS per GPU on the paper's V100 and A100 nodes, read off its plots.",
)  # fmt: skip
if compare_published:
    gpu_hardware = hardware if hardware is not None and not on_cpu else None
    overlay_index = published_nodes.index(gpu_hardware) if gpu_hardware in published_nodes else 0
    overlay = st.selectbox("Published node", published_nodes, index=overlay_index, key="bench_overlay")
    gpu_runs = ok[ok["hardware"] == gpu_hardware] if gpu_hardware else ok.iloc[0:0]
    st.plotly_chart(bench_charts.tflops_vs_size(bench_data.throughput_points(gpu_runs, published, overlay)), key="bench_published")
    st.caption(
        f"**Published** figures of the paper on {overlay} (dashed lines, hollow markers; read off its plots): the bar "
        f"to beat, not our measurements. FLOPs counted as {bench_data.FLOP_FORMULA}."
        + (f" Solid lines: our GPU runs on {gpu_hardware}." if gpu_hardware and len(gpu_runs) else " No GPU runs of ours drawn.")
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
        show = suite_flagged.assign(
            value=[bench_data.format_metric(m, v) for m, v in zip(suite_flagged["metric"], suite_flagged["value"])],
            baseline=[bench_data.format_metric(m, v) for m, v in zip(suite_flagged["metric"], suite_flagged["baseline"])],
            metric=suite_flagged["metric"].map(lambda m: bench_data.METRIC_LABELS.get(m, m)),
        )[["created_utc", "git_commit", "series", "metric", "value", "baseline", "change_pct"]]
        st.dataframe(
            show, hide_index=True, key="bench_regressions",
            column_config={"change_pct": st.column_config.NumberColumn("change", format="%+.1f%%")},
        )  # fmt: skip
