"""Unit tests of the dashboard's pure data shaping (no Streamlit, no profile file)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from chunkstar_profiler import Profile

from chunkstar_dashboard import charts
from chunkstar_dashboard.data import (
    OUTSIDE_MOMENTS,
    activation_moves_by_block,
    activation_series,
    activation_totals,
    clock_label,
    MoveFilter,
    compare_table,
    display_name,
    downsample_minmax,
    duration_s,
    filter_moves,
    format_bytes,
    format_duration,
    has_activation_moves,
    has_disk_tier,
    iteration_span,
    memory_series,
    move_totals,
    moves_by_operator,
    placement_grid,
    prediction_note,
    round_significant,
    step_time_comparison,
    step_times,
    tiers_present,
    time_axis,
)

MIB = 2**20


def _moves(n: int = 200, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    t0 = np.sort(rng.random(n))
    dur = rng.random(n) * 1e-3
    dst = rng.choice(["device", "host"], n)
    return pd.DataFrame(
        {
            "t_start_s": t0, "t_end_s": t0 + dur, "duration_s": dur,
            "chunk_id": rng.integers(0, 8, n), "chunk_list": rng.choice(["param", "master", "exp_avg"], n),
            "nbytes": rng.integers(1, 1 << 20, n), "src": np.where(dst == "device", "host", "device"), "dst": dst,
            "reason": rng.choice(["access", "eviction", "prefetch", "optimizer"], n), "moment_row": rng.integers(-1, 30, n),
            "module": rng.choice(["", "h.0.attn", "h.0.mlp", "h.1.attn", "lm_head"], n),
            "stage": rng.choice(["fwd", "bwd", "optim"], n), "iteration": rng.integers(0, 5, n),
        }
    )  # fmt: skip


def _memory(n: int, tier: str = "device", seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, 100, n) * MIB
    non_model = rng.integers(0, 10, n) * MIB
    return pd.DataFrame(
        {
            "t_s": np.arange(n) * 1e-3, "tier": tier, "total_bytes": chunk + non_model, "chunk_bytes": chunk,
            "non_model_bytes": non_model, "budget_bytes": 128 * MIB, "moment_row": np.arange(n),
            "module": [f"m{i % 7}" for i in range(n)], "stage": "fwd", "iteration": 0,
        }
    )  # fmt: skip


def _stages(step_s: list[float]) -> pd.DataFrame:
    rows, t = [], 0.0
    for it, total in enumerate(step_s):
        for stage, share in (("fwd", 0.3), ("bwd", 0.5), ("optim", 0.2)):
            rows.append({"stage": stage, "iteration": it, "t_start_s": t, "t_end_s": t + share * total})
            t += share * total
        t += 0.01  # a gap between iterations is not step time
    return pd.DataFrame(rows)


def _with(p: Profile, **tables: pd.DataFrame) -> Profile:
    """``p`` with some of its tables replaced."""
    return Profile(**{"meta": p.meta, "moments": p.moments, "moves": p.moves, "memory": p.memory, "stages": p.stages,
                      "placements": p.placements, "source": p.source, **tables})  # fmt: skip


def _profile(name: str, *, peak_mib: int, moves: pd.DataFrame, step_s: list[float], chunk_size: int = 4096) -> Profile:
    memory = _memory(50)
    memory.loc[10, ["total_bytes", "chunk_bytes"]] = [peak_mib * MIB, peak_mib * MIB]
    placements = pd.DataFrame(columns=["chunk_id", "chunk_list", "tier", "t_start_s", "t_end_s"])
    meta = {"chunk_size": chunk_size, "n_chunks": 8, "budget_bytes": 128 * MIB, "chunk_lists": ["param"]}
    return Profile(meta, pd.DataFrame(), moves, memory, _stages(step_s), placements, source=f"/runs/{name}.csprof")


# --- downsampling ---------------------------------------------------------------


def test_downsample_short_frame_is_unchanged() -> None:
    mem = _memory(100)
    out = downsample_minmax(mem.sample(frac=1.0, random_state=0), "t_s", ["total_bytes"], 1000)
    pd.testing.assert_frame_equal(out, mem)


@pytest.mark.parametrize("n, max_points", [(10_000, 500), (123_457, 5000), (5001, 5000)])
def test_downsample_keeps_extremes_and_bounds_size(n: int, max_points: int) -> None:
    mem = _memory(n)
    ys = ["total_bytes", "chunk_bytes", "non_model_bytes"]
    out = downsample_minmax(mem, "t_s", ys, max_points)
    assert len(out) <= max_points
    assert out["t_s"].is_monotonic_increasing
    assert out["t_s"].iloc[0] == mem["t_s"].iloc[0] and out["t_s"].iloc[-1] == mem["t_s"].iloc[-1]
    for col in ys:
        assert out[col].max() == mem[col].max() and out[col].min() == mem[col].min()
    # kept rows are real rows, whole (module and time belong to the kept sample)
    merged = out.merge(mem, on=list(mem.columns), how="left", indicator=True)
    assert (merged["_merge"] == "both").all()


def test_downsample_keeps_local_peaks_per_bucket() -> None:
    # a single 1-sample spike in every 1000 samples must survive as a spike
    n = 100_000
    mem = _memory(n).assign(total_bytes=0)
    spikes = np.arange(500, n, 1000)
    mem.loc[spikes, "total_bytes"] = 7
    out = downsample_minmax(mem, "t_s", ["total_bytes"], 1000)
    assert set(spikes * 1e-3).issubset(set(np.round(out.loc[out["total_bytes"] == 7, "t_s"], 9)))


def test_memory_series_splits_tiers_and_reports_downsampling() -> None:
    mem = pd.concat([_memory(20_000, "device"), _memory(30, "host", seed=1)], ignore_index=True)
    mem.loc[0, "module"] = ""
    dev, dropped = memory_series(mem, "device", 2000)
    host, host_dropped = memory_series(mem, "host", 2000)
    assert dropped and len(dev) <= 2000 and (dev["tier"] == "device").all()
    assert not host_dropped and len(host) == 30
    assert dev["module"].iloc[0] == OUTSIDE_MOMENTS


# --- per-operator aggregation ---------------------------------------------------


def test_moves_by_operator_totals_equal_the_moves_table() -> None:
    moves = _moves()
    table = moves_by_operator(moves)
    to_dev = moves["dst"] == "device"
    assert table["moves"].sum() == len(moves)
    assert table["bytes_to_device"].sum() == moves.loc[to_dev, "nbytes"].sum()
    assert table["bytes_to_host"].sum() == moves.loc[~to_dev, "nbytes"].sum()
    assert table["to_device"].sum() == to_dev.sum() and table["to_host"].sum() == (~to_dev).sum()
    assert table["stall_s"].sum() == pytest.approx(moves["duration_s"].sum())
    for reason, count in moves["reason"].value_counts().items():
        assert table[reason].sum() == count
    assert (table[["access", "eviction", "prefetch", "optimizer"]].sum(axis=1) == table["moves"]).all()
    assert table["module"].is_unique and OUTSIDE_MOMENTS in set(table["module"])
    assert table["stall_s"].is_monotonic_decreasing
    # one module checked by hand
    attn = moves[moves["module"] == "h.0.attn"]
    row = table.set_index("module").loc["h.0.attn"]
    assert row["moves"] == len(attn) and row["bytes_to_host"] == attn.loc[attn["dst"] == "host", "nbytes"].sum()
    totals = move_totals(moves)
    assert totals["moves"] == len(moves) and totals["bytes_to_device"] == table["bytes_to_device"].sum()


def test_moves_by_operator_empty() -> None:
    table = moves_by_operator(_moves().iloc[:0])
    assert table.empty and {"module", "moves", "bytes_to_device", "stall_s", "eviction"} <= set(table.columns)


def test_filter_moves() -> None:
    moves = _moves()
    out = filter_moves(moves, MoveFilter(stages=("fwd",), reasons=("eviction", "access"), chunk_lists=("param",), iterations=(1, 3)))
    assert len(out) and set(out["stage"]) == {"fwd"} and set(out["reason"]) <= {"eviction", "access"}
    assert set(out["chunk_list"]) == {"param"} and out["iteration"].between(1, 3).all()
    expected = moves[
        (moves["stage"] == "fwd") & moves["reason"].isin(["eviction", "access"]) & (moves["chunk_list"] == "param")
        & moves["iteration"].between(1, 3)
    ]  # fmt: skip
    pd.testing.assert_frame_equal(out, expected)
    assert len(filter_moves(moves, MoveFilter())) == len(moves)
    assert filter_moves(moves, MoveFilter(reasons=())).empty


# --- chunk location map ---------------------------------------------------------


def test_placement_grid_fractions() -> None:
    placements = pd.DataFrame(
        [
            # param 0: host for [0, 1), device [1, 3), host [3, 4)
            (0, "param", "host", 0.0, 1.0), (0, "param", "device", 1.0, 3.0), (0, "param", "host", 3.0, 4.0),
            # master 0: host for the whole run
            (0, "master", "host", 0.0, 4.0),
            # param 1: allocated on the device at 2.5 only
            (1, "param", "device", 2.5, 4.0),
        ],
        columns=["chunk_id", "chunk_list", "tier", "t_start_s", "t_end_s"],
    )  # fmt: skip
    grid = placement_grid(placements, ["param", "master"], n_bins=4)
    assert grid.chunk_lists == ["param", "param", "master"] and grid.chunk_ids == [0, 1, 0]
    np.testing.assert_allclose(grid.edges, [0, 1, 2, 3, 4])
    np.testing.assert_allclose(grid.device, [[0, 1, 1, 0], [0, 0, 0.5, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(grid.host, [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    share = grid.device_share()
    assert np.isnan(share[1, 0]) and share[1, 2] == 1.0 and share[2, 1] == 0.0
    # a coarser grid: each bin's device time is the integral of the intervals
    coarse = placement_grid(placements, ["param", "master"], n_bins=2)
    np.testing.assert_allclose(coarse.device[0], [0.5, 0.5])
    np.testing.assert_allclose(coarse.device[1], [0.0, 0.75])
    fig = charts.chunk_map(grid)
    assert [t.type for t in fig.data] == ["heatmap", "heatmap"]


def _random_placements(n_chunks: int, lists: tuple[str, ...], seed: int = 0) -> pd.DataFrame:
    """Each chunk's payload alternating between tiers in back-to-back stays, with gaps (freed) now and then."""
    rng = np.random.default_rng(seed)
    rows = []
    for chunk_list in lists:
        for cid in rng.permutation(n_chunks):  # in no particular order, as the recorder closes them
            t = float(rng.random())
            while t < 10.0:
                d = float(rng.exponential(0.7))
                rows.append((int(cid) * 3, chunk_list, str(rng.choice(["device", "host", "disk"], p=[0.5, 0.4, 0.1])), t, t + d))
                t += d + (float(rng.exponential(0.5)) if rng.random() < 0.2 else 0.0)
    return pd.DataFrame(rows, columns=["chunk_id", "chunk_list", "tier", "t_start_s", "t_end_s"])


