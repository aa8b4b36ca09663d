"""Config parsing refuses non-finite and absurd values, naming the key.

Parse-level checks only (no engine is built): NaN/inf hyperparameters, loss
scaling past sane bounds, ``device_memory_slack``, and config paths that are
not a JSON object's file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import chunkstar
from chunkstar.config import host_memory_bytes
from chunkstar.config.hyperparams import validate_param_group

NAN, INF = math.nan, math.inf
HOST = host_memory_bytes() or 1 << 40


def _config(**change: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"device": "cpu", "device_memory_budget": "64MB"}
    cfg.update(change)
    return cfg


def _adam(**params: Any) -> dict[str, Any]:
    return {"type": "AdamW", "params": params}


def _fp16(**keys: Any) -> dict[str, Any]:
    return {"enabled": True, **keys}


BAD = {
    "lr nan": (_config(optimizer=_adam(lr=NAN)), "optimizer.params.lr"),
    "lr inf": (_config(optimizer=_adam(lr=INF)), "optimizer.params.lr"),
    "lr past float": (_config(optimizer=_adam(lr=10**400)), "optimizer.params.lr"),
    "eps nan": (_config(optimizer=_adam(eps=NAN)), "optimizer.params.eps"),
    "eps inf": (_config(optimizer=_adam(eps=INF)), "optimizer.params.eps"),
    "beta1 nan": (_config(optimizer=_adam(betas=[NAN, 0.999])), "optimizer.params.betas[0]"),
    "beta2 -inf": (_config(optimizer=_adam(betas=[0.9, -INF])), "optimizer.params.betas[1]"),
    "weight_decay nan": (_config(optimizer=_adam(weight_decay=NAN)), "optimizer.params.weight_decay"),
    "weight_decay inf": (_config(optimizer=_adam(weight_decay=INF)), "optimizer.params.weight_decay"),
    "clipping nan": (_config(gradient_clipping=NAN), "gradient_clipping"),
    "clipping inf": (_config(gradient_clipping=INF), "gradient_clipping"),
    "loss_scale inf": (_config(fp16=_fp16(loss_scale=INF)), "fp16.loss_scale"),
    "loss_scale nan": (_config(fp16=_fp16(loss_scale=NAN)), "fp16.loss_scale"),
    "min_loss_scale inf": (_config(fp16=_fp16(min_loss_scale=INF)), "fp16.min_loss_scale"),
    "min_loss_scale nan": (_config(fp16=_fp16(min_loss_scale=NAN)), "fp16.min_loss_scale"),
    "initial_scale_power 2000": (_config(fp16=_fp16(initial_scale_power=2000)), "fp16.initial_scale_power"),
    "initial_scale_power 64": (_config(fp16=_fp16(initial_scale_power=64)), "fp16.initial_scale_power"),
    "loss_scale_window 1e12": (_config(fp16=_fp16(loss_scale_window=10**12)), "fp16.loss_scale_window"),
    "hysteresis 1e9": (_config(fp16=_fp16(hysteresis=10**9)), "fp16.hysteresis"),
    # a typo in the fp16 section is one even while fp16 is off
    "loss_scale nan, fp16 off": (_config(fp16={"enabled": False, "loss_scale": NAN}), "fp16.loss_scale"),
    "slack negative": (_config(device_memory_slack=-0.1), "device_memory_slack"),
    "slack one half": (_config(device_memory_slack=0.5), "device_memory_slack"),
    "slack nan": (_config(device_memory_slack=NAN), "device_memory_slack"),
    "slack string": (_config(device_memory_slack="10%"), "device_memory_slack"),
    "slack bool": (_config(device_memory_slack=True), "device_memory_slack"),
    "prefetch_window zero": (_config(prefetch_window=0), "prefetch_window"),
    "prefetch_window negative": (_config(prefetch_window=-5), "prefetch_window"),
    "prefetch_window words": (_config(prefetch_window="far"), "prefetch_window"),
    "prefetch_window bool": (_config(prefetch_window=True), "prefetch_window"),
    "reduce_dtype fp16 under bf16": (_config(bf16={"enabled": True}, reduce_dtype="fp16"), "reduce_dtype"),
    "reduce_dtype bf16 under fp32": (_config(reduce_dtype="bf16"), "reduce_dtype"),
    "reduce_dtype words": (_config(reduce_dtype="double"), "reduce_dtype"),
    # sizes past what the machine could hold (Note [sizes the machine could hold])
    "budget 9999999TB": (_config(device_memory_budget="9999999TB"), "device_memory_budget"),
    "budget 1e30": (_config(device_memory_budget=1e30), "device_memory_budget"),
    "budget 10**30": (_config(device_memory_budget=10**30), "device_memory_budget"),
    "budget 400 digits": (_config(device_memory_budget="9" * 400 + "GB"), "device_memory_budget"),
    "budget past host memory": (_config(device_memory_budget=4 * HOST), "device_memory_budget"),
    "prefetch_window 10**30": (_config(prefetch_window=10**30), "prefetch_window"),
    "chunk size 10**30": (_config(default_chunk_size=10**30), "default_chunk_size"),
    "staging 9999999TB": (_config(disk={"path": "/nonexistent/chunks", "staging_budget": "9999999TB"}), "disk.staging_budget"),
    "staging 1e30": (_config(disk={"path": "/nonexistent/chunks", "staging_budget": 1e30}), "disk.staging_budget"),
    # AdamW multiplies the weights by 1 - lr x weight_decay each step
    "AdamW lr 1e30": (_config(optimizer=_adam(lr=1e30)), "optimizer.params.weight_decay"),
    "AdamW weight_decay 1e9": (_config(optimizer=_adam(weight_decay=1e9)), "optimizer.params.weight_decay"),
    # values that train to NaN, or to nothing, in silence (issue 30, item 8)
    "eps below float32's smallest normal": (_config(optimizer=_adam(eps=1e-50)), "optimizer.params.eps"),
    "eps past float32": (_config(optimizer=_adam(eps=1e39)), "optimizer.params.eps"),
    "Adam weight_decay 1e30": (_config(optimizer={"type": "Adam", "params": {"weight_decay": 1e30}}), "optimizer.params.weight_decay"),
    "Adam weight_decay 1e5": (_config(optimizer={"type": "Adam", "params": {"weight_decay": 1e5}}), "optimizer.params.weight_decay"),
    "static loss_scale 1e13": (_config(fp16=_fp16(loss_scale=1e13)), "fp16.loss_scale"),
    "static loss_scale 2**63": (_config(fp16=_fp16(loss_scale=2.0**63)), "fp16.loss_scale"),
    "static loss_scale 1e-30": (_config(fp16=_fp16(loss_scale=1e-30)), "fp16.loss_scale"),
    "min_loss_scale 1e-30": (_config(fp16=_fp16(min_loss_scale=1e-30)), "fp16.min_loss_scale"),
    "gradient_accumulation_steps 1e300": (_config(gradient_accumulation_steps=1e300), "gradient_accumulation_steps"),
    "gradient_accumulation_steps 10**30": (_config(gradient_accumulation_steps=10**30), "gradient_accumulation_steps"),
}


def test_reduce_dtype_is_fp32_unless_the_param_dtype_is_asked_for() -> None:
    assert chunkstar.parse_config(_config(bf16={"enabled": True})).reduce_dtype == torch.float32
    assert chunkstar.parse_config(_config(bf16={"enabled": True}, reduce_dtype="bf16")).reduce_dtype == torch.bfloat16
    assert chunkstar.parse_config(_config(fp16={"enabled": True}, reduce_dtype="fp16")).reduce_dtype == torch.float16


def test_sizes_up_to_what_the_machine_holds_are_accepted() -> None:
    assert chunkstar.parse_config(_config(device_memory_budget=HOST)).placement.budget == HOST
    staged = chunkstar.parse_config(_config(disk={"path": "/nonexistent/chunks", "staging_budget": HOST // 2}))
    assert staged.disk is not None and staged.disk.staging_budget == HOST // 2
    # Adam (coupled) has no decay product to bound; AdamW just below 1 is a setting
    assert chunkstar.parse_config(_config(optimizer={"type": "Adam", "params": {"weight_decay": 1e3}})).optimizer.weight_decay == 1e3
    assert chunkstar.parse_config(_config(optimizer=_adam(lr=0.5, weight_decay=1.9))).optimizer.lr == 0.5


def test_the_size_message_says_what_the_machine_has() -> None:
    with pytest.raises(chunkstar.ConfigError, match=r"physical memory \(\d") as info:
        chunkstar.parse_config(_config(device_memory_budget="9999999TB"))
    assert "9999999TB" in str(info.value)


def test_a_param_groups_adamw_decay_past_one_is_refused() -> None:
    with pytest.raises(chunkstar.ConfigError, match=re.escape("param_groups[1].weight_decay")):
        validate_param_group({"params": [], "weight_decay": 20.0}, "param_groups[1]", decoupled=True, defaults={"lr": 0.1})
    assert validate_param_group({"params": [], "weight_decay": 20.0}, "param_groups[1]", defaults={"lr": 0.1})


def test_prefetch_window_parses() -> None:
    assert chunkstar.parse_config(_config()).schedule.prefetch_window is None  # "auto"
    assert chunkstar.parse_config(_config(prefetch_window="64MB")).schedule.prefetch_window == 64_000_000
    assert chunkstar.parse_config(_config(prefetch_window=4096)).schedule.prefetch_window == 4096


@pytest.mark.parametrize("what", list(BAD))
def test_bad_value_names_the_key(what: str) -> None:
    config, key = BAD[what]
    with pytest.raises(chunkstar.ConfigError, match=re.escape(f"'{key}'")) as info:
        chunkstar.parse_config(config)
    assert info.value.key == key


def test_sane_bounds_are_accepted() -> None:
    cfg = chunkstar.parse_config(
        _config(fp16=_fp16(initial_scale_power=63, loss_scale_window=10_000_000, hysteresis=1000, min_loss_scale=2.0**63))
    )
    assert cfg.optimizer.loss_scale.initial_scale_power == 63
    # a static scale never comes down: 2**40 is the largest at which any fp16 gradient survives
    for scale in (2.0**40, 1.0, 2.0**-40):
        assert chunkstar.parse_config(_config(fp16=_fp16(loss_scale=scale))).optimizer.loss_scale.static_scale == scale
    assert chunkstar.parse_config(_config(fp16=_fp16(loss_scale=0))).optimizer.loss_scale.dynamic  # DeepSpeed's 0: dynamic
    tiny = float(torch.finfo(torch.float32).tiny)
    assert chunkstar.parse_config(_config(optimizer=_adam(eps=tiny))).optimizer.eps == tiny
    assert chunkstar.parse_config(_config(optimizer=_adam(eps=1.0))).optimizer.eps == 1.0  # TF's Inception setting
    assert chunkstar.parse_config(_config(gradient_accumulation_steps=1_000_000)).optimizer.accumulation_steps == 1_000_000


@pytest.mark.parametrize(
    "config, why",
    [
        (_config(optimizer=_adam(eps=1e-50)), r"between 1\.2e-38 .*0/0 = NaN.*PyTorch's Adam accepts eps=0"),
        (_config(optimizer={"type": "Adam", "params": {"weight_decay": 1e30}}), r"at most 10000 .*weight_decay x weight"),
        (_config(fp16=_fp16(loss_scale=1e13)), r"0 \(dynamic\) or between 9\.1e-13 and 1\.1e\+12.*overflow"),
        (_config(fp16=_fp16(loss_scale=1e-30)), r"0 \(dynamic\) or between 9\.1e-13 and 1\.1e\+12.*zero"),
        (_config(gradient_accumulation_steps=1e300), r"<= 1000000 .*micro-batches"),
    ],
)
def test_an_absurd_value_says_the_valid_range_and_why(config: dict[str, Any], why: str) -> None:
    with pytest.raises(chunkstar.ConfigError, match=why):
        chunkstar.parse_config(config)


def test_param_groups_and_steps_refuse_the_same_values() -> None:
    """The config, a param_groups_fn group and a group changed later (at the step) share the checks."""
    with pytest.raises(chunkstar.ConfigError, match=re.escape("param_groups[0].eps")):
        validate_param_group({"params": [], "eps": 1e-45}, "param_groups[0]")
    with pytest.raises(chunkstar.ConfigError, match=re.escape("param_groups[0].weight_decay")):
        validate_param_group({"params": [], "weight_decay": 1e9}, "param_groups[0]", decoupled=False)


def test_initial_scale_power_message_says_why() -> None:
    with pytest.raises(chunkstar.ConfigError, match=r"<= 63") as info:
        chunkstar.parse_config(_config(fp16=_fp16(initial_scale_power=2000)))
    assert "2000" in str(info.value)


def test_device_memory_slack_defaults_and_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    assert chunkstar.parse_config(_config()).placement.slack == 0.0
    assert chunkstar.parse_config(_config(device_memory_slack=0.25)).placement.slack == 0.25
    assert chunkstar.parse_config(_config(device_memory_slack=0)).placement.slack == 0.0
    # on CUDA the default keeps 10% free (Gemini's figure); no GPU needed to parse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = chunkstar.parse_config({"device": "cuda"})
    assert cuda.device == torch.device("cuda", 0)
    assert cuda.placement.slack == 0.1
    assert chunkstar.parse_config({"device": "cuda", "device_memory_slack": 0.0}).placement.slack == 0.0


def test_config_path_that_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(chunkstar.ConfigError, match="directory") as info:
        chunkstar.parse_config(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"cpu"', "42", "null"])
def test_config_file_that_is_not_a_json_object(tmp_path: Path, text: str) -> None:
    path = tmp_path / "chunkstar.json"
    path.write_text(text)
    with pytest.raises(chunkstar.ConfigError, match="JSON object") as info:
        chunkstar.parse_config(str(path))
    assert str(path) in str(info.value)


def test_param_group_values_are_checked_like_the_config() -> None:
    ok = validate_param_group({"params": [], "lr": 0.1, "betas": [0.8, 0.9], "name": "decay"}, "param_groups[0]")
    assert ok["betas"] == (0.8, 0.9) and ok["name"] == "decay"
    with pytest.raises(chunkstar.ConfigError, match=re.escape("param_groups[2].betas[1]")):
        validate_param_group({"params": [], "betas": (0.9, 1.0)}, "param_groups[2]")


@pytest.mark.parametrize("path", ["/tmp/a\0b", Path("/tmp/a\0b")])
def test_a_disk_path_with_a_nul_byte_is_a_config_error(path: str | Path) -> None:
    with pytest.raises(chunkstar.ConfigError, match=r"disk\.path.*NUL"):
        chunkstar.parse_config(_config(disk={"path": path}))
