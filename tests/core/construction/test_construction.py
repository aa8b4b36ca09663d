"""Building straight into chunks (Note [construction]): meta-device models and pretrained=.

A model built under ``torch.device("meta")`` gets exactly the values that plain
PyTorch gives the same meta model after ``to_empty`` and
:func:`chunkstar.init_weights` (same seed), its buffers equal a real build's,
and it trains like plain PyTorch under eviction. A safetensors checkpoint, one
file or a sharded Hugging Face directory, streams into the chunks bit for bit.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import chunkstar
from tests.core._models import (
    ModelCase,
    assert_losses_close,
    build_gpt2,
    engine_config,
    eviction_budget,
    gpt2_batch,
    hf_loss,
    train_engine,
    train_reference,
)

SEED = 4321
STEPS = 3


def _on_meta(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def meta() -> nn.Module:
        with torch.device("meta"):
            return build()

    return meta


def _plain_from_meta(meta_build: Callable[[], nn.Module]) -> nn.Module:
    """The plain-PyTorch reference: seed, the same meta model, to_empty, then init_weights
    (the order initialize_engine runs them in; a builder may seed for itself)."""
    torch.manual_seed(SEED)
    model = meta_build()
    model.to_empty(device="cpu")
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()  # to_empty unties shared parameters (each module gets its own copy)
    chunkstar.init_weights(model)
    return model


def _gpt2() -> nn.Module:
    return build_gpt2(n_layer=3)


def _llama(tie_word_embeddings: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tie_word_embeddings,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def _bert() -> nn.Module:
    from tests.core._models import build_bert

    return build_bert(n_layer=2)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64))


def _engine(build: Callable[[], nn.Module], budget: int | str = "64MB", **kw: Any) -> tuple[Any, Any]:
    torch.manual_seed(SEED)
    return chunkstar.initialize_engine(build, 0, engine_config("fp32", budget=budget), **kw)


@pytest.mark.parametrize("build", [_gpt2, _llama, _bert, _mlp], ids=["gpt2", "llama", "bert", "mlp"])
def test_meta_model_gets_the_values_plain_pytorch_gives_it(build: Callable[[], nn.Module]) -> None:
    meta = _on_meta(build)
    want = _plain_from_meta(meta).state_dict()
    engine, _ = _engine(meta)
    got = engine.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert engine.construction.meta_params == len(list(engine.parameters()))
    assert engine.construction.initialised


@pytest.mark.parametrize("build", [_llama, _bert], ids=["llama-rotary", "bert-position-ids"])
def test_meta_buffers_equal_a_real_builds(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    real = dict(build().named_buffers())
    engine, _ = _engine(_on_meta(build))
    got = dict(engine.module.named_buffers())
    assert real and got.keys() == real.keys()
    for k in real:
        assert not got[k].is_meta and torch.equal(got[k], real[k]), k


def test_meta_gpt2_is_initialised_by_its_own_scheme() -> None:
    engine, _ = _engine(_on_meta(_gpt2))
    sd = engine.state_dict()
    w = sd["transformer.h.0.mlp.c_fc.weight"]
    assert abs(w.std().item() - 0.02) < 0.002  # GPT-2's normal(0, initializer_range)
    assert torch.equal(sd["transformer.h.0.ln_1.weight"], torch.ones(128))
    assert torch.equal(sd["transformer.h.0.attn.c_attn.bias"], torch.zeros(3 * 128))
    assert engine.module.lm_head.weight is engine.module.transformer.wte.weight  # still tied


def test_meta_gpt2_trains_like_plain_pytorch_under_eviction() -> None:
    meta = _on_meta(_gpt2)
    want = train_reference(ModelCase("gpt2", lambda: _plain_from_meta(meta), gpt2_batch, hf_loss), STEPS)
    engine, optimizer = _engine(meta, budget=eviction_budget(_gpt2(), torch.float32))
    got = train_engine(engine, optimizer, ModelCase("gpt2", _gpt2, gpt2_batch, hf_loss), STEPS)
    assert_losses_close(got, want, 1e-5, "meta gpt2")
    assert engine.stats()["chunk_moves_to_host"] > 0


def test_meta_model_with_frozen_parameters_and_an_lstm() -> None:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.rnn = nn.LSTM(16, 16, batch_first=True)  # holds weak references to its weights
            self.out = nn.Linear(16, 5)
            self.embed.weight.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.rnn(self.embed(x))[0])

    meta = _on_meta(Tagger)
    want = _plain_from_meta(meta).state_dict()
    torch.manual_seed(SEED)
    engine, optimizer = chunkstar.initialize_engine(meta, 0, engine_config("fp32", budget="64MB", chunk_size="auto"))
    got = engine.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    x = torch.randint(0, 50, (2, 6))
    engine.backward(engine(x).float().pow(2).mean())
    optimizer.step()
    assert engine.mgr.layout.frozen  # the frozen embedding has a chunk of its own


# ---------------------------------------------------------------------- pretrained=
def _save_pretrained(model: nn.Module, path: Path, max_shard_size: str | None = None) -> None:
    if max_shard_size is None:
        model.save_pretrained(path)  # type: ignore[operator]
    else:
        model.save_pretrained(path, max_shard_size=max_shard_size)  # type: ignore[operator]


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded-index"])
def test_pretrained_streams_a_checkpoint_into_the_chunks_bit_for_bit(tmp_path: Path, sharded: bool) -> None:
    torch.manual_seed(7)
    saved = _gpt2()
    _save_pretrained(saved, tmp_path, max_shard_size="100KB" if sharded else None)
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").is_file()
        assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    want = saved.state_dict()
    for build in (_on_meta(_gpt2), _gpt2):  # a meta model, and one built for real (overwritten)
        engine, _ = _engine(build, pretrained=tmp_path)
        got = engine.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), k
        report = engine.construction
        assert not report.initialised and not report.not_in_checkpoint and not report.unused_keys
        assert report.bytes_read > 0


def test_pretrained_bf16_file_and_base_model_prefix(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(8)
    saved = _gpt2()
    # the base model's keys ("h.0..." without "transformer."), stored in bf16
    base = {k.removeprefix("transformer."): v.to(torch.bfloat16) for k, v in saved.state_dict().items() if k != "lm_head.weight"}
    save_file(base, str(tmp_path / "base.safetensors"))
    engine, _ = _engine(_on_meta(_gpt2), pretrained=tmp_path / "base.safetensors")
    got = engine.state_dict()
    for k, v in saved.state_dict().items():
        assert torch.equal(got[k], v.to(torch.bfloat16).float()), k  # widened exactly


def test_pretrained_with_missing_parameters_initialises_the_rest(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(9)
    saved = _gpt2().state_dict()
    partial = {k: v for k, v in saved.items() if ".h.2." not in k and k != "lm_head.weight"}  # tied to wte
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.warns(UserWarning, match=r"12 of the model's 40 parameters are not in the checkpoint.*transformer\.h\.2\."):
        engine, _ = _engine(_on_meta(_gpt2), pretrained=tmp_path / "partial.safetensors")
    report = engine.construction
    assert report.initialised and len(report.not_in_checkpoint) == 12
    assert all(".h.2." in n for n in report.not_in_checkpoint)
    got = engine.state_dict()
    for k in partial:
        assert torch.equal(got[k], saved[k]), k
    assert torch.equal(got["transformer.h.2.ln_1.weight"], torch.ones(128))  # initialised


def test_pretrained_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(chunkstar.PretrainedError, match="pickle"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path)
    with pytest.raises(chunkstar.PretrainedError, match="no such file"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "nope.safetensors")
    torch.manual_seed(1)
    _save_pretrained(_gpt2(), tmp_path / "ok")
    data = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(chunkstar.PretrainedError, match="truncated"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "cut.safetensors")
    from safetensors.torch import save_file

    sd = build_gpt2(n_layer=3).state_dict()
    sd["transformer.wte.weight"] = torch.zeros(10, 10)
    save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(chunkstar.PretrainedError, match="transformer.wte.weight"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "shape.safetensors")


def _checkpoint_warnings(caught: list[warnings.WarningMessage], path: Path) -> list[str]:
    return [str(w.message) for w in caught if str(path) in str(w.message)]


def _t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg)  # shared embeddings: encoder, decoder and lm_head


def _llama_tied() -> nn.Module:
    return _llama(tie_word_embeddings=True)


@pytest.mark.parametrize("build", [_gpt2, _llama, _llama_tied, _bert, _t5], ids=["gpt2", "llama", "llama-tied", "bert", "t5"])
def test_a_models_own_checkpoint_loads_without_a_warning(tmp_path: Path, build: Callable[[], nn.Module]) -> None:
    """Note [what a checkpoint may lack]: tied parameters saved once, non-persistent buffers never
    saved, and what Hugging Face itself lets checkpoints hold, warn of nothing."""
    from safetensors.torch import save_file, save_model

    torch.manual_seed(5)
    model = build()
    want = model.state_dict()
    _save_pretrained(model, tmp_path / "hf")
    save_model(model, str(tmp_path / "one.safetensors"))  # safetensors' own: one name per shared tensor
    # every name of a tied tensor stored, and the buffers old GPT-2 checkpoints hold (HF ignores them)
    every = {k: v.clone() for k, v in want.items()}
    old_buffers = [f"transformer.h.{i}.attn.bias" for i in range(3)] if build is _gpt2 else []
    every.update({k: torch.ones(1, 1, 32, 32) for k in old_buffers})
    save_file(every, str(tmp_path / "every.safetensors"))
    for path in (tmp_path / "hf", tmp_path / "one.safetensors", tmp_path / "every.safetensors"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, _ = _engine(_on_meta(build), pretrained=path)
        assert _checkpoint_warnings(caught, path) == [], path.name
        report = engine.construction
        assert not report.not_in_checkpoint and not report.initialised, path.name
        assert report.unused_keys == (old_buffers if path.name == "every.safetensors" else []), path.name
        got = engine.state_dict()
        assert all(torch.equal(got[k], v) for k, v in want.items()), path.name


def test_a_checkpoint_that_matches_nothing_is_refused_naming_both_sides(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = _gpt2().state_dict()
    # another model's names: "model." where this one says "transformer."
    renamed = {"model." + k.removeprefix("transformer."): v for k, v in sd.items() if k != "lm_head.weight"}
    save_file(renamed, str(tmp_path / "other.safetensors"))
    with pytest.raises(chunkstar.PretrainedError, match="none of the model's parameters") as err:
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "other.safetensors")
    message = str(err.value)
    assert "transformer.wte.weight" in message and "model.h.0." in message and "leave out pretrained=" in message
    save_file({}, str(tmp_path / "empty.safetensors"))
    with pytest.raises(chunkstar.PretrainedError, match="holds no tensors"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "empty.safetensors")
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(chunkstar.PretrainedError, match="weight_map names no tensors"):
        _engine(_on_meta(_gpt2), pretrained=tmp_path / "index")


def test_checkpoint_tensors_the_model_has_no_place_for_are_reported_and_warned_of(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = {k: v for k, v in _gpt2().state_dict().items() if k != "lm_head.weight"}
    sd.update({"junk.weight": torch.zeros(3), "score.bias": torch.zeros(2)})
    save_file(sd, str(tmp_path / "extra.safetensors"))
    with pytest.warns(UserWarning, match=r"2 of the checkpoint's \d+ tensors match no parameter") as caught:
        engine, _ = _engine(_on_meta(_gpt2), pretrained=tmp_path / "extra.safetensors")
    assert "junk.weight" in str(caught[0].message) and "score.bias" in str(caught[0].message)
    assert engine.construction.unused_keys == ["junk.weight", "score.bias"]


def test_write_safetensors_streams_a_file_safetensors_reads(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from chunkstar.construction.pretrained import PretrainedSource, write_safetensors

    values = {"w": torch.randn(3, 5), "b": torch.randn(7).bfloat16(), "h": torch.randn(2, 2).half()}
    spec = [(k, tuple(v.shape), v.dtype) for k, v in values.items()]
    size = write_safetensors(tmp_path / "x.safetensors", spec, lambda n, out: out.copy_(values[n].reshape(-1)), {"k": "v"})
    assert size == (tmp_path / "x.safetensors").stat().st_size
    got = load_file(str(tmp_path / "x.safetensors"))  # the reference reader
    assert all(torch.equal(got[k], v) for k, v in values.items())
    with PretrainedSource(tmp_path / "x.safetensors") as src:  # and ours
        assert all(torch.equal(src.read(k), v) for k, v in values.items())
    assert not list(tmp_path.glob(".*partial"))


def test_lora_on_a_meta_base_loads_the_base_checkpoint_and_initialises_the_adapters(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    base = _llama()
    base.save_pretrained(tmp_path / "base")  # type: ignore[operator]

    def lora() -> nn.Module:
        with torch.device("meta"):
            model = LlamaForCausalLM(base.config)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer = _engine(lora, pretrained=tmp_path / "base")
    assert _checkpoint_warnings(caught, tmp_path / "base") == []  # the adapters are not the base's to hold
    report = engine.construction
    assert report.initialised and not report.unused_keys
    assert report.not_in_checkpoint and all("lora_" in n for n in report.not_in_checkpoint)
    sd = engine.state_dict()
    want = base.state_dict()
    for k, v in sd.items():  # PEFT's names: base_model.model.<name>, .base_layer. inside wrapped layers
        plain = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if "lora_" not in k:
            assert torch.equal(v, want[plain]), k
    assert all(not v.any() for k, v in sd.items() if "lora_B" in k)  # the adapted model starts as the base
    assert all(v.abs().sum() > 0 for k, v in sd.items() if "lora_A" in k)
    ids = gpt2_batch(0)
    engine.backward(engine(**ids).loss)
    optimizer.step()
