"""The dry run against real runs (issue 26, 'Checked against what is real', 1).

A dry run on the meta device must decide exactly as the real engine does: on the
CPU device, for GPT-2, Llama and T5 at two budgets each, its chunk moves and bytes
after every step equal a real run's ``engine.stats()``, and its device peak is
within 5% of the real run's measured ``device_peak_bytes``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config, T5ForConditionalGeneration

import chunkstar
from chunkstar.errors import ConfigError

_COUNTERS = ("chunk_moves_to_device", "chunk_moves_to_host", "bytes_to_device", "bytes_to_host", "moves_by_reason",
             "clean_evictions", "n_chunks", "chunk_size", "moments_per_micro_step", "device_adam_chunks")  # fmt: skip

_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=64)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )),
    "t5": lambda: T5ForConditionalGeneration(T5Config(
        vocab_size=512, d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0, pad_token_id=0,
    )),
}  # fmt: skip

# two budgets per model: a tight one (chunks move every step) and a roomier one
_BUDGETS = {"gpt2": ("1700KB", "3MB"), "llama": ("1250KB", "3MB"), "t5": ("1500KB", "3MB")}


def _config(budget: str) -> dict[str, Any]:
    return {"device": "cpu", "device_memory_budget": budget, "default_chunk_size": 40000, "bf16": {"enabled": True}, "overlap": False}


def _inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 32), generator=g)
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(0, 512, (2, 16), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _real(name: str, budget: str, steps: int, config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return _MODELS[name]()

    engine, opt = chunkstar.initialize_engine(build, config=config or _config(budget))
    out = []
    try:
        for _ in range(steps):
            for _ in range(int((config or {}).get("gradient_accumulation_steps", 1))):
                engine.backward(engine(**_inputs(name)).loss)
            opt.step()
            opt.zero_grad()
            if engine.mgr.chunks.disk is not None:
                engine.mgr.chunks.disk.drain()  # the write-behinds issued, done (as the dry run counts them)
            out.append(dict(engine.stats()))
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("name", sorted(_MODELS))
@pytest.mark.parametrize("which", [0, 1])
def test_the_dry_run_decides_as_a_real_run(name: str, which: int) -> None:
    budget = _BUDGETS[name][which]
    real = _real(name, budget, 3)
    report = chunkstar.dry_run(_MODELS[name], _config(budget), _inputs(name), steps=3)
    assert report.fits and report.target == "cpu"
    dry = report.ranks[0].steps
    assert len(dry) == len(real)
    for step, (r, d) in enumerate(zip(real, dry)):
        assert {k: d[k] for k in _COUNTERS} == {k: r[k] for k in _COUNTERS}, (name, budget, step)
    if which == 0:
        assert real[-1]["chunk_moves_to_device"] > 3 * len(real)  # the tight budget makes chunks move every step
    assert dry[-1]["device_peak_bytes"] == pytest.approx(real[-1]["device_peak_bytes"], rel=0.05)
    # what a real run's minimum would say, and the report's
    assert report.minimum_budget == real[-1]["minimum_budget_bytes"]
    assert report.minimum_budget <= chunkstar.parse_bytes(budget)


def test_a_budget_too_small_is_a_verdict_with_the_minimum() -> None:
    real_minimum = _real("gpt2", "2MB", 3)[-1]["minimum_budget_bytes"]
    report = chunkstar.dry_run(_MODELS["gpt2"], _config("600KB"), _inputs("gpt2"))
    assert not report.fits
    rank = report.ranks[0]
    assert "device_memory_budget" in rank.error and rank.steps == []
    # the warm-up's first pass: it covers what that pass measured, as a real run's error does
    assert 0 < report.minimum_budget <= real_minimum
    with pytest.raises(chunkstar.DeviceMemoryError) as err:
        _real("gpt2", "600KB", 1)
    assert err.value.minimum == report.minimum_budget


def test_the_record_adds_up() -> None:
    report = chunkstar.dry_run(_MODELS["gpt2"], _config("1700KB"), _inputs("gpt2"), steps=3)
    rank = report.ranks[0]
    rec = rank.record
    assert rec is not None and rec.moments and rec.flops > 0
    # the last step's moves, moment by moment, are the counters' growth over it
    grown = rank.steps[-1]["bytes_to_device"] - rank.steps[-2]["bytes_to_device"]
    assert rec.moved("host", "device") == grown
    assert {m.stage for m in rec.moments} == {"fwd", "bwd"}
    # a 3-layer GPT-2's matrix products: 2 * 3 (fwd + bwd) * tokens * weights, within the attention's share
    tokens, weights = 2 * 32, 3 * 12 * 64 * 64 + 512 * 64
    assert 6 * tokens * weights <= rec.flops <= 1.5 * 6 * tokens * weights
    assert rec.host_adam_params + rec.device_adam_params == sum(rank.stats["chunk_size"] for _ in range(rank.stats["n_chunks"]))


def test_nothing_gets_bytes() -> None:
    """A model far larger than this machine: 8 ranks of a 1.3B-parameter GPT-2 in a few seconds,
    and the process never holds its weights."""
    import resource

    def big() -> torch.nn.Module:
        return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=2048, n_layer=24, n_head=16, n_positions=256))

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ids = torch.zeros(1, 256, dtype=torch.long)
    report = chunkstar.dry_run(big, {"bf16": {"enabled": True}}, {"input_ids": ids, "labels": ids}, world_size=8,
                               hardware="a100x8_1tb", ranks=[0, 7], steps=3)  # fmt: skip
    assert report.fits and [r.rank for r in report.ranks] == [0, 7]
    assert report.ranks[0].stats["n_params"] > 1.2e9
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 1 << 30  # not 2.6 GB of bf16
    assert report.prediction is not None and report.prediction.seconds > 0
    # an 80 GB device holds this rank's share and its Adam state many times over: hybrid Adam
    # places every chunk this rank owns on it, and only those (one process's count, all
    # chunks of the model beside the peak, once placed none on any rank of a 68B run)
    stats = report.ranks[0].stats
    assert stats["device_adam_chunks"] == stats["n_chunks"] // 8
    assert report.ranks[0].record is not None and report.ranks[0].record.host_adam_params == 0


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="hardware="):
        chunkstar.dry_run(_MODELS["gpt2"], {"bf16": {"enabled": True}}, _inputs("gpt2"))
    with pytest.raises(ValueError, match="unknown hardware"):
        chunkstar.dry_run(_MODELS["gpt2"], {}, _inputs("gpt2"), hardware="a100")
    with pytest.raises(ValueError, match="world_size"):
        chunkstar.dry_run(_MODELS["gpt2"], _config("2MB"), _inputs("gpt2"), world_size=0)
    with pytest.raises(ValueError, match="ranks"):
        chunkstar.dry_run(_MODELS["gpt2"], _config("2MB"), _inputs("gpt2"), world_size=2, ranks=[2])
    with pytest.raises(TypeError, match="loss"):
        chunkstar.dry_run(_MODELS["gpt2"], _config("2MB"), {"input_ids": _inputs("gpt2")["input_ids"]})


def test_a_model_reading_values_is_named() -> None:
    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            return y.sum() if bool((y > 0).any()) else y.mean()  # steered by a value

    with pytest.raises(chunkstar.dryrun.DryRunError, match="read the value of a tensor") as err:
        chunkstar.dry_run(Branchy, {**_config("3MB"), "default_chunk_size": 4160}, torch.zeros(4, 64))
    assert "meta" in str(err.value.__cause__)


def test_full_rows_are_what_a_mask_says_and_checkpointing_works() -> None:
    """An all-ones mask and Hugging Face's packed-sequence check (which gradient checkpointing
    reaches) read values: a dry run takes them as full rows, as a real run of such a batch finds."""
    def checkpointed() -> torch.nn.Module:
        m = _MODELS["llama"]()
        m.gradient_checkpointing_enable()
        return m

    inputs = {**_inputs("llama"), "attention_mask": torch.ones(2, 32, dtype=torch.long)}
    real = _real("llama", "3MB", 3)
    report = chunkstar.dry_run(_MODELS["llama"], _config("3MB"), inputs)
    assert {k: report.ranks[0].stats[k] for k in _COUNTERS} == {k: real[-1][k] for k in _COUNTERS}
    lean = chunkstar.dry_run(checkpointed, _config("3MB"), _inputs("llama"))
    assert lean.fits and lean.minimum_budget < report.minimum_budget  # recomputed blocks keep fewer activations


_DISK_COUNTERS = ("disk_bytes_read", "disk_bytes_written", "disk_file_bytes", "disk_staging_budget_bytes",
                  "disk_staging_peak_bytes", "disk_direct_io")  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_the_disk_tier_decides_as_in_a_real_run(name: str, tmp_path: Any) -> None:
    """Note [dry run disk]: the real tier over files that record bytes and hold none. Its
    staging moves, disk bytes, file size and staging peak equal a real run's, and no file is made."""
    real_dir, dry_dir = tmp_path / "real", tmp_path / "dry"
    config = {**_config(_BUDGETS[name][0]), "disk": {"path": str(real_dir)}}
    real = _real(name, _BUDGETS[name][0], 3, config)
    report = chunkstar.dry_run(_MODELS[name], {**config, "disk": {"path": str(dry_dir)}}, _inputs(name), steps=3)
    assert report.fits
    for step, (r, d) in enumerate(zip(real, report.ranks[0].steps)):
        assert {k: d[k] for k in _COUNTERS + _DISK_COUNTERS} == {k: r[k] for k in _COUNTERS + _DISK_COUNTERS}, (name, step)
    assert real[-1]["moves_by_reason"]["stage_in"] > 0 and real[-1]["disk_bytes_written"] > 0
    assert not dry_dir.exists()  # nothing claimed, nothing written
    # the node's host holds the chunks whose home is host memory and the staging pool, once: its plan
    last = report.ranks[0].stats
    param_bytes = real[-1]["model_data_bytes"] - real[-1]["master_and_adam_bytes"]
    # a cpu virtual device lives in host memory too: its budget, or every param chunk if fewer
    device = min(last["device_budget_bytes"], param_bytes)
    staging = last["disk_staging_budget_bytes"]
    assert last["host_memory_plan"] == {"param chunks": param_bytes, "disk staging": staging, "the cpu virtual device": device}
    assert report.host_peak_bytes_per_node == param_bytes + staging + device
    assert last["host_chunk_bytes_peak"] <= report.host_peak_bytes_per_node  # the staged chunks are the pool's
    # the step record carries the staging moves for the time model's disk lane
    rec = report.ranks[0].record
    assert rec is not None and rec.moved("disk", "host") > 0 and rec.moved("host", "disk") > 0
    # all of them: the step's staging runs on the tier's own thread, and a record closed before
    # it was done lost the step's moves (the time model then gave the disk no time at all)
    # on LoHan's node (an RTX 4090 and an NVMe disk) the time model gives the disk its lane
    on_gpu = {k: v for k, v in config.items() if k not in ("device", "device_memory_budget")}
    nvme = chunkstar.dry_run(_MODELS[name], {**on_gpu, "disk": {"path": str(dry_dir)}}, _inputs(name),
                             hardware="rtx4090_256gb_nvme", steps=3)  # fmt: skip
    assert nvme.fits and nvme.prediction is not None and nvme.prediction.busy["disk"] > 0
    assert nvme.ranks[0].stats["disk_bytes_written"] > 0 and not dry_dir.exists()
    # the record holds all of the step's disk moves: the step's staging runs on the tier's own
    # thread (Note [the step issued behind]), and a record closed before it was done lost them
    # (the time model then gave the disk no time at all)
    for r in (report, nvme):
        steps, rec = r.ranks[0].steps, r.ranks[0].record
        read, written = (steps[-1][k] - steps[-2][k] for k in ("disk_bytes_read", "disk_bytes_written"))
        assert rec is not None and (rec.moved("disk", "host"), rec.moved("host", "disk")) == (read, written)


