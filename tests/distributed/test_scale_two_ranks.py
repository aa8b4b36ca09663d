"""Beyond host memory on two gloo ranks: frozen parameters (a LoRA Llama) keep state
for the adapters only, each rank for its own chunks; a meta-device model is
materialised and initialised with each rank holding its own chunks only, and a
checkpoint is streamed with each rank reading its own share; all train like one
process on the full batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.core._models import ModelCase, assert_losses_close, gpt2_batch, hf_loss, train_reference

from ._scale_worker import STEPS, scale
from ._spawn import WORLD, run_ranks

pytest.importorskip("peft")


def test_lora_on_two_ranks_matches_one_process(tmp_path: Path) -> None:
    from tests.core.runtime.test_frozen import build_lora_llama

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


def _meta_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    from tests.core.construction import test_construction as tc

    def build() -> torch.nn.Module:
        return tc._plain_from_meta(tc._on_meta(tc._gpt2))

    return build().state_dict(), train_reference(ModelCase("meta", build, gpt2_batch, hf_loss), STEPS)


@pytest.mark.parametrize("case", ["meta", "meta-disk", "meta-disk-params"])
def test_meta_model_on_two_ranks_matches_one_process(tmp_path: Path, case: str) -> None:
    init, want = _meta_reference()
    results = run_ranks(scale, tmp_path, case)
    assert len(results) == WORLD and all("error" not in r for r in results), results
    for r in results:
        assert_losses_close(r["losses"], want, 1e-5, f"meta gpt2, rank {r['rank']}")
        for k, v in init.items():  # every rank initialised every value alike (gathered back)
            assert abs(r["initial"][k] - v.sum().item()) <= 1e-6 * max(1.0, v.abs().sum().item()), k
    # each rank allocated its own chunks only: together, one model's chunks
    total = sum(r["host_chunk_bytes"] for r in results)
    if case == "meta-disk-params":
        assert total == 0  # every chunk this rank owns lives in its files: the host only stages them
    else:
        assert results[0]["host_chunk_bytes"] < 0.6 * total
    if case.startswith("meta-disk"):  # each rank's own state went through its own files, in one shared directory
        assert all(r["disk_bytes_written"] > 0 for r in results)
        assert not list((tmp_path / "disk").glob("*.chunks"))  # removed by close()


def test_pretrained_on_two_ranks_each_reads_its_share(tmp_path: Path) -> None:
    from tests.core.construction import test_construction as tc

    torch.manual_seed(11)
    saved = tc._gpt2()
    saved.save_pretrained(tmp_path / "ck", max_shard_size="200KB")  # type: ignore[operator]
    results = run_ranks(scale, tmp_path, "meta", str(tmp_path / "ck"))
    assert len(results) == WORLD and all("error" not in r for r in results), results
    for r in results:
        for k, v in saved.state_dict().items():
            assert abs(r["initial"][k] - v.sum().item()) <= 1e-6 * max(1.0, v.abs().sum().item()), k
    # every tensor read once, by the rank that owns its chunk (no rank reads the whole file)
    tensor_bytes = sum(p.numel() * 4 for p in saved.parameters())
    assert sum(r["bytes_read"] for r in results) == tensor_bytes
    assert all(0 < r["bytes_read"] < tensor_bytes for r in results)
