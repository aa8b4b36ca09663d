"""What a too-small device budget error tells the user, checked by doing what it says.

- the smallest budget the warm-up's error names trains, and evaluates after training:
  an evaluation forward (``torch.no_grad``) between steps budgets each moment with
  the traced forward's (Note [evaluation budgets]), not with the trace's largest
  non-model peak, which comes in backward and would deny the embedding's chunk the
  room it had in training; an evaluation on larger inputs still gets the largest;
- a moment that fails because one parameter (a chunk of its own) is larger than the
  room its non-model peak leaves is not told to lower ``default_chunk_size``;
- under control flow that changes between iterations (stochastic depth), the minimum
  holds for every path the warm-up ran, and says it covers only those (Note [advice
  covers the paths seen]); ``warmup_non_model_peak_bytes`` reports the largest peak
  measured so far, also while the warm-up re-traces.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import chunkstar
from chunkstar.memory.tracer import ScheduleMode

BATCH = 2


def _build(vocab: int, n_embd: int, n_layer: int, seq: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=max(1, n_embd // 64), n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    model = GPT2LMHeadModel(cfg)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _train_then_evaluate(shape: tuple[int, int, int], budget: int, steps: int = 3, seq: int = 64) -> None:
    """``steps`` training steps on ``BATCH`` x ``seq`` tokens, then one evaluation forward
    (the demo's pattern) on a GPT-2 of ``shape`` (vocabulary, hidden size, layers)."""
    transformers.logging.set_verbosity_error()
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": "auto",
    }
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(*shape, seq), 0, config)
    ids = torch.randint(0, shape[0], (BATCH, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
    assert engine.stats()["schedule"] == "frozen"
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)


def test_the_named_minimum_trains_and_then_evaluates() -> None:
    # the largest non-model peak comes in backward; the tied embedding's chunk is needed in forward
    shape = (2048, 256, 4)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate(shape, budget=2 * 1024 * 1024)
    minimum = info.value.minimum
    assert minimum is not None, str(info.value)
    _train_then_evaluate(shape, budget=minimum)  # planned with the largest peak, the evaluation failed here


def test_an_evaluation_on_larger_inputs_is_planned_with_the_largest_peak() -> None:
    """Its moments' traced peaks do not bound it: the trace's largest peak does, as before."""
    transformers.logging.set_verbosity_error()
    config = {"optimizer": {"type": "AdamW"}, "device": "cpu", "device_memory_budget": "64MB", "default_chunk_size": 4096}
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(512, 64, 2, 64), 0, config)
    ids = torch.randint(0, 512, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
    cursor = engine.mgr.cursor
    seen: list[bool] = []
    hook = engine.module.transformer.h[1].register_forward_pre_hook(lambda *_: seen.append(cursor.mode is ScheduleMode.EVALUATING_ALONG))
    with torch.no_grad():
        engine(input_ids=ids, labels=ids)  # the traced inputs: budgeted moment by moment
        engine(input_ids=torch.cat([ids, ids]), labels=torch.cat([ids, ids]))  # twice the batch: the largest peak
    hook.remove()
    assert seen == [True, False]
    assert cursor.mode is ScheduleMode.FOLLOWING


def test_a_parameter_too_big_for_its_moment_does_not_suggest_smaller_chunks() -> None:
    # the demo's vocabulary and sequences: the tied embedding (8192 x 512, 8 MiB in bf16, a chunk of its
    # own) must sit beside the loss's ~30 MiB at 'lm_head' (fwd); 34 MiB leaves it ~3.5 MiB, though the
    # embedding is under half the device (the old rule of thumb then suggested smaller chunks)
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _train_then_evaluate((8192, 512, 1), budget=34 * 1024 * 1024, steps=1, seq=128)
    msg = str(info.value)
    assert "'lm_head' (fwd)" in msg and "'transformer.wte.weight'" in msg, msg
    assert "smaller chunks cannot help" in msg and "lower 'default_chunk_size'" not in msg, msg


# ---------------------------------------------------------------------------- control flow that changes


class Depth(nn.Module):
    """Runs a different number of its blocks per training forward: at random with
    ``p_skip`` (stochastic depth), or cycling through ``depths``."""

    def __init__(self, p_skip: float = 0.0, depths: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.p_skip, self.depths, self.calls = p_skip, depths, 0
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(8))
        self.out = nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        depth = self.depths[self.calls % len(self.depths)] if self.depths and self.training else len(self.blocks)
        self.calls += self.training
        for block in self.blocks[:depth]:
            if self.training and self.p_skip and torch.rand(()) < self.p_skip:
                continue
            x = x + block(x)
        return self.out(x).squeeze(-1)


def _depth_engine(budget: int, **kwargs: object) -> tuple[chunkstar.ChunkEngine, chunkstar.ChunkAdam]:
    def build() -> Depth:
        torch.manual_seed(0)
        return Depth(**kwargs)  # type: ignore[arg-type]

    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "device": "cpu",
              "device_memory_budget": budget, "default_chunk_size": 17000}  # fmt: skip
    return chunkstar.initialize_engine(build, 0, config)


