"""The checks every config value goes through: known keys, objects, finite numbers in bounds,
integers, booleans. Each failure is a :class:`~chunkstar.errors.ConfigError` naming the key.

A leaf module (it imports nothing else of chunkstar but the errors), so the config parser
and the optimizer's parameter-group checks (:mod:`chunkstar.config.hyperparams`) share it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from chunkstar.errors import ConfigError

__all__ = ["boolean", "check_keys", "integer", "mapping", "number"]


def check_keys(section: Mapping[str, Any], allowed: Mapping[str, str] | set[str], where: str) -> None:
    for k in section:
        if k not in allowed:
            choices = ", ".join(sorted(allowed))
            raise ConfigError(f"{where}{k}", f"unknown key; allowed here: {choices}")


def mapping(value: object, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"expected an object/dict, got {type(value).__name__}")
    return value


def number(
    value: object, key: str, *, lo: float | None = None, lo_open: bool = False, hi: float | None = None, hi_open: bool = True
) -> float:
    """A finite number within the bounds (NaN and inf are never a setting)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, f"expected a number, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except OverflowError:  # an int past float's range
        v = math.inf
    if not math.isfinite(v):
        raise ConfigError(key, f"must be a finite number, got {value!r}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ConfigError(key, f"must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise ConfigError(key, f"must be {'<' if hi_open else '<='} {hi}, got {value!r}")
    return v


def integer(value: object, key: str, *, lo: int, hi: int | None = None, why: str = "") -> int:
    given = value  # as the user wrote it, for the messages (1e300, not its 301 digits)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(key, f"expected an integer, got {type(value).__name__} {value!r}")
    if value < lo:
        raise ConfigError(key, f"must be >= {lo}, got {given!r}")
    if hi is not None and value > hi:
        raise ConfigError(key, f"must be <= {hi}{why}, got {given!r}")
    return value


def boolean(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"expected true or false, got {type(value).__name__} {value!r}")
    return value
