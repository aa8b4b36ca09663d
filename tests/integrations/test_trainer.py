"""ChunkstarTrainer against the plain ``transformers.Trainer`` on the same tiny GPT-2.

Both trainers get the same seed, data and TrainingArguments (gradient accumulation
2, a linear schedule with warm-up, clipping that bites, weight decay); the chunkstar
run keeps its model under a device budget of 70% of the parameter bytes, so chunks
are evicted and brought back every step. What the Trainer logs (loss, grad_norm,
learning_rate) and evaluates must agree; checkpoints, resume, model_init, PEFT and
two processes under torchrun are checked against runs that did not use them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

from chunkstar.errors import ConfigError
from chunkstar.integrations.transformers import CHECKPOINT_DIR, ChunkstarTrainer, EngineModule, engine_config

from tests.core._models import SMALL_CHUNK, build_mlp, eviction_budget, mlp_batch

from ._trainer_case import (
    SAVE_AT, STEPS, TokenRows, build_model, chunkstar_config, eval_rows, logged, train_rows, training_args,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
LOSS_TOL = 1e-4  # fp32: the same kernels, the gradient norm summed in another grouping


def _assert_logs_close(a: list[dict[str, float]], b: list[dict[str, float]], tol: float = LOSS_TOL) -> float:
    """Same steps, losses and grad norms within ``tol``, the same learning rates; the max loss difference."""
    assert [e["step"] for e in a] == [e["step"] for e in b] == list(range(1, len(a) + 1))
    for x, y in zip(a, b):
        assert set(x) == set(y) == {"step", "loss", "grad_norm", "learning_rate"}, (x, y)
        assert math.isclose(x["loss"], y["loss"], rel_tol=0, abs_tol=tol), (x, y)
        assert math.isclose(x["grad_norm"], y["grad_norm"], rel_tol=tol), (x, y)
        assert x["learning_rate"] == y["learning_rate"], (x, y)
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One plain and one chunkstar run of STEPS steps (the chunkstar one saves checkpoint-3)."""
    out = tmp_path_factory.mktemp("runs")
    plain = Trainer(model=build_model(), args=training_args(str(out / "plain")), train_dataset=train_rows(),
                    eval_dataset=eval_rows())  # fmt: skip
    plain_eval_before = plain.evaluate()["eval_loss"]
    plain.train()
    cs = ChunkstarTrainer(
        model=build_model(), args=training_args(str(out / "cs"), save_strategy="steps", save_steps=SAVE_AT),
        train_dataset=train_rows(), eval_dataset=eval_rows(), chunkstar_config=chunkstar_config(),
    )  # fmt: skip
    cs_eval_before = cs.evaluate()["eval_loss"]
    cs.train()
    return {
        "out": out, "plain": plain, "cs": cs, "eval_before": (plain_eval_before, cs_eval_before),
        "eval_after": (plain.evaluate()["eval_loss"], cs.evaluate()["eval_loss"]),
    }  # fmt: skip


def test_losses_grad_norms_lrs_and_eval_match_the_plain_trainer(runs: dict[str, Any]) -> None:
    cs: ChunkstarTrainer = runs["cs"]
    diff = _assert_logs_close(logged(runs["plain"]), logged(cs))
    print(f"max |loss diff| over {STEPS} steps: {diff:.3g}")
    lrs = [e["learning_rate"] for e in logged(cs)]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-3) and lrs[-1] < max(lrs)  # warm-up, then linear decay
    assert all(e["grad_norm"] > 1.0 for e in logged(cs))  # max_grad_norm 1.0 clipped every step
    for plain_eval, cs_eval in (runs["eval_before"], runs["eval_after"]):
        assert math.isclose(plain_eval, cs_eval, rel_tol=0, abs_tol=LOSS_TOL)
    assert runs["eval_after"][1] < runs["eval_before"][1]  # it learned

    # the Trainer drove the engine: its model, its optimizer, and chunks that really moved
    stats = cs.engine.stats()
    assert cs.model is cs.engine.module and isinstance(cs.model_wrapped, EngineModule)
    assert cs.optimizer.optimizer is cs.chunk_optimizer
    assert stats["chunk_moves_to_device"] > stats["n_chunks"] and stats["moves_by_reason"]["eviction"] > 0
    assert stats["device_budget_bytes"] < 4 * stats["n_params"]
    assert stats["micro_steps"] == 2 * STEPS


