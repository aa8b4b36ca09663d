"""The Benchmarks page's pure functions and figures, on hand-made run frames and the packaged published figures."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from chunkstar_bench import published
from chunkstar_bench.results import COLUMNS

from chunkstar_dashboard import bench_charts, bench_data


def _config(device: str) -> str:
    return json.dumps({"spec": {"device": device}})


def _runs(rows: list[dict]) -> pd.DataFrame:
    base = {c: None for c in bench_data.RUN_COLUMNS}
    base.update(suite="nightly", hardware="cpu-2core", nprocs=1, batch=4, seq_len=128, status="ok", git_commit="c",
                config_json=_config("cpu"))  # fmt: skip
    frame = pd.DataFrame([{**base, "id": i + 1, **r} for i, r in enumerate(rows)])
    return frame[list(bench_data.RUN_COLUMNS)]


def _gpu(**row: object) -> dict:
    return {"hardware": "a100x8_1tb", "config_json": _config("cuda"), **row}


def _published() -> pd.DataFrame:
    return bench_data.published_frame(published.load_published())


def test_run_columns_are_the_results_schema() -> None:
    assert bench_data.RUN_COLUMNS == tuple(name for name, _ in COLUMNS)


def test_published_frame() -> None:
    pub = _published()
    assert (pub["source"] == "published").all()
    row = pub[(pub["hardware"] == "v100x8_240gb") & (pub["system"] == "patrickstar") & (pub["gpus"] == 8) & (pub["model"] == "18B")]
    assert len(row) == 1
    exact = next(r for r in published.load_published() if r.label == "18B" and r.zoo_model is not None)
    assert row["n_params"].iloc[0] == exact.n_params != 18e9  # the zoo's exact size where there is one
    assert row["tflops_per_gpu"].iloc[0] == pytest.approx(419 / 8)
    assert pub.loc[pub["model"] == "30B", "n_params"].iloc[0] == 30e9  # nominal otherwise
    assert len(pub) == len(published.load_published())


def test_run_devices_from_the_spec_then_the_hardware_label() -> None:
    runs = _runs([dict(system="chunkstar", model="m"), _gpu(system="chunkstar", model="m"),
                  dict(system="chunkstar", model="m", config_json="{}", hardware="h200x1_128gb"),
                  dict(system="chunkstar", model="m", config_json="not json", hardware="cpu-16core")])  # fmt: skip
    assert bench_data.run_devices(runs).tolist() == ["cpu", "cuda", "cuda", "cpu"]


def test_measured_throughput_of_a_cpu_node() -> None:
    runs = _runs([
        dict(system="chunkstar", model="m1", n_params=1e8, tokens_per_s=900.0, step_time_s=0.57),
        dict(system="chunkstar", model="m1", n_params=1e8, tokens_per_s=1000.0, step_time_s=0.51),
        dict(system="deepspeed", model="m1", n_params=1e8, tokens_per_s=500.0, step_time_s=1.02),
        dict(system="deepspeed", model="m2", n_params=3e8, status="oom"),
        _gpu(system="chunkstar", model="m1", n_params=1e8, tokens_per_s=9e4),
    ])  # fmt: skip
    pts = bench_data.measured_throughput(runs, "cpu-2core")
    assert pts[["system", "model", "tokens_per_s", "step_time_s"]].values.tolist() == [
        ["chunkstar", "m1", 1000.0, 0.51], ["deepspeed", "m1", 500.0, 1.02],
    ]  # fmt: skip
    assert set(pts["device"]) == {"cpu"} and pts["label"].tolist() == ["chunkstar", "DeepSpeed"]
    fig = bench_charts.tokens_vs_size(pts, "cpu-2core")
    assert fig.layout.title.text == "Measured on cpu-2core (CPU)"
    assert fig.layout.yaxis.title.text == "tokens/s" and "TFLOPS" not in fig.to_json()  # 2x apart: a linear axis
    assert [t.name for t in fig.data] == ["chunkstar", "DeepSpeed"]
    assert fig.data[0].customdata[0][1] == "510 ms"  # time per step in hover, in a readable unit


def test_throughput_points_best_run_per_point_and_published_overlay() -> None:
    runs = _runs([
        _gpu(system="chunkstar", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.4),
        _gpu(system="chunkstar", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.5),
        _gpu(system="chunkstar", model="m2", n_params=2e8, tflops_per_gpu_patrickstar=0.45),
        _gpu(system="chunkstar", model="m3", n_params=3e8, status="oom"),
        _gpu(system="deepspeed", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.3, nprocs=2),
        dict(system="chunkstar", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.9),  # a CPU run: no TFLOPS per GPU
    ])  # fmt: skip
    pts = bench_data.throughput_points(runs, _published(), "v100x8_240gb")
    ours = pts[pts["source"] == "measured"]
    assert len(ours) == 3 and set(ours["hardware"]) == {"a100x8_1tb"}
    assert ours.loc[(ours["system"] == "chunkstar") & (ours["model"] == "m1"), "tflops_per_gpu"].item() == 0.5
    assert set(ours["gpus"]) == {1, 2}
    pub = pts[pts["source"] == "published"]
    assert set(pub["hardware"]) == {"v100x8_240gb"} and len(pub) > 40
    assert bench_data.throughput_points(runs).query("source == 'published'").empty
    assert bench_data.throughput_points(bench_data.empty_runs()).empty


def test_max_scale_measured_published_planned() -> None:
    runs = _runs([
        dict(system="chunkstar", model="small", n_params=1e8),
        dict(system="chunkstar", model="big", n_params=6e8),
        dict(system="chunkstar", model="bigger", n_params=7e8, status="oom"),
        dict(system="deepspeed", model="small", n_params=1e8),
    ])  # fmt: skip
    planned = pd.DataFrame([{"hardware": "v100x8_240gb", "system": "chunkstar", "model": "GPT3_18B", "n_params": 18.3e9}])
    table = bench_data.max_scale(runs, _published(), planned)
    got = {(r.hardware, r.system, r.source): r.model for r in table.itertuples()}
    assert got[("cpu-2core", "chunkstar", "measured")] == "big"
    assert got[("cpu-2core", "deepspeed", "measured")] == "small"
    # PatrickStar's published bar stands in chunkstar's group
    assert got[("v100x8_240gb", "chunkstar", "published")] == "18B (PatrickStar)"
    assert got[("a100x8_1tb", "chunkstar", "published")] == "68B (PatrickStar)"
    assert got[("a100x8_1tb", "deepspeed", "published")] == "30B (DeepSpeed)"
    assert got[("v100x8_240gb", "chunkstar", "planned")] == "GPT3_18B"
    # sources in order measured, published, planned within a group
    group = table[(table["hardware"] == "v100x8_240gb") & (table["system"] == "chunkstar")]
    assert group["source"].tolist() == ["published", "planned"]
    assert bench_data.max_scale(bench_data.empty_runs()).empty


def _nightly(values: list[float], memory: list[float] | None = None) -> pd.DataFrame:
    memory = memory or [100.0] * len(values)
    return _runs([
        dict(system="chunkstar", model="m", n_params=1e8, tokens_per_s=v, peak_host_bytes=m, peak_device_bytes=m,
             created_utc=f"2025-03-{i + 1:02d}T00:00:00Z", git_commit=f"commit{i}")
        for i, (v, m) in enumerate(zip(values, memory))
    ])  # fmt: skip


def test_trends_flag_a_drop_against_the_median_of_the_previous_five() -> None:
    # slow early runs (a rise is no regression); the 9th run (0.85) is 15% below the median (1.0) of
    # runs 4-8; over all eight earlier runs the median would be 0.55 and 0.85 a rise. Run 10 is back.
    trend = bench_data.trends(_nightly([0.1] * 4 + [1.0, 0.95, 1.05, 1.0, 0.85, 0.95]))
    tok = trend[trend["metric"] == "tokens_per_s"].reset_index(drop=True)
    assert np.isnan(tok.loc[0, "baseline"])
    assert tok.loc[8, "baseline"] == 1.0
    assert tok["regression"].tolist() == [False] * 8 + [True, False]
    assert tok.loc[8, "change"] == pytest.approx(-0.15)
    flagged = bench_data.regressions(trend)
    assert flagged["git_commit"].tolist() == ["commit8"] and flagged["change_pct"].item() == pytest.approx(-15)


def test_trends_flag_memory_rises_not_drops() -> None:
    trend = bench_data.trends(_nightly([1.0] * 4, memory=[100.0, 100.0, 80.0, 115.0]))
    host = trend[trend["metric"] == "peak_host_bytes"]
    assert host["regression"].tolist() == [False, False, False, True]  # 20% less memory is not a regression
    # a 9% drop is within the threshold; a custom threshold of 5% flags it
    assert not bench_data.trends(_nightly([1.0, 1.0, 0.91]))["regression"].any()
    assert bench_data.trends(_nightly([1.0, 1.0, 0.91]), threshold=0.05)["regression"].any()


def test_trends_keep_series_apart_and_skip_failed_runs() -> None:
    runs = pd.concat([
        _nightly([1.0, 1.0, 1.0]),
        _nightly([2.0, 2.0, 2.0]).assign(system="deepspeed", id=lambda f: f["id"] + 10),
        _nightly([0.1]).assign(status="oom", tokens_per_s=None, id=99),
    ])  # fmt: skip
    trend = bench_data.trends(runs)
    assert set(trend["system"]) == {"chunkstar", "deepspeed"}
    assert not trend["regression"].any()  # 2.0 after 1.0 would be a rise, but the series are apart
    assert trend["series"].nunique() == 2
    assert bench_data.trends(bench_data.empty_runs()).empty
    assert bench_data.regressions(bench_data.trends(bench_data.empty_runs())).empty


def test_figures() -> None:
    runs = _runs([
        _gpu(system="chunkstar", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.5),
        _gpu(system="deepspeed", model="m1", n_params=1e8, tflops_per_gpu_patrickstar=0.3),
    ])  # fmt: skip
    fig = bench_charts.tflops_vs_size(bench_data.throughput_points(runs, _published(), "a100x8_1tb"))
    names = {t.name for t in fig.data}
    assert {"chunkstar", "DeepSpeed", "PatrickStar (published)", "DeepSpeed (published)"} <= names
    assert all(t.line.dash == "dash" for t in fig.data if "published" in t.name)
    assert all(t.line.dash == "solid" for t in fig.data if "published" not in t.name)
    assert len(fig.layout.annotations) == 4  # panels for 1, 2, 4, 8 GPUs

    bars = bench_charts.max_scale_bars(bench_data.max_scale(runs, _published()))
    assert {t.name for t in bars.data} == {"measured", "published"}
    assert all(t.marker.pattern.shape == "/" for t in bars.data if t.name == "published")

    trend = bench_data.trends(_nightly([1.0, 1.0, 0.5]))
    tf = bench_charts.trend_chart(trend)
    assert [t.name for t in tf.data].count("regression") == 1  # only the throughput drop
    assert len(tf.layout.annotations) == 3  # tokens/s, device, host panels


def test_trend_series_keep_their_legend_colour_in_every_panel() -> None:
    # six series, three panels: plotly's default colour cycle would give one series a new colour per panel
    runs = pd.concat([
        _nightly([1.0, 1.1, 1.0]).assign(system=system, model=model, id=lambda f, k=k: f["id"] + 10 * k)
        for k, (system, model) in enumerate((s, m) for s in ("chunkstar", "deepspeed", "pytorch") for m in ("m1", "m2"))
    ])  # fmt: skip
    fig = bench_charts.trend_chart(bench_data.trends(runs))
    lines = [t for t in fig.data if t.name != "regression"]
    looks: dict[str, set] = {}
    for t in lines:
        looks.setdefault(t.name, set()).add((t.line.color, t.line.dash, t.marker.symbol, t.marker.color))
    assert len(looks) == 6 and all(len(v) == 1 for v in looks.values())  # one look per series, in all panels
    assert len({next(iter(v)) for v in looks.values()}) == 6  # and no two series alike
    shown = {t.name: t.line.color for t in lines if t.showlegend}
    assert shown == {name: next(iter(v))[0] for name, v in looks.items()}
    assert shown["chunkstar m1 x1 b4 (cpu-2core)"] == bench_charts.SYSTEM_COLOURS["chunkstar"]


def test_format_metric() -> None:
    assert bench_data.format_metric("peak_host_bytes", 629145600) == "600 MiB"
    assert bench_data.format_metric("step_time_s", 0.0512) == "51.2 ms"
    assert bench_data.format_metric("tokens_per_s", 4123.4) == "4,123 tokens/s"
    assert bench_data.format_metric("tflops_per_gpu_patrickstar", 0.45678) == "0.457 TFLOPS"
    assert bench_data.format_metric("tokens_per_s", float("nan")) == "n/a"
