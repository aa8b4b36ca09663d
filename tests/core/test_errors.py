"""Errors a user can cause fail early and say what to change.

- a budget that cannot hold one module plus activations: DeviceMemoryError
  naming the device and the byte figures (never a hang or an allocator OOM);
- bad config: ConfigError (a ValueError) naming the key;
- a model_func that is not a callable returning an nn.Module: TypeError.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import chunkstar

from ._models import CASES, LR, engine_config


def _init(config: Any, model_func: Any = None) -> tuple[Any, Any]:
    return chunkstar.initialize_engine(model_func=model_func or CASES["mlp"].build, local_rank=0, config=config)


def _step(engine: Any, optimizer: Any, name: str = "mlp") -> float:
    case = CASES[name]
    loss = case.loss(engine, case.batch(0), torch.float32)
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def test_errors_are_the_documented_types() -> None:
    assert issubclass(chunkstar.ConfigError, ValueError)
    assert issubclass(chunkstar.DeviceMemoryError, RuntimeError)


def test_over_budget_raises_device_memory_error() -> None:
    # GPT-2's largest module (c_fc, 128 x 512 fp32 = 256 KiB) cannot fit in 64 KiB.
    with pytest.raises(chunkstar.DeviceMemoryError) as info:
        engine, optimizer = _init(engine_config("fp32", budget=64 * 1024), CASES["gpt2"].build)
        _step(engine, optimizer, "gpt2")
    msg = str(info.value)
    assert "cpu" in msg.lower(), msg
    figures = re.findall(r"\d[\d,_]*(?:\.\d+)?", msg)
    assert len(figures) >= 2, f"no bytes needed / bytes free in: {msg}"
    assert re.search(r"bytes|[KMG]i?B\b", msg), msg
    # The error leaves the process usable: nothing of the failed engine (such as
    # the warm-up's memory-tracking dispatch mode) stays installed.
    assert _get_current_dispatch_mode_stack() == [], "a dispatch mode outlived the failed engine"
    assert torch.is_grad_enabled()


CONFIG_CASES = {
    "unknown top-level key": ({"optimiser": {"type": "AdamW"}}, "optimiser"),
    "unknown optimizer param": ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "momentum"),
    "wrong type": ({"gradient_accumulation_steps": "four"}, "gradient_accumulation_steps"),
    "wrong type of clipping": ({"gradient_clipping": "big"}, "gradient_clipping"),
    "bf16 and fp16": ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "bf16"),
    "bad budget string": ({"device_memory_budget": "12XB"}, "device_memory_budget"),
    "negative budget": ({"device_memory_budget": -5}, "device_memory_budget"),
    "unsupported optimizer": ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, "optimizer"),
    "bad chunk size": ({"default_chunk_size": "huge"}, "default_chunk_size"),
}


@pytest.mark.parametrize("what", list(CONFIG_CASES))
def test_bad_config_names_the_key(what: str) -> None:
    change, key = CONFIG_CASES[what]
    config = engine_config("fp32", budget="64MB")
    config.update(change)
    with pytest.raises(chunkstar.ConfigError, match=re.escape(key)) as info:
        _init(config)
    assert isinstance(info.value, ValueError)
    if what == "bf16 and fp16":
        assert "fp16" in str(info.value)
    if what == "unsupported optimizer":
        assert "SGD" in str(info.value)


def test_cpu_without_budget_is_a_config_error() -> None:
    config = engine_config("fp32", budget="64MB")
    del config["device_memory_budget"]
    with pytest.raises(chunkstar.ConfigError, match="device_memory_budget"):
        _init(config)


def test_model_func_must_be_callable() -> None:
    with pytest.raises(TypeError, match="model_func"):
        _init(engine_config("fp32", budget="64MB"), nn.Linear(4, 4).state_dict())


def test_model_func_must_return_a_module() -> None:
    with pytest.raises(TypeError, match="model_func") as info:
        _init(engine_config("fp32", budget="64MB"), lambda: torch.zeros(3))
    assert "Module" in str(info.value) and "Tensor" in str(info.value), str(info.value)


def test_json_config_file(tmp_path: Path) -> None:
    path = tmp_path / "chunkstar.json"
    path.write_text(json.dumps(engine_config("fp32", budget="64MB")))
    engine, optimizer = _init(str(path))
    assert math.isfinite(_step(engine, optimizer))
    assert optimizer.param_groups[0]["lr"] == LR


GROUP_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "lr nan": ({"lr": math.nan}, "param_groups[1].lr"),
    "betas out of range": ({"betas": (0.9, 1.5)}, "param_groups[1].betas[1]"),
    "eps zero": ({"eps": 0.0}, "param_groups[1].eps"),
    "weight_decay inf": ({"weight_decay": math.inf}, "param_groups[1].weight_decay"),
}


@pytest.mark.parametrize("what", list(GROUP_CASES))
def test_bad_param_group_value_names_the_group_and_key(what: str) -> None:
    change, key = GROUP_CASES[what]

    def groups(model: nn.Module) -> list[dict[str, Any]]:
        out = chunkstar.no_decay_param_groups(model)
        out[1].update(change)
        return out

    with pytest.raises(chunkstar.ConfigError, match=re.escape(key)):
        chunkstar.initialize_engine(CASES["mlp"].build, 0, engine_config("fp32", budget="64MB"), param_groups_fn=groups)


def test_chunk_size_larger_than_the_device_budget() -> None:
    # 200_000 fp32 elements = 800 KB per param chunk; the virtual device holds 512 KB
    with pytest.raises(chunkstar.ConfigError, match="default_chunk_size") as info:
        _init(engine_config("fp32", budget="512KB", chunk_size=200_000))
    msg = str(info.value)
    assert "800000" in msg and "512000" in msg, msg


def test_chunk_size_larger_than_the_budget_after_slack() -> None:
    # 200_000 bf16 elements = 400 KB: fits 512 KB, not the 261 KB a slack of 0.49 leaves
    _init(engine_config("bf16", budget="512KB", chunk_size=200_000))
    with pytest.raises(chunkstar.ConfigError, match="default_chunk_size") as info:
        _init(engine_config("bf16", budget="512KB", chunk_size=200_000, device_memory_slack=0.49))
    assert "device_memory_slack 0.49" in str(info.value), str(info.value)


def test_chunk_size_larger_than_the_model() -> None:
    n = sum(p.numel() for p in CASES["mlp"].build().parameters())
    with pytest.raises(chunkstar.ConfigError, match="default_chunk_size") as info:
        _init(engine_config("fp32", budget="64MB", chunk_size=n + 1))
    msg = str(info.value)
    assert str(n) in msg and '"auto"' in msg, msg
    engine, _ = _init(engine_config("fp32", budget="64MB", chunk_size=n))  # exactly one chunk is fine
    assert engine.stats()["n_chunks"] == 1


def test_device_memory_slack_lowers_the_capacity() -> None:
    engine, optimizer = _init(engine_config("fp32", budget=64_000_000, device_memory_slack=0.25))
    assert engine.stats()["device_budget_bytes"] == 48_000_000
    assert math.isfinite(_step(engine, optimizer))
    engine, _ = _init(engine_config("fp32", budget=64_000_000))  # cpu default: no slack
    assert engine.stats()["device_budget_bytes"] == 64_000_000


def test_integer_parameters_stay_a_type_error() -> None:
    def with_ints() -> nn.Module:
        model = nn.Linear(8, 8)
        model.steps = nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)
        return model

    with pytest.raises(TypeError, match="'steps'"):
        _init(engine_config("fp32", budget="64MB", chunk_size="auto"), with_ints)
