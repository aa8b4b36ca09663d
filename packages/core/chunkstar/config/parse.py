"""Parsing the user's config: a DeepSpeed-style dict or JSON file into :class:`EngineConfig`.

Every key is checked here, once, against the sections' fields (:mod:`.sections`);
unknown keys and bad values raise a :class:`~chunkstar.errors.ConfigError` naming
the key and what is allowed. Derived values are resolved here too (Note [config
sections] in :mod:`chunkstar.config`).
"""

from __future__ import annotations

import json
import os
import re
from fractions import Fraction
from typing import Any, Mapping

import torch

from chunkstar.chunk.lists import ChunkList
from chunkstar.config.checks import boolean as _boolean
from chunkstar.config.checks import check_keys as _check_keys
from chunkstar.config.checks import integer as _integer
from chunkstar.config.checks import mapping as _mapping
from chunkstar.config.checks import number as _number
from chunkstar.config.hyperparams import ADAM_HYPERPARAMS, validate_param_group
from chunkstar.config.sections import (
    ActivationPolicy,
    ActivationsConfig,
    DEFAULT_DISK_LISTS,
    DISK_LISTS,
    DiskConfig,
    EngineConfig,
    EvictionPolicyName,
    LossScaleConfig,
    OptimizerConfig,
    PlacementConfig,
    Precision,
    ScheduleConfig,
    _default,
    _help_of,
)
from chunkstar.errors import ConfigError

__all__ = ["host_memory_bytes", "parse_bytes", "parse_config", "read_config_file"]


_KEY_HELP = _help_of(EngineConfig, PlacementConfig, ScheduleConfig, OptimizerConfig, LossScaleConfig, DiskConfig, ActivationsConfig)
_DISK_KEYS = {k.removeprefix("disk."): v for k, v in _KEY_HELP.items() if k.startswith("disk.")}
_ACTIVATION_KEYS = {k.removeprefix("activations."): v for k, v in _KEY_HELP.items() if k.startswith("activations.")}
_FP16_KEYS = {k.removeprefix("fp16."): v for k, v in _KEY_HELP.items() if k.startswith("fp16.")}
_TOP_KEYS = {
    **{k: v for k, v in _KEY_HELP.items() if "." not in k and " " not in k},
    "optimizer": "{type, params}",
    "bf16": "{enabled}",
    "fp16": "{" + ", ".join(["enabled", *_FP16_KEYS]) + "}",
}


def _parse_disk(value: object) -> DiskConfig | None:
    if value is None:
        return None
    sec = _mapping(value, "disk")
    _check_keys(sec, _DISK_KEYS, "disk.")
    path = sec.get("path")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError("disk.path", f"required: {_DISK_KEYS['path']}; got {path!r}")
    path = os.fsdecode(os.fspath(path))
    if "\0" in path:
        raise ConfigError("disk.path", f"{path!r} holds a NUL byte, which no file system path can")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("disk.path", f"{path!r} is a file; the disk tier needs a directory")
    lists_raw = sec.get("lists", "auto")
    if lists_raw == "auto":
        lists_raw = list(DEFAULT_DISK_LISTS)
    if not isinstance(lists_raw, (list, tuple)) or not lists_raw:
        raise ConfigError("disk.lists", f"expected {_DISK_KEYS['lists']}, got {lists_raw!r}")
    for name in lists_raw:
        if name not in DISK_LISTS:
            raise ConfigError("disk.lists", f"unknown list {name!r}; choose among {', '.join(DISK_LISTS)}")
    lists = tuple(ChunkList(n) for n in DISK_LISTS if n in lists_raw)  # in the lists' own order, once each
    lists_auto = "lists" not in sec or sec["lists"] == "auto"
    staging_raw = sec.get("staging_budget", "auto")
    staging = None
    if staging_raw != "auto":  # host buffers: Note [sizes the machine could hold]
        host = host_memory_bytes()
        staging = _at_most(parse_bytes(staging_raw, "disk.staging_budget"),
                           (host, f"this machine's physical memory ({_fmt_size(host or 0)})"), "disk.staging_budget", staging_raw)  # fmt: skip
    on_stale = sec.get("on_stale", _default(DiskConfig, "on_stale"))
    if on_stale not in ("refuse", "wipe"):
        raise ConfigError("disk.on_stale", f"got {on_stale!r}; expected {_DISK_KEYS['on_stale']}")
    return DiskConfig(path=path, lists=lists, lists_auto=lists_auto, staging_budget=staging, on_stale=on_stale,
                      direct=_boolean(sec.get("direct", _default(DiskConfig, "direct")), "disk.direct"),
                      verify=_boolean(sec.get("verify", _default(DiskConfig, "verify")), "disk.verify"))  # fmt: skip

