"""Training habits real code has, each against plain PyTorch on the same seed and data.

Each case trains under a budget that forces chunk evictions after the warm-up
(the non-model peak a probe engine measured plus half the fp32 parameter bytes)
and compares per-step losses and the final weights with plain PyTorch (fused
AdamW, clipping at 1.0). The habits: a plain ``loss.backward()`` instead of
``engine.backward(loss)``, reentrant activation checkpointing, a parameter
written in place inside a forward (``nn.Embedding(max_norm=...)``), evaluation
under ``torch.inference_mode()``, and the inputs a serious tool refuses clearly
(sparse embeddings, an optimizer of one's own over the engine's parameters).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import chunkstar
from chunkstar.errors import ChunkStateError

from tests.core._budget import measured_budget

VOCAB = 40
WIDTH = 32


def _config(budget: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": 1100,
    }
    cfg.update(extra)
    return cfg


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)) for _ in range(steps)]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _built(cls: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _reference(cls: Callable[[], nn.Module], data: list[tuple[torch.Tensor, torch.Tensor]], accum: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _built(cls)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for i, (x, y) in enumerate(data):
        loss = _ce(model(x), y)
        (loss / accum).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _eviction_budget(cls: Callable[[], nn.Module], data: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The non-model peak a probe measured plus 70% of the fp32 parameter bytes (a model's
    ``budget_fraction`` overrides it; each test asserts that chunks were evicted)."""
    return measured_budget(
        lambda: _built(cls), _config, lambda e, _o: e.backward(_ce(e(data[0][0]), data[0][1])),
        fraction=getattr(cls, "budget_fraction", 0.7),
    )


def _train(
    cls: Callable[[], nn.Module],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    plain_backward: bool = False,
    accum: int = 1,
    between: Callable[[Any, int], None] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    budget = _eviction_budget(cls, data)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(cls), 0, _config(budget, gradient_accumulation_steps=accum))
    losses = []
    for i, (x, y) in enumerate(data):
        if between is not None:
            between(engine, i)
        loss = _ce(engine(x), y)
        if plain_backward:
            loss.backward()
        else:
            engine.backward(loss)
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return losses, state, engine.stats()


def _assert_same(got: tuple[list[float], dict[str, torch.Tensor], dict[str, Any]], want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    losses, state, stats = got
    assert stats["chunk_moves_to_host"] > 0, "the budget should force evictions"
    assert losses == pytest.approx(want[0], rel=1e-5)
    assert state.keys() == want[1].keys()
    for k, v in want[1].items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


class Tied(nn.Module):
    """A small LM with tied input and output embeddings and a block used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.other = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.block(h)
        h = h + self.other(h)
        h = h + self.block(h)
        return F.linear(self.norm(h), self.emb.weight)


# ---------------------------------------------------------------------------- 1. loss.backward()


@pytest.mark.parametrize("accum", [1, 2])
def test_plain_loss_backward_trains_as_engine_backward(accum: int) -> None:
    data = _data(6)
    _assert_same(_train(Tied, data, plain_backward=True, accum=accum), _reference(Tied, data, accum=accum))


def test_plain_loss_backward_mixed_with_engine_backward() -> None:
    """A loop that switches (an evaluation helper calling loss.backward() for a gradient
    probe is not this; a port halfway done is): each backward is an iteration of its own."""
    data = _data(6)
    budget = _eviction_budget(Tied, data)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(budget))
    losses = []
    for i, (x, y) in enumerate(data):
        loss = _ce(engine(x), y)
        loss.backward() if i % 2 else engine.backward(loss)
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    assert losses == pytest.approx(_reference(Tied, data)[0], rel=1e-5)


def test_plain_loss_backward_under_fp16_loss_scaling_is_refused() -> None:
    """Loss scaling needs the loss: a plain backward cannot be scaled, so it is refused,
    naming engine.backward, and the engine stays usable."""
    data = _data(2)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30, fp16={"enabled": True}))
    x, y = data[0]
    with pytest.raises(ChunkStateError, match=r"engine\.backward\(loss\)"):
        _ce(engine(x), y).backward()
    engine.backward(_ce(engine(x), y))
    optimizer.step()


# ---------------------------------------------------------------------------- 2. reentrant checkpointing


class ReentrantShared(nn.Module):
    """Zamba2's pattern: a parent-owned parameter read inside two reentrant regions, and
    one block called inside two reentrant regions."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.scale = nn.Parameter(torch.ones(WIDTH))
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def _region(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers[i](h) * self.scale) + self.shared(h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for i in range(len(self.layers)):
            h = h + checkpoint(self._region, i, h, use_reentrant=True)
        return self.head(h)


def test_reentrant_checkpointing_with_shared_parameters_matches() -> None:
    data = _data(5)
    _assert_same(_train(ReentrantShared, data), _reference(ReentrantShared, data))


def test_reentrant_checkpointing_with_plain_backward_matches() -> None:
    data = _data(5)
    _assert_same(_train(ReentrantShared, data, plain_backward=True), _reference(ReentrantShared, data))


# ---------------------------------------------------------------------------- 3. writes inside a forward


class MaxNorm(nn.Module):
    """nn.Embedding(max_norm) renormalises the rows it looks up, in place, inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH, max_norm=1.0)
        self.body = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(ids))))


class Lookup(nn.Module):
    """Looks up another module's table with max_norm (that module is never called)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, ids: torch.Tensor, table: nn.Embedding) -> torch.Tensor:
        return F.embedding(ids, table.weight, max_norm=1.0) + self.shift


class ParentMaxNorm(MaxNorm):
    def __init__(self) -> None:
        super().__init__()
        self.lookup = Lookup()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.lookup(ids, self.emb))))


