"""FLOP counting, TFLOPS and MFU: the only place in chunkstar where FLOPs are counted.

Two counts are in use in the field (docs/design.md, 'Benchmarks'), and every figure this package
records names the one it used:

* ``patrickstar`` -- ``8 * N * B * s``: PatrickStar's and ColossalAI's count
  (2 forward + 4 backward + 2 recompute FLOPs per parameter per token). The
  published PatrickStar numbers use it, so it is the one to compare them with.
* ``megatron`` -- ``24 * c * B * s * L * h^2 * (1 + s/(6h) + V/(16 L h))``
  (Narayanan et al. 2021): ``c = 4`` with activation recompute, ``c = 3``
  without. It also counts attention scores and the LM head. None of the
  benchmarked systems recompute activations, so runs use ``c = 3``.

MFU (model FLOPs utilisation, PaLM's definition) divides the achieved FLOPs
*without* recompute (Megatron, ``c = 3``) by the hardware's dense bf16/fp16
peak; it is only defined where the peak is known (not on a CPU).

The peaks are :data:`chunkstar.dryrun.HARDWARE`'s (``peak_flops``, with its sources), read on the
first MFU asked for: importing this module imports no torch; that first call does (the core
package imports it).

This module is otherwise arithmetic on ints and floats.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from chunkstar_bench.zoo import ModelSpec

__all__ = [
    "FORMULA_MEGATRON",
    "FORMULA_MFU",
    "FORMULA_PATRICKSTAR",
    "PEAK_TFLOPS",
    "megatron_flops",
    "mfu",
    "patrickstar_flops",
    "peak_tflops",
    "tflops",
]

FORMULA_PATRICKSTAR = "patrickstar: 8*N*B*s"
FORMULA_MEGATRON = "megatron: 24*c*B*s*L*h^2*(1+s/(6h)+V/(16*L*h)), c=3 (no recompute)"
FORMULA_MFU = "mfu: megatron c=3 FLOPs / dense bf16 peak"

_PEAKS_NOT_IN_CORE: dict[str, float | None] = {
    # The core table describes GPU nodes only; a run on a CPU (this package's CPU suites, the
    # virtual device's "cpu (chunkstar's virtual device)") has no published peak, so no MFU.
    "cpu": None,
}
"""Peaks of what :data:`chunkstar.dryrun.HARDWARE` has no entry for, by a key that appears in hardware labels."""

PEAK_TFLOPS: dict[str, float | None]
"""Dense bf16/fp16 peak TFLOPS per accelerator, by a key that appears in hardware labels and GPU names
(``"a100"`` in ``a100x8_1tb`` and in ``NVIDIA A100-SXM4-80GB``): the GPU of each entry of
:data:`chunkstar.dryrun.HARDWARE` (the letters and digits its name starts with) at that entry's
``peak_flops``, then :data:`_PEAKS_NOT_IN_CORE`. Built on first use (module ``__getattr__``)."""


def _gpu_of(node: str) -> str:
    """The GPU a core node's name starts with: ``v100`` of ``v100x8_240gb``, ``rtx4090`` of ``rtx4090_256gb_nvme``."""
    m = re.match(r"[a-z]+\d+", node.lower())
    if m is None:
        raise ValueError(f"chunkstar.dryrun.HARDWARE entry {node!r} does not start with a GPU name (letters, then digits)")
    return m.group(0)


@functools.lru_cache(maxsize=1)
def _peaks() -> dict[str, float | None]:
    from chunkstar.dryrun import HARDWARE  # imports torch: only the first MFU pays for it

    peaks: dict[str, float | None] = {}
    for name, node in HARDWARE.items():
        gpu, peak = _gpu_of(name), node.peak_flops / 1e12
        if peaks.setdefault(gpu, peak) != peak:
            raise ValueError(f"chunkstar.dryrun.HARDWARE gives the {gpu} two peaks: {peaks[gpu]} and {peak} TFLOPS ({name})")
    return {**peaks, **{k: v for k, v in _PEAKS_NOT_IN_CORE.items() if k not in peaks}}


def __getattr__(name: str) -> Any:
    if name == "PEAK_TFLOPS":
        return dict(_peaks())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def patrickstar_flops(n_params: int, batch: int, seq: int) -> int:
    """FLOPs of one training step by PatrickStar's count: ``8 * N * B * s``."""
    return 8 * n_params * batch * seq


def megatron_flops(spec: ModelSpec, batch: int, recompute: bool, *, seq: int | None = None) -> float:
    """FLOPs of one training step by Megatron's count; ``seq`` defaults to the model's own."""
    s = spec.seq_len if seq is None else seq
    h, layers, vocab = spec.hidden, spec.layers, spec.vocab
    c = 4 if recompute else 3
    return 24 * c * batch * s * layers * h * h * (1 + s / (6 * h) + vocab / (16 * layers * h))


def tflops(flops_per_step: float, step_time_s: float, n_devices: int = 1) -> float:
    """Achieved TFLOPS per device: a step's FLOPs (all devices together) over its time, split evenly."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s must be positive, got {step_time_s}")
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices}")
    return flops_per_step / step_time_s / n_devices / 1e12


def peak_tflops(hardware: str) -> float | None:
    """The peak for a hardware label such as ``a100x8_1tb`` or ``h200``, or a GPU's name such as
    ``NVIDIA GeForce RTX 4090`` (spaces and hyphens are dropped before matching); None when unknown."""
    label = re.sub(r"[\s-]", "", hardware.lower())
    for key, peak in _peaks().items():
        if key in label:
            return peak
    return None


def mfu(tflops_per_device: float, hardware: str) -> float | None:
    """Model FLOPs utilisation (0..1) of ``tflops_per_device`` on ``hardware``; None without a peak."""
    peak = peak_tflops(hardware)
    if peak is None:
        return None
    return tflops_per_device / peak
