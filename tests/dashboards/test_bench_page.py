"""The Benchmarks page, run headless by ``AppTest`` on a real results SQLite (``_bench_db``)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

from streamlit.testing.v1 import AppTest

from chunkstar_dashboard.text import escape_markdown

from ._bench_db import COMMITS, MAXSCALE_OK
from .conftest import APP

PAGE = "views/benchmarks.py"


def _page(db: Path | str | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=90)
    if db is not None:
        at.session_state["bench_db_path"] = str(db)  # as `-- --bench-db PATH` would
    at.run()
    return at.switch_page(PAGE).run()


def _assert_clean(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def test_without_a_database_shows_published_and_planned(tmp_path: Path) -> None:
    at = _page()
    _assert_clean(at)
    assert at.title[0].value == "Benchmarks"
    assert any("No results database loaded" in i.value for i in at.info)
    assert len(at.get("plotly_chart")) == 1  # max scale (published, planned); the published throughput is opt-in
    assert any("No successful runs" in i.value for i in at.info)
    assert at.checkbox(key="bench_show_published").value is False
    at.checkbox(key="bench_show_published").check().run()
    _assert_clean(at)
    assert len(at.get("plotly_chart")) == 2
    assert at.selectbox(key="bench_overlay").value == "a100x8_1tb"
    assert any("**Published** figures of the paper on a100x8_1tb" in c.value for c in at.caption)
    table = at.dataframe[0].value
    assert set(table["source"]) == {"published", "planned"}
    v100 = table[(table["hardware"] == "v100x8_240gb") & (table["system"] == "chunkstar")].set_index("source")
    assert v100.loc["published", "model"] == "18B (PatrickStar)"
    assert v100.loc["planned", "model"].startswith("GPT")


def test_with_a_results_database(bench_db_path: Path) -> None:
    at = _page(bench_db_path)
    _assert_clean(at)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Runs"] == "63" and metrics["Out of memory / error"] == "2 / 0"
    assert metrics["Regressions flagged"] == "1"
    assert len(at.get("plotly_chart")) == 3  # throughput in tokens/s, max scale, trends
    assert at.selectbox(key="bench_hardware").value == "cpu-2core"
    # a CPU node: tokens/s, never TFLOPS per GPU beside the paper's A100 figures unless asked for
    assert any("a CPU machine: throughput in tokens/s" in c.value for c in at.caption)
    assert not any("TFLOPS" in h.value for h in at.subheader)
    at.checkbox(key="bench_show_published").check().run()
    _assert_clean(at)
    assert len(at.get("plotly_chart")) == 4
    assert any("No GPU runs of ours drawn" in c.value for c in at.caption)
    # max scale: measured bars for the CPU node, published and planned beside them
    table = at.dataframe[0].value
    measured = table[table["source"] == "measured"].set_index("system")["model"].to_dict()
    assert measured["chunkstar"] == MAXSCALE_OK["chunkstar"] and measured["deepspeed"] == MAXSCALE_OK["deepspeed"]
    assert {"measured", "published", "planned"} == set(table["source"])
    # trends: the nightly suite, the one regressed run named with its commit
    assert at.selectbox(key="bench_suite").value == "nightly"
    assert any("1 run(s) flagged" in w.value for w in at.warning)
    flagged = at.dataframe[1].value
    assert set(flagged["git_commit"]) == {COMMITS[-1]}
    assert set(flagged["metric"]) == {"tokens/s", "peak device memory", "peak host memory"}  # CPU runs: no TFLOPS per GPU
    assert (flagged.loc[flagged["metric"] == "tokens/s", "change_pct"] < -25).all()
    assert flagged.loc[flagged["metric"] == "peak host memory", "value"].tolist() == ["800 MiB"]  # a unit, not 838860800
    # widgets: no overlay, one node, one series
    at.checkbox(key="bench_show_published").uncheck().run()
    at.multiselect(key="bench_scale_nodes").set_value(["cpu-2core"]).run()
    at.multiselect(key="bench_series").set_value(["deepspeed cpu-tiny x1 b4 (cpu-2core)"]).run()
    _assert_clean(at)
    assert len(at.get("plotly_chart")) == 3
    assert any("1 run(s) flagged" in w.value for w in at.warning)  # the list covers the suite, not the chart's pick
    # the max-scale suite's runs are one run per series: nothing to flag there
    at.selectbox(key="bench_suite").set_value("maxscale").run()
    _assert_clean(at)
    assert any("No regressions flagged" in s.value for s in at.success)


def test_bad_database_shows_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "not.sqlite"
    bad.write_bytes(b"not a database\n" * 100)
    at = _page(bad)
    assert not at.exception
    assert len(at.error) == 1
    assert escape_markdown(f"not.sqlite is not a readable chunkstar-bench results database: {bad}: not an SQLite database") == at.error[0].value
    assert not at.get("plotly_chart")
    at.text_input(key="bench_db_path").input(str(tmp_path / "missing.sqlite")).run()
    assert not at.exception and "Cannot open" in at.error[0].value


def test_profile_pages_still_work_with_the_benchmarks_page(profile_path: Path, bench_db_path: Path) -> None:
    at = AppTest.from_file(str(APP), default_timeout=90)
    at.session_state["profile_path"] = str(profile_path)
    at.session_state["bench_db_path"] = str(bench_db_path)
    at.run()
    _assert_clean(at)
    assert at.title[0].value == "Memory timeline" and len(at.get("plotly_chart")) == 1


def test_a_row_of_the_wrong_type_is_named_and_the_other_runs_shown(bench_db_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "edited.sqlite"
    shutil.copyfile(bench_db_path, path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE runs SET tokens_per_s = 'garbage' WHERE id = 5")
    at = _page(path)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    warning = " ".join(w.value for w in at.warning)
    assert escape_markdown(f"{path}: 1 row cannot be read: row id 5 (tokens_per_s holds text, not a number)") in warning
    assert {m.label: m.value for m in at.metric}["Runs"] == "62"  # the 63 rows but the bad one
    assert len(at.get("plotly_chart")) == 3
