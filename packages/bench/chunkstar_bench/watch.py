"""Run a child process under watch: a time limit, a host-memory cap, its output read line by line.

Mechanism shared by the benchmark runner (``runner.run``) and the GPU check
script (``benchmarks/gpu_check.py``). The child gets a session of its own, so a
kill reaches whatever it started; stderr is folded into stdout and read by a
thread (one pipe cannot deadlock); the resident memory of its whole process
group is sampled while it runs.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

__all__ = ["Watched", "group_rss_bytes", "watch"]

_POLL_S = 0.05


@dataclasses.dataclass
class Watched:
    returncode: int
    killed_for: str | None
    """Why the child was killed ("timeout", or the memory cap it passed); None if it ended by itself."""
    timed_out: bool
    sampled_peak_rss_bytes: int
    wall_s: float


def group_rss_bytes(pgid: int) -> int:
    """Resident bytes of every live process in process group ``pgid`` (Linux ``/proc``)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
            total += int(Path(entry.path, "statm").read_text().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return total


def watch(
    command: Sequence[str],
    env: Mapping[str, str],
    on_line: Callable[[str], None],
    timeout_s: float,
    cap_bytes: int | None = None,
) -> Watched:
    """Run ``command``; every output line (without its newline) goes to ``on_line``, on a
    reader thread. The child is killed (its whole group) when it runs past ``timeout_s``
    or its group's resident memory passes ``cap_bytes``, or when the caller is interrupted."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env=dict(env), start_new_session=True,
    )  # fmt: skip

    def reader() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            on_line(raw.rstrip("\n"))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    killed_for: str | None = None
    timed_out = False
    sampled_peak = 0
    try:
        while proc.poll() is None:
            rss = group_rss_bytes(proc.pid)
            sampled_peak = max(sampled_peak, rss)
            if cap_bytes is not None and rss > cap_bytes:
                killed_for = f"host memory {rss / 2**30:.2f} GiB passed the cap of {cap_bytes / 2**30:.2f} GiB"
            elif time.monotonic() - start > timeout_s:
                killed_for, timed_out = "timeout", True
            if killed_for is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None and killed_for is None:  # interrupted: leave nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
        returncode = proc.wait()
        thread.join(timeout=10)
    return Watched(returncode, killed_for, timed_out, sampled_peak, time.monotonic() - start)
