"""Adam's hyperparameters and torch-style parameter groups, checked.

The one check for the config's ``optimizer.params``, for each group a
``param_groups_fn`` returns and for each group at each step (where a scheduler
or the user may have changed it): finite numbers in their ranges, betas in
[0, 1], ``eps`` a normal float32 number, Adam's (coupled) ``weight_decay`` at
most :data:`MAX_COUPLED_WEIGHT_DECAY`, and AdamW's ``lr x weight_decay`` below
1. It sits beside the optimizer, which owns what the values mean; the config
parser calls it for its section.

Note [hyperparameters that train to NaN]: the fused Adam kernel computes in
float32 whatever the Python numbers are, and some values that PyTorch accepts
train to NaN, or to nothing, without a word:

* ``eps`` is added to ``sqrt(exp_avg_sq)`` in float32. Below float32's smallest
  normal number (2**-126, 1.2e-38) it is a subnormal, which flush-to-zero modes
  (CUDA's fast paths, ``torch.set_flush_denormal``) make 0, and below 2**-149
  (1.4e-45) it rounds to 0 everywhere: then a parameter whose gradient has been 0
  so far (an unused embedding row, a padding index) updates by 0/0 = NaN, as
  measured with ``eps`` 1e-46 on the test GPT-2 (NaN from the second step on;
  1e-44 trained). PyTorch's Adam accepts ``eps=0`` and gives exactly that. Above
  float32's largest number it is inf and every update is 0. So ``eps`` must be a
  normal float32 number, [2**-126, 3.4e38]; 1e-8 is usual, 1.0 (TensorFlow's
  Inception) is a setting.
* Adam (not AdamW) adds ``weight_decay x weight`` to each gradient, and the
  update divides by the root of its square's average: once the decay term
  outweighs every gradient the loss can give, the loss no longer steers the
  weights (they only shrink), and past 1.8e19 (the square root of float32's
  largest number, for a weight of 1) the square overflows, the update is
  m/inf = 0 and the weights freeze (``weight_decay`` 1e30 did so in silence).
  Usual values are 0 to 0.1; :data:`MAX_COUPLED_WEIGHT_DECAY` (1e4) is far past
  any of them and far below the overflow.
* AdamW multiplies each weight by ``1 - lr x weight_decay``: at 1 or more that
  zeroes the weights or flips their sign every step (:func:`check_decoupled_decay`).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from chunkstar.config.checks import number
from chunkstar.errors import ConfigError

__all__ = ["ADAM_HYPERPARAMS", "MAX_COUPLED_WEIGHT_DECAY", "check_coupled_decay", "check_decoupled_decay", "validate_param_group"]

_F32 = torch.finfo(torch.float32)
MAX_COUPLED_WEIGHT_DECAY = 1e4
"""Adam's (coupled, L2) weight decay at most (Note [hyperparameters that train to NaN])."""


def _betas(value: object, key: str) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(key, f"expected two numbers [beta1, beta2], got {value!r}")
    return (number(value[0], f"{key}[0]", lo=0.0, hi=1.0), number(value[1], f"{key}[1]", lo=0.0, hi=1.0))


def _eps(value: object, key: str) -> float:
    """A normal float32 number (Note [hyperparameters that train to NaN])."""
    v = number(value, key)
    if not float(_F32.tiny) <= v <= float(_F32.max):
        raise ConfigError(
            key,
            f"must be between {float(_F32.tiny):.2g} (float32's smallest normal number) and {float(_F32.max):.2g}, got "
            f"{value!r}: Adam adds eps to sqrt(exp_avg_sq) in float32, where a smaller eps is flushed or rounded to 0, "
            "and a parameter whose gradient has been 0 then updates by 0/0 = NaN (PyTorch's Adam accepts eps=0 and "
            "does that; past float32's largest it is inf, and nothing trains). The usual value is 1e-8",
        )
    return v


# Adam's hyperparameters, the one check for the config's and for each parameter group's
ADAM_HYPERPARAMS: dict[str, Callable[[object, str], Any]] = {
    "lr": lambda v, key: number(v, key, lo=0.0),
    "betas": _betas,
    "eps": _eps,
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
    elif "weight_decay" in out:
        check_coupled_decay(out["weight_decay"], f"{where}.weight_decay")
    return out


def check_coupled_decay(weight_decay: float, key: str) -> None:
    """Adam adds ``weight_decay x weight`` to each gradient: past :data:`MAX_COUPLED_WEIGHT_DECAY`
    the loss no longer steers the weights, and far past it they freeze or turn NaN (Note
    [hyperparameters that train to NaN])."""
    if weight_decay > MAX_COUPLED_WEIGHT_DECAY:
        raise ConfigError(
            key,
            f"must be at most {MAX_COUPLED_WEIGHT_DECAY:g} for Adam, got {weight_decay:g}: Adam adds weight_decay x weight "
            "to every gradient, so the decay outweighs anything the loss asks and the weights only shrink, and once its "
            "square overflows float32 (weight_decay x weight past 1.8e19) every update is 0 or NaN. Usual values are 0 to "
            "0.1 (AdamW, optimizer.type \"AdamW\", decays the weights apart from the gradient)",
        )


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
