"""Beyond host memory on two gloo ranks: frozen parameters (a LoRA Llama) keep state
for the adapters only, each rank for its own chunks, and train like one process on the
full batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.core._models import ModelCase, assert_losses_close, gpt2_batch, hf_loss, train_reference

from ._scale_worker import STEPS, scale
from ._spawn import WORLD, run_ranks

pytest.importorskip("peft")


def test_lora_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    from tests.core.test_frozen import build_lora_llama

    results = run_ranks(scale, tmp_path, "lora")
    assert len(results) == WORLD and all("error" not in r for r in results), results
    want = train_reference(ModelCase("lora", build_lora_llama, gpt2_batch, hf_loss), STEPS)
    for r in results:
        assert_losses_close(r["losses"], want, 1e-5, f"lora, rank {r['rank']}")
        assert r["moves"] > 0
    # each rank keeps the state of its own trainable chunks: half of them
    assert sum(r["state_bytes"] for r in results) == 12 * results[0]["trainable_elements"]
    sd = torch.load(tmp_path / "lora_sd.pt", weights_only=True)
    ref = build_lora_llama().state_dict()
    assert sd.keys() == ref.keys()
    frozen = [k for k in ref if "lora_" not in k and k.endswith("weight")]
    for k in frozen:  # frozen weights come back untouched
        assert torch.equal(sd[k], ref[k]), k
