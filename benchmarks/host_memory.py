"""Host memory (RSS) of plain PyTorch and chunkstar, phase by phase, side by side.

What it measures
    The training step of ``chunkstar-bench step-time`` (its zoo model
    ``gpt2-51m``, the same seed, batches and AdamW settings from
    :mod:`chunkstar_bench.harness`; chunkstar on the CPU virtual device with a
    budget far above the model data, so nothing is evicted), cut into phases:
    imports, model build, set-up (engine or optimizer), then each step's
    forward, backward and optimizer step
    (``optimizer.step()`` and ``zero_grad``; PyTorch's includes its clipping).
    For every phase it records the RSS at its end and the *peak* RSS within it:
    the kernel's high-water mark (``VmHWM``) is reset at the start of each phase
    by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0), so a peak
    belongs to the phase that reached it. Where that file cannot be written the
    peaks are cumulative (``ru_maxrss``) and the report says so. ``malloc free``
    is what glibc holds free in its heaps at the end of the phase
    (``mallinfo2().fordblks``): memory freed by torch but not returned to the
    system.

    Every system runs in its own child process, like ``chunkstar-bench
    step-time``. Python's tracemalloc cannot see torch's allocations, hence RSS.

    With ``--live`` each child runs one more step (left out of the RSS table)
    under :class:`chunkstar.memory.probes.LiveTensorTracker` and reports the
    *live tensor bytes* per phase: the model state at the step's start
    (PyTorch: parameters, gradients, AdamW state; chunkstar: its chunks) plus the
    peak of the tensors the phase's ops allocated. RSS minus that is what the
    allocator keeps beside the live data.

How to read it
    ``peak`` columns compare what each system needs at the worst moment of a
    phase, ``end`` what it keeps. The last row is the peak RSS of the whole run,
    the figure ``chunkstar-bench step-time`` prints. chunkstar's first two
    steps are its warm-up (the memory tracer's dispatch mode runs); the later
    ones are the steady state.

    python benchmarks/host_memory.py                 # pytorch and chunkstar, 4 steps
    python benchmarks/host_memory.py --steps 6 --live --json runs/host_memory.json
    python benchmarks/host_memory.py --precision fp32   # a CPU without fast bf16 (this project's CI machine)
    python benchmarks/host_memory.py --model cpu-355m   # a heavier model
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkstar_bench.harness import ADAMW, Context
from chunkstar_bench.runner import RunSpec
from chunkstar_bench.systems.chunkstar import chunkstar_budget_bytes, engine_config

SYSTEMS = ("pytorch", "chunkstar")
MODEL = "gpt2-51m"
"""The zoo model: the one ``chunkstar-bench step-time`` times by default."""
_RESULT_PREFIX = "HOST_MEMORY_RESULT "
_MIB = 2**20


# --------------------------------------------------------------------------- measuring (child side)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


class PhaseMeter:
    """RSS at the end of each phase and its peak within it (``VmHWM`` reset per phase)."""

    def __init__(self) -> None:
        self.phases: list[dict[str, Any]] = []
        try:
            self._reset_hwm()
            self.per_phase_peaks = True
        except OSError:
            self.per_phase_peaks = False
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        self._mallinfo2 = getattr(libc, "mallinfo2", None)
        if self._mallinfo2 is not None:
            self._mallinfo2.restype = _Mallinfo2

    @staticmethod
    def _reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _malloc_free_mib(self) -> float | None:
        return None if self._mallinfo2 is None else self._mallinfo2().fordblks / 1024.0 / 1024.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.per_phase_peaks:
            self._reset_hwm()
        start = _status_kib("VmRSS")
        t0 = time.perf_counter()
        yield
        seconds = time.perf_counter() - t0
        end = _status_kib("VmRSS")
        self.phases.append(
            {
                "phase": name,
                "rss_start_mib": start / 1024.0,
                "rss_end_mib": end / 1024.0,
                "peak_mib": _status_kib("VmHWM") / 1024.0,
                "malloc_free_mib": self._malloc_free_mib(),
                "seconds": seconds,
            }
        )


def _state_bytes(tensors: list[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _child(spec: RunSpec, live: bool, precision: str = "bf16") -> dict[str, Any]:
    system = spec.system
    ctx = Context(spec)
    meter = PhaseMeter()
    with meter.phase("imports"):
        import torch
        import transformers  # noqa: F401  (imported here so its RSS lands in this phase)

        if system == "chunkstar":
            import chunkstar
        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
    with meter.phase("build model"):
        model = ctx.build()
    fwd: Callable[[Any], Any]
    bwd: Callable[[Any], None]
    opt: Callable[[], None]
    with meter.phase("set-up"):
        if system == "pytorch":
            model.train()
            params = list(model.parameters())
            optimizer = torch.optim.AdamW(params, **ADAMW, fused=True)

            def fwd(ids: Any) -> Any:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    return model(input_ids=ids, labels=ids).loss

            def bwd(loss: Any) -> None:
                loss.backward()

            def opt() -> None:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            def model_state_bytes() -> int:
                states = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
                return _state_bytes(params + [p.grad for p in params if p.grad is not None] + states)

        else:
            budget = chunkstar_budget_bytes(ctx.model, spec.batch, ctx.seq, spec.chunkstar_budget)
            engine, optimizer = chunkstar.initialize_engine(
                model_func=lambda: model, local_rank=0, config=engine_config(ctx, budget)
            )

            def fwd(ids: Any) -> Any:
                return engine(input_ids=ids, labels=ids).loss

            def bwd(loss: Any) -> None:
                engine.backward(loss)

            def opt() -> None:
                optimizer.step()
                optimizer.zero_grad()

            def model_state_bytes() -> int:
                return int(engine.stats()["model_data_bytes"])  # every chunk payload, on either tier

    losses: list[float] = []
    ids_list = list(ctx.batches())
    for i, ids in enumerate(ids_list, start=1):
        with meter.phase(f"step {i} forward"):
            loss = fwd(ids)
        with meter.phase(f"step {i} backward"):
            bwd(loss)
        with meter.phase(f"step {i} optimizer"):
            opt()
        losses.append(float(loss.item()))
        del loss
    result: dict[str, Any] = {
        "system": system,
        "phases": meter.phases,
        "per_phase_peaks": meter.per_phase_peaks,
        "losses": losses,
        "peak_rss_mib": max(p["peak_mib"] for p in meter.phases),
        "torch_threads": torch.get_num_threads(),
    }
    if live:
        from chunkstar.memory.probes import LiveTensorTracker

        state = model_state_bytes()
        tracker = LiveTensorTracker()
        live_phases: dict[str, float] = {"model state": state / _MIB}
        with tracker:
            for name, run in (("forward", lambda: fwd(ids_list[-1])), ("backward", lambda: bwd(loss)), ("optimizer", opt)):
                out = run()
                if name == "forward":
                    loss = out
                live_phases[name] = (state + tracker.peak_bytes) / _MIB
                tracker.peak_bytes = tracker.live_bytes
        result["live_mib"] = live_phases
    return result


# --------------------------------------------------------------------------- orchestration (parent side)


def _run_child(spec: RunSpec, live: bool, precision: str = "bf16") -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--spec", spec.to_json(), "--precision", precision]
    if live:
        command.append("--live")
    proc = subprocess.run(command, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_PREFIX):
            return json.loads(line[len(_RESULT_PREFIX) :])
    sys.stderr.write(proc.stderr[-4000:])
    return {"system": spec.system, "error": f"child exited with status {proc.returncode}, no result"}


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    return "\n".join(lines)


def _report(results: dict[str, dict[str, Any]]) -> str:
    ok = {s: r for s, r in results.items() if "phases" in r}
    names = [p["phase"] for p in next(iter(ok.values()))["phases"]] if ok else []
    headers = ["phase"]
    for s in ok:
        headers += [f"{s} peak", f"{s} end", f"{s} malloc free"]
    if len(ok) == 2:
        headers.append("peak diff")
    rows: list[list[str]] = []

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    for k, name in enumerate(names):
        row = [name]
        peaks = []
        for r in ok.values():
            p = r["phases"][k]
            row += [fmt(p["peak_mib"]), fmt(p["rss_end_mib"]), fmt(p["malloc_free_mib"])]
            peaks.append(p["peak_mib"])
        if len(peaks) == 2:
            row.append(f"{peaks[1] - peaks[0]:+.0f}")
        rows.append(row)
    row = ["peak RSS of the run"]
    peaks = []
    for r in ok.values():
        row += [fmt(r["peak_rss_mib"]), "", ""]
        peaks.append(r["peak_rss_mib"])
    if len(peaks) == 2:
        row.append(f"{peaks[1] - peaks[0]:+.0f}")
    rows.append(row)
    out = ["host memory per phase, MiB (peak: high-water mark within the phase; end: RSS when it ended)", _table(headers, rows)]
    live = {s: r["live_mib"] for s, r in ok.items() if "live_mib" in r}
    if live:
        out.append("")
        out.append("live tensor bytes in one more step, MiB (model state at its start + peak of what each phase allocated)")
        kinds = list(next(iter(live.values())))
        rows = [[k, *(f"{v[k]:.0f}" for v in live.values())] for k in kinds]
        out.append(_table(["", *live], rows))
    for s, r in results.items():
        if "error" in r:
            out.append(f"{s}: {r['error']}")
        elif not r["per_phase_peaks"]:
            out.append(f"{s}: /proc/self/clear_refs not writable: peaks are cumulative (ru_maxrss)")
        else:
            out.append(f"{s}: losses {', '.join(f'{x:.4f}' for x in r['losses'])}; torch threads {r['torch_threads']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--model", default=MODEL, help="a zoo model (default %(default)s, the step-time suite's)")
    parser.add_argument("--steps", type=int, default=4, help="training steps (chunkstar's first two are its warm-up)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads in every child (default: torch's own choice)")
    parser.add_argument("--free-budget-gib", type=float, default=16.0, help="chunkstar's device budget")
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), default="bf16",
        help="bf16: PyTorch under bf16 autocast, chunkstar with bf16 chunks (fp32 masters); fp32: both in fp32, "
        "for a CPU without fast bf16 matrix products",
    )  # fmt: skip
    parser.add_argument("--live", action="store_true", help="one more step measuring live tensor bytes (see the docstring)")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the results here as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = _child(RunSpec.from_json(args.spec), args.live, args.precision)
        print(_RESULT_PREFIX + json.dumps(result), flush=True)
        return 0
    systems = [s for s in SYSTEMS if s in {x.strip() for x in args.systems.split(",")}]
    if not systems:
        parser.error(f"--systems: choose from {','.join(SYSTEMS)}")
    specs = {
        system: RunSpec(
            system=system, model=args.model, batch=args.batch, seq_len=args.seq, steps=args.steps, warmup=0,
            seed=args.seed, threads=args.threads,
            chunkstar_budget=int(args.free_budget_gib * 2**30) if system == "chunkstar" else None,
            chunkstar_precision="fp32" if system == "chunkstar" and args.precision == "fp32" else None,
        )
        for system in systems
    }  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for system, spec in specs.items():
        print(f"running {system} ...", file=sys.stderr, flush=True)
        results[system] = _run_child(spec, args.live, args.precision)
    print(_report(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        specs_json = {s: dataclasses.asdict(spec) for s, spec in specs.items()}
        record = {"benchmark": "host_memory", "specs": specs_json, "results": results}
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
