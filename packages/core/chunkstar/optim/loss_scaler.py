"""fp16 loss scaling with DeepSpeed's keys and meanings.

Dynamic scaling: start at 2**initial_scale_power; an overflowing step is
skipped; after ``hysteresis`` overflows the scale halves (never below
``min_loss_scale``); after ``loss_scale_window`` clean steps it doubles.
A static scale (``loss_scale`` > 0) never changes.
"""

from __future__ import annotations

import math
from typing import Any

from chunkstar.config import LossScaleConfig

__all__ = ["LossScaler"]


class LossScaler:
    def __init__(self, cfg: LossScaleConfig, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.scale = (2.0 ** cfg.initial_scale_power if cfg.dynamic else cfg.static_scale) if enabled else 1.0
        self._hysteresis_left = cfg.hysteresis
        self._clean_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.enabled or not self.cfg.dynamic:
            return
        if overflow:
            self._clean_steps = 0
            if self._hysteresis_left <= 1:
                self.scale = max(self.scale / 2.0, self.cfg.min_loss_scale)
            else:
                self._hysteresis_left -= 1
            return
        self._clean_steps += 1
        if self._clean_steps % self.cfg.loss_scale_window == 0:
            self.scale *= 2.0
            self._hysteresis_left = self.cfg.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean_steps": self._clean_steps}

    @staticmethod
    def check_state_dict(sd: Any) -> None:
        """Raise ValueError, saying what is wrong, unless ``sd`` is a :meth:`state_dict`
        (a checkpoint's copy may be damaged: it is checked before anything is loaded)."""
        if not isinstance(sd, dict):
            raise ValueError(f"the loss scaler state is {type(sd).__name__}, not a map of 'scale', 'hysteresis_left', 'clean_steps'")
        missing = [k for k in ("scale", "hysteresis_left", "clean_steps") if k not in sd]
        if missing:
            raise ValueError(f"the loss scaler state lacks {missing}")
        scale = sd["scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"the loss scale is {scale!r}, not a positive finite number")
        for k in ("hysteresis_left", "clean_steps"):
            v = sd[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"the loss scaler's '{k}' is {v!r}, not a count (a whole number >= 0)")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.check_state_dict(sd)
        self.scale = float(sd["scale"])
        self._hysteresis_left = int(sd["hysteresis_left"])
        self._clean_steps = int(sd["clean_steps"])