def _reference_fractions(placements: pd.DataFrame, tier: str, key: tuple[str, int], edges: np.ndarray) -> np.ndarray:
    """Each bin's covered fraction, interval by interval (the plain definition the vectorised grid must match)."""
    sel = placements[(placements["chunk_list"] == key[0]) & (placements["chunk_id"] == key[1]) & (placements["tier"] == tier)]
    out = np.zeros(len(edges) - 1)
    for s, e in zip(sel["t_start_s"], sel["t_end_s"]):
        out += np.clip(np.minimum(edges[1:], e) - np.maximum(edges[:-1], s), 0.0, None)
    return np.clip(out / np.diff(edges), 0.0, 1.0)


def test_placement_grid_matches_the_interval_by_interval_sum() -> None:
    placements = _random_placements(12, ("param", "master"))
    grid = placement_grid(placements, ["param", "master"], n_bins=37, t_end=8.0)  # stays past t_end are cut
    assert grid.band == 1 and grid.band_sizes == [1] * 24 and grid.last_ids == grid.chunk_ids
    assert grid.row_labels()[:3] == ["0", "3", "6"]
    for r, key in enumerate(zip(grid.chunk_lists, grid.chunk_ids)):
        for tier in ("device", "host", "disk"):
            np.testing.assert_allclose(getattr(grid, tier)[r], _reference_fractions(placements, tier, key, grid.edges), atol=1e-9)


