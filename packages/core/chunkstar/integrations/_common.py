"""What the integrations share: reading the user's engine config, comparing a value the
user set in it with the one the framework decides (a difference is a ConfigError naming
both), the engine's name for the framework's device, and the engine behind an ``nn.Module``
face that the framework calls instead of the model."""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

import torch
from torch import nn

from chunkstar.config import read_config_file
from chunkstar.runtime.engine import ChunkEngine

__all__ = ["ConfigLike", "EngineFace", "device_agrees", "device_name", "same", "user_config"]

ConfigLike = Mapping[str, Any] | str | os.PathLike[str]


def user_config(config: ConfigLike | None, what: str) -> dict[str, Any]:
    """A copy of ``config`` (a dict, or a JSON file's path); ``what`` names the argument in errors."""
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        return read_config_file(config)  # the file's errors, worded once (config/parse.py)
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise TypeError(f"{what} must be a dict or a JSON file's path, got {type(config).__name__}")


def same(a: Any, b: Any) -> bool:
    """Whether a config value and the framework's are the same setting (1 and 1.0 are; True and 1 are not)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return bool(a == b)


def device_name(device: torch.device) -> str | None:
    """The engine config's ``device`` for the framework's device: "cpu" (the virtual device)
    or "cuda:N"; None for a device the engine does not run on."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    return None


def device_agrees(given: object, device: str) -> bool:
    """Whether the user's config ``device`` names ``device`` ("cuda" names any CUDA device)."""
    return str(given) == device or (str(given) == "cuda" and device.startswith("cuda"))


class EngineFace(nn.Module):
    """The engine behind an ``nn.Module`` face, as DDP's wrapper is: what the framework calls
    instead of the model. ``module`` is the user's model (a child, so ``parameters()``,
    ``train()`` and ``eval()`` reach it); a call runs ``engine(...)``, so the engine's
    iteration begins."""

    def __init__(self, engine: ChunkEngine) -> None:
        super().__init__()
        self.module = engine.module
        self.engine = engine  # not an nn.Module: a plain attribute

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)