@pytest.mark.parametrize("policy", ["checkpoint", "offload"])
def test_the_activation_policy_decides_as_in_a_real_run(policy: str) -> None:
    """A block policy (Note [activation policies]) runs the same on meta: recomputation, the
    offload's saved tensors (storages of 1 MiB and more, sized as on the real device), the
    device peak they leave and the chunk moves after every step equal a real run's."""

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=256))

    config = {"device": "cpu", "device_memory_budget": "128MB", "default_chunk_size": 40000, "activations": {"policy": policy}}
    ids = torch.randint(0, 512, (4, 256), generator=torch.Generator().manual_seed(1))
    engine, opt = chunkstar.initialize_engine(build, config=config)
    real = []
    try:
        for _ in range(3):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
            real.append(dict(engine.stats()))
    finally:
        engine.close()
    report = chunkstar.dry_run(build, config, {"input_ids": ids, "labels": ids}, steps=3)
    keys = (*_COUNTERS, "device_peak_bytes", "activation_blocks", "activation_recomputed_calls", "activation_offloaded_calls",
            "activation_bytes_to_host", "activation_bytes_to_device")  # fmt: skip
    for step, (r, d) in enumerate(zip(real, report.ranks[0].steps)):
        assert {k: d[k] for k in keys} == {k: r[k] for k in keys}, (policy, step)
    assert real[-1]["activation_bytes_to_host" if policy == "offload" else "activation_recomputed_calls"] > 0