def test_the_trainers_lr_is_the_optimizers(runs: dict[str, Any]) -> None:
    """The scheduler's last lr sits in every group of chunkstar's optimizer, the Trainer's groups
    (decay / no decay) included."""
    cs: ChunkstarTrainer = runs["cs"]
    groups = cs.chunk_optimizer.param_groups
    assert len(groups) == 2 and groups[0]["weight_decay"] == 0.01 and groups[1]["weight_decay"] == 0.0
    assert [g["lr"] for g in groups] == cs.lr_scheduler.get_last_lr()
    no_decay = {id(p) for p in groups[1]["params"]}
    names = {n for n, p in cs.model.named_parameters() if id(p) in no_decay}
    assert names and all("bias" in n or "ln_" in n for n in names)


def test_save_model_writes_a_checkpoint_from_pretrained_loads(runs: dict[str, Any]) -> None:
    cs: ChunkstarTrainer = runs["cs"]
    out = runs["out"] / "saved"
    cs.save_model(str(out))
    assert (out / "model.safetensors").exists() and not (out / "pytorch_model.bin").exists()
    written = safetensors.torch.load_file(str(out / "model.safetensors"))
    assert "transformer.wte.weight" in written and "lm_head.weight" not in written  # tied: written once
    loaded = GPT2LMHeadModel.from_pretrained(str(out))
    assert loaded.dtype == torch.float32
    expected = cs.engine.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied, as saved
    # the plain run's weights are within fp32 noise of these
    plain = runs["plain"].model.state_dict()
    assert max((plain[k] - v).abs().max().item() for k, v in expected.items()) < 1e-4


def test_resume_from_checkpoint_equals_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    cs: ChunkstarTrainer = runs["cs"]
    ckpt = runs["out"] / "cs" / f"checkpoint-{SAVE_AT}"
    assert {"trainer_state.json", "scheduler.pt", "rng_state.pth", "model.safetensors", CHECKPOINT_DIR} <= set(os.listdir(ckpt))
    assert not (ckpt / "optimizer.pt").exists()  # the optimizer state rides in the engine's shard
    published = ckpt / CHECKPOINT_DIR / (ckpt / CHECKPOINT_DIR / "latest").read_text().strip()
    assert os.listdir(published) == ["rank0-of-1.safetensors"]
    resumed = ChunkstarTrainer(
        model=build_model(), args=training_args(str(runs["out"] / "resumed")), train_dataset=train_rows(),
        chunkstar_config=chunkstar_config(),
    )  # fmt: skip
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert logged(resumed) == logged(cs)  # steps 1-3 from trainer_state.json, 4-6 trained again: bit for bit
    final, again = cs.engine.state_dict(), resumed.engine.state_dict()
    assert all(torch.equal(final[k], again[k]) for k in final)
    assert resumed.chunk_optimizer.state_dict()["state"].keys() == cs.chunk_optimizer.state_dict()["state"].keys()
    for i, st in cs.chunk_optimizer.state_dict()["state"].items():
        other = resumed.chunk_optimizer.state_dict()["state"][i]
        assert all(torch.equal(st[k], other[k]) for k in st)


def test_resume_from_a_checkpoint_without_the_engine_state_is_refused(tmp_path: Path) -> None:
    trainer = ChunkstarTrainer(model=build_model(), args=training_args(str(tmp_path)), train_dataset=train_rows(),
                               chunkstar_config=chunkstar_config())  # fmt: skip
    ckpt = tmp_path / "checkpoint-3"
    trainer.save_model(str(ckpt))  # weights only, as save_only_model would leave it
    with pytest.raises(ValueError, match=f"no {CHECKPOINT_DIR}/ folder"):
        trainer.train(resume_from_checkpoint=str(ckpt))


def test_model_init_builds_each_model_into_a_new_engine(tmp_path: Path) -> None:
    plain = Trainer(model_init=build_model, args=training_args(str(tmp_path / "p")), train_dataset=train_rows(),
                    eval_dataset=eval_rows())  # fmt: skip
    plain.train()
    cs = ChunkstarTrainer(model_init=build_model, args=training_args(str(tmp_path / "c")), train_dataset=train_rows(),
                          eval_dataset=eval_rows(), chunkstar_config=chunkstar_config())  # fmt: skip
    first = cs.engine
    assert cs.model is first.module
    cs.train()  # the Trainer calls model_init again: a new model in a new engine
    assert cs.engine is not first and cs.model is cs.engine.module and cs.model_wrapped.engine is cs.engine
    assert cs.optimizer.optimizer is cs.chunk_optimizer
    _assert_logs_close(logged(plain), logged(cs))
    assert math.isclose(plain.evaluate()["eval_loss"], cs.evaluate()["eval_loss"], abs_tol=LOSS_TOL)


