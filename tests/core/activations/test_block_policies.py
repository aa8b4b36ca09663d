"""Activations under a policy per block: keep, checkpoint, offload (issue 27, Note [activation policies]).

Every policy trains exactly like plain PyTorch; checkpoint and offload leave less
on the device than keep; nothing changes in the model's code or class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

import chunkstar
import chunkstar.activations.offload as offload_mod
from chunkstar.activations import BlockActivations, find_blocks, repeated_classes
from chunkstar.config import ActivationPolicy
from chunkstar.errors import ConfigError

from tests.core._models import CASES, DTYPES, assert_losses_close, engine_config, eviction_budget, train_engine, train_reference

STEPS = 4
RTOL = {"fp32": 1e-5, "bf16": 3e-2}


@pytest.fixture
def small_offloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test models' saved tensors are kilobytes: offload them all."""
    monkeypatch.setattr(offload_mod, "MIN_OFFLOAD_BYTES", 1)


# ---------------------------------------------------------------------- which modules are blocks
def test_blocks_are_the_repeated_layers() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    gpt2 = CASES["gpt2"].build()
    assert [type(b).__name__ for b in find_blocks(gpt2)] == ["GPT2Block"] * 4
    bert = CASES["bert"].build()  # declares BertEmbeddings too, which does not repeat
    assert {type(b).__name__ for b in find_blocks(bert)} == {"BertLayer"}
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=2, d_kv=16))
    assert len(find_blocks(t5)) == 5  # the encoder's and the decoder's
    # no declared list: the ModuleLists of one class; outermost only
    inner = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(3)])
            self.head = inner

    net = Net()
    assert repeated_classes(net) == ["Block", "Linear"]
    assert [type(b).__name__ for b in find_blocks(net, ["Block"])] == ["Block"] * 3
    assert len(find_blocks(net)) == 3 + 2  # the Blocks, and the head's Linears (the Blocks' own are inside)
    with pytest.raises(ValueError, match="repeated layers are"):
        find_blocks(net, ["Nothing"])
    with pytest.raises(ValueError, match="no ModuleList"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="has no repeated layers to take as blocks .* or leave activations.policy"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))  # "auto" found none: said as such, not as classes asked for


def test_bad_config_is_refused() -> None:
    base = engine_config("fp32", budget="1MB")
    for bad, key in (({"policy": "sometimes"}, "activations.policy"), ({"blocks": [3]}, "activations.blocks"),
                     ({"blocks": []}, "activations.blocks"), ({"plan": 1}, "activations.plan")):  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            chunkstar.initialize_engine(CASES["mlp"].build, config={**base, "activations": bad})
    # a model with no blocks of the named class: said at start, with the classes it has
    with pytest.raises(ValueError, match="GPT2Block"):
        chunkstar.initialize_engine(CASES["gpt2"].build, config={**base, "activations": {"policy": "checkpoint", "blocks": ["Block"]}})


# ---------------------------------------------------------------------- equal to plain PyTorch
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_every_policy_trains_like_pytorch(name: str, policy: str, dtype: str, small_offloads: None) -> None:
    case = CASES[name]
    want = train_reference(case, STEPS, dtype=dtype)
    budget = eviction_budget(case.build(), DTYPES[dtype])
    engine, opt = chunkstar.initialize_engine(
        case.build, config=engine_config(dtype, budget=budget, activations={"policy": policy})
    )
    try:
        got = train_engine(engine, opt, case, STEPS, dtype=dtype)
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL[dtype], f"{name}/{policy}/{dtype}")
    assert stats["activation_policy"] == policy and stats["activation_blocks"][policy] == 4
    assert stats["chunk_moves_to_host"] > 0  # under eviction, as the parity tests run
    if policy == "offload":
        assert stats["activation_offloaded_calls"] == 4 * STEPS
        assert stats["activation_bytes_to_host"] > 0 and stats["activation_bytes_to_device"] == stats["activation_bytes_to_host"]
    else:
        assert stats["activation_recomputed_calls"] == 4 * STEPS and stats["activation_bytes_to_host"] == 0


def _gpt2_with_dropout() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=3, n_head=4, resid_pdrop=0.3, attn_pdrop=0.3))


