"""A device budget that forces evictions, measured: the tests of habits and traps share it."""

from __future__ import annotations

from typing import Any, Callable

import chunkstar


def measured_budget(
    build: Callable[[], Any], config: Callable[[int], dict[str, Any]], first: Callable[[Any, Any], None],
    fraction: float = 0.5, itemsize: int = 4,
) -> int:  # fmt: skip
    """The non-model peak a probe engine measured in its first iteration (``first(engine,
    optimizer)`` runs it, under a budget far above the model) plus ``fraction`` of the
    model's parameter bytes at ``itemsize`` bytes each."""
    probe, optimizer = chunkstar.initialize_engine(build, 0, config(1 << 30))
    first(probe, optimizer)
    param_bytes = sum(p.numel() * itemsize for p in build().parameters())
    budget = int(probe.stats()["warmup_non_model_peak_bytes"]) + int(param_bytes * fraction)
    probe.close()
    return budget
