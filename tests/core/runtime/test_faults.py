"""State that half-changes (issue 30, item 8): an interrupt inside ``optimizer.step()`` or
``engine.load_checkpoint``, reads from a monitoring thread while training runs, and an
engine closed after its disk directory was deleted.

A step and a load either complete (a Ctrl-C that arrives meanwhile is raised once they
have) or, when something else stops them half-way, leave an engine that refuses to go on
until a load completes (Note [all or nothing] in chunkstar/interrupts.py). The
interrupts are injected deterministically: a function the step or load calls midway raises
KeyboardInterrupt, or sends the process a real SIGINT, on its Nth call."""

from __future__ import annotations

import collections
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import chunkstar
from chunkstar.chunk.store import Chunks
from chunkstar.errors import ChunkStateError
from chunkstar.optim.adam import ChunkAdam

from tests.core._models import CASES, engine_config, eviction_budget, train_engine

MLP = CASES["mlp"]
BUDGET = 1 << 24
SAVED_AT = 2


def _engine(**extra: Any) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    # Adam on the host: one update job per chunk, so a step has a middle to stop in
    return chunkstar.initialize_engine(MLP.build, 0, engine_config("fp32", budget=BUDGET, hybrid_adam=False, **extra))


def _weights(engine: chunkstar.ChunkEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _backward(engine: chunkstar.ChunkEngine, step: int) -> None:
    engine.backward(MLP.loss(engine, MLP.batch(step), torch.float32))


def _on_call(n: int, fault: Callable[[], None], real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, whose ``n``-th call runs ``fault`` first."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            fault()
        return real(*args, **kwargs)

    return wrapped


def _interrupt() -> None:
    raise KeyboardInterrupt


def _sigint() -> None:
    signal.raise_signal(signal.SIGINT)  # a real Ctrl-C: Python's handler runs at the next bytecode


@pytest.fixture()
def saved(tmp_path: Path) -> tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    engine, optimizer = _engine()
    train_engine(engine, optimizer, MLP, SAVED_AT)
    ckpt = tmp_path / "ckpt"
    engine.save_checkpoint(str(ckpt))
    return ckpt, engine, optimizer


def _reference(ckpt: Path, steps: range) -> tuple[dict[str, torch.Tensor], list[float]]:
    """What the checkpoint's run gives: the weights after its next step, and the losses of ``steps``."""
    engine, optimizer = _engine()
    engine.load_checkpoint(str(ckpt))
    _backward(engine, SAVED_AT)
    optimizer.step()
    optimizer.zero_grad()
    after = _weights(engine)
    return after, train_engine(engine, optimizer, MLP, steps)


# ---------------------------------------------------------------------- optimizer.step()
def test_a_step_stopped_half_way_is_refused_until_a_checkpoint_loads(
    saved: tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, engine, optimizer = saved
    _, want = _reference(ckpt, range(SAVED_AT + 1, SAVED_AT + 3))
    _backward(engine, SAVED_AT)
    monkeypatch.setattr(ChunkAdam, "_update_on_host", _on_call(3, _interrupt, ChunkAdam._update_on_host))
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()  # two chunks were updated, the others not
    monkeypatch.undo()
    refused = r"optimizer step 3 was stopped by KeyboardInterrupt.*engine\.load_checkpoint"
    with pytest.raises(ChunkStateError, match=refused):
        optimizer.zero_grad()  # the advice after an interrupt: here it would train on half a step
    _backward(engine, SAVED_AT + 1)  # the model still runs (its values are each chunk's own)...
    with pytest.raises(ChunkStateError, match=refused):
        optimizer.step()  # ...but no step builds on them
    with pytest.raises(ChunkStateError, match=refused):
        engine.save_checkpoint(str(ckpt))  # nor does a checkpoint keep them
    engine.load_checkpoint(str(ckpt))
    optimizer.zero_grad()
    assert optimizer.step_count == SAVED_AT
    _backward(engine, SAVED_AT)
    optimizer.step()
    optimizer.zero_grad()
    assert train_engine(engine, optimizer, MLP, range(SAVED_AT + 1, SAVED_AT + 3)) == want


def test_a_ctrl_c_inside_a_step_lets_the_step_finish_first(
    saved: tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, engine, optimizer = saved
    after, want = _reference(ckpt, range(SAVED_AT + 1, SAVED_AT + 3))
    _backward(engine, SAVED_AT)
    monkeypatch.setattr(ChunkAdam, "_update_on_host", _on_call(3, _sigint, ChunkAdam._update_on_host))
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    assert optimizer.step_count == SAVED_AT + 1 and _same(_weights(engine), after), "the step did not complete"
    optimizer.zero_grad()  # the advice after an interrupt: a no-op after a complete step
    assert train_engine(engine, optimizer, MLP, range(SAVED_AT + 1, SAVED_AT + 3)) == want


def test_a_step_stopped_before_it_changed_anything_is_no_step(
    saved: tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, engine, optimizer = saved
    before = _weights(engine)
    _backward(engine, SAVED_AT)
    monkeypatch.setattr(ChunkAdam, "_place", _on_call(2, _interrupt, ChunkAdam._place))
    with pytest.raises(KeyboardInterrupt):
        optimizer.step()
    monkeypatch.undo()
    optimizer.zero_grad()
    assert optimizer.step_count == SAVED_AT and _same(_weights(engine), before)
    train_engine(engine, optimizer, MLP, range(SAVED_AT, SAVED_AT + 1))
    assert optimizer.step_count == SAVED_AT + 1


# ---------------------------------------------------------------------- engine.load_checkpoint
def test_a_load_stopped_half_way_is_refused_until_a_load_completes(
    saved: tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, _, _ = saved
    _, want = _reference(ckpt, range(SAVED_AT + 1, SAVED_AT + 3))
    engine, optimizer = _engine()
    train_engine(engine, optimizer, MLP, range(100, 103))  # its own weights, moments and step count
    monkeypatch.setattr(Chunks, "staged", _on_call(3, _interrupt, Chunks.staged))
    with pytest.raises(KeyboardInterrupt):
        engine.load_checkpoint(str(ckpt))  # two chunks are the checkpoint's, the others not
    monkeypatch.undo()
    refused = r"engine\.load_checkpoint\(.*ckpt.*\) was stopped by KeyboardInterrupt.*load_checkpoint again"
    with pytest.raises(ChunkStateError, match=refused):
        optimizer.zero_grad()
    _backward(engine, 0)
    with pytest.raises(ChunkStateError, match=refused):
        optimizer.step()
    with pytest.raises(ChunkStateError, match=refused):
        engine.save_checkpoint(str(ckpt))
    engine.load_checkpoint(str(ckpt))  # it takes pending gradients along: the load replaces them
    assert optimizer.step_count == SAVED_AT
    optimizer.zero_grad()
    _backward(engine, SAVED_AT)
    optimizer.step()
    optimizer.zero_grad()
    assert train_engine(engine, optimizer, MLP, range(SAVED_AT + 1, SAVED_AT + 3)) == want


def test_a_ctrl_c_inside_a_load_lets_the_load_finish_first(
    saved: tuple[Path, chunkstar.ChunkEngine, chunkstar.ChunkAdam], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, done, _ = saved
    engine, optimizer = _engine()
    train_engine(engine, optimizer, MLP, range(100, 103))
    monkeypatch.setattr(Chunks, "staged", _on_call(3, _sigint, Chunks.staged))
    with pytest.raises(KeyboardInterrupt):
        engine.load_checkpoint(str(ckpt))
    monkeypatch.undo()
    assert optimizer.step_count == SAVED_AT and _same(_weights(engine), _weights(done)), "the load did not complete"
    optimizer.zero_grad()
    train_engine(engine, optimizer, MLP, range(SAVED_AT, SAVED_AT + 1))


@pytest.mark.parametrize("which", ["engine", "optimizer"])
def test_a_state_dict_load_stopped_half_way_is_refused_until_it_completes(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, optimizer = _engine()
    train_engine(engine, optimizer, MLP, SAVED_AT)
    weights, adam = engine.state_dict(), optimizer.state_dict()
    train_engine(engine, optimizer, MLP, range(SAVED_AT, SAVED_AT + 2))
    load = (lambda: engine.load_state_dict(weights)) if which == "engine" else (lambda: optimizer.load_state_dict(adam))
    monkeypatch.setattr(Chunks, "staged", _on_call(3, _interrupt, Chunks.staged))
    with pytest.raises(KeyboardInterrupt):
        load()
    monkeypatch.undo()
    with pytest.raises(ChunkStateError, match=rf"{which}\.load_state_dict\(\) was stopped by KeyboardInterrupt.*again"):
        optimizer.zero_grad()
    load()
    optimizer.zero_grad()
    train_engine(engine, optimizer, MLP, range(SAVED_AT + 2, SAVED_AT + 3))


# ---------------------------------------------------------------------- a monitoring thread
def test_reads_from_a_monitoring_thread_while_training_never_crash() -> None:
    case = CASES["gpt2"]
    config = engine_config("fp32", budget=eviction_budget(case.build(), torch.float32))  # chunks move all the time
    steps = 6
    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    want = train_engine(engine, optimizer, case, steps)

    engine, optimizer = chunkstar.initialize_engine(case.build, 0, config)
    outcomes: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            reads = (("stats", engine.stats), ("state_dict", engine.state_dict), ("module_state_dict", engine.module.state_dict))
            for name, read in reads:
                try:
                    read()
                    outcomes[f"{name} ok"] += 1
                except ChunkStateError as e:
                    ok = "thread" in str(e) and "MainThread" in str(e) and "engine.stats()" in str(e)
                    outcomes[f"{name} refused" if ok else f"{name} {e}"] += 1
                except Exception as e:  # noqa: BLE001 - counted, then the test names it
                    outcomes[f"{name} {type(e).__name__}: {e}"] += 1
            time.sleep(0.001)

    t = threading.Thread(target=monitor, name="monitor", daemon=True)
    t.start()
    try:
        got = train_engine(engine, optimizer, case, steps)
    finally:
        stop.set()
        t.join(60)
    assert not t.is_alive()
    assert set(outcomes) == {"stats ok", "state_dict refused", "module_state_dict refused"}, outcomes
    assert got == want, "reads from another thread changed the training"
    assert engine.stats()["optimizer_steps"] == steps and engine.state_dict().keys() == case.build().state_dict().keys()

    # once the thread that trains is gone, another one may read (and train) in its turn
    trainer = threading.Thread(target=lambda: train_engine(engine, optimizer, case, range(steps, steps + 1)))
    trainer.start()
    trainer.join(120)
    assert optimizer.step_count == steps + 1 and engine.state_dict().keys()


# ---------------------------------------------------------------------- close()
def test_close_after_the_disk_directory_was_deleted(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    engine, optimizer = _engine(disk={"path": str(d)})
    train_engine(engine, optimizer, MLP, 1)
    shutil.rmtree(d)
    with pytest.warns(RuntimeWarning, match=rf"{d}.*no longer exists"):
        engine.close()
    engine.close()  # again: nothing left to do
    with pytest.raises(ChunkStateError, match="closed"):
        train_engine(engine, optimizer, MLP, 1)