def _dropout_losses(policy: str) -> tuple[list[float], list[torch.Tensor]]:
    engine, opt = chunkstar.initialize_engine(
        _gpt2_with_dropout, config={"device": "cpu", "device_memory_budget": "8MB", "activations": {"policy": policy}}
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    losses = []
    try:
        torch.manual_seed(7)
        for _ in range(3):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with engine.gathered_parameters():
            weights = [p.detach().clone() for p in engine.module.parameters()]
    finally:
        engine.close()
    return losses, weights


def test_recomputation_draws_the_same_dropout(small_offloads: None) -> None:
    """The RNG state is preserved: a recomputed block drops the same units, so every policy
    gives keep's losses and weights bit for bit."""
    keep = _dropout_losses("keep")
    for policy in ("checkpoint", "offload"):
        got = _dropout_losses(policy)
        assert got[0] == keep[0], policy
        assert all(torch.equal(a, b) for a, b in zip(got[1], keep[1])), policy


# ---------------------------------------------------------------------- less on the device
def _peak(policy: str) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=256, n_embd=64, n_layer=4, n_head=4))

    engine, opt = chunkstar.initialize_engine(build, config={"device": "cpu", "device_memory_budget": "256MB",
                                                             "activations": {"policy": policy}})  # fmt: skip
    ids = torch.randint(0, 128, (4, 256), generator=torch.Generator().manual_seed(3))
    try:
        for _ in range(3):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
        return dict(engine.stats())
    finally:
        engine.close()


def test_checkpoint_and_offload_leave_less_on_the_device() -> None:
    keep, ckpt, off = _peak("keep"), _peak("checkpoint"), _peak("offload")
    # the measured non-model peak (activations, mostly): the same chunks in all three
    assert ckpt["device_peak_bytes"] < 0.75 * keep["device_peak_bytes"], (ckpt["device_peak_bytes"], keep["device_peak_bytes"])
    assert off["device_peak_bytes"] < 0.85 * keep["device_peak_bytes"], (off["device_peak_bytes"], keep["device_peak_bytes"])
    assert off["activation_bytes_to_host"] > 0  # 1 MiB storages and larger: the blocks' big tensors


def test_evaluation_and_the_model_s_own_checkpointing(small_offloads: None) -> None:
    case = CASES["gpt2"]
    engine, opt = chunkstar.initialize_engine(
        case.build, config=engine_config("fp32", budget="4MB", activations={"policy": "offload"})
    )
    try:
        batch = case.batch(0)
        with torch.no_grad():
            engine(**batch)
        with torch.inference_mode():
            engine(**batch)
        assert engine.stats()["activation_offloaded_calls"] == 0  # nothing saved, nothing moved
        # the model checkpoints its blocks itself: the policy steps aside (no second recomputation)
        engine.module.gradient_checkpointing_enable()
        engine.backward(case.loss(engine, batch, torch.float32))
        opt.step()
        stats = engine.stats()
        assert stats["activation_blocks_checkpointed_by_model"] == 4 and stats["activation_offloaded_calls"] == 0
        forward = engine.module.transformer.h[0].forward
    finally:
        engine.close()
    engine.remove_hooks()
    assert "forward" not in engine.module.transformer.h[0].__dict__ and forward is not engine.module.transformer.h[0].forward


@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
def test_accumulation_and_a_plain_backward(policy: str, small_offloads: None) -> None:
    """Two micro-batches per step through engine.backward, then the same with loss.backward()."""
    case = CASES["gpt2"]
    want = train_reference(case, 3, accum=2)
    budget = eviction_budget(case.build(), DTYPES["fp32"])
    config = engine_config("fp32", budget=budget, accum=2, activations={"policy": policy})
    engine, opt = chunkstar.initialize_engine(case.build, config=config)
    try:
        got = train_engine(engine, opt, case, 3, accum=2)
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], f"{policy} with accumulation")
    engine, opt = chunkstar.initialize_engine(case.build, config=config)
    plain = []
    try:
        for step in range(3):
            for micro in range(2):
                loss = case.loss(engine, case.batch(step * 2 + micro), torch.float32)
                loss.backward()  # the engine divides by gradient_accumulation_steps, as engine.backward does
                plain.append(loss.item())
            opt.step()
            opt.zero_grad()
    finally:
        engine.close()
    assert_losses_close(plain, want, RTOL["fp32"], f"{policy}, loss.backward()")


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                                               d_kv=16, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))  # fmt: skip


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))  # fmt: skip