_CLASS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _parse_activations(value: object) -> ActivationsConfig:
    if value is None:
        return ActivationsConfig()
    sec = _mapping(value, "activations")
    _check_keys(sec, _ACTIVATION_KEYS, "activations.")
    policy_raw = sec.get("policy", ActivationPolicy.KEEP.value)
    try:
        policy = ActivationPolicy(policy_raw)
    except ValueError:
        raise ConfigError("activations.policy", f"got {policy_raw!r}; expected {_ACTIVATION_KEYS['policy']}") from None
    blocks_raw = sec.get("blocks", "auto")
    blocks: tuple[str, ...] | None = None
    if blocks_raw != "auto":
        if isinstance(blocks_raw, str):
            blocks_raw = [blocks_raw]
        if (
            not isinstance(blocks_raw, (list, tuple)) or not blocks_raw
            or not all(isinstance(b, str) and _CLASS_NAME.fullmatch(b) for b in blocks_raw)
        ):  # fmt: skip
            raise ConfigError("activations.blocks", f"got {blocks_raw!r}; expected {_ACTIVATION_KEYS['blocks']}")
        blocks = tuple(dict.fromkeys(blocks_raw))
    return ActivationsConfig(policy=policy, blocks=blocks)


# Bounds on fp16 loss scaling. A scale of 2**63 (9.2e18) already turns the fp16
# gradients (max 65504) of any loss above ~1e-14 into inf, so a larger start only
# costs skipped steps while the scale halves down; far beyond it the scale leaves
# fp32 (2**128) and then Python's float (2.0**1024 raises OverflowError). A window
# longer than any run means the scale never grows, and each overflow hysteresis
# tolerates is a skipped step: values past these are typos, not settings.
#
# A static scale (fp16.loss_scale > 0) never comes down, so its bounds are where no
# gradient can live: fp16 holds magnitudes from 2**-24 (its smallest subnormal) to
# 65504 (just under 2**16). Above 2**40 = 2**16 x 2**24 every gradient fp16 could
# hold unscaled overflows once scaled, so every step is skipped, for ever (a run
# with 1e13 did nothing); below 2**-40 every one it could hold underflows to 0, so
# every update is Adam's of a zero gradient (a run with 1e-30 did that). DeepSpeed's
# 0 means dynamic scaling. The same floor holds for min_loss_scale, which a dynamic
# scale never passes.
_MAX_SCALE_POWER = 63
_MAX_LOSS_SCALE = 2.0**_MAX_SCALE_POWER
_STATIC_SCALE_POWER = 40
_MAX_LOSS_SCALE_WINDOW = 10_000_000
_MAX_HYSTERESIS = 1_000
_MAX_SLACK = 0.5
# engine.backward divides the loss by gradient_accumulation_steps (a torch scalar: an
# integer past 2**63 cannot even be one, and 1e300 failed there with a raw OverflowError);
# a step every million micro-batches is days of work per step, so more is a typo
_MAX_ACCUMULATION_STEPS = 1_000_000

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_bytes(value: object, key: str = "device_memory_budget") -> int:
    """``4096``, ``"512MB"``, ``"1.5 GiB"`` -> bytes. Decimal units are powers of 1000."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a byte count, got {value!r}; {_KEY_HELP.get(key, '')}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(key, f"cannot read {value!r} as a size; {_KEY_HELP.get(key, '')} (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2).lower()])  # exact: no float overflow
    else:
        raise ConfigError(key, f"expected a byte count, got {type(value).__name__} {value!r}; {_KEY_HELP.get(key, '')}")
    if n <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    return n


# Note [sizes the machine could hold]
# A size is checked against the machine it configures, not only for being positive:
# '9999999TB' or 10**30 as a budget parsed, and the engine then planned with it as if
# the memory were there (no eviction ever, until the allocator failed mid-step). The
# CPU virtual device is host memory, so its budget is at most the host's physical
# memory, as is the disk tier's staging (host buffers); a CUDA device's budget is at
# most its total memory; a chunk holds at most the device's bytes. The figures are the
# physical totals, not what is free now: a budget is a ceiling the engine plans under,
# and what is free changes while it runs. Where the total cannot be read, nothing is
# bounded. The emulated link's bandwidth lies between a slow USB link and ten times
# HBM's: below it every copy takes minutes (a value in B/s read as MB/s), above it the
# emulation is off in all but name.
_MIN_LINK_BANDWIDTH = 1e6  # bytes/s
_MAX_LINK_BANDWIDTH = 1e14


def host_memory_bytes() -> int | None:
    """The host's physical memory in bytes, or None where the platform does not say."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return None
    return n if n > 0 else None


