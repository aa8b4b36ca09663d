"""Norm layers under bf16 and fp16 (Note [norm dtypes] in chunkstar/placement/module_dtype.py).

The reference is plain PyTorch: fp32 weights under ``torch.autocast`` with fused
AdamW. Autocast leaves a norm layer's parameters and running statistics in fp32
and runs the op on its low-precision input; the engine's norm layers must do the
same from their compute-dtype param chunks: same losses (bf16 tolerance), same
running statistics, and an evaluation forward that works. Each case trains under
a budget that forces chunk evictions. ``RunningNorm`` is a module no table names:
the general rule (fp32 buffers beside parameters) must cover it.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import chunkstar
from chunkstar.placement.module_dtype import ModuleFacts, ParamPrecision, param_precision

CLASSES = 10
STEPS = 5
LR = 1e-2


class RunningNorm(nn.Module):
    """A norm layer of the user's own (an HF-style custom module): fp32 running statistics
    beside its parameters, and ``F.batch_norm`` in its forward. No table names it."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, 1e-5)


def conv_net(norm: Callable[[int], nn.Module], width: int = 10, depth: int = 4) -> nn.Module:
    """Conv blocks (conv, norm, ReLU) on 3x8x8 images, a pool and a linear head; no
    parameter is larger than a chunk, so each moment needs a chunk or two."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Conv2d(3 if i == 0 else width, width, 3, padding=1), norm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, CLASSES))


def mlp(norm: Callable[[int], nn.Module], width: int = 32, depth: int = 4) -> nn.Module:
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(24 if i == 0 else width, width), norm(width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


class Checkpointed(nn.Module):
    """``block`` under activation checkpointing: its forward (norm hooks included) runs again in backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "batchnorm2d": (lambda: conv_net(nn.BatchNorm2d), (8, 3, 8, 8)),
    "groupnorm": (lambda: conv_net(lambda n: nn.GroupNorm(2, n)), (8, 3, 8, 8)),
    "instancenorm_tracked": (
        lambda: conv_net(lambda n: nn.InstanceNorm2d(n, affine=True, track_running_stats=True)), (8, 3, 8, 8)
    ),
    "batchnorm1d": (lambda: mlp(nn.BatchNorm1d), (16, 24)),
    "layernorm": (lambda: mlp(nn.LayerNorm), (16, 24)),
    "custom_running_norm": (lambda: mlp(RunningNorm), (16, 24)),
    "batchnorm1d_checkpointed": (lambda: nn.Sequential(*(Checkpointed(m) for m in mlp(nn.BatchNorm1d))), (16, 24)),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _data(name: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    shape = MODELS[name][1]
    return [(torch.randn(shape, generator=g), torch.randint(0, CLASSES, (shape[0],), generator=g)) for _ in range(steps)]


def _config(dtype: str, budget: int, chunk_size: int = 1100) -> dict:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": chunk_size,
        dtype: {"enabled": True, **({"loss_scale": 1024.0} if dtype == "fp16" else {})},
    }


def _running_stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in model.named_buffers() if b.is_floating_point()}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_norm_layers_train_like_autocast_under_eviction(name: str, dtype: str) -> None:
    low = DTYPES[dtype]
    data = _data(name, STEPS)

    ref, opt, want, want_eval = _reference(name, low, data)
    # how far the precision alone moves the evaluation from fp32 training: the scale the
    # engine's evaluation is held to (bf16 logits after a few steps differ by ~15%)
    *_, fp32_eval = _reference(name, torch.float32, data)
    eval_noise = (fp32_eval - want_eval).abs().max().item()

    # non-model memory measured once, then half the parameter bytes on top of it (as in test_hooks.py)
    def step(engine: chunkstar.ChunkEngine, optimizer: chunkstar.ChunkAdam, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(engine(x.to(low)).float(), y)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    probe, probe_opt = chunkstar.initialize_engine(lambda: _build(name), 0, _config(dtype, 1 << 30))
    step(probe, probe_opt, *data[0])
    param_bytes = sum(p.numel() * low.itemsize for p in ref.parameters())
    budget = probe.stats()["warmup_non_model_peak_bytes"] + param_bytes // 2

    engine, optimizer = chunkstar.initialize_engine(lambda: _build(name), 0, _config(dtype, budget))
    got = [step(engine, optimizer, x, y) for x, y in data]
    stats = engine.stats()
    assert stats["chunk_moves_to_host"] > 0, "the budget must force evictions"

    rtol = 2e-2 if dtype == "bf16" else 5e-3
    assert got == pytest.approx(want, rel=rtol), f"{name} {dtype}: engine {got} vs autocast {want}"

    # the running statistics stay fp32, as autocast keeps them, and track the reference's
    stats_got, stats_want = _running_stats(engine.module), _running_stats(ref)
    assert stats_got.keys() == stats_want.keys()
    for key, value in stats_got.items():
        assert value.dtype == torch.float32, f"{key} is {value.dtype}"
        # (Adam's sign-like steps on near-zero gradients make a few statistics near zero drift
        # by ~1e-2 in either precision: the weights are rounded to the compute dtype)
        torch.testing.assert_close(value, stats_want[key], rtol=2e-2, atol=2e-2, msg=lambda m: f"{key}: {m}")
    counts = {n: b for n, b in ref.named_buffers() if not b.is_floating_point()}
    assert {n: b for n, b in engine.module.named_buffers() if not b.is_floating_point()} == counts  # num_batches_tracked
    # outside its forward each module holds its own parameters again, in the compute dtype
    assert [id(p) for p in engine.module.parameters()] == [id(p) for p in engine.parameters()]
    assert all(p.dtype == low for p in engine.parameters())
    state = engine.state_dict()  # fp32 masters and fp32 statistics, under the model's own keys
    assert state.keys() == ref.state_dict().keys()
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())

    engine.eval()
    with torch.no_grad():
        got_eval = engine(data[0][0].to(low)).float()
    engine.train()
    eval_diff = (got_eval - want_eval).abs().max().item()
    assert eval_diff <= 2 * eval_noise, f"evaluation differs by {eval_diff:.3g}; the precision alone moves it {eval_noise:.3g}"
    # and training goes on after the evaluation
    assert step(engine, optimizer, *data[1]) == pytest.approx(step_reference(ref, opt, low, *data[1]), rel=rtol)


