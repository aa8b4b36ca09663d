"""Compiled blocks under the engine (Note [compiled units] in chunkstar/hooks/compiled.py).

A model's blocks compiled the way torchtitan and FSDP2 users do it
(``block.compile()``, or ``torch.compile(block)`` put back in its ModuleList)
train under a budget that forces eviction with the losses of plain PyTorch
running the same compiled model, and Dynamo really captures their graphs:
the tests count the graphs the backend receives, and the engine's calls that
ran compiled. Most tests use the ``aot_eager`` backend (Dynamo and AOTAutograd,
no code generation: seconds, not minutes); one runs the default inductor.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.errors import ConfigError

from tests.core._models import CASES, build_gpt2, engine_config, eviction_budget, gpt2_batch, train_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Dynamo's notes on the CPU


class Graphs:
    """A Dynamo backend that counts the graphs it compiles and then runs them with ``inner``."""

    def __init__(self, inner: str = "aot_eager") -> None:
        self.count = 0
        self.inner = inner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.count += 1
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_gpt2(backend: Any, style: str = "method", n_layer: int = 4) -> nn.Module:
    model = build_gpt2(n_layer=n_layer)
    blocks = model.transformer.h
    for i, block in enumerate(blocks):
        if style == "method":
            block.compile(backend=backend)
        else:
            blocks[i] = torch.compile(block, backend=backend)
    return model


def train_plain(model: nn.Module, steps: int) -> list[float]:
    """Plain PyTorch on the same model: AdamW + clipping as the engine config below."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    losses = []
    for step in range(steps):
        loss = model(**gpt2_batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def budget() -> int:
    # all the fp32 param bytes: still far from all model data and activations (chunks move every step),
    # and room for a compiled block's backward, which holds more than the eager one (Note [compiled units])
    return eviction_budget(build_gpt2(), torch.float32, 1.0)


def assert_close(got: list[float], want: list[float], tol: float = 1e-5) -> None:
    assert len(got) == len(want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst <= tol, f"losses differ by {worst:.3g} (relative): {got} vs {want}"


@pytest.mark.parametrize("style", ["method", "torch.compile"])
def test_compiled_blocks_match_plain_pytorch_and_capture_graphs(style: str) -> None:
    steps = 6
    plain_graphs = Graphs()
    want = train_plain(compiled_gpt2(plain_graphs, style), steps)
    assert plain_graphs.count == 4  # the reference itself compiled: one graph per block

    torch._dynamo.reset()
    graphs = Graphs()
    engine, opt = chunkstar.initialize_engine(lambda: compiled_gpt2(graphs, style), 0, engine_config(budget=budget()))
    got = train_engine(engine, opt, CASES["gpt2"], steps)
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0, "the budget must force eviction"
    assert stats["compiled_units"] == 4
    # the first warm-up iteration runs eager (access sets); every later call runs the compiled graph
    assert stats["compiled_calls"] == 4 * (steps - 1)
    assert graphs.count == 4
    assert_close(got, want)
    # and eager chunkstar on the same model (exact parity with plain PyTorch)
    eager, eopt = chunkstar.initialize_engine(build_gpt2, 0, engine_config(budget=budget()))
    assert_close(got, train_engine(eager, eopt, CASES["gpt2"], steps))


def test_compiled_blocks_bf16_train_like_eager_chunkstar() -> None:
    steps = 5
    graphs = Graphs()
    engine, opt = chunkstar.initialize_engine(lambda: compiled_gpt2(graphs), 0, engine_config("bf16", budget=budget() // 2))
    got = train_engine(engine, opt, CASES["gpt2"], steps, dtype="bf16")
    eager, eopt = chunkstar.initialize_engine(build_gpt2, 0, engine_config("bf16", budget=budget() // 2))
    want = train_engine(eager, eopt, CASES["gpt2"], steps, dtype="bf16")
    assert graphs.count == 4 and engine.stats()["compiled_calls"] == 4 * (steps - 1)
    assert_close(got, want, tol=2e-3)  # bf16 kernels fused differently round differently


def test_evaluation_and_copies_of_a_compiled_model() -> None:
    graphs = Graphs()
    engine, opt = chunkstar.initialize_engine(lambda: compiled_gpt2(graphs), 0, engine_config(budget=budget()))
    train_engine(engine, opt, CASES["gpt2"], 4)
    calls = engine.stats()["compiled_calls"]
    batch = gpt2_batch(99)
    with torch.no_grad():
        evaluated = engine(**batch).loss.item()
    assert engine.stats()["compiled_calls"] == calls + 4  # evaluation runs the compiled blocks too
    # a copy (an EMA model) is an ordinary eager model holding the current values
    ema = copy.deepcopy(engine.module)
    assert all(b._compiled_call_impl is None for b in ema.transformer.h)
    with torch.no_grad():
        assert ema(**batch).loss.item() == pytest.approx(evaluated, rel=1e-5)
    # detaching the engine gives the blocks their own compiled call back
    engine.remove_hooks()
    assert all(not isinstance(b._compiled_call_impl, chunkstar.hooks.compiled.CompiledUnit) for b in engine.module.transformer.h)


def test_a_compiled_function_called_during_warmup_still_compiles() -> None:
    """The CPU probe is a dispatch mode while the engine measures; Dynamo must not
    mark code it meets under it as skipped for good."""
    graphs = Graphs()

    @torch.compile(backend=graphs)
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    engine, opt = chunkstar.initialize_engine(build_gpt2, 0, engine_config(budget=budget()))
    for step in range(3):
        batch = gpt2_batch(step)
        engine.backward(loss_fn(engine(input_ids=batch["input_ids"]).logits, batch["labels"]))
        opt.step()
        opt.zero_grad()
    assert graphs.count >= 1


def test_a_whole_compiled_model_that_does_not_fit_is_refused() -> None:
    def whole() -> nn.Module:
        model = build_gpt2()
        model.compile(backend="aot_eager")
        return model

    with pytest.raises(ConfigError, match="Compile the model's blocks instead"):
        chunkstar.initialize_engine(whole, 0, engine_config(budget=budget()))


def test_inductor_blocks_match_eager_within_1e_5() -> None:
    """The default backend, code generation included (a C++ compiler is needed)."""
    steps = 4
    engine, opt = chunkstar.initialize_engine(lambda: compiled_gpt2("inductor", n_layer=2), 0, engine_config(budget=budget()))
    got = train_engine(engine, opt, CASES["gpt2"], steps)
    assert engine.stats()["compiled_calls"] == 2 * (steps - 1)
    eager, eopt = chunkstar.initialize_engine(lambda: build_gpt2(n_layer=2), 0, engine_config(budget=budget()))
    assert_close(got, train_engine(eager, eopt, CASES["gpt2"], steps))