def test_label_smoothing_shifts_a_causal_lms_labels_as_the_plain_trainer(tmp_path: Path) -> None:
    """The Trainer names the model to decide whether labels shift; it sees the engine's wrapper."""
    kw = {"max_steps": 3, "label_smoothing_factor": 0.1}
    plain = Trainer(model=build_model(), args=training_args(str(tmp_path / "p"), **kw), train_dataset=train_rows())
    plain.train()
    cs = ChunkstarTrainer(model=build_model(), args=training_args(str(tmp_path / "c"), **kw), train_dataset=train_rows(),
                          chunkstar_config=chunkstar_config())  # fmt: skip
    cs.train()
    _assert_logs_close(logged(plain), logged(cs))


def test_end_closes_the_engine_and_deletes_its_disk_tier_files(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    cs = ChunkstarTrainer(
        model=build_model(), args=training_args(str(tmp_path / "c"), max_steps=2), train_dataset=train_rows(),
        chunkstar_config={**chunkstar_config(), "disk": {"path": str(disk), "direct": False}},
    )  # fmt: skip
    cs.train()
    assert cs.engine.stats()["disk_bytes_written"] > 0 and any(disk.iterdir())
    cs.end()
    assert not any(disk.iterdir())


def test_peft_lora_trains_frozen_base_weights_without_optimizer_state(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")

    def lora() -> Any:
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        return peft.get_peft_model(build_model(), cfg)

    plain = Trainer(model=lora(), args=training_args(str(tmp_path / "p")), train_dataset=train_rows())
    plain.train()
    cs = ChunkstarTrainer(model=lora(), args=training_args(str(tmp_path / "c")), train_dataset=train_rows(),
                          chunkstar_config=chunkstar_config())  # fmt: skip
    cs.train()
    diff = _assert_logs_close(logged(plain), logged(cs))
    print(f"LoRA: max |loss diff| over {STEPS} steps: {diff:.3g}")
    trainable = sum(p.numel() for p in cs.model.parameters() if p.requires_grad)
    stats = cs.engine.stats()
    assert 0 < trainable < stats["n_params"] // 10
    assert stats["n_frozen_params"] == stats["n_params"] - trainable
    assert stats["master_and_adam_bytes"] == 12 * trainable  # fp32 master + 2 moments for the adapters only

    cs.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(build_model(), str(tmp_path / "adapter")).state_dict()
    for k, v in cs.engine.state_dict().items():
        assert torch.equal(loaded[k], v), k  # adapters as trained, base weights as built


def test_bf16_from_training_arguments_saves_fp32_values(tmp_path: Path) -> None:
    steps = {"max_steps": 3, "bf16": True}
    plain = Trainer(model=build_model(), args=training_args(str(tmp_path / "p"), **steps), train_dataset=train_rows())
    plain.train()
    cs = ChunkstarTrainer(model=build_model(), args=training_args(str(tmp_path / "c"), **steps),
                          train_dataset=train_rows(), chunkstar_config=chunkstar_config(torch.bfloat16))  # fmt: skip
    cs.train()
    assert cs.engine.stats()["precision"] == "bf16"
    _assert_logs_close(logged(plain), logged(cs), tol=1e-2)  # bf16 chunks against autocast over fp32 weights
    cs.save_model(str(tmp_path / "saved"))
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))  # dtype "auto": the config's
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["dtype"] == "float32"
    assert loaded.dtype == torch.float32
    expected = cs.engine.state_dict()  # the fp32 masters, not their bf16 copies
    assert any(not torch.equal(v, v.bfloat16().float()) for v in expected.values())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in expected.items())


