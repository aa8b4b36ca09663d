"""The model zoo: paper configs as packaged, exact parameter counts, clear errors."""

from __future__ import annotations

import pytest
import torch

from chunkstar_bench.zoo import ZOO, ModelSpec, build_hf, cpu_ladder, get, n_params, paper_label


def test_every_paper_model_is_in_the_zoo() -> None:
    paper = [n for n in ZOO if paper_label(ZOO[n]) is not None]
    assert len(paper) == 15
    tables = {"gpt2-51m", "gpt2-30m-v8k", "gpt2-49m-v8k", "gpt2-30m-v8k-1k"}  # the comparison tables' models
    assert {n for n in ZOO if not n.startswith("cpu-")} - set(paper) == tables
    assert not any(n.startswith("gpt2-") for n in cpu_ladder())
    assert ZOO["GPT3_10B"] == ModelSpec("GPT3_10B", 4096, 50, 16, 1024, note=ZOO["GPT3_10B"].note)
    assert paper_label(ZOO["GPT2_1B"]) == "1B" and paper_label(ZOO["GPT_175B"]) == "175B"


@pytest.mark.parametrize(
    "spec",
    [ZOO["cpu-tiny"], ZOO["cpu-small"], ModelSpec("odd", hidden=48, layers=3, heads=4, seq_len=40, vocab=1001)],
    ids=lambda s: s.name,
)
def test_n_params_matches_a_built_model(spec: ModelSpec) -> None:
    torch.manual_seed(0)
    model = build_hf(spec)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: counted once
    assert model.config.use_cache is False and model.config.resid_pdrop == 0.0
    assert n_params(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["GPT2_1B", "GPT_DS_20B", "cpu-1.5b", "cpu-355m"])
def test_n_params_matches_big_models_built_on_meta(name: str) -> None:
    with torch.device("meta"):
        model = build_hf(get(name))
    assert n_params(get(name)) == sum(p.numel() for p in model.parameters())


def test_every_zoo_entry_makes_a_valid_config() -> None:
    from transformers import GPT2Config

    for spec in ZOO.values():
        assert spec.hidden % spec.heads == 0, spec.name
        config = GPT2Config(n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads, n_positions=spec.seq_len)
        assert config.n_embd // config.n_head * config.n_head == spec.hidden


def test_cpu_ladder_is_ordered_and_spans_ten_million_to_one_and_a_half_billion() -> None:
    sizes = [n_params(ZOO[n]) for n in cpu_ladder()]
    assert sizes == sorted(sizes) and len(sizes) >= 8
    assert sizes[0] < 10e6 < 1.5e9 < sizes[-1]
    # fine enough between 200M and 800M to tell 14 from 18+ bytes per parameter under one cap
    mid = [s for s in sizes if 2e8 <= s <= 8e8]
    assert all(b / a < 1.3 for a, b in zip(mid, mid[1:]))


def test_unknown_model_names_the_zoo() -> None:
    with pytest.raises(KeyError, match="cpu-tiny.*GPT2_1B|GPT2_1B.*cpu-tiny"):
        get("GPT-5")