def _device_memory_bytes(device: torch.device) -> tuple[int | None, str]:
    """The memory a device budget may not exceed, and what it is, for messages."""
    if device.type == "cuda":
        try:
            total = int(torch.cuda.get_device_properties(device).total_memory)
        except (RuntimeError, AssertionError):  # the driver cannot say: the budget stays unbounded
            return None, str(device)
        return total, f"the total memory of {device} ({_fmt_size(total)})"
    host = host_memory_bytes()
    return host, f"this machine's physical memory ({_fmt_size(host or 0)}), which the cpu virtual device lives in"


def _fmt_size(n: int) -> str:
    if n >= 1 << 60:  # past float's range for the longest digit strings
        return f"about 10^{len(str(n)) - 1} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _at_most(n: int, limit: tuple[int | None, str], key: str, raw: object) -> int:
    total, what = limit
    if total is not None and n > total:
        raise ConfigError(key, f"{raw!r} is {_fmt_size(n)}, more than {what}; give at most that")
    return n


def _parse_optimizer(section: object, cfg: Mapping[str, Any], loss_scale: LossScaleConfig, on_disk: bool) -> OptimizerConfig:
    sec = _mapping(section, "optimizer")
    _check_keys(sec, {"type", "params"}, "optimizer.")
    kind = sec.get("type", "AdamW")
    if kind not in ("Adam", "AdamW"):
        raise ConfigError("optimizer.type", f"unsupported optimizer {kind!r}; chunkstar supports 'Adam' and 'AdamW'")
    params = _mapping(sec.get("params", {}), "optimizer.params")
    _check_keys(params, set(ADAM_HYPERPARAMS), "optimizer.params.")
    defaults = {k: _default(OptimizerConfig, k) for k in ADAM_HYPERPARAMS}
    if kind == "Adam":
        defaults["weight_decay"] = 0.0  # torch.optim.Adam's default; AdamW's is the field's
    p = validate_param_group({**defaults, **params}, "optimizer.params", decoupled=kind == "AdamW")
    return OptimizerConfig(
        decoupled=kind == "AdamW", lr=p["lr"], betas=p["betas"], eps=p["eps"], weight_decay=p["weight_decay"],
        gradient_clipping=_number(cfg.get("gradient_clipping", _default(OptimizerConfig, "gradient_clipping")), "gradient_clipping", lo=0.0),
        accumulation_steps=_integer(
            cfg.get("gradient_accumulation_steps", _default(OptimizerConfig, "accumulation_steps")), "gradient_accumulation_steps",
            lo=1, hi=_MAX_ACCUMULATION_STEPS, why=" (micro-batches per optimizer step: engine.backward divides the loss by it)",
        ),
        # resolved once: state on disk is updated on the host (Note [disk tier])
        hybrid_adam=_boolean(cfg.get("hybrid_adam", _default(OptimizerConfig, "hybrid_adam")), "hybrid_adam") and not on_disk,
        loss_scale=loss_scale,
    )  # fmt: skip


