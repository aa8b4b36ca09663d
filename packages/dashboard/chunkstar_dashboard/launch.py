"""Starting the dashboard: ``streamlit run`` on the packaged ``app.py``, the files after ``--``.

What ``chunkstar-profile view`` calls. Before any server starts it checks what
can be checked here, each failure a :class:`LaunchError` of one sentence: the
packages of the ``dashboard`` extra are installed, each profile loads
(``chunkstar_profiler.load``), the results database is a readable file, the
address and port can be listened on (:func:`check_listen`). This
module is not the app (``app.py`` is); it imports neither Streamlit nor
plotly, it only asks whether they are installed.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

__all__ = [
    "APP", "DEPENDENCIES", "INSTALL_HINT", "LaunchError", "MissingDependency", "check_dependencies", "check_inputs",
    "check_listen", "serve", "streamlit_command",
]  # fmt: skip

APP = Path(__file__).resolve().with_name("app.py")
"""The Streamlit script; its ``.streamlit/config.toml`` (shipped beside it) holds the same settings as
``STREAMLIT_OPTIONS``, which are passed as flags too, for a Streamlit that reads no script-level config."""
DEPENDENCIES = ("streamlit", "plotly", "pandas")
"""What the app imports beyond chunkstar: the ``dashboard`` extra."""
INSTALL_HINT = "pip install 'chunkstar[dashboard]'"
STREAMLIT_OPTIONS = (
    "--client.toolbarMode", "minimal",  # no "Deploy" button: this is a local viewer
    "--runner.magicEnabled", "false",  # a bare string in a page script never shows on the page
    "--browser.gatherUsageStats", "false",
)  # fmt: skip


class LaunchError(RuntimeError):
    """The dashboard cannot start; the message, one sentence, says why and what to do."""


class MissingDependency(LaunchError):
    """A package of the ``dashboard`` extra is not installed; the message says which and how to install it."""


def check_dependencies() -> None:
    """Raise :class:`MissingDependency` naming every missing package of :data:`DEPENDENCIES`."""
    missing = [name for name in DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependency(f"the dashboard needs {', '.join(missing)}, which is not installed: {INSTALL_HINT}")


def check_inputs(
    profile: str | os.PathLike[str] | None,
    compare: str | os.PathLike[str] | None = None,
    bench_db: str | os.PathLike[str] | None = None,
) -> None:
    """Raise :class:`LaunchError` unless each profile given loads and ``bench_db`` (if given) is a readable file.

    The results database is not parsed here (that needs ``chunkstar_bench``); a file that is not one is
    reported on the Benchmarks page.
    """
    import chunkstar_profiler

    for path in (profile, compare):
        if path is not None:
            try:
                chunkstar_profiler.load(path)  # a missing or unreadable profile fails here, not in a browser tab
            except chunkstar_profiler.ProfileFormatError as err:  # ProfileNotFoundError too
                raise LaunchError(str(err)) from None
    if bench_db is not None and not (os.path.isfile(bench_db) and os.access(bench_db, os.R_OK)):
        raise LaunchError(f"{os.fspath(bench_db)}: no readable file there (a chunkstar-bench results database)")


# Note [Checking the address before Streamlit binds it]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Once `view` has exec'd Streamlit, a bad address is its traceback (socket.gaierror) and a
# port in use its exit status 1, while docs/profiling.md promises one line and status 2. So the
# address and port are bound here first, the way Streamlit's own server binds them: an IPv6
# socket when the address has a ":", IPv4 otherwise, SO_REUSEADDR on POSIX, then closed again.
# Without --port, Streamlit looks for a free port from 8501 on, so only the address is checked
# (port 0). Between this check and Streamlit's bind another process could take the port;
# Streamlit then says so itself -- a narrow race, not worth holding the socket across exec for.


def check_listen(address: str, port: int | None) -> None:
    """Raise :class:`LaunchError` unless this machine can listen on ``address`` (and ``port``, when given)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            if os.name != "nt":  # as Streamlit: on Windows it would let a second socket take a port in use
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port or 0))
    except OSError as err:  # socket.gaierror too: a name that does not resolve
        if isinstance(err, socket.gaierror) or err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
            raise LaunchError(
                f"--address {address}: not an address of this machine ({err.strerror or err}); "
                "use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
            ) from None
        if err.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} on {address} is in use; pick another with --port") from None
        if err.errno == errno.EACCES:
            raise LaunchError(
                f"port {port} on {address}: permission denied (ports below 1024 need root); pick another with --port"
            ) from None
        raise LaunchError(f"cannot listen on {address} port {port or 'any'}: {err.strerror or err}") from None


def streamlit_command(
    profile: str | os.PathLike[str] | None,
    *,
    compare: str | os.PathLike[str] | None = None,
    bench_db: str | os.PathLike[str] | None = None,
    port: int | None = None,
    address: str = "127.0.0.1",
    open_browser: bool = True,
) -> list[str]:
    """The ``python -m streamlit run app.py ... -- --profile ...`` command line.

    Paths are made absolute (the app shows them in its path boxes). ``address``
    defaults to this machine only: the app reads any path typed into it.
    ``port`` None: Streamlit's default (8501).
    """
    cmd = [sys.executable, "-m", "streamlit", "run", str(APP), *STREAMLIT_OPTIONS]
    cmd += ["--server.headless", "false" if open_browser else "true", "--server.address", address]
    if port is not None:
        cmd += ["--server.port", str(port)]
    cmd.append("--")
    for flag, path in (("--profile", profile), ("--compare", compare), ("--bench-db", bench_db)):
        if path is not None:
            cmd += [flag, os.path.abspath(os.path.expanduser(os.fspath(path)))]
    return cmd


def serve(
    profile: str | os.PathLike[str] | None,
    *,
    compare: str | os.PathLike[str] | None = None,
    bench_db: str | os.PathLike[str] | None = None,
    port: int | None = None,
    address: str = "127.0.0.1",
    open_browser: bool = True,
) -> int:
    """Check the inputs (:func:`check_dependencies`, :func:`check_inputs`, :func:`check_listen`), then run the
    app until it is stopped (Ctrl-C). On POSIX this process becomes Streamlit (``exec``), so signals reach the server
    directly; elsewhere Streamlit runs as a child and its exit status is returned."""
    check_dependencies()
    check_inputs(profile, compare, bench_db)
    check_listen(address, port)
    cmd = streamlit_command(profile, compare=compare, bench_db=bench_db, port=port, address=address, open_browser=open_browser)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execv(cmd[0], cmd)
    return subprocess.call(cmd)