class NoParamsParent(nn.Module):
    """The lookup with max_norm outside every module that owns parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MaxNorm()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.inner.emb.weight, max_norm=1.0)
        return self.inner.head(torch.tanh(self.inner.body(h)))


class ScaledInForward(nn.Module):
    """Another in-place write to a parameter inside a forward: a running clamp of a gain."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.gain = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.gain.weight.clamp_(-0.1, 0.1)
        return self.head(self.gain(self.emb(ids)))


@pytest.mark.parametrize("cls", [MaxNorm, ParentMaxNorm, ScaledInForward])
def test_inplace_writes_inside_a_forward_reach_the_master(cls: type[nn.Module]) -> None:
    data = _data(5)
    _assert_same(_train(cls, data), _reference(cls, data))


def test_inplace_write_by_an_op_outside_modules_is_refused_clearly() -> None:
    data = _data(2)
    engine, _ = chunkstar.initialize_engine(lambda: _built(NoParamsParent), 0, _config(1 << 30))
    with pytest.raises(ChunkStateError, match=r"inner\.emb\.weight.*in place"):
        engine(data[0][0])
    x, y = data[0]
    loss = _ce(engine.module.inner.head(torch.tanh(engine.module.inner.body(engine.module.inner.emb(x)))), y)
    engine.backward(loss)  # the engine stays usable


# ---------------------------------------------------------------------------- 4. evaluation modes


def test_evaluation_under_inference_mode_between_steps() -> None:
    data = _data(6)

    def evaluate(engine: Any, i: int) -> None:
        if i in (2, 4):
            engine.eval()
            with torch.inference_mode():
                engine(data[0][0])
            engine.train()

    _assert_same(_train(Tied, data, between=evaluate), _reference(Tied, data))


def test_evaluation_under_inference_mode_before_the_first_step() -> None:
    data = _data(4)

    def evaluate(engine: Any, i: int) -> None:
        if i == 0:
            with torch.inference_mode():
                engine(data[1][0])

    _assert_same(_train(Tied, data, between=evaluate), _reference(Tied, data))


# ---------------------------------------------------------------------------- 7. clear refusals


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(VOCAB, WIDTH, sparse=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids))


def test_sparse_gradients_are_refused_at_initialize_naming_the_module() -> None:
    with pytest.raises(ValueError, match=r"'table'.*sparse=True"):
        chunkstar.initialize_engine(lambda: _built(Sparse), 0, _config(1 << 30))