def test_placement_grid_bands_consecutive_chunks_past_max_rows() -> None:
    """More chunks than ``max_rows``: a row per band of ``ceil(chunks / max_rows)`` consecutive chunks of one
    list, its fractions the band's mean; the grid holds only the bands."""
    placements = _random_placements(10, ("param", "master", "exp_avg"), seed=1)
    full = placement_grid(placements, ["param", "master", "exp_avg"], n_bins=20)
    banded = placement_grid(placements, ["param", "master", "exp_avg"], n_bins=20, max_rows=8)
    assert banded.band == 4 and banded.n_chunks == full.n_chunks == 30
    # per list 10 chunks: bands of 4, 4 and 2, never across lists
    assert banded.chunk_lists == ["param"] * 3 + ["master"] * 3 + ["exp_avg"] * 3
    assert banded.band_sizes == [4, 4, 2] * 3 and banded.device.shape == (9, 20)
    assert banded.chunk_ids[:3] == [0, 12, 24] and banded.last_ids[:3] == [9, 21, 27]
    assert banded.row_labels()[:3] == ["0-9", "12-21", "24-27"]
    for tier in ("device", "host", "disk"):
        mine, whole = getattr(banded, tier), getattr(full, tier)
        for band, (lo, hi) in enumerate([(0, 4), (4, 8), (8, 10)] * 3):
            base = 10 * (band // 3)
            np.testing.assert_allclose(mine[band], whole[base + lo : base + hi].mean(axis=0), atol=1e-9)
    fig = charts.chunk_map(banded)
    assert [len(t.y) for t in fig.data] == [3, 3, 3] and fig.data[0].ygap == 1
    assert fig.layout.annotations[0].text == "param (10 chunks, 4 a row)"
    assert "chunks %{y}" in fig.data[0].hovertemplate and "mean over the row's chunks" in fig.data[0].hovertemplate
    assert placement_grid(placements, ["param", "master", "exp_avg"], n_bins=20, max_rows=30).band == 1
    # rows thinner than 4 px (the map is at most 1,400 px tall) are drawn without a gap, which would hide them
    thin = charts.chunk_map(placement_grid(_random_placements(100, ("param", "master", "exp_avg")), n_bins=10))
    assert len(thin.data[0].y) == 100 and thin.layout.height == 1400 and thin.data[0].ygap == 0


def test_a_predicted_profile_is_named_as_such() -> None:
    measured = _profile("m", peak_mib=10, moves=_moves(), step_s=[0.1])
    assert prediction_note(measured) is None and clock_label(measured) == "time since profile start"
    meta = {**measured.meta, "platform": "8x A100 [80 GB](http://x)", "predicted": {
        "seconds_per_step": 83.2, "binding": "*compute*", "rank": 0, "world_size": 8}}  # fmt: skip
    predicted = Profile(meta, measured.moments, measured.moves, measured.memory, measured.stages, measured.placements)
    note = prediction_note(predicted)
    assert note is not None and note.startswith("**Predicted profile, not measured**: a dry run's step of rank 0 of 8 on ")
    assert "8x A100 \\[80 GB\\]\\(http\\:\\/\\/x\\)" in note  # strings from the file, escaped
    assert "(1 min 23 s per step, bound by \\*compute\\*)" in note
    assert clock_label(predicted) == "predicted time since step start"
    fig, _ = charts.memory_timeline(predicted)
    assert fig.layout.xaxis.title.text == "predicted time since step start (ms)"
    # a prediction whose fields are missing or of the wrong type: still predicted, without figures
    bare = Profile({"predicted": {"binding": 3}}, measured.moments, measured.moves, measured.memory, measured.stages, measured.placements)
    assert prediction_note(bare) == (
        "**Predicted profile, not measured**: a dry run's step, on the time model's clock (`chunkstar.dry_run`). "
        "Every time and duration here is the model's; the moves, chunk placements and memory are the real engine's, "
        "run on the meta device."
    )


# --- comparison -----------------------------------------------------------------


def test_step_times_span_fwd_to_optim() -> None:
    steps = step_times(_stages([1.0, 2.0, 0.5]))
    np.testing.assert_allclose(steps.to_numpy(), [1.0, 2.0, 0.5])
    assert list(steps.index) == [0, 1, 2]


def test_compare_table_deltas() -> None:
    moves = _moves()
    a = _profile("a", peak_mib=200, moves=moves, step_s=[1.0, 1.0])
    b = _profile("b", peak_mib=150, moves=moves.iloc[:50], step_s=[0.5, 0.7, 0.9], chunk_size=8192)
    table = compare_table(a, b).set_index("figure")
    np.testing.assert_allclose(table["delta"], table["B"] - table["A"], equal_nan=True)
    assert table.loc["peak device memory (MiB)", "A"] == 200 and table.loc["peak device memory (MiB)", "B"] == 150
    assert table.loc["peak device memory (MiB)", "delta_pct"] == pytest.approx(-25.0)
    assert table.loc["chunk size (elements)", "delta"] == 4096
    # traffic is per iteration: a has 2 iterations, b 3
    assert list(table.loc["iterations", ["A", "B"]]) == [2, 3]
    assert table.loc["moves per iteration", "A"] == len(moves) / 2 and table.loc["moves per iteration", "B"] == 50 / 3
    bytes_to_dev = moves.loc[moves["dst"] == "device", "nbytes"]
    assert table.loc["moved to device per iteration (MiB)", "A"] == pytest.approx(bytes_to_dev.sum() / MIB / 2)
    assert table.loc["move time per iteration (ms)", "A"] == pytest.approx(moves["duration_s"].sum() * 1e3 / 2)
    for reason in ("access", "eviction", "prefetch", "optimizer"):
        assert table.loc[f"{reason} moves per iteration", "A"] == (moves["reason"] == reason).sum() / 2
    assert table.loc["mean step time (ms)", "A"] == pytest.approx(1000.0)
    assert table.loc["mean step time (ms)", "B"] == pytest.approx(700.0)
    assert table.loc["mean step time (ms)", "delta_pct"] == pytest.approx(-30.0)
    steps = step_time_comparison(a, b)
    assert list(steps["iteration"]) == [0, 1, 2]
    chart = charts.step_times_chart(steps, ("A: a", "B: b"))
    assert chart.layout.xaxis.dtick == 1 and chart.layout.xaxis.tickformat == "d"  # whole iterations on the axis
    assert chart.layout.legend.yanchor == "bottom" and chart.layout.legend.y > 1  # above the plot, in its margin
    np.testing.assert_allclose(steps["delta"].iloc[:2], [-500.0, -300.0])
    assert np.isnan(steps["A"].iloc[2]) and steps["B"].iloc[2] == pytest.approx(900.0)


def test_memory_timeline_figure() -> None:
    p = _profile("a", peak_mib=200, moves=_moves(), step_s=[0.01, 0.02])
    p = _with(p, memory=pd.concat([_memory(12_000), _memory(40, "host")]))
    fig, downsampled = charts.memory_timeline(p, max_points=1000)
    assert downsampled
    names = {t.name for t in fig.data}
    assert {"total", "chunks", "non-model", "budget", "forward", "backward", "optimizer"} <= names
    totals = [t for t in fig.data if t.name == "total"]
    assert len(totals) == 2 and len(totals[0].x) <= 1000
    assert "module" in totals[0].hovertemplate and totals[0].customdata[0][0].startswith("m")
    assert max(totals[0].y) == pytest.approx(p.memory.loc[p.memory["tier"] == "device", "total_bytes"].max() / MIB)


def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1,023 B"
    assert format_bytes(2071142) == "1.98 MiB"
    assert format_bytes(14.1 * MIB) == "14.1 MiB"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert format_bytes(5000 * 2**30) == "5,000 GiB"


@pytest.mark.parametrize("budget_mib, on_scale", [(0, None), (120, True), (10_000, False)])
def test_memory_timeline_budget_line(budget_mib: int, on_scale: bool | None) -> None:
    p = _profile("a", peak_mib=100, moves=_moves(), step_s=[0.01])
    memory = p.memory.assign(budget_bytes=budget_mib * MIB)
    fig, downsampled = charts.memory_timeline(_with(p, memory=memory, stages=p.stages.iloc[:0]))
    assert not downsampled
    budget = [t for t in fig.data if t.name and t.name.startswith("budget")]
    if on_scale is None:
        assert not budget
        return
    assert len(budget) == 1 and budget[0].y[0] == budget_mib
    y_top = fig.layout.yaxis.range[1]
    assert (y_top >= budget_mib) == on_scale and y_top >= 100
    assert ("off scale" in budget[0].name) != on_scale


# --- the disk tier ------------------------------------------------------------------


def _disk_moves() -> pd.DataFrame:
    """Two stage-ins, a stage-out written and one dropped unchanged, an eviction: the optimizer's and a module's."""
    rows = [
        ("disk", "host", "stage_in", 4096, "optimizer"), ("disk", "host", "stage_in", 4096, "optimizer"),
        ("host", "disk", "stage_out", 4096, "optimizer"), ("host", "disk", "stage_out", 0, "optimizer"),
        ("device", "host", "eviction", 100, "h.0.attn"), ("host", "device", "access", 10, "h.0.attn"),
    ]  # fmt: skip
    n = len(rows)
    return pd.DataFrame(
        {
            "t_start_s": np.arange(n) * 0.1, "t_end_s": np.arange(n) * 0.1, "duration_s": 0.0, "chunk_id": 0,
            "chunk_list": "master", "nbytes": [r[3] for r in rows], "src": [r[0] for r in rows], "dst": [r[1] for r in rows],
            "reason": [r[2] for r in rows], "moment_row": 0, "module": [r[4] for r in rows], "stage": "optim", "iteration": 0,
        }
    )  # fmt: skip


def _disk_profile() -> Profile:
    memory = pd.concat([_memory(30, "device"), _memory(30, "host", seed=1), _memory(30, "disk", seed=2)], ignore_index=True)
    disk = memory["tier"] == "disk"
    memory.loc[disk, ["total_bytes", "chunk_bytes", "budget_bytes"]] = 300 * MIB
    memory.loc[disk, "non_model_bytes"] = 0
    meta = {"chunk_size": 4096, "n_chunks": 8, "budget_bytes": 128 * MIB, "chunk_lists": ["param", "master"],
            "disk_stats": {"disk_bytes_read": 8 * MIB, "disk_read_s": 2.0, "disk_bytes_written": 4 * MIB, "disk_write_s": 0.0}}  # fmt: skip
    placements = pd.DataFrame(columns=["chunk_id", "chunk_list", "tier", "t_start_s", "t_end_s"])
    return Profile(meta, pd.DataFrame(), _disk_moves(), memory, _stages([0.01]), placements, source="d.csprof")


def test_tiers_present_in_order() -> None:
    mem = pd.concat([_memory(3, "disk"), _memory(3, "moon"), _memory(3, "device")])
    assert tiers_present(mem) == ["device", "disk", "moon"]
    assert tiers_present(_memory(3, "host")) == ["host"]


def test_moves_by_operator_counts_stage_moves_apart() -> None:
    moves = _disk_moves()
    table = moves_by_operator(moves).set_index("module")
    opt, attn = table.loc["optimizer"], table.loc["h.0.attn"]
    assert (opt["from_disk"], opt["to_disk"], opt["to_host"], opt["to_device"]) == (2, 2, 0, 0)
    assert (opt["bytes_from_disk"], opt["bytes_to_disk"], opt["bytes_to_host"]) == (8192, 4096, 0)
    assert (opt["stage_in"], opt["stage_out"]) == (2, 2)
    assert (attn["to_host"], attn["bytes_to_host"], attn["to_device"], attn["from_disk"]) == (1, 100, 1, 0)
    totals = move_totals(moves)
    assert totals == {
        "moves": 6, "to_device": 1, "to_host": 1, "from_disk": 2, "to_disk": 2, "bytes_to_device": 10,
        "bytes_to_host": 100, "bytes_from_disk": 8192, "bytes_to_disk": 4096, "stall_s": 0.0,
    }  # fmt: skip
    empty = moves_by_operator(moves.iloc[:0])
    assert {"from_disk", "bytes_to_disk", "stage_in", "stage_out", "offload"} <= set(empty.columns)


def test_operator_bars_show_the_disk_only_when_it_moved_bytes() -> None:
    fig = charts.operator_bytes(moves_by_operator(_disk_moves()))
    bars = {t.name: t for t in fig.data}
    assert set(bars) == {"to device", "to host", "disk -> host (stage-in)", "host -> disk (stage-out)"}
    assert bars["host -> disk (stage-out)"].marker.color == charts.TIER_COLOURS["disk"]
    assert bars["disk -> host (stage-in)"].marker.color == charts.TIER_COLOURS["host"]
    assert bars["disk -> host (stage-in)"].marker.pattern.shape == "/"
    plain = charts.operator_bytes(moves_by_operator(_moves()))
    assert [t.name for t in plain.data] == ["to device", "to host"]


def test_placement_grid_with_disk_stays() -> None:
    placements = pd.DataFrame(
        [
            # master 0: only in its file for [0, 1), staged in [1, 2), in its file again [2, 4)
            (0, "master", "disk", 0.0, 1.0), (0, "master", "host", 1.0, 2.0), (0, "master", "disk", 2.0, 4.0),
            # param 0: host [0, 2), device [2, 4)
            (0, "param", "host", 0.0, 2.0), (0, "param", "device", 2.0, 4.0),
        ],
        columns=["chunk_id", "chunk_list", "tier", "t_start_s", "t_end_s"],
    )  # fmt: skip
    grid = placement_grid(placements, ["param", "master"], n_bins=4)
    assert grid.has_disk and grid.chunk_lists == ["param", "master"]
    np.testing.assert_allclose(grid.disk, [[0, 0, 0, 0], [1, 0, 1, 1]])
    np.testing.assert_allclose(grid.host, [[1, 1, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_allclose(grid.tier_level(), [[0.5, 0.5, 1, 1], [0, 0.5, 0, 0]])
    np.testing.assert_allclose(grid.device_share(), [[0, 0, 1, 1], [0, 0, 0, 0]])
    coarse = placement_grid(placements, ["param", "master"], n_bins=2)
    np.testing.assert_allclose(coarse.tier_level()[1], [0.25, 0.0])  # half on disk, half on the host
    fig = charts.chunk_map(grid)
    heat = fig.data[0]
    assert [c[1] for c in heat.colorscale] == [charts.TIER_COLOURS[t] for t in ("disk", "host", "device")]
    assert list(heat.colorbar.ticktext) == ["disk", "host", "device"] and "disk %{customdata[2]}%" in heat.hovertemplate
    np.testing.assert_allclose(fig.data[1].z, grid.tier_level()[1:])
    # without a disk stay the map is the two-tier one it always was
    plain = charts.chunk_map(placement_grid(placements[placements["tier"] != "disk"], ["param", "master"], n_bins=4))
    assert list(plain.data[0].colorbar.ticktext) == ["host", "mixed", "device"]


def test_memory_timeline_draws_the_disk_tier() -> None:
    p = _disk_profile()
    fig, _ = charts.memory_timeline(p)
    axes = [fig.layout.yaxis, fig.layout.yaxis2, fig.layout.yaxis3]
    assert [a.title.text for a in axes] == ["device memory (MiB)", "host memory (MiB)", "disk: chunk files (MiB)"]
    assert [a.title.font.color for a in axes] == [charts.TIER_COLOURS[t] for t in ("device", "host", "disk")]
    disk_total = [t for t in fig.data if t.name == "total" and t.yaxis == "y3"]
    assert len(disk_total) == 1 and max(disk_total[0].y) == 300
    # a profile without disk samples gets no disk panel, even though TIERS names it
    plain, _ = charts.memory_timeline(_profile("a", peak_mib=100, moves=_moves(), step_s=[0.01]))
    assert not any(t.yaxis == "y3" for t in plain.data)


def test_summary_figures_of_the_disk_tier() -> None:
    d = _disk_profile()
    plain = _profile("a", peak_mib=100, moves=_moves(), step_s=[0.01])
    assert has_disk_tier(d) and not has_disk_tier(plain)
    table = compare_table(plain, d).set_index("figure")
    assert table.loc["disk chunk files (MiB)", "B"] == 300 and np.isnan(table.loc["disk chunk files (MiB)", "A"])
    assert table.loc["staged in from disk per iteration (MiB)", "B"] == pytest.approx(8192 / MIB)  # one iteration
    assert table.loc["staged out to disk per iteration (MiB)", "B"] == pytest.approx(4096 / MIB)
    assert table.loc["disk read bandwidth (MiB/s)", "B"] == pytest.approx(4.0)
    assert np.isnan(table.loc["disk write bandwidth (MiB/s)", "B"])  # no write time recorded
    assert table.loc["stage_in moves per iteration", "B"] == 2 and np.isnan(table.loc["stage_in moves per iteration", "A"])
    assert table.loc["moved to host per iteration (MiB)", "B"] == pytest.approx(100 / MIB)  # device -> host only


# --- units and rounding ---------------------------------------------------------------


def test_format_duration_picks_a_readable_unit() -> None:
    assert format_duration(0) == "0 s"
    assert format_duration(850e-6) == "850 µs"
    assert format_duration(0.1134) == "113 ms"
    assert format_duration(0.376) == "376 ms"
    assert format_duration(2.3456) == "2.35 s"
    assert format_duration(59.99) == "1 min 00 s"
    assert format_duration(245.2) == "4 min 05 s"
    assert format_duration(3780) == "1 h 03 min"
    assert format_duration(-0.0127) == "-12.7 ms"
    assert format_duration(float("nan")) == "n/a"


def test_time_axis_unit_follows_the_span() -> None:
    assert time_axis(0.376) == ("ms", 1e-3)
    assert time_axis(30.0) == ("s", 1.0)
    assert time_axis(3600.0) == ("min", 60.0)


def test_round_significant_keeps_integer_digits() -> None:
    out = round_significant([4096, 21.6875, 1.9752, 0.11342, -0.0127, 0.0, np.nan, 123456.7])
    np.testing.assert_array_equal(out[:6], [4096, 21.7, 1.98, 0.113, -0.0127, 0.0])
    assert np.isnan(out[6]) and out[7] == 123457


def test_profile_name_and_duration() -> None:
    p = _profile("run1", peak_mib=10, moves=_moves(), step_s=[0.1, 0.2])
    assert display_name(p) == "run1.csprof"
    assert duration_s(p) == pytest.approx(max(p.moves["t_end_s"].max(), p.stages["t_end_s"].max(), p.memory["t_s"].max()))


def test_memory_timeline_zooms_to_an_iteration_range() -> None:
    p = _profile("a", peak_mib=100, moves=_moves(), step_s=[0.01, 0.02, 0.01])
    p = _with(p, memory=_memory(60))  # one sample a millisecond over the three iterations (0.07 s)
    full, _ = charts.memory_timeline(p)
    assert [a.text for a in full.layout.annotations] == ["iter 0", "iter 1", "iter 2"]
    t0, t1 = iteration_span(p.stages, 1, 1)
    assert (t0, t1) == pytest.approx((0.02, 0.04))
    fig, _ = charts.memory_timeline(p, iterations=(1, 1))
    assert [a.text for a in fig.layout.annotations] == ["iter 1"]
    assert tuple(fig.layout.xaxis.range) == pytest.approx((t0 * 1e3, t1 * 1e3))  # a 20 ms span: drawn in ms
    assert fig.layout.xaxis.title.text == "time since profile start (ms)"
    total = next(t for t in fig.data if t.name == "total")
    # the samples inside the window and the one before it (the memory at the window's start)
    inside = p.memory[p.memory["t_s"].between(t0, t1)]
    assert len(total.x) == len(inside) + 1 and min(total.x) < t0 * 1e3
    bands = [t for t in fig.data if t.name in ("forward", "backward", "optimizer")]
    assert len(bands) == 3 and all(np.nanmin(b.x) >= t0 * 1e3 - 1e-9 for b in bands)


# --- activation moves -----------------------------------------------------------------


def _activation_moves(n_steps: int = 3) -> pd.DataFrame:
    """Per step (10 ms each: forward 3 ms, backward 5 ms, then the optimizer): two blocks' two storages to the host
    in the forward, back to the device in the backward, the second block's ahead of its backward (prefetched)."""
    rows = []
    for it in range(n_steps):
        t = it * 0.01
        for k, (block, mib) in enumerate((("h.0", 2), ("h.0", 3), ("h.1", 2), ("h.1", 3))):
            rows.append((t + 0.0005 * k, block, mib * MIB, "device", "host", False, "fwd", it))
        for k, (block, mib) in enumerate((("h.1", 2), ("h.1", 3), ("h.0", 2), ("h.0", 3))):
            rows.append((t + 0.004 + 0.0005 * k, block, mib * MIB, "host", "device", block == "h.0", "bwd", it))
    frame = pd.DataFrame(rows, columns=["t_start_s", "block", "nbytes", "src", "dst", "prefetch", "stage", "iteration"])
    return frame.assign(
        t_end_s=frame["t_start_s"] + 0.001, duration_s=0.001, moment_row=0, module=frame["block"] + ".mlp",
    )  # fmt: skip


def test_activation_moves_are_counted_apart_from_chunk_moves() -> None:
    am = _activation_moves()
    table = activation_moves_by_block(am).set_index("block")
    assert list(table.index) == ["h.0", "h.1"]
    assert table.loc["h.0", ["moves", "to_host", "to_device", "bytes_to_host", "bytes_to_device", "prefetched"]].tolist() == [
        12, 6, 6, 15 * MIB, 15 * MIB, 6,
    ]  # fmt: skip
    assert table.loc["h.1", "prefetched"] == 0 and table["copy_s"].sum() == pytest.approx(24 * 0.001)
    totals = activation_totals(am)
    assert totals == {
        "moves": 24, "to_host": 12, "to_device": 12, "bytes_to_host": 30 * MIB, "bytes_to_device": 30 * MIB, "prefetched": 6,
        "copy_s": pytest.approx(0.024),
    }  # fmt: skip
    assert activation_totals(am.iloc[:0])["moves"] == 0 and activation_moves_by_block(am.iloc[:0]).empty
    # a profile's chunk figures are the chunk moves' alone; the activation moves get figures of their own
    moves = _moves()
    plain = _profile("a", peak_mib=100, moves=moves, step_s=[0.008, 0.008, 0.008])
    offload = _with(plain, activation_moves=am)
    assert not has_activation_moves(plain) and has_activation_moves(offload)
    assert move_totals(offload.moves) == move_totals(moves)
    table = compare_table(plain, offload).set_index("figure")
    assert table.loc["moves per iteration", "B"] == table.loc["moves per iteration", "A"] == len(moves) / 3
    assert table.loc["activation moves per iteration", "B"] == 8 and np.isnan(table.loc["activation moves per iteration", "A"])
    assert table.loc["activations to host per iteration (MiB)", "B"] == pytest.approx(10)
    assert table.loc["activations to device per iteration (MiB)", "B"] == pytest.approx(10)
    assert "activation moves per iteration" not in compare_table(plain, plain)["figure"].tolist()


def test_memory_timeline_draws_activation_moves_in_a_panel_of_their_own() -> None:
    am = _activation_moves()
    plain = _with(_profile("a", peak_mib=100, moves=_moves(), step_s=[0.008, 0.008, 0.008]), memory=_memory(30))
    p = _with(plain, activation_moves=am)
    fig, downsampled = charts.memory_timeline(p)
    assert not downsampled
    markers = {t.name: t for t in fig.data if t.name in ("activations to host", "activations to device")}
    assert set(markers) == {"activations to host", "activations to device"}
    for name, dst in (("activations to host", "host"), ("activations to device", "device")):
        trace, want = markers[name], am[am["dst"] == dst]
        assert trace.mode == "markers" and trace.marker.color == charts.TIER_COLOURS[dst]
        assert trace.yaxis == "y2" and trace.showlegend is not False  # under the device panel, with a legend entry
        np.testing.assert_allclose(trace.x, want["t_start_s"] * 1e3)  # ms: a 30 ms run
        np.testing.assert_allclose(trace.y, want["nbytes"] / MIB)
    assert [c[0] for c in markers["activations to device"].customdata] == list(am.loc[am["dst"] == "device", "block"])
    assert ", prefetched" in {c[4] for c in markers["activations to device"].customdata}
    assert fig.layout.yaxis2.title.text == "activation moves (MiB)" and fig.layout.yaxis.title.text == "device memory (MiB)"
    assert fig.layout.height == 320 + charts.ACTIVATION_PANEL_PX + 100
    assert fig.layout.xaxis2.title.text == "time since profile start (ms)"  # under the bottom panel
    # the memory lines are what they were without the activation moves
    def memory_lines(f: object) -> list[tuple[str, str, tuple[float, ...]]]:
        return [(t.name, t.yaxis, tuple(t.y)) for t in f.data if t.name in ("total", "chunks", "non-model")]  # type: ignore[attr-defined]

    bare, _ = charts.memory_timeline(plain)
    assert memory_lines(fig) == memory_lines(bare)
    # none without activation moves, or when asked for none (the compare page's two timelines keep one layout)
    for fig in (bare, charts.memory_timeline(p, activations=False)[0]):
        assert not any((t.name or "").startswith("activations") for t in fig.data) and fig.layout.height == 420
    # zoomed to iteration 1: its moves only
    zoomed, _ = charts.memory_timeline(p, iterations=(1, 1))
    host = next(t for t in zoomed.data if t.name == "activations to host")
    assert len(host.x) == ((am["dst"] == "host") & (am["iteration"] == 1)).sum()


def test_activation_series_downsamples_and_keeps_the_largest_copy() -> None:
    n = 20_000
    am = pd.DataFrame(
        {
            "t_start_s": np.arange(n) * 1e-4, "t_end_s": np.arange(n) * 1e-4, "duration_s": 0.0, "block": "h.0",
            "nbytes": np.where(np.arange(n) == 12_345, 64 * MIB, 2 * MIB), "src": "device", "dst": "host", "prefetch": False,
            "moment_row": -1, "module": "", "stage": "", "iteration": -1,
        }
    )  # fmt: skip
    rows, dropped = activation_series(am, "host", max_points=1000)
    assert dropped and len(rows) <= 1000 and rows["nbytes"].max() == 64 * MIB
    assert rows["module"].iloc[0] == OUTSIDE_MOMENTS
    assert activation_series(am, "device")[0].empty
    inside, dropped = activation_series(am, "host", window=(0.5, 0.6))
    assert not dropped and inside["t_start_s"].between(0.5, 0.6).all() and len(inside) == 1001
