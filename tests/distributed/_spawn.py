"""Start a function on two gloo ranks (spawned processes) and collect what each wrote."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(fn: Callable[..., None], out: Path, *args: Any, timeout: float = 180) -> list[dict[str, Any]]:
    """``fn(rank, WORLD, port, str(out), *args)`` on every rank; each writes ``out/rank{r}.json``.
    A rank still running at the deadline fails the test (a hang is the bug)."""
    ctx = mp.start_processes(fn, args=(WORLD, free_port(), str(out), *args), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.time() + timeout
    for p in ctx.processes:
        p.join(max(1.0, deadline - time.time()))
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            pytest.fail("a rank hung past the test's timeout")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD) if (out / f"rank{r}.json").exists()]
