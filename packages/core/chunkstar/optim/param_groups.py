"""Adam's hyperparameters and torch-style parameter groups, checked.

The one check for the config's ``optimizer.params`` and for each group a
``param_groups_fn`` returns (and, for AdamW's decay, for each step, where a
scheduler may have changed ``lr``): finite numbers in their ranges, betas in
[0, 1], and ``lr x weight_decay`` below 1. It sits beside the optimizer, which
owns what the values mean; the config parser calls it for its section.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from chunkstar.checks import number
from chunkstar.errors import ConfigError

__all__ = ["ADAM_HYPERPARAMS", "check_decoupled_decay", "validate_param_group"]


def _betas(value: object, key: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(key, f"expected two numbers [beta1, beta2], got {value!r}")
    return (number(value[0], f"{key}[0]", lo=0.0, hi=1.0), number(value[1], f"{key}[1]", lo=0.0, hi=1.0))


# Adam's hyperparameters, the one check for the config's and for each parameter group's
ADAM_HYPERPARAMS: dict[str, Callable[[object, str], Any]] = {
    "lr": lambda v, key: number(v, key, lo=0.0),
    "betas": _betas,
    "eps": lambda v, key: number(v, key, lo=0.0, lo_open=True),
    "weight_decay": lambda v, key: number(v, key, lo=0.0),
}


def validate_param_group(
    group: Mapping[str, Any], where: str, *, decoupled: bool = False, defaults: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A torch-style parameter group with its ``lr``/``betas``/``eps``/``weight_decay``
    checked as the config's are (``where`` names the group in errors, e.g.
    ``param_groups[1]``); returns a copy with ``betas`` as a tuple. Other keys pass.
    With ``decoupled`` (AdamW) the group's decay, its values over ``defaults``, is checked
    too (:func:`check_decoupled_decay`)."""
    out = dict(group)
    for k, check in ADAM_HYPERPARAMS.items():
        if k in out:
            out[k] = check(out[k], f"{where}.{k}")
    if decoupled:
        merged = {**(defaults or {}), **out}
        if "lr" in merged and "weight_decay" in merged:
            check_decoupled_decay(merged["lr"], merged["weight_decay"], f"{where}.weight_decay")
    return out


def check_decoupled_decay(lr: float, weight_decay: float, key: str) -> None:
    """AdamW multiplies every weight by ``1 - lr * weight_decay`` at each step: at 1 or
    more that zeroes the weights or flips their sign each step (``lr 1e30`` or
    ``weight_decay 1e9`` trained to inf/NaN losses), which is never a setting."""
    if lr * weight_decay >= 1:
        raise ConfigError(
            key,
            f"lr x weight_decay is {lr:g} x {weight_decay:g} = {lr * weight_decay:g}; AdamW multiplies each weight by "
            "1 - lr x weight_decay every step, so the product must be below 1 (typical: lr 1e-4..1e-3, weight_decay 0.01..0.1)",
        )