class _Classifier(torch.nn.Module):
    """The core tests' MLP with its loss inside. Its forward takes no loss kwargs, so the
    Trainer hands over each micro-batch's mean loss to be divided by the accumulation steps."""

    def __init__(self) -> None:
        super().__init__()
        self.net = build_mlp(depth=4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


class _ClassifierRows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.rows = [mlp_batch(i, batch=1) for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.rows[i]["x"][0], "labels": self.rows[i]["y"][0]}


def test_a_model_without_loss_kwargs_has_its_loss_divided_by_the_accumulation_steps(tmp_path: Path) -> None:
    plain = Trainer(model=_Classifier(), args=training_args(str(tmp_path / "p")), train_dataset=_ClassifierRows(48))
    plain.train()
    budget = eviction_budget(_Classifier(), torch.float32, 0.8)  # the warm-up measures 0.3 of them as non-model
    cs = ChunkstarTrainer(model=_Classifier(), args=training_args(str(tmp_path / "c")), train_dataset=_ClassifierRows(48),
                          chunkstar_config={"device_memory_budget": budget, "default_chunk_size": SMALL_CHUNK})  # fmt: skip
    assert not cs.model_accepts_loss_kwargs
    cs.train()
    _assert_logs_close(logged(plain), logged(cs))
    assert cs.engine.stats()["moves_by_reason"]["eviction"] > 0
    cs.save_model(str(tmp_path / "saved"))  # not a PreTrainedModel: its state dict as safetensors
    saved = safetensors.torch.load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in cs.engine.state_dict().items())


# ---------------------------------------------------------------------- the engine config
def _args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    return training_args(str(tmp_path), **kw)


@pytest.mark.parametrize(
    ("config", "args", "names"),
    [
        ({"optimizer": {"params": {"lr": 3e-4}}}, {}, ("optimizer.params.lr", "TrainingArguments.learning_rate")),
        ({"optimizer": {"params": {"betas": [0.9, 0.95]}}}, {}, ("optimizer.params.betas", "adam_beta1/adam_beta2")),
        ({"optimizer": {"params": {"eps": 1e-6}}}, {}, ("optimizer.params.eps", "TrainingArguments.adam_epsilon")),
        ({"optimizer": {"params": {"weight_decay": 0.1}}}, {}, ("optimizer.params.weight_decay", "TrainingArguments.weight_decay")),
        ({"optimizer": {"type": "Adam"}}, {}, ("optimizer.type", "TrainingArguments.optim")),
        ({"gradient_clipping": 0.5}, {}, ("gradient_clipping", "TrainingArguments.max_grad_norm")),
        ({"gradient_clipping": 1.0}, {"max_grad_norm": 0.0}, ("gradient_clipping", "TrainingArguments.max_grad_norm")),
        ({"gradient_accumulation_steps": 4}, {}, ("gradient_accumulation_steps", "TrainingArguments.gradient_accumulation_steps")),
        ({"bf16": {"enabled": True}}, {}, ("bf16.enabled", "TrainingArguments.bf16")),
        ({"fp16": {"enabled": False}}, {"fp16": True}, ("fp16.enabled", "TrainingArguments.fp16")),
        ({"device": "cuda"}, {}, ("device", "TrainingArguments.device")),
    ],
)  # fmt: skip
def test_a_setting_in_both_that_differs_is_an_error_naming_both(
    tmp_path: Path, config: dict[str, Any], args: dict[str, Any], names: tuple[str, str]
) -> None:
    with pytest.raises(ConfigError) as err:
        engine_config(_args(tmp_path, **args), {"device_memory_budget": "1MB", **config})
    assert all(n in str(err.value) for n in names), str(err.value)


def test_the_engine_config_takes_the_training_arguments(tmp_path: Path) -> None:
    args = _args(tmp_path, learning_rate=2e-4, adam_beta2=0.95, weight_decay=0.1, max_grad_norm=0.5, bf16=True)
    agreeing = {
        "device_memory_budget": "1MB", "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95]}},
        "gradient_clipping": 0.5, "bf16": {"enabled": True}, "device": "cpu", "overlap": False,
    }  # fmt: skip
    cfg = engine_config(args, agreeing)
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}
    assert (cfg["gradient_clipping"], cfg["gradient_accumulation_steps"]) == (0.5, 2)
    assert cfg["bf16"] == {"enabled": True} and cfg["fp16"] == {"enabled": False}
    assert (cfg["device"], cfg["overlap"], cfg["device_memory_budget"]) == ("cpu", False, "1MB")
    assert engine_config(_args(tmp_path, max_grad_norm=0.0), {})["gradient_clipping"] == 0.0  # off in both


