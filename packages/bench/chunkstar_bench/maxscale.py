"""Max-scale search: the largest zoo model a system can train on a machine under a memory cap.

Each attempt is one isolated run (:func:`chunkstar_bench.runner.run`) with the
same host-memory cap, batch and steps for every system, so the answer compares
what each system needs per parameter, not luck. A model "trains" when the run
finishes its warm-up and timed steps with status ``ok``; ``oom`` and
``error`` both mean it does not (the record keeps which, and why).

Bisection over the ladder (sorted by parameter count) assumes that if a model
trains, every smaller one does; it needs about log2(len(models)) attempts. The
``ascending`` strategy tries every model from the smallest and stops at the
first failure: slower, but it checks that assumption.

This module searches; it does not choose the cap or print tables.
"""

from __future__ import annotations

import sys
from typing import Literal

from chunkstar_bench.results import ResultsDB
from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.zoo import cpu_ladder, get, n_params

__all__ = ["SUITE", "peaks", "search"]

SUITE = "max-scale"
"""The suite name max-scale attempts are stored under."""


def peaks(record: RunRecord) -> str:
    """``peak RSS 7.20 GiB`` (and ``, disk 12.3 GiB at 1.10 GB/s`` for a run that swapped to disk)."""
    text = f"peak RSS {record.peak_host_bytes / 2**30:.2f} GiB" if record.peak_host_bytes else "peak RSS ?"
    # the swap folder's blocks when the run ended, or what chunkstar's disk tier reported (its
    # files go when the engine does, before the runner looks)
    found = [v for v in (record.details.get("disk_bytes"), record.details.get("disk_file_bytes")) if isinstance(v, int)]
    disk = max(found) if found else None
    rate = record.details.get("disk_bytes_per_s")
    text += f", disk {disk / 2**30:.2f} GiB" if disk is not None else ""
    return text + (f" at {rate / 1e9:.2f} GB/s" if isinstance(rate, (int, float)) else "")


def search(
    system: str,
    models: list[str] | None,
    host_mem_cap_bytes: int,
    *,
    db: ResultsDB | None = None,
    strategy: Literal["bisect", "ascending"] = "bisect",
    batch: int = 2,
    seq_len: int | None = 128,
    steps: int = 1,
    warmup: int = 2,
    device: Literal["cpu", "cuda"] = "cpu",
    hardware: str = "cpu",
    chunkstar_budget: str | int | None = None,
    disk_dir: str | None = None,
    nvme_params: bool = False,
    chunkstar_staging: str | int | None = None,
    timeout_s: float = 1800.0,
    echo: bool = True,
) -> tuple[str | None, list[RunRecord]]:
    """The largest of ``models`` (default: the CPU ladder) that ``system`` trains under the cap.

    Returns ``(name or None, every attempt's record in the order run)``; each
    attempt is appended to ``db`` (suite ``max-scale``) as soon as it ends.
    ``disk_dir``, ``nvme_params`` and ``chunkstar_staging`` go to every attempt's :class:`RunSpec`.
    """
    ladder = sorted(models if models is not None else cpu_ladder(), key=lambda m: n_params(get(m)))
    if not ladder:
        raise ValueError("no models to search")
    records: list[RunRecord] = []
    verdict: dict[int, bool] = {}

    def attempt(i: int) -> bool:
        spec = RunSpec(
            system=system, model=ladder[i], batch=batch, seq_len=seq_len, steps=steps, warmup=warmup,
            device=device, host_mem_cap_bytes=host_mem_cap_bytes, chunkstar_budget=chunkstar_budget,
            hardware=hardware, disk_dir=disk_dir, nvme_params=nvme_params, chunkstar_staging=chunkstar_staging,
        )
        if echo:
            print(
                f"max-scale {system}: trying {ladder[i]} ({n_params(get(ladder[i])) / 1e6:,.0f}M params) "
                f"under {host_mem_cap_bytes / 2**30:.2f} GiB ...", file=sys.stderr, flush=True,
            )
        record = run(spec, timeout_s, echo=echo)
        records.append(record)
        if db is not None:
            db.append(record, suite=SUITE)
        if echo:
            print(f"max-scale {system}: {ladder[i]} -> {record.status} ({peaks(record)}) {record.message}",
                  file=sys.stderr, flush=True)
        verdict[i] = record.status == "ok"
        return verdict[i]

    if strategy == "ascending":
        best: int | None = None
        for i in range(len(ladder)):
            if not attempt(i):
                break
            best = i
        return (None if best is None else ladder[best]), records
    if strategy != "bisect":
        raise ValueError(f"strategy must be 'bisect' or 'ascending', got {strategy!r}")
    lo, hi = -1, len(ladder)  # ladder[lo] trains (or lo = -1), ladder[hi] does not (or hi = len)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return (ladder[lo] if lo >= 0 else None), records
