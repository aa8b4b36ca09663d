"""An engine's end: closed or dropped, it is freed with its threads; used after close(), it refuses.

Notebooks and hyper-parameter sweeps build many engines in one process, so each must
let go of its chunks, threads and disk directory when it is closed or dropped.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

import chunkstar
from chunkstar.errors import ChunkStateError

from tests.core._models import build_mlp, engine_config, mlp_batch, mlp_loss


def _engine(tmp: Path | None = None) -> tuple[chunkstar.ChunkEngine, torch.optim.Optimizer]:
    extra = {"disk": {"path": str(tmp)}} if tmp is not None else {}
    return chunkstar.initialize_engine(lambda: build_mlp(), 0, engine_config(budget=400_000, **extra))


def _train_step(engine: chunkstar.ChunkEngine, optimizer: torch.optim.Optimizer) -> None:
    engine.backward(mlp_loss(engine, mlp_batch(0), torch.float32))
    optimizer.step()
    optimizer.zero_grad()


def _chunkstar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("chunkstar")}


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_engines_closed_or_dropped_are_freed_with_their_threads(close: bool) -> None:
    before = _chunkstar_threads()
    refs = []
    for _ in range(3):
        engine, optimizer = _engine()
        _train_step(engine, optimizer)
        if close:
            engine.close()
        refs.append(weakref.ref(engine))
        del engine, optimizer
    # a dropped engine's last host-Adam job may still be running: it is freed once that is done
    deadline = time.monotonic() + 10
    while True:
        gc.collect()
        if all(r() is None for r in refs) and _chunkstar_threads() <= before or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [r() is None for r in refs] == [True] * 3
    assert _chunkstar_threads() <= before  # (earlier tests' engines may go in the same collection)


def test_a_closed_engine_refuses_to_train_and_still_reads_its_values() -> None:
    engine, optimizer = _engine()
    _train_step(engine, optimizer)
    want = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    engine.close()  # twice is harmless
    with pytest.raises(ChunkStateError, match="closed"):
        engine(mlp_batch(1)["x"])
    with pytest.raises(ChunkStateError, match="closed"):
        with torch.no_grad():
            engine(mlp_batch(1)["x"])
    with pytest.raises(ChunkStateError, match="closed"):
        optimizer.step()
    got = engine.module.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_new_engine_takes_the_disk_directory_of_an_old_one(tmp_path: Path, close: bool) -> None:
    engine, optimizer = _engine(tmp_path)
    _train_step(engine, optimizer)
    if close:
        engine.close()
    old = weakref.ref(engine)
    del engine, optimizer
    deadline = time.monotonic() + 10
    while old() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    engine, optimizer = _engine(tmp_path)  # not refused as locked by this very process
    _train_step(engine, optimizer)
    engine.close()