def test_unsupported_trainer_features_fail_at_construction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def build(**kw: Any) -> ChunkstarTrainer:
        args = kw.pop("args", None) or _args(tmp_path)
        return ChunkstarTrainer(model=build_model(), args=args, train_dataset=train_rows(),
                                chunkstar_config=chunkstar_config(), **kw)  # fmt: skip

    model = build_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizers="):
        build(optimizers=(opt, None))
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs="):
        build(optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}))
    with pytest.raises(ValueError, match="TrainingArguments.optim is 'sgd'"):
        build(args=_args(tmp_path, optim="sgd"))
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "")  # torch_compile sets it: restored after the test
    with pytest.raises(ValueError, match="torch_compile"):
        build(args=_args(tmp_path, torch_compile=True))
    with pytest.raises(ValueError, match="bf16_full_eval"):
        build(args=_args(tmp_path, bf16_full_eval=True))


@pytest.mark.parametrize("per_batch_loss", [False, True], ids=["normalised-over-the-window", "per-batch"])
def test_an_epochs_short_last_accumulation_window_steps_as_the_plain_trainer(tmp_path: Path, per_batch_loss: bool) -> None:
    """9 batches an epoch with accumulation 2: each epoch's last step follows one micro-batch.
    GPT-2's loss is normalised over each window's tokens (num_items_in_batch); the MLP's is a
    per-batch mean, which the Trainer divides by that window's micro-batches (1, not 2)."""
    if per_batch_loss:
        build: Any = _Classifier
        rows: Any = lambda: _ClassifierRows(18)  # noqa: E731
        config = {"device_memory_budget": eviction_budget(_Classifier(), torch.float32, 0.8), "default_chunk_size": SMALL_CHUNK}
    else:
        build, rows, config = build_model, lambda: TokenRows(18), chunkstar_config()
    runs = []
    for cls, extra in ((Trainer, {}), (ChunkstarTrainer, {"chunkstar_config": config})):
        trainer = cls(model=build(), args=_args(tmp_path / cls.__name__, max_steps=-1, num_train_epochs=2),
                      train_dataset=rows(), **extra)  # fmt: skip
        trainer.train()
        runs.append(trainer)
    plain, cs = runs
    assert plain.state.global_step == cs.state.global_step == 10  # 4 full windows and a short one, twice
    _assert_logs_close(logged(plain), logged(cs))
    assert cs.engine.stats()["optimizer_steps"] == 10


# ---------------------------------------------------------------------- several processes
def test_two_processes_under_torchrun_match_one_process(runs: dict[str, Any], tmp_path: Path) -> None:
    """Two gloo ranks, per-rank batch 1 x accumulation 2, against the single-process
    run's batch 2 x accumulation 2 (the same samples per step); each rank's checkpoint
    shard rides in checkpoint-3 and resumes exactly."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(Path(__file__).with_name("_trainer_worker.py")), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    single = logged(runs["cs"])
    for rec in ranks:
        assert rec["world_size"] == 2 and rec["evictions"] > 0
        diff = _assert_logs_close(single, rec["logged"], tol=1e-5)
        assert math.isclose(rec["eval_loss"], runs["eval_after"][1], abs_tol=1e-5)
        assert rec["resumed_logged"] == rec["logged"] and rec["resumed_equal"]
    print(f"2 ranks vs 1 process: max |loss diff| {diff:.3g}")
    assert ranks[0]["logged"] == ranks[1]["logged"]  # the Trainer logs the mean over ranks
    ckpt = tmp_path / "run" / f"checkpoint-{SAVE_AT}"
    published = ckpt / CHECKPOINT_DIR / (ckpt / CHECKPOINT_DIR / "latest").read_text().strip()
    assert sorted(os.listdir(published)) == ["rank0-of-2.safetensors", "rank1-of-2.safetensors"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(ckpt))
    saved = safetensors.torch.load_file(str(tmp_path / "final" / "model.safetensors"))
    single_saved = runs["cs"].engine.state_dict()
    assert max((saved[k] - single_saved[k]).abs().max().item() for k in saved) < 1e-5


# ---------------------------------------------------------------------- import
def test_the_integrations_package_needs_only_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["transformers"] = None  # "import transformers" now raises ModuleNotFoundError
        import chunkstar.integrations
        try:
            import chunkstar.integrations.transformers
        except ImportError as e:
            assert "chunkstar[hf]" in str(e), e
            print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
