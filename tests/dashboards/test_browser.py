"""The app served by a real Streamlit, started as a user starts it, opened in Debian's chromium (playwright).

``chunkstar-profile view PROFILE --compare OTHER --bench-db DB`` serves the
packaged app; ``streamlit run dashboards/app.py`` the checkout's entry. Checks
what AppTest cannot: that the pages render in a browser, the plotly charts
draw, no page shows a Streamlit exception box, and what a newcomer sees:

* no stray text above a page's title (a bare string in a page script, which
  Streamlit's "magic" writes onto the page);
* every legend inside its figure and clear of every plot area, annotation and
  title (the operator bars' legend used to cover the top bar);
* no "Deploy" button, no metric cut short;
* the trend chart draws only colours its legend shows;
* durations in µs/ms/s/min, never seconds with many digits;
* the compare table per iteration, three significant figures;
* the memory timeline's iteration range and numbered forward/backward/optimizer bands;
* a run's activation moves in a panel and legend entries of their own, and a table of their own
  on the operator page (a run that offloads none shows neither);
* CPU benchmark runs in tokens/s, the paper's GPU figures only on request.

A full-page screenshot of each page (and of the states the test moves to) goes
to ``$CHUNKSTAR_SCREENSHOTS/<case>/`` when that is set, else to the test's
``tmp_path``. Skips when /usr/bin/chromium is not installed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkstar_dashboard.data import round_significant

from .conftest import ENTRY, source_pythonpath

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]  # fmt: skip
# url path of each page (st.navigation derives it from the file name) -> charts it must draw
PAGES = {"": 1, "chunks": 1, "operators": 1, "compare": 3, "benchmarks": 3}
RAW_SECONDS = re.compile(r"\d\.\d{4,}\s*s\b")
"""A duration shown as raw seconds with many digits ("0.1134 s")."""
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)"
)

# Each plot's legend, plot areas (one per subplot: plotly's drag rectangles), annotations and titles, in page pixels.
_LAYOUT_JS = """() => [...document.querySelectorAll('[data-testid="stMain"] .js-plotly-plot')].map(plot => {
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const legend = plot.querySelector('g.legend');
    return {
        figure: box(plot.querySelector('.main-svg')),
        legend: legend ? box(legend) : null,
        legendTexts: [...plot.querySelectorAll('g.legend .legendtext')].map(e => e.textContent),
        areas: [...plot.querySelectorAll('.nsewdrag')].map(box),
        // annotations and the figure's and axes' titles (xtitle, y2title, gtitle, ...)
        annotations: [...plot.querySelectorAll('g.annotation, .infolayer text[class$="title"]')].map(box),
        annotationTexts: [...plot.querySelectorAll('g.annotation')].map(e => e.textContent),
        text: plot.textContent,
    };
})"""
# Stroke colours a plot draws its lines in, and those its legend shows.
_STROKES_JS = """(plot) => {
    const stroke = e => getComputedStyle(e).stroke;
    const drawn = [...plot.querySelectorAll('.scatterlayer .trace path.js-line')].filter(e => (e.getAttribute('d') || '').length > 1);
    return {drawn: [...new Set(drawn.map(stroke))], legend: [...new Set([...plot.querySelectorAll('g.legend path.js-line')].map(stroke))]};
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"streamlit did not answer at {url} within {timeout:.0f} s")


def _serve(cmd: list[str], port: int, log: Path, cwd: Path) -> Iterator[str]:
    env = {**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", "PYTHONPATH": source_pythonpath()}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_healthy(url, proc)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(
    params=["profile_path", "disk_profile_path", "offload_profile_path"], ids=["device+host", "disk tier", "activation offload"]
)
def server(request: pytest.FixtureRequest, other_profile_path: Path, bench_db_path: Path, tmp_path: Path) -> Iterator[str]:
    """``chunkstar-profile view`` on a profile of a run without the disk tier, then on one with it, then on one
    that offloads its blocks' activations."""
    profile_path: Path = request.getfixturevalue(request.param)
    port = _free_port()
    cmd = [
        sys.executable, "-m", "chunkstar_profiler.cli", "view", str(profile_path), "--compare", str(other_profile_path),
        "--bench-db", str(bench_db_path), "--port", str(port), "--no-browser",
    ]  # fmt: skip
    yield from _serve(cmd, port, tmp_path / "streamlit.log", cwd=tmp_path)


