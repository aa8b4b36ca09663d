"""The systems under test, one module each, and :data:`RUNNERS`: canonical name -> its training loop.

Each module turns a :class:`~chunkstar_bench.harness.Context` into a per-rank
record (``run(ctx) -> dict``) with the harness's timing; a module covers its
variants (``chunkstar`` and ``chunkstar-disk``, ``deepspeed`` and
``deepspeed-nvme``). The names are those of
:data:`chunkstar_bench.published.RUN_SYSTEMS`. Module level: standard library
only; each loop imports torch, chunkstar or deepspeed when it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunkstar_bench.harness import Context
from chunkstar_bench.systems import chunkstar, deepspeed, fsdp2, pytorch

__all__ = ["RUNNERS"]

RUNNERS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "chunkstar": chunkstar.run,
    "chunkstar-disk": chunkstar.run,
    "deepspeed": deepspeed.run,
    "deepspeed-nvme": deepspeed.run_nvme,
    "fsdp2": fsdp2.run,
    "pytorch": pytorch.run,
}
"""Every runnable system (``published.RUN_SYSTEMS``) -> the function that trains one rank of a run."""
