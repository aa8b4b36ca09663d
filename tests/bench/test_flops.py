"""FLOP counts against hand-computed values; TFLOPS and MFU arithmetic."""

from __future__ import annotations

import pytest

from chunkstar_bench import flops
from chunkstar_bench.zoo import ModelSpec, get, n_params


def test_patrickstar_count_is_eight_n_b_s() -> None:
    assert flops.patrickstar_flops(1000, 2, 3) == 48_000


def test_megatron_count_by_hand() -> None:
    # h=4, L=2, V=16, s=8, B=1: 24*c*1*8*2*16 * (1 + 8/24 + 16/(16*2*4)) = 24*c*256 * 35/24
    spec = ModelSpec(name="hand", hidden=4, layers=2, heads=1, seq_len=8, vocab=16)
    assert flops.megatron_flops(spec, 1, recompute=False) == pytest.approx(3 * 256 * 35)
    assert flops.megatron_flops(spec, 1, recompute=True) == pytest.approx(4 * 256 * 35)
    # an explicit sequence length overrides the model's: s=4 -> 24*3*1*4*2*16*(1 + 4/24 + 1/8)
    assert flops.megatron_flops(spec, 1, recompute=False, seq=4) == pytest.approx(72 * 128 * (1 + 1 / 6 + 1 / 8))


def test_the_two_counts_agree_roughly_on_a_paper_model() -> None:
    # With recompute both count ~8 FLOPs per parameter per token; Megatron adds attention scores and the head.
    spec = get("GPT2_1B")
    ratio = flops.megatron_flops(spec, 8, recompute=True) / flops.patrickstar_flops(n_params(spec), 8, spec.seq_len)
    assert 0.95 < ratio < 1.2


def test_tflops_and_mfu() -> None:
    assert flops.tflops(2e12, 1.0) == pytest.approx(2.0)
    assert flops.tflops(2e12, 1.0, n_devices=2) == pytest.approx(1.0)
    assert flops.mfu(156.0, "a100x8_1tb") == pytest.approx(0.5)
    assert flops.mfu(62.5, "V100x8_240gb") == pytest.approx(0.5)
    assert flops.mfu(1.0, "cpu") is None
    assert flops.mfu(1.0, "mystery-box") is None
    assert flops.peak_tflops("h200") == 989.0
    # GPU names as torch reports them (gpu_check's MFU): the same peaks as the nodes
    assert flops.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert flops.peak_tflops("NVIDIA GeForce RTX 4090") == 165.0
    assert flops.peak_tflops("cpu (chunkstar's virtual device)") is None
    with pytest.raises(ValueError, match="step_time_s"):
        flops.tflops(1.0, 0.0)


def test_importing_flops_imports_no_torch() -> None:
    """The peaks are chunkstar.dryrun.HARDWARE's, read on the first MFU: the runner's parent side imports this
    module and stays torch-free until then."""
    import subprocess
    import sys

    code = "import sys, chunkstar_bench.flops; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
