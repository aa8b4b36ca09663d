"""One benchmark run, inside its own process: ``python -m chunkstar_bench.child --spec JSON``.

This is what runs *in* the subprocess that :func:`chunkstar_bench.runner.run`
starts (under ``torchrun`` when the run has several processes, one per GPU).
It hands the spec to its system's loop (:data:`chunkstar_bench.systems.RUNNERS`,
timed by :mod:`chunkstar_bench.harness`), turns whatever happens into one
per-rank record (a failure becomes status ``oom`` or ``error`` with its first
line, never a crash), and writes it where the runner reads it. It decides
nothing about suites, databases or host-memory caps (the parent watches memory
from outside).

Note [peak memory]: what the record's peaks measure.
    Host: ``ru_maxrss`` of this rank. Device: on CUDA
    ``torch.cuda.max_memory_allocated``; on chunkstar's CPU *virtual* device the
    peak chunk bytes plus the warm-up non-model peak (both from
    ``engine.stats()``); none for the other systems on CPU (they have no device
    tier there). The record's ``peak_device_kind`` says which.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import traceback
from typing import Any

from chunkstar_bench.harness import Context
from chunkstar_bench.runner import RESULT_DIR_ENV, RESULT_PREFIX, RunSpec
from chunkstar_bench.systems import RUNNERS
from chunkstar_bench.zoo import n_params

__all__ = ["main", "run_in_this_process"]

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "bad_alloc")


def _is_oom(exc: BaseException) -> bool:
    """True for every way the systems report running out of memory (device, budget or host)."""
    if isinstance(exc, MemoryError):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"OutOfMemoryError", "DeviceMemoryError"}:
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _OOM_MARKERS)


def _device_memory_error(exc: BaseException) -> dict[str, Any] | None:
    """A chunkstar ``DeviceMemoryError``'s figures (its message is cut at 500 characters in the
    record, before the smallest budget it names); None for any other exception."""
    if "DeviceMemoryError" not in {cls.__name__ for cls in type(exc).__mro__}:
        return None
    return {
        "minimum_budget_bytes": getattr(exc, "minimum", None),
        "needed_bytes": getattr(exc, "needed", None),
        "free_bytes": getattr(exc, "free", None),
        "budget_bytes": getattr(exc, "budget", None),
        "where": str(getattr(exc, "where", ""))[:300],
    }


def run_in_this_process(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` here; the per-rank result dict (never raises for a failing system)."""
    ctx = Context(spec)
    result: dict[str, Any] = {"rank": ctx.rank, "world": ctx.world, "n_params": n_params(ctx.model)}
    try:
        import torch

        if ctx.device == "cpu":
            # Share the cores among the ranks; torchrun would otherwise pin each to 1 thread.
            torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // ctx.world))
        result.update(RUNNERS[spec.system](ctx))
        result["torch_threads"] = torch.get_num_threads()  # after the run: a system may change it
        result["step_time_s"] = statistics.median(result["step_times_s"])
        result["status"] = "ok"
        result["message"] = ""
    except BaseException as exc:  # noqa: BLE001  (reported in the record, see module docstring)
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc(file=sys.stderr)
        result["status"] = "oom" if _is_oom(exc) else "error"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result["message"] = f"{type(exc).__name__}: {first}"[:500]
        figures = _device_memory_error(exc)
        if figures is not None:
            result["device_memory_error"] = figures
    result["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one chunkstar-bench run in this process (per rank).")
    parser.add_argument("--spec", required=True, help="the RunSpec as JSON")
    args = parser.parse_args(argv)
    # Offline by construction: models come from configs, never from the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    spec = RunSpec.from_json(args.spec)
    result = run_in_this_process(spec)
    line = json.dumps(result, default=str)
    out_dir = os.environ.get(RESULT_DIR_ENV)
    if out_dir:
        # a file per rank: under torchrun the ranks share one stdout pipe, and a long
        # line from one rank can be cut by another's writes
        rank = result.get("rank", 0)
        tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line)
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    else:
        print(RESULT_PREFIX + line, flush=True)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (teardown of a failed run must not hide its record)
        pass
    # A failed rank exits non-zero so torchrun tears down the other ranks instead of
    # leaving them blocked in a collective.
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