@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
@pytest.mark.parametrize("family", ["t5", "llama"])
def test_a_decoder_s_cache_and_grouped_heads(family: str, policy: str, small_offloads: None) -> None:
    """T5's decoder blocks are handed a key/value cache they write: a recomputed block leaves it
    out, as Hugging Face's checkpointing does (replayed, it was written twice and the
    recomputation saved other tensors); Llama's grouped heads and rotary embeddings."""
    build = _t5 if family == "t5" else _llama
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 32), generator=g)
    batch = {"input_ids": ids, "labels": torch.randint(0, 256, (2, 16), generator=g) if family == "t5" else ids}
    ref = build()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = []
    for _ in range(3):
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    config = {"device": "cpu", "device_memory_budget": "2MB", "default_chunk_size": 8192,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "activations": {"policy": policy}}  # fmt: skip
    engine, chunk_opt = chunkstar.initialize_engine(build, config=config)
    got = []
    try:
        for _ in range(3):
            loss = engine(**batch).loss
            engine.backward(loss)
            chunk_opt.step()
            chunk_opt.zero_grad()
            got.append(loss.item())
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], f"{family}/{policy}")
    assert stats["chunk_moves_to_host"] > 0 and stats["activation_blocks"][policy] == (4 if family == "t5" else 3)


# ---------------------------------------------------------------------- auto: planned per block
def _minimum(build: Any, config: dict[str, Any], batch: Any, loss: Any) -> int:
    """The least budget the engine's warm-up measured for ``config`` (two iterations at a roomy budget)."""
    engine, opt = chunkstar.initialize_engine(build, config=config)
    try:
        for _ in range(2):
            for _ in range(config.get("gradient_accumulation_steps", 1)):
                engine.backward(loss(engine, batch))
            opt.step()
            opt.zero_grad()
        return int(engine.stats()["minimum_budget_bytes"])
    finally:
        engine.close()


AUTO_FAMILIES = {
    "gpt2": (lambda: CASES["gpt2"].build(), lambda s: CASES["gpt2"].batch(s)),
    "bert": (lambda: CASES["bert"].build(), lambda s: CASES["bert"].batch(s)),
    "t5": (_t5, lambda s: {"input_ids": torch.randint(1, 256, (2, 32), generator=torch.Generator().manual_seed(s)),
                           "labels": torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(100 + s))}),
    "llama": (_llama, lambda s: {"input_ids": (ids := torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(s))),
                                 "labels": ids}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(AUTO_FAMILIES))
def test_auto_trains_like_pytorch_where_keep_cannot(family: str, dtype: str, small_offloads: None) -> None:
    """Under a budget between offloading's least and keeping's least, ``keep`` stops with a
    DeviceMemoryError and ``auto`` plans its blocks, traces again under the plan and trains
    equal to plain PyTorch (the plan keeps some blocks where it can: it is not just offload)."""
    build, batch = AUTO_FAMILIES[family]
    steps = 5

    def loss(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            return model(**b).loss  # type: ignore[no-any-return]

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    want = []
    for s in range(steps):
        out = loss(ref, batch(s))
        out.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(out.item())

    def config(policy: str, budget: int | str) -> dict[str, Any]:
        cfg = {"device": "cpu", "device_memory_budget": budget, "default_chunk_size": 8192,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "activations": {"policy": policy}}  # fmt: skip
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        return cfg

    keep_min = _minimum(build, config("keep", "256MB"), batch(0), loss)
    off_min = _minimum(build, config("offload", "256MB"), batch(0), loss)
    assert off_min < 0.9 * keep_min, (off_min, keep_min)
    budget = (keep_min + off_min) // 2
    with pytest.raises(chunkstar.DeviceMemoryError):
        _minimum(build, config("keep", budget), batch(0), loss)
    engine, opt = chunkstar.initialize_engine(build, config=config("auto", budget))
    got = []
    try:
        for s in range(steps):
            out = loss(engine, batch(s))
            engine.backward(out)
            opt.step()
            opt.zero_grad()
            got.append(out.item())
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL[dtype], f"{family}/auto/{dtype}")
    plan = stats["activation_plan"]
    assert not stats["activation_measuring"] and plan["fits"] and stats["activation_plan_fallbacks"] == 0
    assert set(plan["blocks"].values()) <= {"keep", "checkpoint", "offload"} and set(plan["blocks"].values()) != {"keep"}
    assert stats["activation_blocks"] == {p: list(plan["blocks"].values()).count(p) for p in ("keep", "checkpoint", "offload")}
    assert stats["device_peak_bytes"] <= budget  # and the strict device checks every moment against it (tests/conftest.py)