@pytest.mark.parametrize("fused", [False, True])
def test_an_optimizer_of_ones_own_is_refused_naming_the_engines(fused: bool) -> None:
    data = _data(2)
    engine, _ = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    mine = torch.optim.AdamW(engine.parameters(), lr=1e-3, fused=fused)
    x, y = data[0]
    engine.backward(_ce(engine(x), y))
    with pytest.raises(ChunkStateError, match="optimizer initialize_engine returned"):
        mine.step()
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())


# ---------------------------------------------------------------------------- steps PyTorch would take otherwise


def test_a_second_step_without_a_backward_is_refused_and_after_zero_grad_changes_nothing() -> None:
    """torch.optim applies the same gradients again on a second step(); the engine's step
    consumed them (they live in the param chunks), so it refuses rather than differ. After
    zero_grad a step has no gradients and changes nothing, as torch.optim's."""
    data = _data(2)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    x, y = data[0]
    engine.backward(_ce(engine(x), y))
    optimizer.step()
    after = {k: v.clone() for k, v in engine.module.state_dict().items()}
    with pytest.raises(ChunkStateError, match="no backward since the last step"):
        optimizer.step()
    optimizer.zero_grad()
    optimizer.step()
    assert all(torch.equal(after[k], v) for k, v in engine.module.state_dict().items())
    # and training goes on
    x, y = data[1]
    engine.backward(_ce(engine(x), y))
    optimizer.step()
    assert engine.stats()["optimizer_steps"] == 3


def test_a_loss_the_engine_did_not_produce_is_refused() -> None:
    data = _data(2)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    other = nn.Linear(WIDTH, 1)
    x, y = data[0]
    engine(x)  # the engine's forward ran, but the loss comes from another model
    with pytest.raises(ChunkStateError, match="no gradient reached this engine's parameters"):
        engine.backward(other(torch.randn(3, WIDTH)).sum())
    engine(x)
    with pytest.raises(ChunkStateError, match="no gradient reached"):
        engine.backward(torch.ones((), requires_grad=True) * 2)
    # the engine is usable afterwards
    engine.backward(_ce(engine(x), y))
    optimizer.step()
    assert engine.stats()["optimizer_steps"] == 1


def test_a_step_skipped_for_a_non_finite_loss_is_logged_once_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    data = _data(3)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    with caplog.at_level("WARNING", logger="chunkstar"):
        for x, y in data[:2]:
            engine.backward(_ce(engine(x), y) * float("nan"))
            optimizer.step()
            optimizer.zero_grad()
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step 1 skipped" in skipped[0].getMessage()
    stats = engine.stats()
    assert (stats["skipped_steps"], stats["optimizer_steps"]) == (2, 2)
    assert all(torch.isfinite(v).all() for v in engine.module.state_dict().values())


def test_a_scheduler_raising_adamw_decay_past_one_is_refused_at_the_step() -> None:
    data = _data(1)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    x, y = data[0]
    engine.backward(_ce(engine(x), y))
    optimizer.param_groups[0]["lr"] = 200.0  # x weight_decay 0.01 = 2
    with pytest.raises(chunkstar.ConfigError, match="lr x weight_decay"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = float("nan")  # a scheduler gone wrong: every weight would be NaN
    with pytest.raises(chunkstar.ConfigError, match=r"param_groups\[0\] at step 1.lr.*finite"):
        optimizer.step()
    optimizer.param_groups[0]["lr"] = 1e-2
    optimizer.step()


def test_a_second_backward_with_no_forward_in_between_is_refused() -> None:
    data = _data(2)
    engine, optimizer = chunkstar.initialize_engine(lambda: _built(Tied), 0, _config(1 << 30))
    x, y = data[0]
    loss = _ce(engine(x), y)
    engine.backward(loss)
    with pytest.raises(ChunkStateError, match="no training forward of the engine since the last backward"):
        engine.backward(loss)
    optimizer.step()  # the first backward's gradients are intact
    x, y = data[1]
    engine.backward(_ce(engine(x), y))
    optimizer.step()
    assert engine.stats()["optimizer_steps"] == 2