def _reference(
    name: str, low: torch.dtype, data: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[nn.Module, torch.optim.Optimizer, list[float], torch.Tensor]:
    """Plain PyTorch: fp32 weights under autocast to ``low`` (off for fp32), fused AdamW; the
    model, its optimizer, the losses and the evaluation logits on the first batch."""
    ref = _build(name)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01, fused=True)
    losses = [step_reference(ref, opt, low, x, y) for x, y in data]
    ref.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=low, enabled=low != torch.float32):
        logits = ref(data[0][0]).float()
    return ref, opt, losses, logits


def step_reference(ref: nn.Module, opt: torch.optim.Optimizer, low: torch.dtype, x: torch.Tensor, y: torch.Tensor) -> float:
    ref.train()
    with torch.autocast("cpu", dtype=low, enabled=low != torch.float32):
        loss = F.cross_entropy(ref(x).float(), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def test_fp32_input_to_a_norm_layer_works_as_under_autocast() -> None:
    """A norm layer fed an fp32 tensor (the first layer, or after an op autocast runs in
    fp32) computes as the reference does: fp32 in, fp32 out (bf16 parameters beside an
    fp32 input fail in every CPU norm kernel)."""
    build = lambda: nn.Sequential(nn.LayerNorm(24), nn.Linear(24, CLASSES))  # noqa: E731
    engine, optimizer = chunkstar.initialize_engine(build, 0, _config("bf16", 1 << 30, chunk_size=128))
    seen: list[torch.dtype] = []
    engine.module[0].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    out = engine(torch.randn(4, 24))
    engine.backward(out.float().square().mean())
    optimizer.step()
    assert seen == [torch.float32]
    assert out.dtype == torch.bfloat16  # the Linear after it runs under autocast


def test_a_forward_that_raises_leaves_the_module_its_parameters() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(24, 24)
            self.norm = nn.BatchNorm1d(24)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x))

    engine, optimizer = chunkstar.initialize_engine(Fails, 0, _config("bf16", 1 << 30, chunk_size=128))
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # inside BatchNorm's own forward
        engine(torch.randn(1, 24, dtype=torch.bfloat16))
    norm = engine.module.norm
    assert isinstance(norm.weight, nn.Parameter) and norm.weight.dtype == torch.bfloat16
    assert [id(p) for p in engine.module.parameters()] == [id(p) for p in engine.parameters()]
    engine.backward(engine(torch.randn(4, 24, dtype=torch.bfloat16)).float().square().mean())  # and it trains on
    optimizer.step()


# ---------------------------------------------------------------------------- the policy alone


def _facts(kind: type, params: set[torch.dtype], buffers: set[torch.dtype]) -> ModuleFacts:
    return ModuleFacts(kind, frozenset(params), frozenset(buffers))


@pytest.mark.parametrize(
    "kind",
    [nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d, nn.InstanceNorm2d,
     nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm],
)  # fmt: skip
def test_torch_norm_layers_see_fp32_parameters(kind: type) -> None:
    bf16 = torch.bfloat16
    assert param_precision(_facts(kind, {bf16}, set()), bf16) is ParamPrecision.FP32
    assert param_precision(_facts(kind, {bf16}, {torch.float32}), bf16) is ParamPrecision.FP32
    # in fp32 there is nothing to change
    assert param_precision(_facts(kind, {torch.float32}, {torch.float32}), torch.float32) is ParamPrecision.COMPUTE


def test_a_norm_subclass_inherits_its_precision() -> None:
    class MyLayerNorm(nn.LayerNorm):
        pass

    assert param_precision(_facts(MyLayerNorm, {torch.float16}, set()), torch.float16) is ParamPrecision.FP32


def test_fp32_buffers_beside_parameters_decide_for_an_unknown_module() -> None:
    bf16 = torch.bfloat16
    assert param_precision(_facts(RunningNorm, {bf16}, {torch.float32}), bf16) is ParamPrecision.FP32
    # buffers in the compute dtype (a model built in bf16), or none: the parameters stay as they are
    assert param_precision(_facts(RunningNorm, {bf16}, {bf16}), bf16) is ParamPrecision.COMPUTE
    assert param_precision(_facts(nn.Linear, {bf16}, set()), bf16) is ParamPrecision.COMPUTE
    # a module with buffers but no parameters of its own (rotary caches) has nothing to cast
    assert param_precision(_facts(nn.Module, set(), {torch.float32}), bf16) is ParamPrecision.COMPUTE


def test_a_model_built_in_bf16_keeps_its_norm_layers_as_built() -> None:
    """Buffers in the compute dtype beside a norm layer: the op meets them as built."""
    bf16 = torch.bfloat16
    assert param_precision(_facts(nn.BatchNorm2d, {bf16}, {bf16}), bf16) is ParamPrecision.COMPUTE


def test_facts_of_a_module_read_its_own_tensors_only() -> None:
    block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert ModuleFacts.of(block) == ModuleFacts(nn.Sequential, frozenset(), frozenset())
    bn = ModuleFacts.of(block[1])
    assert bn.param_dtypes == {torch.float32} and bn.buffer_dtypes == {torch.float32}  # num_batches_tracked is int64