def _mid_budget(build: Any, base: dict[str, Any], batch: Any) -> int:
    """A budget between offloading every block's least and keeping every block's least."""

    def loss(model: Any, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**b).loss  # type: ignore[no-any-return]

    base = {**base, "device_memory_budget": "256MB"}
    keep_min = _minimum(build, {**base, "activations": {"policy": "keep"}}, batch, loss)
    off_min = _minimum(build, {**base, "activations": {"policy": "offload"}}, batch, loss)
    return (keep_min + off_min) // 2


def test_auto_with_the_habits_of_real_loops(monkeypatch: pytest.MonkeyPatch, small_offloads: None) -> None:
    """Accumulation over two micro-batches, the second through a plain ``loss.backward()``,
    an evaluation under ``no_grad`` and one under ``inference_mode`` between steps, and random
    delays before every copy (a copy used before it landed would show as a wrong loss): auto
    trains as plain PyTorch does."""
    case = CASES["gpt2"]
    steps, accum = 5, 2
    want = train_reference(case, steps, accum=accum)
    base = engine_config("fp32", budget="256MB", accum=accum)
    budget = _mid_budget(case.build, base, case.batch(0))
    monkeypatch.setenv("CHUNKSTAR_DEBUG_COPY_DELAY_MS", "0-3")
    engine, opt = chunkstar.initialize_engine(case.build, config={**base, "device_memory_budget": budget, "activations": {"policy": "auto"}})
    got = []
    try:
        for step in range(steps):
            for micro in range(accum):
                loss = case.loss(engine, case.batch(step * accum + micro), torch.float32)
                if micro == 0:
                    engine.backward(loss)
                else:
                    loss.backward()
                got.append(loss.item())
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                engine(**case.batch(100))
            with torch.inference_mode():
                engine(**case.batch(101))
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], "auto with accumulation, plain backward and evaluations")
    assert stats["activation_plan"]["fits"] and not stats["activation_measuring"]
    assert set(stats["activation_plan"]["blocks"].values()) != {"keep"}
    assert stats["activation_plan"]["timed_on_frozen_step"]  # planned on a frozen micro-step's forward times


_POLICY_OF = {"K": ActivationPolicy.KEEP, "C": ActivationPolicy.CHECKPOINT, "O": ActivationPolicy.OFFLOAD}


