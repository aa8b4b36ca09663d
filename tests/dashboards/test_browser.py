"""The app served by ``streamlit run`` and opened in a real browser (Debian's chromium via playwright).

Checks what AppTest cannot: that the pages render in a browser, the plotly
charts draw, and no page shows a Streamlit exception box. Leaves a
screenshot of each page in ``tmp_path``. Skips when /usr/bin/chromium is not installed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import APP, BENCH, REPO

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]  # fmt: skip
# url path of each page (st.navigation derives it from the file name) -> charts it must draw
PAGES = {"": 1, "chunks": 1, "operators": 1, "compare": 3, "benchmarks": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout: float = 45.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"streamlit exited with {server.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"streamlit did not answer at {url} within {timeout:.0f} s")


@pytest.fixture(params=["profile_path", "disk_profile_path"], ids=["device+host", "disk tier"])
def server(request: pytest.FixtureRequest, other_profile_path: Path, bench_db_path: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The app on a profile of a run without the disk tier, then on one with it."""
    profile_path: Path = request.getfixturevalue(request.param)
    port = _free_port()
    log = open(tmp_path / "streamlit.log", "wb")
    # the Benchmarks page imports chunkstar_bench (found there even before it is pip-installed)
    pythonpath = os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", "PYTHONPATH": pythonpath}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true", "--server.port", str(port),
            "--server.address", "127.0.0.1", "--server.fileWatcherType", "none", "--browser.gatherUsageStats", "false",
            "--", "--profile", str(profile_path), "--compare", str(other_profile_path), "--bench-db", str(bench_db_path),
        ],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )  # fmt: skip
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
        log.close()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (apt-get install chromium)")
def test_pages_render_in_chromium(server: str, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            for path, n_charts in PAGES.items():
                page.goto(f"{server}/{path}", wait_until="domcontentloaded")
                charts = page.locator('[data-testid="stPlotlyChart"] .js-plotly-plot')
                charts.nth(n_charts - 1).wait_for(state="visible", timeout=30_000)
                page.locator(".js-plotly-plot .main-svg").first.wait_for(state="visible", timeout=10_000)
                # the run has finished when Streamlit's status widget stops showing "running"
                page.wait_for_function(
                    "() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000
                )
                assert charts.count() == n_charts, path
                assert page.locator('[data-testid="stException"]').count() == 0, path
                assert page.locator('[data-testid="stAlertContentError"]').count() == 0, path
                # plotly drew data: line/bar traces or heatmap images
                assert page.locator(".js-plotly-plot .trace, .js-plotly-plot .hm image").count() > 0, path
                page.screenshot(path=str(tmp_path / f"page_{path or 'memory'}.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "page_memory.png").stat().st_size > 10_000
