"""Every page of the Streamlit app, run headless by ``streamlit.testing.v1.AppTest`` on real profiles."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from chunkstar_dashboard.data import round_significant
from chunkstar_dashboard.text import escape_markdown

from .conftest import APP

PAGES = ("views/memory.py", "views/chunks.py", "views/operators.py", "views/compare.py")


def _app(profile: Path | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    if profile is not None:
        at.session_state["profile_path"] = str(profile)  # as `-- --profile PATH` would
    return at.run()


def _plotly_charts(at: AppTest) -> list:
    return at.get("plotly_chart")


def _assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_no_profile_explains_how_to_load_one() -> None:
    at = _app()
    _assert_clean(at)
    assert at.text_input(key="profile_path").value == ""
    for page in PAGES:
        at.switch_page(page).run()
        _assert_clean(at)
        assert any("No profile loaded" in i.value for i in at.info), page
        assert not _plotly_charts(at)


def test_memory_page(profile_path: Path) -> None:
    at = _app(profile_path)
    _assert_clean(at)
    assert at.title[0].value == "Memory timeline"
    labels = {m.label: m.value for m in at.metric}
    assert {"Peak device memory", "Peak device chunks", "Device budget", "Peak host memory"} <= set(labels)
    assert labels["Device budget"].endswith("MiB")
    assert len(_plotly_charts(at)) == 1
    assert any("samples shown: the whole recording" in c.value for c in at.caption)
    # zoom to iterations 1-2: the samples inside their stages, the chart's x-axis over them
    at.slider(key="memory_iters").set_value((1, 2)).run()
    _assert_clean(at)
    import chunkstar_profiler

    from chunkstar_dashboard.data import iteration_span

    prof = chunkstar_profiler.load(str(profile_path))
    t0, t1 = iteration_span(prof.stages, 1, 2)
    n = int(prof.memory["t_s"].between(t0, t1).sum())
    assert any(f"All {n:,} samples shown: iterations 1-2" in c.value for c in at.caption)
    at.slider(key="memory_iters").set_value((0, 2)).run()
    assert any(escape_markdown(profile_path.name) in c.value for c in at.sidebar.caption)  # escaped: names are untrusted
    # one tier only
    at.multiselect(key="memory_tiers").set_value(["device"]).run()
    _assert_clean(at)
    assert len(_plotly_charts(at)) == 1


def test_chunk_locations_page(profile_path: Path) -> None:
    at = _app(profile_path)
    at.switch_page("views/chunks.py").run()
    _assert_clean(at)
    assert at.title[0].value == "Chunk locations"
    assert set(at.multiselect(key="chunk_lists").value) == {"param", "master", "exp_avg", "exp_avg_sq"}
    assert len(_plotly_charts(at)) == 1
    at.multiselect(key="chunk_lists").set_value(["param"]).run()
    at.slider(key="chunk_bins").set_value(100).run()
    _assert_clean(at)
    assert len(_plotly_charts(at)) == 1


def test_operator_movements_page(profile_path: Path) -> None:
    import chunkstar_profiler

    moves = chunkstar_profiler.load(str(profile_path)).moves
    at = _app(profile_path)
    at.switch_page("views/operators.py").run()
    _assert_clean(at)
    assert at.title[0].value == "Operator movements"
    table = at.dataframe[0].value
    assert table["moves"].sum() == len(moves) > 0
    assert table["MiB to device"].sum() * 2**20 == pytest.approx(moves.loc[moves["dst"] == "device", "nbytes"].sum())
    assert {m.label for m in at.metric} >= {"Moves", "To device", "To host", "Move time"}
    assert at.metric[0].value == f"{len(moves):,}"
    assert len(_plotly_charts(at)) == 1
    # filter to evictions in the forward pass
    at.multiselect(key="ops_reasons").set_value(["eviction"]).run()
    at.multiselect(key="ops_stages").set_value(["fwd"]).run()
    _assert_clean(at)
    want = moves[(moves["reason"] == "eviction") & (moves["stage"] == "fwd")]
    assert at.metric[0].value == f"{len(want):,}"
    table = at.dataframe[0].value
    assert table["moves"].sum() == len(want)
    assert set(table.columns) >= {"module", "eviction", "access", "move time (ms)"}


def test_compare_page(profile_path: Path, other_profile_path: Path) -> None:
    at = _app(profile_path)
    at.switch_page("views/compare.py").run()
    _assert_clean(at)
    assert any("second profile" in i.value for i in at.info)
    at.text_input(key="compare_path").input(str(other_profile_path)).run()
    _assert_clean(at)
    table = at.dataframe[0].value.set_index("figure")
    assert table.loc["chunk size (elements)"].tolist()[:3] == [4096, 8192, 4096]
    assert {
        "iterations", "peak device memory (MiB)", "moved to device per iteration (MiB)", "moved to host per iteration (MiB)",
        "move time per iteration (ms)", "eviction moves per iteration", "mean step time (ms)",
    } <= set(table.index)  # fmt: skip
    # traffic per iteration: the recording's totals over its 3 iterations, three significant figures shown
    import chunkstar_profiler

    moves = chunkstar_profiler.load(str(profile_path)).moves
    assert table.loc["iterations"].iloc[0] == 3
    assert table.loc["moves per iteration"].iloc[0] == round_significant([len(moves) / 3])[0]
    mib_to_device = moves.loc[moves["dst"] == "device", "nbytes"].sum() / 2**20 / 3
    assert table.loc["moved to device per iteration (MiB)"].iloc[0] == pytest.approx(mib_to_device, rel=5e-3)
    numbers = table.iloc[:, :3].to_numpy(dtype=float)
    np.testing.assert_array_equal(numbers, round_significant(numbers.ravel()).reshape(numbers.shape))
    assert len(_plotly_charts(at)) == 3  # step times + both memory timelines


def test_bad_file_shows_the_format_error(profile_path: Path, bad_profile_path: Path) -> None:
    at = _app(bad_profile_path)
    assert not at.exception
    assert len(at.error) == 1 and "not a readable chunkstar profile" in at.error[0].value
    assert not _plotly_charts(at)
    at.switch_page("views/compare.py").run()
    assert not at.exception and at.error
    # a missing file
    at.text_input(key="profile_path").input(str(bad_profile_path.with_name("missing.csprof"))).run()
    assert not at.exception and "Cannot open" in at.error[0].value
    # a bad second profile on the compare page
    at.text_input(key="profile_path").input(str(profile_path)).run()
    at.text_input(key="compare_path").input(str(bad_profile_path)).run()
    assert not at.exception
    assert len(at.error) == 1 and "not a readable chunkstar profile" in at.error[0].value


def test_upload(profile_path: Path) -> None:
    at = _app()
    if not hasattr(at, "file_uploader"):
        pytest.skip("this Streamlit's AppTest cannot drive st.file_uploader")
    at.file_uploader(key="profile_upload").upload(profile_path.name, profile_path.read_bytes()).run()
    _assert_clean(at)
    assert len(_plotly_charts(at)) == 1


def test_pages_show_the_disk_tier(disk_profile_path: Path, profile_path: Path) -> None:
    import chunkstar_profiler

    prof = chunkstar_profiler.load(str(disk_profile_path))
    staged_in = prof.moves[prof.moves["reason"] == "stage_in"]
    assert len(staged_in) > 0
    at = _app(disk_profile_path)
    _assert_clean(at)
    labels = {m.label: m.value for m in at.metric}
    assert labels["Disk (chunk files)"].endswith("MiB")
    assert at.multiselect(key="memory_tiers").options == ["device", "host", "disk"]
    assert at.multiselect(key="memory_tiers").value == ["device", "host", "disk"]
    assert any("chunk files" in c.value for c in at.caption) and any("disk tier" in c.value for c in at.sidebar.caption)
    at.multiselect(key="memory_tiers").set_value(["disk"]).run()
    _assert_clean(at)
    assert len(_plotly_charts(at)) == 1

    at.switch_page("views/chunks.py").run()
    _assert_clean(at)
    assert any("only on disk (brown" in c.value for c in at.caption)

    at.switch_page("views/operators.py").run()
    _assert_clean(at)
    assert "stage_in" in at.multiselect(key="ops_reasons").options
    labels = {m.label: m.value for m in at.metric}
    assert {"Staged in", "Staged out"} <= set(labels)
    table = at.dataframe[0].value
    assert table["MiB staged in"].sum() * 2**20 == pytest.approx(staged_in["nbytes"].sum())
    assert table["stage-ins"].sum() == table["stage_in"].sum() == len(staged_in)
    to_host = prof.moves[(prof.moves["dst"] == "host") & (prof.moves["src"] == "device")]
    assert table["moves to host"].sum() == len(to_host)
    at.multiselect(key="ops_reasons").set_value(["stage_out"]).run()
    _assert_clean(at)
    assert at.metric[0].value == f"{(prof.moves['reason'] == 'stage_out').sum():,}"

    # beside a run without the disk tier
    at.switch_page("views/compare.py").run()
    at.text_input(key="compare_path").input(str(profile_path)).run()
    _assert_clean(at)
    figures = at.dataframe[0].value.set_index("figure")
    iterations = figures.loc["iterations"].iloc[0]
    staged = figures.loc["staged in from disk per iteration (MiB)"]
    assert staged.iloc[0] * 2**20 * iterations == pytest.approx(staged_in["nbytes"].sum(), rel=5e-3)  # shown to 3 figures
    assert pd.isna(staged.iloc[1])


def test_a_profile_without_the_disk_tier_shows_no_disk(profile_path: Path) -> None:
    at = _app(profile_path)
    assert at.multiselect(key="memory_tiers").options == ["device", "host"]
    assert "Disk (chunk files)" not in {m.label for m in at.metric}
    at.switch_page("views/operators.py").run()
    _assert_clean(at)
    assert not {"Staged in", "Staged out"} & {m.label for m in at.metric}
    assert not {"stage-ins", "MiB staged in"} & set(at.dataframe[0].value.columns)


def _array(values: object) -> np.ndarray:
    """A trace's numbers as the browser gets them: a list, or plotly's base64 typed array (``{"bdata", "dtype"}``)."""
    if isinstance(values, dict):
        import base64

        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"])
    return np.asarray(values)


def test_pages_show_activation_moves_apart_from_chunk_moves(offload_profile_path: Path, profile_path: Path) -> None:
    import json

    import chunkstar_profiler

    prof = chunkstar_profiler.load(str(offload_profile_path))
    am, moves = prof.activation_moves, prof.moves
    to_host, to_device = am[am["dst"] == "host"], am[am["dst"] == "device"]
    assert len(to_host) > 0 and len(to_device) > 0 and len(moves) > 0
    at = _app(offload_profile_path)
    _assert_clean(at)
    traces = json.loads(_plotly_charts(at)[0].proto.spec)["data"]
    markers = {t["name"]: t for t in traces if t.get("name", "").startswith("activations")}
    assert set(markers) == {"activations to host", "activations to device"}
    for name, frame in (("activations to host", to_host), ("activations to device", to_device)):
        np.testing.assert_allclose(np.sort(_array(markers[name]["y"])), np.sort(frame["nbytes"] / 2**20))
    assert all(t["mode"] == "markers" for t in markers.values())
    assert {t["yaxis"] for t in markers.values()} == {"y3"}  # a panel under device and host memory
    assert any(f"{len(to_host):,} copies to the host" in c.value for c in at.caption)
    assert any("activations offloaded" in c.value for c in at.sidebar.caption)

    at.switch_page("views/operators.py").run()
    _assert_clean(at)
    labels = {m.label: m.value for m in at.metric}
    assert labels["Moves"] == f"{len(moves):,}"  # the chunk moves alone
    assert labels["Activation moves"] == f"{len(am):,}"
    chunk_table, act_table = at.dataframe[0].value, at.dataframe[1].value
    assert chunk_table["moves"].sum() == len(moves)
    assert chunk_table["MiB to host"].sum() * 2**20 == pytest.approx(moves.loc[moves["dst"] == "host", "nbytes"].sum())
    assert set(act_table["block"]) == set(am["block"])
    assert act_table["copies to host"].sum() == len(to_host) and act_table["copies to device"].sum() == len(to_device)
    assert act_table["MiB to host"].sum() * 2**20 == pytest.approx(to_host["nbytes"].sum())
    assert act_table["MiB to device"].sum() * 2**20 == pytest.approx(to_device["nbytes"].sum())
    # the chunk filters leave the activation moves as they are
    at.multiselect(key="ops_reasons").set_value(["eviction"]).run()
    _assert_clean(at)
    assert at.dataframe[1].value["copies to host"].sum() == len(to_host)

    # beside a run that offloads none
    at.switch_page("views/compare.py").run()
    at.text_input(key="compare_path").input(str(profile_path)).run()
    _assert_clean(at)
    figures = at.dataframe[0].value.set_index("figure")
    per_iteration = figures.loc["activations to host per iteration (MiB)"]
    assert per_iteration.iloc[0] * 2**20 * 3 == pytest.approx(to_host["nbytes"].sum(), rel=5e-3) and pd.isna(per_iteration.iloc[1])
    assert figures.loc["moves per iteration"].iloc[0] == round_significant([len(moves) / 3])[0]


def test_a_profile_without_activation_moves_shows_none(profile_path: Path) -> None:
    import json

    at = _app(profile_path)
    names = {t.get("name") for t in json.loads(_plotly_charts(at)[0].proto.spec)["data"]}
    assert not {"activations to host", "activations to device"} & names
    assert not any("activation moves" in c.value for c in at.caption)
    at.switch_page("views/operators.py").run()
    _assert_clean(at)
    assert len(at.dataframe) == 1 and "Activation moves" not in {m.label for m in at.metric}


def _x_titles(chart: object) -> list[str]:
    import json

    layout = json.loads(chart.proto.spec)["layout"]  # type: ignore[attr-defined]
    return [axis["title"]["text"] for key, axis in layout.items() if key.startswith("xaxis") and axis.get("title")]


def test_a_predicted_profile_opens_on_every_page(predicted_profile_path: Path, profile_path: Path) -> None:
    """A dry run's predicted step (``write_predicted_profile``), opened as a user opens any profile: every page
    renders it and says, above its figures, that it is predicted, on the time model's clock, not measured."""
    import chunkstar_profiler

    prof = chunkstar_profiler.load(str(predicted_profile_path))
    assert prof.prediction is not None and len(prof.moves) > 0
    at = _app(predicted_profile_path)
    _assert_clean(at)
    sidebar = at.sidebar.caption[0].value
    assert "**predicted** by a dry run, not measured" in sidebar and re.search(r"1 iterations, \S+ (µs|ms|s) predicted", sidebar)
    assert "recorded" not in sidebar  # written, not recorded
    for page in ("views/memory.py", "views/chunks.py", "views/operators.py"):
        if page != "views/memory.py":
            at.switch_page(page).run()
        _assert_clean(at)
        notes = [i.value for i in at.info if "Predicted profile, not measured" in i.value]
        assert len(notes) == 1, page
        assert "rank 0 of 2" in notes[0] and "per step, bound by" in notes[0], notes[0]
        charts = _plotly_charts(at)
        assert len(charts) == 1, page
        if page != "views/operators.py":
            assert _x_titles(charts[0])[-1].startswith("predicted time since step start ("), page
    table = at.dataframe[0].value
    assert table["moves"].sum() == len(prof.moves)
    # beside a measured run on the compare page: A is the predicted one, B is not
    at.switch_page("views/compare.py").run()
    at.text_input(key="compare_path").input(str(profile_path)).run()
    _assert_clean(at)
    assert [i.value.startswith("**Predicted profile") for i in at.info] == [True]
    assert len(_plotly_charts(at)) == 3
    # a measured profile has no such note
    at.text_input(key="profile_path").input(str(profile_path)).run()
    at.switch_page("views/memory.py").run()
    _assert_clean(at)
    assert not any("Predicted" in i.value for i in at.info)
    assert _x_titles(_plotly_charts(at)[0])[-1].startswith("time since profile start (")


def test_a_chunk_map_of_more_chunks_than_rows_draws_bands(predicted_profile_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_CHUNK_ROWS`` chunks (a 68B run's lists, or a deep model's with small chunks), a row of the map is a
    band of consecutive chunks, and the page says so; here the limit is lowered to below the tiny run's chunks."""
    import json

    import chunkstar_profiler

    from chunkstar_dashboard import data

    prof = chunkstar_profiler.load(str(predicted_profile_path))
    n_chunks = len(prof.placements[["chunk_list", "chunk_id"]].drop_duplicates())
    assert n_chunks > 8
    monkeypatch.setattr(data, "MAX_CHUNK_ROWS", 8)
    at = _app(predicted_profile_path)
    at.switch_page("views/chunks.py").run()
    _assert_clean(at)
    band = -(-n_chunks // 8)
    assert any(f"{n_chunks:,} chunks, more than the 8 rows the map draws: each row is a band of {band} " in c.value for c in at.caption)
    heatmaps = json.loads(_plotly_charts(at)[0].proto.spec)["data"]
    rows = [y for h in heatmaps for y in h["y"]]
    assert len(rows) <= 8 + len(heatmaps) and any("-" in y for y in rows)  # a list's last band may be short