@pytest.mark.parametrize("pattern", ["OKKK", "KOKO", "OOKK", "OCKO", "COOK"])
def test_a_plan_holds_no_more_than_its_model_says(pattern: str, monkeypatch: pytest.MonkeyPatch, small_offloads: None) -> None:
    """The plan's model of what each policy holds (Note [activation plan]) and the mechanism
    agree, for any mix of policies: every moment of the trace under a plan holds at most the
    measuring run's non-model bytes plus what the model adds there, so a budget the plan fits
    holds by design. (A kept block after an offloaded one once held the offloaded block's bytes
    until the backward, where the model let them go after the kept block's forward.)"""
    import chunkstar.runtime.activation_planning as planning
    from chunkstar.activations.plan import MARGIN_BYTES, MARGIN_FRACTION, _added
    from chunkstar.runtime import iteration

    forced = tuple(_POLICY_OF[c] for c in pattern)
    seen: dict[str, Any] = {}
    real_plan = planning.plan_activations

    def forced_plan(blocks: Any, headroom: Any, *args: Any, **kwargs: Any) -> Any:
        seen["blocks"] = blocks
        return dataclasses.replace(real_plan(blocks, headroom, *args, **kwargs), policies=forced, overlap=True)

    real_measure = iteration.Iteration._plan_activations

    def capture(self: Any, act: Any) -> Any:
        seen["measured"] = [(r.module, r.stage, r.non_model_peak) for r in self.cursor.trace.records]
        return real_measure(self, act)

    monkeypatch.setattr(planning, "plan_activations", forced_plan)
    monkeypatch.setattr(iteration.Iteration, "_plan_activations", capture)
    case = CASES["gpt2"]
    engine, opt = chunkstar.initialize_engine(case.build, config=engine_config("fp32", budget="256MB", activations={"policy": "auto"}))
    try:
        train_engine(engine, opt, case, 4)  # 2 measured, 2 traced under the plan
        planned = [(r.module, r.stage, r.non_model_peak) for r in engine._iteration.cursor.trace.records]
        assert engine.stats()["activation_blocks"] == {p.value: forced.count(p) for p in _POLICY_OF.values()}
    finally:
        engine.close()
    measured = seen["measured"]
    added = _added(seen["blocks"], forced, len(measured))
    margin = MARGIN_BYTES + int(MARGIN_FRACTION * max(added))
    # recomputation adds backward moments: compare the forward's, and the backward's where the moments agree
    n = len(measured) if "C" not in pattern else next(m for m, r in enumerate(measured) if r[1] == "bwd")
    assert [r[:2] for r in planned[:n]] == [r[:2] for r in measured[:n]]
    over = [(m, measured[m][0], measured[m][1], planned[m][2] - measured[m][2] - added[m]) for m in range(n)]
    assert all(x[3] <= margin for x in over), [x for x in over if x[3] > margin]


def test_a_frozen_steps_forward_times_plan_again(monkeypatch: pytest.MonkeyPatch, small_offloads: None) -> None:
    """The plan's first frozen step times the blocks' forward; times far from the measured ones
    plan again and, where the plan changes, trace it afresh, training exactly throughout. Here
    the frozen step reports forwards too short to hide any copy: an offloaded block is then
    dearer than recomputing it, and no block stays offloaded."""
    case = CASES["gpt2"]
    steps = 8
    want = train_reference(case, steps)
    base = engine_config("fp32", budget="256MB")
    budget = _mid_budget(case.build, base, case.batch(0))
    monkeypatch.setattr(BlockActivations, "frozen_forward_s", lambda self: [1e-9] * len(self.blocks))
    engine, opt = chunkstar.initialize_engine(
        case.build, config={**base, "device_memory_budget": budget, "device_link_bandwidth": "1GB/s", "activations": {"policy": "auto"}}
    )  # fmt: skip
    try:
        got = train_engine(engine, opt, case, 4)  # 2 measured, 2 traced under the plan
        planned = dict(engine.stats()["activation_plan"])
        got += train_engine(engine, opt, case, range(4, 5))  # the first frozen step, timed
        first = dict(engine.stats()["activation_plan"])
        got += train_engine(engine, opt, case, range(5, steps))
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], "auto planned again on a frozen step's times")
    plan = stats["activation_plan"]
    assert not planned["timed_on_frozen_step"] and "offload" in planned["blocks"].values()
    assert first["timed_on_frozen_step"] and set(first["forward_seconds"].values()) == {1e-9}
    assert "offload" not in plan["blocks"].values() and plan["fits"] and not stats["activation_measuring"]
    assert stats["activation_blocks"] == {p: list(plan["blocks"].values()).count(p) for p in ("keep", "checkpoint", "offload")}


