"""Starting the viewer: the Streamlit command ``chunkstar-profile view`` runs, and the viewer from an installed wheel.

The wheel test builds a wheel from a copy of the sources, installs it into a
fresh virtual environment (its dependencies seen from this one), checks that
``chunkstar_dashboard`` is imported from that environment and not from the
checkout, and serves a real profile with the environment's own
``chunkstar-profile view``, fetched over HTTP (and, with chromium, rendered).
"""

from __future__ import annotations

import os
import shutil
import site
import socket
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from chunkstar_dashboard import APP, launch, streamlit_command

from .conftest import REPO
from .test_browser import CHROMIUM, CHROMIUM_ARGS, _free_port, _settle, _wait_healthy


def test_the_command_serves_the_packaged_app_with_the_files_after_dashdash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cmd = streamlit_command("run.csprof", compare="~/b.csprof", bench_db=tmp_path / "r.sqlite", port=8600, open_browser=False)
    assert cmd[:5] == [sys.executable, "-m", "streamlit", "run", str(APP)]
    assert APP.name == "app.py" and (APP.parent / "views" / "memory.py").is_file()
    flags = cmd[5 : cmd.index("--")]
    options = dict(zip(flags[::2], flags[1::2]))
    assert options == {
        "--client.toolbarMode": "minimal", "--runner.magicEnabled": "false", "--browser.gatherUsageStats": "false",
        "--server.headless": "true", "--server.address": "127.0.0.1", "--server.port": "8600",
    }  # fmt: skip
    # paths made absolute: the app shows them, and Streamlit may run from elsewhere
    assert cmd[cmd.index("--") + 1 :] == [
        "--profile", str(tmp_path / "run.csprof"), "--compare", str(Path("~/b.csprof").expanduser()),
        "--bench-db", str(tmp_path / "r.sqlite"),
    ]  # fmt: skip
    default = streamlit_command("run.csprof")
    assert "--server.port" not in default and default[default.index("--server.headless") + 1] == "false"
    assert default[default.index("--") + 1 :] == ["--profile", str(tmp_path / "run.csprof")]


def test_the_shipped_config_matches_the_flags() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((APP.parent / ".streamlit" / "config.toml").read_text())
    assert config["client"]["toolbarMode"] == "minimal" and config["runner"]["magicEnabled"] is False
    flags = dict(zip(launch.STREAMLIT_OPTIONS[::2], launch.STREAMLIT_OPTIONS[1::2]))
    assert flags["--client.toolbarMode"] == config["client"]["toolbarMode"]
    # `streamlit run dashboards/app.py` reads the same file, through the link beside that entry
    entry_config = REPO / "dashboards" / ".streamlit" / "config.toml"
    assert entry_config.resolve() == (APP.parent / ".streamlit" / "config.toml").resolve()


def test_check_listen_accepts_what_streamlit_can_bind_and_names_what_it_cannot() -> None:
    for address in ("127.0.0.1", "localhost", "0.0.0.0"):
        launch.check_listen(address, None)  # no --port: Streamlit finds a free one itself
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        taken.listen()
        with pytest.raises(launch.LaunchError, match=f"^port {port} on 127.0.0.1 is in use; pick another with --port$"):
            launch.check_listen("127.0.0.1", port)
    launch.check_listen("127.0.0.1", port)  # and free again once closed: the check holds nothing
    with pytest.raises(launch.LaunchError, match="^--address no-such-host.invalid: not an address of this machine"):
        launch.check_listen("no-such-host.invalid", 8501)


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    assert out.returncode == 0, f"{cmd}\n{out.stdout}\n{out.stderr}"
    return out


def test_an_installed_wheel_serves_the_viewer(profile_path: Path, tmp_path: Path) -> None:
    # the sources a build reads, copied: building in the checkout would leave build/ there for others to trip on
    src = tmp_path / "src"
    shutil.copytree(REPO / "packages", src / "packages", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(dist)], timeout=300)
    (wheel,) = dist.glob("chunkstar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for member in ("app.py", "launch.py", "views/memory.py", "views/benchmarks.py", ".streamlit/config.toml"):
        assert f"chunkstar_dashboard/{member}" in names, member

    # a fresh environment; the dependencies (torch, pandas, streamlit, ...) are seen from this one, whose own
    # site directories are added as plain paths: their .pth files (this checkout's editable install) stay unread
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip())
    (purelib / "_outer_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], env=env, timeout=300)

    where = _run(
        [str(python), "-c", "import chunkstar_dashboard, chunkstar_profiler; print(chunkstar_dashboard.__file__); "
         "print(chunkstar_profiler.__file__); print(chunkstar_dashboard.APP)"],
        env=env, cwd=tmp_path,
    ).stdout.split()  # fmt: skip
    for path in where:
        assert Path(path).is_relative_to(purelib), (path, purelib)
        assert not Path(path).is_relative_to(REPO), path

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    view = [str(venv / "bin" / "chunkstar-profile"), "view", str(profile_path), "--port", str(port), "--no-browser"]
    with open(tmp_path / "view.log", "wb") as log:
        server = subprocess.Popen(view, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_healthy(url, server)
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=10) as r:
                assert r.status == 200 and r.read().decode().strip() == "ok"
            with urllib.request.urlopen(f"{url}/", timeout=10) as r:
                page = r.read().decode()
                assert r.status == 200 and 'id="root"' in page
            if CHROMIUM.exists():  # the page renders: the packaged scripts ran, from the wheel's files
                from playwright.sync_api import sync_playwright

                with sync_playwright() as p:
                    browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
                    try:
                        tab = browser.new_page(viewport={"width": 1400, "height": 1000})
                        tab.goto(url, wait_until="domcontentloaded")
                        _settle(tab, 1)
                        assert tab.locator("h1").first.inner_text() == "Memory timeline"
                        assert tab.locator('[data-testid="stException"]').count() == 0
                        assert profile_path.name in tab.locator('[data-testid="stSidebar"]').inner_text()
                    finally:
                        browser.close()
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
    assert "Traceback" not in (tmp_path / "view.log").read_text()
