"""``chunkstar-profile view``: every input it cannot serve fails in one sentence, before any server starts.

Each command runs in its own process: on success ``view`` becomes Streamlit
(``exec``), so a check that wrongly passed would start a server, which the
timeout turns into a failure here rather than a hijacked test process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.profiler._hostile import small_profile

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packages" / "dashboard"
"""``chunkstar_dashboard``'s source root, for a checkout installed before that package existed."""


def _view(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom chunkstar_profiler.cli import main\nsys.exit(main(['view', *sys.argv[1:]]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(DASHBOARD), os.environ.get("PYTHONPATH", "")]))}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.fixture(scope="module")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_profile(tmp_path_factory.mktemp("view") / "small.csprof")


def test_a_missing_profile(tmp_path: Path) -> None:
    out = _view(str(tmp_path / "nothing.csprof"))
    assert out.returncode == 2
    assert out.stderr.strip() == f"chunkstar-profile view: {tmp_path / 'nothing.csprof'}: no such file"


def test_a_file_that_is_not_a_profile(tmp_path: Path) -> None:
    bad = tmp_path / "notes.csprof"
    bad.write_text("not a profile\n")
    out = _view(str(bad))
    assert out.returncode == 2 and "not a chunkstar profile" in out.stderr and str(bad) in out.stderr
    assert "Traceback" not in out.stderr


def test_a_missing_second_profile_or_results_database(profile: Path, tmp_path: Path) -> None:
    out = _view(str(profile), "--compare", str(tmp_path / "b.csprof"))
    assert out.returncode == 2 and f"{tmp_path / 'b.csprof'}: no such file" in out.stderr
    out = _view(str(profile), "--bench-db", str(tmp_path / "results.sqlite"))
    assert out.returncode == 2
    assert f"{tmp_path / 'results.sqlite'}: no readable file there" in out.stderr


def test_without_streamlit_it_names_the_extra(profile: Path) -> None:
    # sys.modules[name] = None is how Python spells "not installed" to importlib.util.find_spec and import
    out = _view(str(profile), prelude="import sys; sys.modules['streamlit'] = None")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "chunkstar-profile view: the dashboard needs streamlit, which is not installed: pip install 'chunkstar[dashboard]'"
    )


def test_a_port_out_of_range(profile: Path) -> None:
    out = _view(str(profile), "--port", "70000")
    assert out.returncode == 2 and "--port 70000: a port is 1..65535" in out.stderr


def test_an_address_that_does_not_resolve(profile: Path) -> None:
    out = _view(str(profile), "--address", "no-such-host.invalid", "--no-browser")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("chunkstar-profile view: --address no-such-host.invalid: not an address of this machine")
    assert len(out.stderr.splitlines()) == 1


def test_an_address_of_another_machine(profile: Path) -> None:
    out = _view(str(profile), "--address", "192.0.2.1", "--no-browser")  # TEST-NET-1: never this machine's
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("chunkstar-profile view: --address 192.0.2.1: not an address of this machine")


def test_a_port_in_use(profile: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _view(str(profile), "--port", str(port), "--no-browser")
    assert out.returncode == 2, out.stderr  # docs/profiling.md's status for a bad port; Streamlit itself would exit 1
    assert out.stderr.strip() == f"chunkstar-profile view: port {port} on 127.0.0.1 is in use; pick another with --port"


def test_a_file_that_is_not_a_profile_is_never_quoted(tmp_path: Path) -> None:
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:$6$secret:19000:0:99999:7:::\n")
    out = _view(str(secret))
    assert out.returncode == 2
    assert out.stderr.strip() == f"chunkstar-profile view: {secret}: not a chunkstar profile"