def test_auto_with_the_disk_tier(tmp_path: Any, small_offloads: None) -> None:
    """The optimizer state in files (the disk tier) beside a planned activation policy: the two
    share the host memory and the copy engines, and training stays exact."""
    case = CASES["gpt2"]
    steps = 6
    want = train_reference(case, steps)
    base = engine_config("fp32", budget="256MB")
    budget = _mid_budget(case.build, base, case.batch(0))
    engine, opt = chunkstar.initialize_engine(case.build, config={
        **base, "device_memory_budget": budget, "activations": {"policy": "auto"}, "disk": {"path": str(tmp_path / "disk")},
    })  # fmt: skip
    try:
        got = train_engine(engine, opt, case, steps)
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], "auto with the disk tier")
    assert stats["disk_bytes_written"] > 0 and stats["disk_bytes_read"] > 0
    plan = stats["activation_plan"]
    assert plan["fits"] and not stats["activation_measuring"] and set(plan["blocks"].values()) != {"keep"}
    assert stats["device_peak_bytes"] <= budget


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_auto_with_compiled_blocks(small_offloads: None) -> None:
    """Blocks compiled as torchtitan users do (``block.compile()``): the plan changes what the
    compiled forward runs (Dynamo compiles again for the new policy) and training stays exact."""
    from tests.core.hooks.test_compile import Graphs, compiled_gpt2

    case = CASES["gpt2"]
    want = train_reference(case, 6)
    torch._dynamo.reset()
    graphs = Graphs()
    base = engine_config("fp32", budget="256MB")
    # a compiled block's backward is one moment holding all of its chunks: the budget is the compiled model's
    budget = _mid_budget(lambda: compiled_gpt2(Graphs()), base, case.batch(0))
    torch._dynamo.reset()
    try:
        engine, opt = chunkstar.initialize_engine(
            lambda: compiled_gpt2(graphs), config={**base, "device_memory_budget": budget, "activations": {"policy": "auto"}}
        )
        try:
            got = train_engine(engine, opt, case, 6)
            stats = engine.stats()
        finally:
            engine.close()
    finally:
        torch._dynamo.reset()
    assert_losses_close(got, want, RTOL["fp32"], "auto, compiled blocks")
    assert stats["compiled_units"] == 4 and stats["compiled_calls"] > 0 and graphs.count >= 4
    assert stats["activation_plan"]["fits"] and set(stats["activation_plan"]["blocks"].values()) != {"keep"}


def test_a_warm_up_that_does_not_fit_names_the_blocks_activations_and_what_auto_would_do(small_offloads: None) -> None:
    case = CASES["gpt2"]
    base = engine_config("fp32", budget="256MB")
    budget = _mid_budget(case.build, base, case.batch(0))
    engine, _opt = chunkstar.initialize_engine(case.build, config={**base, "device_memory_budget": budget})
    with pytest.raises(chunkstar.DeviceMemoryError) as err:
        engine.backward(case.loss(engine, case.batch(0), torch.float32))
    engine.close()
    text = str(err.value)
    assert "bytes were activations" in text and "of the model's 4 blocks" in text, text
    assert '"activations": {"policy": "auto"}' in text and "with every block offloaded" in text, text
    # the count is the warm-up's only, and leaves the model as it was
    assert "forward" not in engine.module.transformer.h[0].__dict__
    # a model without blocks under keep: nothing to count, nothing refused
    mlp, _ = chunkstar.initialize_engine(CASES["mlp"].build, config=engine_config("fp32", budget="64MB"))
    mlp.close()


def test_auto_measures_and_plans_again_when_the_run_changes_shape(small_offloads: None) -> None:
    """Longer sequences after the plan: the trace is outgrown, the blocks are measured again
    (every block offloaded) and planned anew for the new shape, and training stays exact."""
    from tests.core._models import gpt2_batch

    case = CASES["gpt2"]
    long_case = type(case)("gpt2-long", case.build, lambda s: gpt2_batch(s, seq=8 if s < 5 else 32), case.loss)
    want = train_reference(long_case, 10)
    base = engine_config("fp32", budget="256MB")
    budget = _mid_budget(case.build, base, gpt2_batch(0, seq=32))  # sized for the long sequences
    engine, opt = chunkstar.initialize_engine(case.build, config={**base, "device_memory_budget": budget, "activations": {"policy": "auto"}})
    try:
        got = train_engine(engine, opt, long_case, 5)
        short = engine.stats()["activation_plan"]
        got += train_engine(engine, opt, long_case, range(5, 10))
        stats = engine.stats()
    finally:
        engine.close()
    assert_losses_close(got, want, RTOL["fp32"], "auto across a change of shape")
    long = stats["activation_plan"]
    assert not stats["activation_measuring"] and long["fits"]
    assert max(long["saved_bytes"].values()) > 3 * max(short["saved_bytes"].values())  # measured again, at 4x the tokens
    assert set(short["blocks"].values()) == {"keep"} and set(long["blocks"].values()) != {"keep"}