def _shots(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    root = os.environ.get("CHUNKSTAR_SCREENSHOTS")
    case = re.sub(r"[^A-Za-z0-9_.+-]+", "_", request.node.name)
    out = Path(root) / case if root else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    return out


def _settle(page: Any, n_charts: int) -> None:
    charts = page.locator('[data-testid="stPlotlyChart"] .js-plotly-plot')
    charts.nth(n_charts - 1).wait_for(state="visible", timeout=30_000)
    page.locator(".js-plotly-plot .main-svg").first.wait_for(state="visible", timeout=10_000)
    # the run has finished when Streamlit's status widget stops showing "running"
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)
    page.wait_for_timeout(500)  # plotly's last relayout after the run
    assert charts.count() == n_charts


def _screenshot(page: Any, path: Path) -> None:
    """The whole page: Streamlit scrolls inside its main block, so the viewport is made as tall as the content."""
    size = page.viewport_size
    height = int(page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight"))
    page.set_viewport_size({"width": size["width"], "height": max(size["height"], height + 40)})
    page.wait_for_timeout(700)
    page.screenshot(path=str(path), full_page=True)
    page.set_viewport_size(size)


def _overlaps(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


def _inside(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    return a[0] >= b[0] - slack and a[1] >= b[1] - slack and a[2] <= b[2] + slack and a[3] <= b[3] + slack


def _assert_newcomer_view(page: Any, where: str) -> list[dict[str, Any]]:
    """What every page must give a newcomer; returns the plots' layout boxes for page-specific checks."""
    assert page.locator('[data-testid="stException"]').count() == 0, where
    assert page.locator('[data-testid="stAlertContentError"]').count() == 0, where
    # plotly drew data: line/bar traces or heatmap images
    assert page.locator(".js-plotly-plot .trace, .js-plotly-plot .hm image").count() > 0, where
    # nothing above the title: the first text-bearing element of the page is its h1
    first = page.evaluate(
        """() => { const main = document.querySelector('[data-testid="stMainBlockContainer"]');
        const e = main.querySelector('[data-testid="stHeading"], [data-testid="stMarkdown"], [data-testid="stText"],'
            + ' [data-testid="stCaptionContainer"], [data-testid="stCode"], [data-testid="stJson"]');
        return e ? [e.getAttribute('data-testid'), e.querySelector('h1') !== null] : null; }"""
    )
    assert first == ["stHeading", True], (where, first)
    # no Deploy button (a local viewer: client.toolbarMode = minimal)
    assert page.locator('[data-testid="stAppDeployButton"]').count() == 0, where
    assert page.get_by_role("button", name="Deploy").count() == 0, where
    # figures shown whole: no metric cut short by an ellipsis
    cut = page.evaluate(
        """() => [...document.querySelectorAll('[data-testid="stMetricValue"]')]
            .filter(e => [e, ...e.querySelectorAll('*')].some(x => x.scrollWidth > x.clientWidth + 1)).map(e => e.textContent)"""
    )
    assert not cut, (where, cut)
    # durations in a unit a person reads
    text = page.locator('[data-testid="stMain"]').inner_text() + page.locator('[data-testid="stSidebar"]').inner_text()
    assert not RAW_SECONDS.search(text), (where, RAW_SECONDS.findall(text))
    # legends: inside their figure, over no plot area, annotation or title
    plots: list[dict[str, Any]] = page.evaluate(_LAYOUT_JS)
    for i, plot in enumerate(plots):
        if plot["legend"] is None:
            continue
        assert _inside(plot["legend"], plot["figure"]), (where, i, plot["legend"], plot["figure"])
        for box in plot["areas"] + plot["annotations"]:
            assert not _overlaps(plot["legend"], box), (where, i, "legend overlaps", plot["legend"], box)
    return plots


def _memory_page(page: Any, plots: list[dict[str, Any]], shots: Path, offload: bool) -> None:
    timeline = plots[0]
    assert {"forward", "backward", "optimizer"} <= set(timeline["legendTexts"])
    # activation moves: their own legend entries and panel, only for a run that moved some
    activations = {"activations to host", "activations to device"}
    assert (activations <= set(timeline["legendTexts"])) == offload and (activations & set(timeline["legendTexts"]) != set()) == offload
    assert ("activation moves (MiB)" in timeline["text"]) == offload
    assert timeline["annotationTexts"] == ["iter 0", "iter 1", "iter 2"]
    assert re.search(r"time since profile start \((ms|s)\)", timeline["text"])  # ms for a run under 2 s
    bands = page.evaluate(
        "() => document.querySelector('.js-plotly-plot').data.filter(t => ['forward', 'backward', 'optimizer']"
        ".includes(t.name)).map(t => parseFloat(t.fillcolor.split(',')[3]))"
    )
    assert len(bands) >= 3 and min(bands) >= 0.15, bands  # bands a reader can tell apart
    assert re.search(r"3 iterations, \d+(\.\d+)? (ms|s) recorded", page.locator('[data-testid="stSidebar"]').inner_text())
    # narrow the iteration range from the left: iteration 0 leaves the chart
    page.get_by_role("slider").first.focus()
    page.keyboard.press("ArrowRight")
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot g.annotation')].map(e => e.textContent).join() == 'iter 1,iter 2'",
        timeout=30_000,
    )
    _settle(page, 1)
    x0 = page.evaluate("() => document.querySelector('.js-plotly-plot')._fullLayout.xaxis.range[0]")
    assert x0 > 0
    assert page.get_by_text(re.compile(r"samples shown: iterations 1-2 \(\d+(\.\d+)? (ms|s)\)")).count() == 1
    _assert_newcomer_view(page, "memory, iterations 1-2")
    _screenshot(page, shots / "page_memory_iterations_1-2.png")


def _operators_page(page: Any, plots: list[dict[str, Any]], offload: bool) -> None:
    assert page.get_by_text("Activation moves by block").count() == int(offload)
    assert page.locator('[data-testid="stDataFrame"]').count() == 1 + offload
    bars = plots[0]
    assert {"to host", "to device"} <= set(bars["legendTexts"])
    assert all(bars["legend"][1] >= area[3] for area in bars["areas"])  # under the bars, not over the top one
    moved = page.locator('[data-testid="stMetric"]').filter(has_text="Move time").locator('[data-testid="stMetricValue"]')
    assert re.fullmatch(r"\d[\d.]* (µs|ms|s)|\d+ min \d\d s", moved.inner_text().strip())


def _compare_page(page: Any) -> None:
    rows = page.evaluate(
        "() => [...document.querySelector('[data-testid=\"stDataFrame\"] table').querySelectorAll('tr')]"
        ".map(r => [...r.querySelectorAll('th, td')].map(c => c.textContent.trim()))"
    )
    figures = {r[0]: r[1:] for r in rows[1:]}
    assert {"iterations", "moves per iteration", "moved to device per iteration (MiB)", "move time per iteration (ms)"} <= set(figures)
    assert not any(name in figures for name in ("moves", "moved to device (MiB)", "move time (s)"))  # no totals
    for name, cells in figures.items():
        for cell in cells[:3]:  # A, B, B - A: three significant figures (integers whole)
            if cell not in ("", "None", "NaN"):
                assert round_significant([float(cell)])[0] == float(cell), (name, cell)
        if cells[3] not in ("", "None", "NaN"):
            assert float(cells[3]) == round(float(cells[3]), 1), (name, cells[3])
    assert page.get_by_text("Traffic (moves, bytes moved, move time) is per iteration").count() == 1


def _benchmarks_page(page: Any, plots: list[dict[str, Any]], shots: Path) -> None:
    tokens, _, trends = plots
    assert "Measured on cpu-2core (CPU)" in tokens["text"] and "tokens/s" in tokens["text"]
    assert not any("TFLOPS" in p["text"] for p in plots)  # no GPU figure of merit over CPU runs by default
    assert not any(t.endswith("(published)") for p in plots for t in p["legendTexts"])
    box = page.get_by_role("checkbox", name="Compare with the paper's published GPU figures")
    assert not box.is_checked()
    # the trend chart draws only the colours its legend shows (plotly's colour cycle used to change them per panel)
    plot = page.locator('[data-testid="stMain"] .js-plotly-plot').nth(2)
    strokes = plot.evaluate(_STROKES_JS)
    assert strokes["drawn"] and set(strokes["drawn"]) <= set(strokes["legend"]), strokes
    assert "regression" in trends["legendTexts"]
    # the published GPU figures: a chart of their own, on request
    page.get_by_text("Compare with the paper's published GPU figures").click()
    _settle(page, 4)
    published = page.evaluate(_LAYOUT_JS)[1]
    assert "TFLOPS per GPU" in published["text"]
    assert any(t.endswith("(published)") for t in published["legendTexts"])
    assert page.get_by_text("figures of the paper on a100x8_1tb").count() == 1
    _assert_newcomer_view(page, "benchmarks, published figures shown")
    _screenshot(page, shots / "page_benchmarks_published.png")


@needs_chromium
def test_pages_render_in_chromium(server: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    shots = _shots(request, tmp_path)
    offload = request.node.callspec.id == "activation offload"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for path, n_charts in PAGES.items():
                page.goto(f"{server}/{path}", wait_until="domcontentloaded")
                _settle(page, n_charts)
                plots = _assert_newcomer_view(page, path or "memory")
                _screenshot(page, shots / f"page_{path or 'memory'}.png")
                if path == "":
                    _memory_page(page, plots, shots, offload)
                elif path == "chunks":
                    assert page.get_by_text("Largest chunk x bin grid").count() == 0  # the stray docstring of old
                elif path == "operators":
                    _operators_page(page, plots, offload)
                elif path == "compare":
                    _compare_page(page)
                elif path == "benchmarks":
                    _benchmarks_page(page, plots, shots)
        finally:
            browser.close()
    assert (shots / "page_memory.png").stat().st_size > 10_000


@needs_chromium
def test_the_checkout_entry_serves_the_same_app(profile_path: Path, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """``streamlit run dashboards/app.py`` with no flags of ours: the settings come from the config.toml beside it."""
    from playwright.sync_api import sync_playwright

    port = _free_port()
    cmd = [
        sys.executable, "-m", "streamlit", "run", str(ENTRY), "--server.headless", "true", "--server.port", str(port),
        "--server.address", "127.0.0.1", "--", "--profile", str(profile_path),
    ]  # fmt: skip
    shots = _shots(request, tmp_path)
    for url in _serve(cmd, port, tmp_path / "streamlit.log", cwd=tmp_path):
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(url, wait_until="domcontentloaded")
                _settle(page, 1)
                _assert_newcomer_view(page, "checkout entry")
                assert page.locator("h1").first.inner_text() == "Memory timeline"
                _screenshot(page, shots / "entry_memory.png")
            finally:
                browser.close()


@needs_chromium
def test_a_predicted_profile_renders_in_chromium(
    predicted_profile_path: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``chunkstar-profile view`` on a dry run's predicted step (``write_predicted_profile``): the memory timeline,
    chunk map and per-operator moves draw, with no exception, and each says, under its title, that the profile is
    predicted (the time model's clock, not measured), as do the sidebar and the time axes."""
    from playwright.sync_api import sync_playwright

    port = _free_port()
    cmd = [
        sys.executable, "-m", "chunkstar_profiler.cli", "view", str(predicted_profile_path), "--port", str(port), "--no-browser",
    ]  # fmt: skip
    shots = _shots(request, tmp_path)
    for url in _serve(cmd, port, tmp_path / "streamlit.log", cwd=tmp_path):
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                for path, axis in (("", True), ("chunks", True), ("operators", False)):
                    where = f"predicted, {path or 'memory'}"
                    page.goto(f"{url}/{path}", wait_until="domcontentloaded")
                    _settle(page, 1)
                    plots = _assert_newcomer_view(page, where)
                    note = page.locator('[data-testid="stAlert"]').filter(has_text="Predicted profile, not measured")
                    assert note.count() == 1, where
                    assert re.search(r"a dry run's step of rank 0 of 2 on .*per step, bound by \w+", note.inner_text()), where
                    if axis:
                        assert "predicted time since step start" in plots[0]["text"], where
                        assert "time since profile start" not in plots[0]["text"], where
                    sidebar = page.locator('[data-testid="stSidebar"]').inner_text()
                    assert "predicted by a dry run, not measured" in sidebar and "recorded" not in sidebar, where
                    _screenshot(page, shots / f"predicted_{path or 'memory'}.png")
            finally:
                browser.close()
    assert (shots / "predicted_chunks.png").stat().st_size > 10_000