def _parse_fp16(sec: Mapping[str, Any]) -> LossScaleConfig:
    p = "fp16."
    return LossScaleConfig(
        static_scale=_static_scale(sec.get("loss_scale", 0.0), p + "loss_scale"),
        initial_scale_power=_integer(
            sec.get("initial_scale_power", 16), p + "initial_scale_power", lo=0, hi=_MAX_SCALE_POWER,
            why=" (larger scales overflow every fp16 gradient; DeepSpeed's default is 16)",
        ),
        loss_scale_window=_integer(
            sec.get("loss_scale_window", 1000), p + "loss_scale_window", lo=1, hi=_MAX_LOSS_SCALE_WINDOW,
            why=" (the scale would never grow; for a fixed scale set loss_scale > 0)",
        ),
        hysteresis=_integer(
            sec.get("hysteresis", 2), p + "hysteresis", lo=1, hi=_MAX_HYSTERESIS,
            why=" (each tolerated overflow is a skipped optimizer step; DeepSpeed's default is 2)",
        ),
        min_loss_scale=_number(
            sec.get("min_loss_scale", 1.0), p + "min_loss_scale", lo=2.0**-_STATIC_SCALE_POWER, hi=_MAX_LOSS_SCALE, hi_open=False
        ),
    )  # fmt: skip


def _static_scale(value: object, key: str) -> float:
    """0 (dynamic scaling) or a fixed scale at which some fp16 gradient can live (the bounds' comment above)."""
    v = _number(value, key)
    lo, hi = 2.0**-_STATIC_SCALE_POWER, 2.0**_STATIC_SCALE_POWER
    if v != 0.0 and not lo <= v <= hi:
        raise ConfigError(
            key,
            f"must be 0 (dynamic) or between {lo:.2g} and {hi:.2g} (2**-40 to 2**40), got {value!r}: a fixed scale never "
            f"changes, and fp16 holds gradients from 2**-24 to 65504, so "
            + ("a scale is positive" if v < 0 else
               "above 2**40 every scaled gradient would overflow and every step be skipped" if v > hi else
               "below 2**-40 every scaled gradient would underflow to zero and nothing train")
            + ". Usual fixed scales are 128 to 65536; 0 lets the scale find its level",
        )
    return v