def _steps(engine: chunkstar.ChunkEngine, optimizer: chunkstar.ChunkAdam, n: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the blocks skipped
    for _ in range(n):
        x, y = torch.randn(256, 64, generator=g), torch.randn(256, generator=g)
        engine.backward((engine(x) - y).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def test_under_stochastic_depth_the_minimum_says_it_covers_only_the_paths_seen() -> None:
    # each run's first warm-up iteration skips other blocks: no minimum can know the paths not run
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _steps(*_depth_engine(200_000, p_skip=0.5), 4, seed=1)
    err = info.value
    assert err.minimum is not None
    assert "the one path through the model that the 1 warm-up iteration traced so far took" in str(err), str(err)
    assert "control flow changes between iterations" in err.covers
    try:  # another run, other blocks skipped: it trains, or says again what its minimum covers
        _steps(*_depth_engine(err.minimum, p_skip=0.5), 4, seed=2)
    except chunkstar.DeviceMemoryError as again:
        assert again.minimum is not None and again.minimum > err.minimum
        assert "traced so far took" in str(again), str(again)


def test_the_minimum_holds_for_every_path_the_warm_up_ran() -> None:
    """The first warm-up iteration runs 2 blocks and fits; the second runs 6 and does not.
    Its moments past the first pass's last used to go unchecked (the trace's records are the
    first pass's): now its error names a minimum that trains both paths, and says it covers two."""
    probe, probe_opt = _depth_engine(1 << 30, depths=(2, 6))
    _steps(probe, probe_opt, 1)
    shallow = probe.stats()["warmup_non_model_peak_bytes"]
    _steps(probe, probe_opt, 1)
    deep = probe.stats()["warmup_non_model_peak_bytes"]
    assert deep > shallow > 0  # the deeper path's peak is reported (it read 0 while re-tracing)
    param_bytes = sum(s.numel * 4 for s in probe.mgr.slots)
    budget = shallow + param_bytes + (deep - shallow) // 4

    engine, optimizer = _depth_engine(budget, depths=(2, 6))
    _steps(engine, optimizer, 1)  # the shallow path fits
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        _steps(engine, optimizer, 1)
    err = info.value
    assert err.minimum is not None and err.minimum > budget
    assert "the 2 different paths through the model that the 2 warm-up iterations traced so far took" in str(err)
    # the fresh engine runs the same two paths (and re-traces each time they differ)
    _steps(*_depth_engine(err.minimum, depths=(2, 6)), 4)


def test_the_non_model_peak_is_reported_while_the_warm_up_re_traces() -> None:
    engine, optimizer = _depth_engine(1 << 30, p_skip=0.5)
    peaks = []
    for i in range(4):
        _steps(engine, optimizer, 1, seed=i)
        peaks.append(engine.stats()["warmup_non_model_peak_bytes"])
    assert engine.stats()["replans"] > 0  # the passes disagreed: the warm-up started over
    assert peaks[0] > 0 and peaks == sorted(peaks), peaks  # the largest so far, never 0 while re-tracing
