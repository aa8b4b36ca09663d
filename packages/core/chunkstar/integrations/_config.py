"""What the integrations share: reading the user's engine config and comparing a value the
user set in it with the one the framework decides (a difference is a ConfigError naming both)."""

from __future__ import annotations

import copy
import os
from typing import Any, Mapping

from chunkstar.config import read_config_file

__all__ = ["ConfigLike", "same", "user_config"]

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
