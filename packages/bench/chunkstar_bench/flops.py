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

This module has no torch dependency; it is arithmetic on ints and floats.
"""

from __future__ import annotations

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

PEAK_TFLOPS: dict[str, float | None] = {
    "v100": 125.0,  # fp16 tensor cores, SXM2
    "a100": 312.0,  # bf16 dense
    "h100": 989.0,  # bf16 dense, SXM
    "h200": 989.0,  # same compute die as the H100 SXM
    "cpu": None,  # no meaningful published peak for "a CPU"
}
"""Dense bf16/fp16 peak TFLOPS per accelerator, by a key that appears in hardware labels."""


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
    """The peak for a hardware label such as ``a100x8_1tb`` or ``h200``; None when unknown."""
    label = hardware.lower()
    for key, peak in PEAK_TFLOPS.items():
        if key in label:
            return peak
    return None


def mfu(tflops_per_device: float, hardware: str) -> float | None:
    """Model FLOPs utilisation (0..1) of ``tflops_per_device`` on ``hardware``; None without a peak."""
    peak = peak_tflops(hardware)
    if peak is None:
        return None
    return tflops_per_device / peak