def _parse_device(value: object, local_rank: int, target_memory: int | None) -> torch.device:
    if target_memory is not None:  # a device that is not here (a dry run): its kind, on meta
        if value is not None and (not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value)):
            raise ConfigError("device", f"got {value!r}; allowed: {_TOP_KEYS['device']}")
        return torch.device("cpu" if value == "cpu" else "cuda")
    if value is None:
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ConfigError("device", f"got {value!r}; allowed: {_TOP_KEYS['device']}")
    if value.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{value!r} was asked for but CUDA is not available; use \"cpu\" with a device_memory_budget")
        dev = torch.device(value)
        index = dev.index if dev.index is not None else local_rank
        if index >= torch.cuda.device_count():
            raise ConfigError("device", f"{value!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    return torch.device("cpu")


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in the config file at ``path``, unchecked (:func:`parse_config`
    checks it); what keeps it from being read is a :class:`ConfigError` naming the file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError("<file>", f"config path {path!r} is a directory; give the path of a JSON file (or a dict)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError("<file>", f"config file {path!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("<file>", f"config file {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ConfigError("<file>", f"config file {path!r} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError("<file>", f"config file {path!r} holds a JSON {type(config).__name__}, expected a JSON object {{...}}")
    return config


def parse_config(
    config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str], local_rank: int = 0, *, target_memory: int | None = None
) -> EngineConfig:
    """Parse a DeepSpeed-style dict or JSON file path into an :class:`EngineConfig`.

    ``"device": "cuda"`` (or no device on a CUDA machine) means ``cuda:<local_rank>``.
    An :class:`EngineConfig` is already parsed: it is returned as it is (how a config
    for a device no dict names comes in: the meta device, Note [the meta device] in
    :mod:`chunkstar.device.tiers`).

    ``target_memory``: the config is for a device that is not here, of that many usable
    bytes (the dry run, :mod:`chunkstar.dryrun`): nothing asks torch about it, no device
    or no ``"cuda"`` means a GPU (the budget, when none is given, is all of
    ``target_memory``), ``"cpu"`` the CPU virtual device, and the parsed config runs on
    the meta device.
    """
    if isinstance(config, EngineConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        config = read_config_file(config)
    cfg = _mapping(config, "<config>")
    _check_keys(cfg, _TOP_KEYS, "")

    bf16 = _mapping(cfg.get("bf16", {}), "bf16")
    _check_keys(bf16, {"enabled"}, "bf16.")
    fp16 = _mapping(cfg.get("fp16", {}), "fp16")
    _check_keys(fp16, {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"}, "fp16.")
    bf16_on = _boolean(bf16.get("enabled", False), "bf16.enabled")
    fp16_on = _boolean(fp16.get("enabled", False), "fp16.enabled")
    if bf16_on and fp16_on:
        raise ConfigError("bf16.enabled", "bf16 and fp16 cannot both be enabled; pick one (neither means fp32)")
    precision = Precision.BF16 if bf16_on else Precision.FP16 if fp16_on else Precision.FP32

    device = _parse_device(cfg.get("device"), local_rank, target_memory)
    if target_memory is None:
        device_limit = _device_memory_bytes(device)  # Note [sizes the machine could hold]
    else:
        device_limit = (target_memory, f"the target device's memory ({_fmt_size(target_memory)})")
    budget_raw = cfg.get("device_memory_budget")
    budget = None if budget_raw is None else _at_most(parse_bytes(budget_raw), device_limit, "device_memory_budget", budget_raw)
    if target_memory is not None and device.type == "cuda" and budget is None:
        budget = target_memory
    if device.type == "cpu" and budget is None:
        raise ConfigError(
            "device_memory_budget",
            "required when device is cpu: it is the size of the virtual device (e.g. \"2GB\")",
        )

    loss_scale = _parse_fp16(fp16)  # checked even while fp16 is off: a bad value is a typo either way
    slack_default = 0.1 if device.type == "cuda" else 0.0
    slack = _number(cfg.get("device_memory_slack", slack_default), "device_memory_slack", lo=0.0, hi=_MAX_SLACK)

    bandwidth = None
    if cfg.get("device_link_bandwidth") is not None:
        if device.type != "cpu":
            raise ConfigError(
                "device_link_bandwidth", "emulates a link on the cpu virtual device only; a real device has its own"
            )
        raw_bw = cfg["device_link_bandwidth"]
        if isinstance(raw_bw, str) and raw_bw.strip().lower().endswith("/s"):
            raw_bw = raw_bw.strip()[:-2]
        bandwidth = float(parse_bytes(raw_bw, "device_link_bandwidth"))
        if not _MIN_LINK_BANDWIDTH <= bandwidth <= _MAX_LINK_BANDWIDTH:
            raise ConfigError(
                "device_link_bandwidth",
                f"{cfg['device_link_bandwidth']!r} is not a link's speed: give 1MB/s to 100TB/s "
                "(a PCIe 4 x16 link moves about 25GB/s)",
            )

    window_raw = cfg.get("prefetch_window", "auto")
    window = None if window_raw == "auto" else _at_most(parse_bytes(window_raw, "prefetch_window"), device_limit, "prefetch_window", window_raw)
    if window is not None and window <= 0:
        raise ConfigError("prefetch_window", f"got {window_raw!r}; expected {_TOP_KEYS['prefetch_window']} (> 0)")

    reduce_raw = cfg.get("reduce_dtype", "fp32")
    reduce_dtypes = {"fp32": torch.float32, "float32": torch.float32}
    if precision is not Precision.FP32:
        reduce_dtypes[precision.value] = precision.dtype
    if not isinstance(reduce_raw, str) or reduce_raw.lower() not in reduce_dtypes:
        raise ConfigError("reduce_dtype", f"got {reduce_raw!r}; expected {_TOP_KEYS['reduce_dtype']}")
    reduce_dtype = reduce_dtypes[reduce_raw.lower()]

    chunk_raw = cfg.get("default_chunk_size", "auto")
    chunk_size = None
    if chunk_raw != "auto":
        chunk_size = _integer(chunk_raw, "default_chunk_size", lo=1)
        total, what = device_limit
        if total is not None and chunk_size * precision.dtype.itemsize > total:
            raise ConfigError(
                "default_chunk_size",
                f"{chunk_raw!r} elements of {precision.value} are {_fmt_size(chunk_size * precision.dtype.itemsize)}, "
                f"more than {what}: one chunk must fit on the device",
            )

    policy_raw = cfg.get("eviction_policy", EvictionPolicyName.FURTHEST_NEXT_USE.value)
    try:
        policy = EvictionPolicyName(policy_raw)
    except ValueError:
        raise ConfigError("eviction_policy", f"got {policy_raw!r}; allowed: {_TOP_KEYS['eviction_policy']}") from None

    disk = _parse_disk(cfg.get("disk"))
    host_raw = cfg.get("host_memory_budget", "auto")
    host_budget = None
    if host_raw != "auto":
        host = host_memory_bytes()
        host_budget = _at_most(parse_bytes(host_raw, "host_memory_budget"),
                               (host, f"this machine's physical memory ({_fmt_size(host or 0)})"), "host_memory_budget", host_raw)  # fmt: skip
        if host_budget <= 0:
            raise ConfigError("host_memory_budget", f"got {host_raw!r}; expected {_TOP_KEYS['host_memory_budget']} (> 0)")
    device_size = device_limit[0] if device.type == "cuda" else None  # a GPU's own size (a dry run's: the target's)
    if target_memory is not None:
        device = torch.device("meta")  # every decision as on the target, no byte anywhere (Note [the meta device])
    placement = PlacementConfig(
        device=device, budget=budget, slack=slack, chunk_size=chunk_size, eviction_policy=policy,
        overlap=_boolean(cfg.get("overlap", _default(PlacementConfig, "overlap")), "overlap"), link_bandwidth=bandwidth,
        device_size=device_size,
    )  # fmt: skip
    return EngineConfig(
        placement=placement,
        precision=precision,
        optimizer=_parse_optimizer(
            cfg.get("optimizer", {"type": "AdamW"}), cfg, loss_scale if fp16_on else LossScaleConfig(), disk is not None
        ),
        schedule=ScheduleConfig(prefetch=_boolean(cfg.get("prefetch", _default(ScheduleConfig, "prefetch")), "prefetch"), prefetch_window=window),
        reduce_dtype=reduce_dtype,
        disk=disk,
        host_memory_budget=host_budget,
        activations=_parse_activations(cfg.get("activations")),
        raw=dict(cfg),
    )