def test_gradient_accumulation_decides_as_in_a_real_run() -> None:
    """Two micro-batches a step: the earlier ones' gradients wait in fp32 accumulators, which a
    dry run keeps on meta (once real CPU tensors, the first copy of a meta gradient stopped it,
    and at the paper's scale they would have been 4 bytes per parameter of real memory)."""
    config = {**_config(_BUDGETS["gpt2"][0]), "gradient_accumulation_steps": 2}
    real = _real("gpt2", _BUDGETS["gpt2"][0], 3, {**config})
    report = chunkstar.dry_run(_MODELS["gpt2"], config, _inputs("gpt2"), steps=3)
    assert report.fits
    for step, (r, d) in enumerate(zip(real, report.ranks[0].steps)):
        assert {k: d[k] for k in _COUNTERS} == {k: r[k] for k in _COUNTERS}, step


def test_auto_plans_at_the_target_s_rates() -> None:
    """Under "auto" a dry run plans its blocks as a real run would, from the blocks' FLOPs at the
    target's rate and the target's host link (nothing on meta takes time to measure), and reports
    the plan; a recomputed block's forward is in the step the time model replays."""
    def build() -> torch.nn.Module:
        return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=1024, n_layer=8, n_head=16, n_positions=1024))

    ids = torch.zeros(8, 1024, dtype=torch.long)
    config = {"bf16": {"enabled": True}, "activations": {"policy": "auto"}}
    report = chunkstar.dry_run(build, config, {"input_ids": ids, "labels": ids}, hardware="v100x8_240gb", steps=5)
    assert report.fits and report.prediction is not None
    last = report.ranks[0].stats
    plan = last["activation_plan"]
    assert not last["activation_measuring"] and plan["fits"] and len(plan["blocks"]) == 8
    from chunkstar.dryrun import hardware_named

    hw = hardware_named("v100x8_240gb")
    assert plan["link_bytes_per_second"] == min(hw.h2d_bandwidth, hw.d2h_bandwidth)
    # a block's forward: about 2 x its 12.6M parameters x 8192 tokens, plus attention, at the V100's rate
    seconds = set(plan["forward_seconds"].values())
    assert len(seconds) == 1 and 0.8 < seconds.pop() * hw.peak_flops * hw.efficiency / (2 * 12.6e6 * 8192) < 1.6
    assert last["activation_blocks"] == {p: list(plan["blocks"].values()).count(p) for p in ("keep", "checkpoint", "offload")}
