"""Named benchmark suites: lists of runs, by name (``chunkstar-bench run --suite NAME``).

* ``paper-v100`` / ``paper-a100`` -- the PatrickStar paper's matrix for GPU
  machines: every paper model the published figure shows for that node x 1, 2,
  4, 8 GPUs x chunkstar and DeepSpeed (ZeRO-3, params + optimizer offloaded to
  CPU), 8 sequences of 1024 tokens per GPU. Batch: PatrickStar's benchmark
  scripts (``examples/benchmark/run_a100_benchmark_*.sh``) sweep 4, 8 and 16
  per GPU and the figures show the best; the best is not recorded per point,
  so the suite fixes the middle value, 8, for every run. The A100 figure's
  '30B' model has no configuration in ``paper_models.csv``, so it is left out
  (its published numbers still show in the report).
* ``cpu`` -- the four systems on two small models, sized for a 2-core CPU
  machine: minutes in all.
* ``nightly`` -- a short subset of ``cpu`` for the nightly job.

The side-by-side tables (``chunkstar-bench step-time``, ``overlap``) are not
suites but comparisons (:mod:`chunkstar_bench.comparisons`): their rows depend
on each other's measurements and their point is the ratios.

A suite is data: this module builds the lists and runs nothing. Hardware
labels name the node the published numbers were measured on, so a report can
set ours beside them; :func:`with_hardware` relabels a suite for another machine.
"""

from __future__ import annotations

import dataclasses

from chunkstar_bench.published import load_published
from chunkstar_bench.runner import RunSpec
from chunkstar_bench.zoo import ZOO, n_params

__all__ = ["GPU_COUNTS", "PAPER_HARDWARE", "SUITES", "get_suite", "with_hardware"]

GPU_COUNTS: tuple[int, ...] = (1, 2, 4, 8)
PAPER_BATCH_PER_GPU = 8
PAPER_HARDWARE: dict[str, str] = {"paper-v100": "v100x8_240gb", "paper-a100": "a100x8_1tb"}
"""Suite name -> the hardware label of its published numbers in ``data/paper_results.csv``."""


def _paper_suite(hardware: str) -> list[RunSpec]:
    names = {r.zoo_model for r in load_published() if r.hardware == hardware and r.zoo_model is not None}
    models = sorted(names, key=lambda n: n_params(ZOO[n]))
    return [
        RunSpec(
            system=system, model=model, nprocs=gpus, batch=PAPER_BATCH_PER_GPU, steps=5, warmup=2,
            device="cuda", hardware=hardware,
        )
        for model in models
        for gpus in GPU_COUNTS
        for system in ("chunkstar", "deepspeed")
    ]


def _cpu_suite(models: tuple[str, ...], systems: tuple[str, ...], steps: int) -> list[RunSpec]:
    # warmup 2: chunkstar's tracer warm-up spans two micro-steps (docs/design.md, 'The iteration').
    return [
        RunSpec(system=system, model=model, batch=4, seq_len=128, steps=steps, warmup=2, device="cpu", hardware="cpu")
        for model in models
        for system in systems
    ]


_ALL_SYSTEMS = ("pytorch", "chunkstar", "deepspeed", "fsdp2")
"""The four systems of the CPU suites (the disk systems are max-scale's)."""

SUITES: dict[str, list[RunSpec]] = {
    "paper-v100": _paper_suite(PAPER_HARDWARE["paper-v100"]),
    "paper-a100": _paper_suite(PAPER_HARDWARE["paper-a100"]),
    "cpu": _cpu_suite(("cpu-small", "cpu-base"), _ALL_SYSTEMS, steps=4),
    "nightly": _cpu_suite(("cpu-small",), _ALL_SYSTEMS, steps=3),
}
"""Every suite by name."""


def get_suite(name: str) -> list[RunSpec]:
    """The runs of suite ``name``; a KeyError naming the suites otherwise."""
    try:
        return SUITES[name]
    except KeyError:
        raise KeyError(f"unknown suite {name!r}; suites: {', '.join(SUITES)}") from None


def with_hardware(specs: list[RunSpec], hardware: str | None) -> list[RunSpec]:
    """``specs`` relabelled to ``hardware`` (unchanged when None)."""
    if hardware is None:
        return list(specs)
    return [dataclasses.replace(s, hardware=hardware) for s in specs]
