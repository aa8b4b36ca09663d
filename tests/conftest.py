"""The whole suite runs on the strict virtual device (Note [strict device] in chunkstar/device/virtual.py).

* ``CHUNKSTAR_STRICT_DEVICE=1``: the CPU virtual device runs each backward on a device thread
  of its own, as autograd does for CUDA tensors, and measures its non-model memory for every
  engine's whole life (as CUDA's allocator always does), so its meter sees every step;
* after each test, every engine the test built on the CPU device must have held no more than
  its device: ``device_peak_bytes <= device_budget_bytes`` (the meter counts payload storages
  until they are really freed, frees still waiting for their copies included), unless its
  warm-up measured a budget too small (it goes over to measure, then raises the error naming
  the smallest that fits). Another test that means to go over says so with
  ``@pytest.mark.over_budget``.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterator

import pytest

os.environ.setdefault("CHUNKSTAR_STRICT_DEVICE", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "over_budget: the test's engines may hold more than their device budget")


@pytest.fixture(autouse=True)
def _engines_stay_within_their_device(request: pytest.FixtureRequest) -> Iterator[None]:
    from chunkstar.runtime.engine import ChunkEngine

    built: list[weakref.ref[Any]] = []
    init = ChunkEngine.__init__

    def recording(self: ChunkEngine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(weakref.ref(self))

    ChunkEngine.__init__ = recording  # type: ignore[method-assign]
    try:
        yield
    finally:
        ChunkEngine.__init__ = init  # type: ignore[method-assign]
        # a forward whose backward never came leaves its engine measuring: stop it, so its
        # dispatch mode does not run under every later test
        for ref in built:
            engine = ref()
            if engine is not None:
                engine.mgr.probe.release_all()
    if request.node.get_closest_marker("over_budget") is not None:
        return
    for ref in built:
        engine = ref()
        if engine is None or engine.device.type != "cpu":
            continue
        stats = engine.stats()
        if stats["warmup_went_over_budget"]:
            continue  # its warm-up measured a shortfall past the budget, then raised the error naming it
        assert stats["device_peak_bytes"] <= stats["device_budget_bytes"], (
            f"the virtual device held {stats['device_peak_bytes']} bytes at its peak, more than its "
            f"{stats['device_budget_bytes']}: first over at {stats['device_first_overrun']}"
        )
