"""Bookkeeping per training step as models grow: chunkstar's step minus plain PyTorch's.

What it measures
    A model of ``modules`` ``Linear(width, width)`` layers in an
    ``nn.Sequential`` (every layer is a hooked module: 2 moments per step, 2
    parameters), cut into about ``chunks`` chunks (the chunk size is searched so
    the layout has that many). The same model (same seed) trains in plain
    PyTorch (fp32, fused AdamW) and in a chunkstar engine (fp32, AdamW) in the
    same process; their steps alternate, and each side's median is taken.

    * ``fwd+bwd ms``: forward + ``backward`` of the loss (the hooks' share);
    * ``optim ms``: ``optimizer.step()`` + ``zero_grad()``;
    * ``bookkeeping ms`` = engine step - plain step (medians), and per moment
      (``bookkeeping / (2 * modules)``);
    * ``% of plain``: bookkeeping / plain step.

    Cases are ``MODULESxCHUNKS[:WIDTH[:BATCH]]`` (width 4, batch 2 by default:
    tiny layers, so the plain step is mostly Python and ``% of plain`` is the
    worst case). Defaults: 100 and 10,000 tiny modules at 16 chunks, 10,000 at
    256 and 1,024 chunks (growth is read across these three rows: same modules,
    same moments), and 1,024 modules of ``Linear(256, 256)`` at batch 256 in
    1,024 chunks (a model of that many chunks whose layers do some work), all
    with a budget that holds everything (nothing moves while timing: checked);
    plus one run under pressure (``--pressure-case``): a budget of the measured
    non-model peak plus half the param chunk bytes, so chunks are evicted and
    fetched every step.

Note [collections]: with 10,000 modules the process tracks over a million
Python objects, and a full garbage collection (about 0.4 s here) lands on
whichever step crosses the collector's threshold, plain or engine alike, so
each timed step starts right after an untimed ``gc.collect()``. The young
collections that the engine's own allocations (hooks, closures) cause inside a
step still count.

This is a script, not a timed test (about 3 minutes on 2 cores)::

    python benchmarks/bookkeeping_scale.py
    python benchmarks/bookkeeping_scale.py --cases 100x16,10000x1024 --pressure-case "" --rounds 3 --json out.json

The machine is shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

import chunkstar
from chunkstar.chunk.layout import build_layout
from chunkstar.chunk.lists import ChunkList

WIDTH = 4
BATCH = 2
SEED = 0
DEFAULT_CASES = "100x16,10000x16,10000x256,10000x1024,1024x1024:256:256"
DEFAULT_PRESSURE = "10000x1024"


@dataclass(frozen=True)
class Case:
    modules: int
    chunks: int
    width: int = WIDTH
    batch: int = BATCH
    pressure: bool = False


@dataclass
class Row:
    case: Case
    n_chunks: int
    chunk_size: int
    budget_bytes: int
    plain_ms: float
    engine_ms: float
    plain_fwd_bwd_ms: float
    engine_fwd_bwd_ms: float
    plain_optim_ms: float
    engine_optim_ms: float
    moves_per_step: float

    @property
    def bookkeeping_ms(self) -> float:
        return self.engine_ms - self.plain_ms

    @property
    def per_moment_us(self) -> float:
        return self.bookkeeping_ms * 1e3 / (2 * self.case.modules)


def _model(modules: int, width: int) -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(modules)])


def _chunk_size_for(modules: int, chunks: int, width: int) -> int:
    """The smallest chunk size whose in-order layout has at most ``chunks`` chunks."""
    shapes = [(width, width), (width,)] * modules
    names = [f"{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(len(shapes))]
    lo, hi = 1, modules * (width * width + width)
    while lo < hi:
        mid = (lo + hi) // 2
        if build_layout(names, shapes, mid).n_chunks <= chunks:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _train(engine: Any, optimizer: Any, x: torch.Tensor, steps: int) -> None:
    for _ in range(steps):
        engine.backward(engine(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def run_case(case: Case, *, rounds: int, warmup: int) -> Row:
    m, w = case.modules, case.width
    chunk_size = _chunk_size_for(m, case.chunks, w)
    x = torch.randn(case.batch, w, generator=torch.Generator().manual_seed(1))
    config: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "device": "cpu",
        "device_memory_budget": "4GB",
        "default_chunk_size": chunk_size,
    }
    if case.pressure:
        # measure the non-model peak without pressure, then leave the chunks half the param bytes
        probe, popt = chunkstar.initialize_engine(model_func=lambda: _model(m, w), config=config)
        _train(probe, popt, x, 3)
        param_bytes = sum(c.nbytes for c in probe.mgr.chunks.chunks_of(ChunkList.PARAM))
        config["device_memory_budget"] = int(probe.stats()["warmup_non_model_peak_bytes"] + param_bytes // 2)
        probe.remove_hooks()
        del probe, popt
    engine, optimizer = chunkstar.initialize_engine(model_func=lambda: _model(m, w), config=config)
    plain = _model(m, w)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)

    def plain_fb() -> None:
        plain(x).square().mean().backward()

    def plain_os() -> None:
        plain_opt.step()
        plain_opt.zero_grad()

    def engine_fb() -> None:
        engine.backward(engine(x).square().mean())

    def engine_os() -> None:
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(warmup):  # past the engine's warm-up: the schedule is frozen
        engine_fb()
        engine_os()
        plain_fb()
        plain_os()
    moves0 = engine.stats()["chunk_moves_to_device"]
    t: dict[str, list[float]] = {k: [] for k in ("pfb", "pos", "efb", "eos", "p", "e")}
    for _ in range(rounds):
        gc.collect()  # Note [collections]
        a, b = _time(plain_fb), _time(plain_os)
        t["pfb"].append(a), t["pos"].append(b), t["p"].append(a + b)
        gc.collect()
        a, b = _time(engine_fb), _time(engine_os)
        t["efb"].append(a), t["eos"].append(b), t["e"].append(a + b)
    stats = engine.stats()
    moves = (stats["chunk_moves_to_device"] - moves0) / rounds
    if not case.pressure:
        assert moves == 0, "chunks moved without pressure: the figures would time transfers, not bookkeeping"
    med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
    engine.remove_hooks()
    return Row(
        case, stats["n_chunks"], chunk_size, stats["device_budget_bytes"], med["p"], med["e"],
        med["pfb"], med["efb"], med["pos"], med["eos"], moves,
    )  # fmt: skip


def _cases(spec: str, pressure: bool) -> list[Case]:
    out = []
    for part in filter(None, spec.split(",")):
        size, *rest = part.lower().split(":")
        m, c = size.split("x")
        width = int(rest[0]) if rest else WIDTH
        batch = int(rest[1]) if len(rest) > 1 else BATCH
        out.append(Case(int(m), int(c), width, batch, pressure))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="MODULESxCHUNKS[:WIDTH[:BATCH]],... without pressure (default %(default)s)")
    ap.add_argument("--pressure-case", default=DEFAULT_PRESSURE, help="cases under pressure, '' for none (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="timed steps per side (medians)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (the engine traces 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: less noise on a shared machine)")
    ap.add_argument("--json", help="also write the rows, config and versions here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    cases = _cases(args.cases, False) + _cases(args.pressure_case, True)
    rows: list[Row] = []
    print(
        f"{'modules':>7} {'width':>5} {'batch':>5} {'chunks':>6} {'pressure':>8} {'plain ms':>9} {'engine ms':>9} "
        f"{'bookkeep ms':>11} {'us/moment':>9} {'% of plain':>10} {'fwd+bwd p/e ms':>15} {'optim p/e ms':>13} {'moves/step':>10}",
        flush=True,
    )
    for case in cases:
        r = run_case(case, rounds=args.rounds, warmup=args.warmup)
        rows.append(r)
        print(
            f"{case.modules:>7} {case.width:>5} {case.batch:>5} {r.n_chunks:>6} {'yes' if case.pressure else 'no':>8} "
            f"{r.plain_ms:>9.1f} {r.engine_ms:>9.1f} {r.bookkeeping_ms:>11.1f} {r.per_moment_us:>9.1f} "
            f"{100 * r.bookkeeping_ms / r.plain_ms:>9.0f}% {r.plain_fwd_bwd_ms:>7.1f}/{r.engine_fwd_bwd_ms:<7.1f} "
            f"{r.plain_optim_ms:>6.1f}/{r.engine_optim_ms:<6.1f} {r.moves_per_step:>10.0f}",
            flush=True,
        )
    series: dict[tuple[int, int, int], list[Row]] = {}
    for r in rows:
        if not r.case.pressure:
            series.setdefault((r.case.modules, r.case.width, r.case.batch), []).append(r)
    for (m, w, _), rs in sorted(series.items()):
        if len(rs) > 1:
            lo, hi = min(rs, key=lambda r: r.n_chunks), max(rs, key=lambda r: r.n_chunks)
            grow = hi.bookkeeping_ms - lo.bookkeeping_ms
            print(
                f"{m} modules of width {w}: bookkeeping {lo.n_chunks} -> {hi.n_chunks} chunks changes by "
                f"{grow:+.1f} ms/step ({100 * grow / hi.plain_ms:+.1f}% of the plain step at {hi.n_chunks} chunks)"
            )
    if args.json:
        out = {
            "benchmark": "bookkeeping_scale",
            "config": {"rounds": args.rounds, "warmup": args.warmup, "threads": args.threads, "precision": "fp32"},
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "chunkstar": chunkstar.__version__},
            "machine": {"platform": platform.platform(), "processor": platform.processor()},
            "rows": [dict(asdict(r), bookkeeping_ms=r.bookkeeping_ms, per_moment_us=r.per_moment_us) for r in rows],
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
