"""ChunkstarStrategy against Lightning's own strategies, on the same seed and data.

Each fit trains a LightningModule (tests/integrations/_lightning_case.py) of the core
tests' tiny GPT-2, a two-layer Llama or a small CNN under a device budget that evicts
chunks every step, with what a Lightning user sets: AdamW in decay / no-decay groups, a
warm-up LR schedule stepped per optimizer step, ``accumulate_grad_batches=2`` over 7
batches an epoch (each epoch ends on a window of one), ``gradient_clip_val=1.0`` and
validation. The reference is the same module under the single-device strategy
(``strategy="auto"``); two processes are compared with Lightning's DDP on one process
over the full batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from chunkstar import initialize_engine  # noqa: E402
from chunkstar.checkpoint import merge_checkpoint  # noqa: E402
from chunkstar.errors import ConfigError  # noqa: E402
from chunkstar.integrations.lightning import ChunkstarStats, ChunkstarStrategy, convert_checkpoint, release  # noqa: E402
from tests.core._models import assert_losses_close  # noqa: E402
from tests.integrations._lightning_case import Case, build, engine_config, loader, trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5


@contextlib.contextmanager
def _no_process_group_left() -> Iterator[None]:
    """ChunkstarStrategy is a DDPStrategy: Lightning starts a (one-process) gloo group and
    sets MASTER_PORT and the rank variables. Later tests of the same pytest process (and the
    launchers they start, which would find that port taken) must not inherit either."""
    env = dict(os.environ)
    try:
        yield
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture(autouse=True)
def _each_test_cleans_up() -> Iterator[None]:
    with _no_process_group_left():
        yield


def _fit(
    kind: str, strategy: Any, root: Path, *, module: Case | None = None, ckpt_path: str | None = None, **kw: Any
) -> tuple[Case, L.Trainer]:
    L.seed_everything(0, verbose=False)
    m = module if module is not None else Case(kind)
    t = trainer(strategy, root, **{"accumulate_grad_batches": 2, "gradient_clip_val": 1.0, **kw})
    t.fit(m, loader(kind), loader(kind, 4, 1000), ckpt_path=ckpt_path)
    return m, t


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def _assert_states_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert got.keys() == want.keys()
    worst = max(((got[k] - want[k]).abs().max().item(), k) for k in want)
    assert worst[0] <= atol, f"{worst[1]} differs by {worst[0]:.3g}"


# ---------------------------------------------------------------------- the same training as Lightning's own
@pytest.fixture(scope="module", params=["gpt2", "llama", "cnn"])
def fitted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"fit-{kind}")
    with _no_process_group_left():
        plain, plain_trainer = _fit(kind, "auto", root / "plain")
        mine, my_trainer = _fit(kind, ChunkstarStrategy(engine_config(kind)), root / "chunkstar")
        strategy = my_trainer.strategy
        assert isinstance(strategy, ChunkstarStrategy)
        return {
            "kind": kind, "plain": plain, "mine": mine, "stats": strategy.engine.stats(),
            "plain_predictions": plain_trainer.predict(plain, loader(kind, 4, 2000)),
            "my_predictions": my_trainer.predict(mine, loader(kind, 4, 2000)),
            "plain_state": _state(plain), "my_state": _state(mine),
        }  # fmt: skip


def test_fp32_training_equals_the_single_device_strategy(fitted: dict[str, Any]) -> None:
    plain, mine = fitted["plain"], fitted["mine"]
    assert len(plain.losses) == 14  # 2 epochs of 7 batches: windows of 2, 2, 2 and 1 each
    assert_losses_close(mine.losses, plain.losses, RTOL, f"{fitted['kind']} training")
    assert_losses_close(mine.val_losses, plain.val_losses, RTOL, f"{fitted['kind']} validation (inference_mode)")
    assert mine.lrs == pytest.approx(plain.lrs, rel=1e-12)  # the warm-up schedule stepped the engine's optimizer
    assert len(mine.lrs) == 8  # 4 optimizer steps an epoch: the short window steps too
    _assert_states_close(fitted["my_state"], fitted["plain_state"], atol=1e-5)
    stats = fitted["stats"]
    assert stats["optimizer_steps"] == 8
    assert stats["chunk_moves_to_host"] > 0, "the budget should evict chunks: the test would prove less"


def test_predict_after_fit_equals_the_single_device_strategy(fitted: dict[str, Any]) -> None:
    for got, want in zip(fitted["my_predictions"], fitted["plain_predictions"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- checkpoints
def test_resume_from_a_checkpoint_folder_is_bit_exact(tmp_path: Path) -> None:
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, every_n_epochs=1)
    whole, _ = _fit("gpt2", ChunkstarStrategy(engine_config("gpt2")), tmp_path, max_epochs=3, callbacks=[ckpt],
                    enable_checkpointing=True)  # fmt: skip
    first = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert first.is_dir() and (first / "latest").is_file(), sorted(os.listdir(tmp_path / "ckpt"))
    dist.destroy_process_group()

    resumed, _ = _fit("gpt2", ChunkstarStrategy(engine_config("gpt2")), tmp_path, max_epochs=3, ckpt_path=str(first))
    assert resumed.losses == whole.losses[7:], "epochs 1 and 2, bit for bit"
    assert resumed.val_losses == whole.val_losses[2:], "its sanity check validates epoch 0's weights"
    assert resumed.lrs == whole.lrs[4:]
    assert all(torch.equal(a, b) for a, b in zip(_state(resumed).values(), _state(whole).values()))


def test_a_checkpoint_folder_converts_to_a_file_lightning_loads(tmp_path: Path) -> None:
    mine, t = _fit("gpt2", ChunkstarStrategy(engine_config("gpt2")), tmp_path, max_epochs=1)
    t.save_checkpoint(tmp_path / "last.ckpt")
    want = _state(mine)
    out = convert_checkpoint(tmp_path / "last.ckpt", tmp_path / "one.ckpt")
    loaded = Case.load_from_checkpoint(out)
    assert all(torch.equal(loaded.state_dict()[k].float(), want[k]) for k in want)
    assert torch.load(out, weights_only=True)["global_step"] == 4

    # validate from the folder in a new Trainer and module: the weights only
    fresh = Case("gpt2")
    t2 = trainer(ChunkstarStrategy(engine_config("gpt2")), tmp_path)
    t2.validate(fresh, loader("gpt2", 4, 1000), ckpt_path=str(tmp_path / "last.ckpt"))
    assert fresh.val_losses == pytest.approx(mine.val_losses[-2:], rel=1e-6)


def test_a_single_file_checkpoint_of_another_strategy_loads_its_weights(tmp_path: Path) -> None:
    plain, t = _fit("gpt2", "auto", tmp_path, max_epochs=1)
    t.save_checkpoint(tmp_path / "plain.ckpt")
    fresh = Case("gpt2")
    t2 = trainer(ChunkstarStrategy(engine_config("gpt2")), tmp_path)
    t2.validate(fresh, loader("gpt2", 4, 1000), ckpt_path=str(tmp_path / "plain.ckpt"))
    assert fresh.val_losses == pytest.approx(plain.val_losses[-2:], rel=1e-5)


class _SaveAt(L.Callback):
    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, i: int) -> None:
        if trainer.current_epoch == 0 and i == self.batch_idx:
            trainer.save_checkpoint(self.path)


def test_a_save_inside_an_accumulation_window_resumes_as_lightnings_own(tmp_path: Path) -> None:
    """A checkpoint after the first micro-batch of a window (ModelCheckpoint re-saving a step
    on resume does this) holds no gradients with either strategy: both resume alike."""

    def resumed(strategy: Any, where: Path) -> Case:
        _fit("gpt2", strategy(), where, callbacks=[_SaveAt(where / "mid.ckpt", 2)])
        if dist.is_initialized():
            dist.destroy_process_group()
        m, _ = _fit("gpt2", strategy(), where, ckpt_path=str(where / "mid.ckpt"))
        if dist.is_initialized():
            dist.destroy_process_group()
        return m

    plain = resumed(lambda: "auto", tmp_path / "plain")
    with pytest.warns(UserWarning, match="inside an accumulation window"):
        mine = resumed(lambda: ChunkstarStrategy(engine_config("gpt2")), tmp_path / "chunkstar")
    assert len(plain.losses) == 11  # Lightning goes on at batch 3 of epoch 0: 4 batches of it, then epoch 1
    assert_losses_close(mine.losses, plain.losses, RTOL, "resumed from inside a window")
    assert mine.lrs == pytest.approx(plain.lrs, rel=1e-12)


# ---------------------------------------------------------------------- precision, loops, modules
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_equals_the_engines_own_loop(tmp_path: Path, precision: str) -> None:
    """Lightning's bf16-mixed / 16-mixed are the engine's bf16 / fp16 (param chunks in half
    precision under autocast, fp32 masters, fp16's loss scaler): the same steps as a plain
    loop around the engine, bit for bit. On a CPU Lightning turns precision="16-mixed" into
    bf16, so fp16 comes in as the plugin a user can pass."""
    cfg = engine_config("gpt2")
    kw: dict[str, Any] = (
        {"precision": precision} if precision == "bf16-mixed" else {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    )
    mine, t = _fit("gpt2", ChunkstarStrategy(cfg), tmp_path, module=Case("gpt2", schedule=False), accumulate_grad_batches=1,
                   max_epochs=1, **kw)  # fmt: skip
    assert t.precision == precision
    section = "bf16" if precision == "bf16-mixed" else "fp16"
    module = Case("gpt2", schedule=False)
    groups = module.configure_optimizers().param_groups
    engine, opt = initialize_engine(
        lambda: module, 0,
        {**cfg, section: {"enabled": True}, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}}},
        param_groups_fn=lambda _m: [{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in groups],
    )  # fmt: skip
    losses = []
    for batch in loader("gpt2"):
        loss = engine(batch)
        losses.append(float(loss.detach()))
        engine.backward(loss)
        opt.step()
        opt.zero_grad()
    engine.close()
    assert mine.losses == losses


class _Manual(Case):
    """Manual optimization as the Lightning docs write it, accumulating two micro-batches and
    clipping by norm before each step."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind, schedule=False)
        self.automatic_optimization = False

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        opt = self.optimizers()
        loss = self(batch)
        self.losses.append(float(loss.detach()))
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


def test_manual_optimization_equals_the_single_device_strategy(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"accumulate_grad_batches": 1, "gradient_clip_val": None, "max_epochs": 1}
    plain, _ = _fit("gpt2", "auto", tmp_path, module=_Manual("gpt2"), **kw)
    if dist.is_initialized():
        dist.destroy_process_group()
    # the user's loop accumulates two and clips at 0.5: the engine's config says so
    cfg = {**engine_config("gpt2"), "gradient_accumulation_steps": 2, "gradient_clipping": 0.5}
    L.seed_everything(0, verbose=False)
    mine, _ = _fit("gpt2", ChunkstarStrategy(cfg), tmp_path, module=_Manual("gpt2"), **{**kw, "limit_train_batches": 6})
    assert_losses_close(mine.losses, plain.losses[:6], RTOL, "manual optimization")


def test_a_frozen_parameter_left_out_of_the_optimizer_stays_as_it_was(tmp_path: Path) -> None:
    plain, _ = _fit("cnn", "auto", tmp_path, module=Case("cnn", freeze_first=True), max_epochs=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    mine, _ = _fit("cnn", ChunkstarStrategy(engine_config("cnn")), tmp_path, module=Case("cnn", freeze_first=True),
                   max_epochs=1)  # fmt: skip
    assert_losses_close(mine.losses, plain.losses, RTOL, "frozen first conv")
    assert torch.equal(_state(mine)["net.0.weight"], _state(Case("cnn"))["net.0.weight"])


def test_a_second_fit_of_the_same_module_starts_a_new_optimizer_as_lightning_does(tmp_path: Path) -> None:
    def twice(strategy: Any) -> Case:
        m, _ = _fit("gpt2", strategy(), tmp_path, max_epochs=1)
        if dist.is_initialized():
            dist.destroy_process_group()
        _fit("gpt2", strategy(), tmp_path, module=m, max_epochs=1)
        if dist.is_initialized():
            dist.destroy_process_group()
        return m

    plain = twice(lambda: "auto")
    mine = twice(lambda: ChunkstarStrategy(engine_config("gpt2")))
    assert_losses_close(mine.losses, plain.losses, RTOL, "two fits")
    release(mine)  # back to plain tensors, the trained values
    assert all(type(p) is torch.nn.Parameter for p in mine.parameters())
    _assert_states_close(_state(mine), _state(plain), atol=5e-5)


def test_validate_reuses_the_engine_of_a_fit_and_rebuilds_one_of_another_precision(tmp_path: Path) -> None:
    mine, t = _fit("gpt2", ChunkstarStrategy(engine_config("gpt2")), tmp_path, precision="bf16-mixed", max_epochs=1)
    assert isinstance(t.strategy, ChunkstarStrategy)
    trained = t.strategy.engine
    t.validate(mine, loader("gpt2", 4, 1000))
    assert t.strategy.engine is trained  # the same Trainer and precision: the module where it is
    t32 = trainer(ChunkstarStrategy(engine_config("gpt2")), tmp_path)
    t32.validate(mine, loader("gpt2", 4, 1000))
    assert isinstance(t32.strategy, ChunkstarStrategy)
    assert t32.strategy.engine is not trained and t32.strategy.engine.config.precision.value == "fp32"
    fp32_val = mine.val_losses[-2:]
    release(mine)
    plain = trainer("auto", tmp_path)
    plain.validate(mine, loader("gpt2", 4, 1000))
    assert mine.val_losses[-2:] == pytest.approx(fp32_val, rel=1e-6)  # the trained values, in fp32


def test_stats_are_logged_after_each_step(tmp_path: Path) -> None:
    _, t = _fit("gpt2", ChunkstarStrategy(engine_config("gpt2")), tmp_path, max_epochs=1, callbacks=[ChunkstarStats()])
    logged = t.logged_metrics
    assert logged["chunkstar/chunk_moves_to_host"] > 0
    assert 0 < logged["chunkstar/device_peak_bytes"] <= engine_config("gpt2")["device_memory_budget"]
    assert torch.isfinite(torch.as_tensor(logged["chunkstar/grad_norm"]))


# ---------------------------------------------------------------------- what it refuses, and how it says so
def test_the_strategy_is_registered_by_name() -> None:
    t = L.Trainer(strategy="chunkstar", accelerator="cpu", devices=1, logger=False)
    assert isinstance(t.strategy, ChunkstarStrategy)


class _SGD(Case):
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _AMSGrad(Case):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), amsgrad=True)


class _LeftOut(Case):
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(list(self.parameters())[1:])


@pytest.mark.parametrize(
    ("module", "kw", "error", "match"),
    [
        (_SGD, {}, ValueError, "torch.optim.sgd.SGD"),
        (_AMSGrad, {}, ValueError, "amsgrad"),
        (_LeftOut, {}, ValueError, "require grad"),
        (Case, {"gradient_clip_algorithm": "value"}, ValueError, "by value"),
    ],
    ids=["sgd", "amsgrad", "trainable-left-out", "clip-by-value"],
)
def test_what_the_engine_cannot_honour_is_refused_before_training(
    tmp_path: Path, module: type[Case], kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    m = module("cnn")
    t = trainer(ChunkstarStrategy(engine_config("cnn")), tmp_path, gradient_clip_val=1.0, **kw)
    with pytest.raises(error, match=match):
        t.fit(m, loader("cnn"))
    assert m.losses == []


def test_a_half_precision_without_masters_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bf16-true"):
        trainer(ChunkstarStrategy(engine_config("cnn")), tmp_path, precision="bf16-true")


def test_a_setting_in_both_the_config_and_the_trainer_that_differs_names_both(tmp_path: Path) -> None:
    t = trainer(ChunkstarStrategy({**engine_config("cnn"), "gradient_clipping": 0.5}), tmp_path, gradient_clip_val=1.0)
    with pytest.raises(ConfigError, match=r"gradient_clipping = 0.5 but Trainer\(gradient_clip_val=...\) is 1.0"):
        t.fit(Case("cnn"), loader("cnn"))
    with pytest.raises(ConfigError, match="give it once"):
        ChunkstarStrategy({"device_memory_budget": "1MB"}, device_memory_budget="2MB")


# ---------------------------------------------------------------------- two processes
def _worker(tmp: Path, strategy: str, devices: int, batch: int) -> list[dict[str, Any]]:
    out = tmp / f"{strategy}-{devices}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tests.integrations._lightning_worker", str(out), strategy, str(devices), str(batch)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]


def test_two_processes_equal_lightnings_ddp_on_one_process_over_the_full_batch(tmp_path: Path) -> None:
    want = _worker(tmp_path, "ddp", 1, 4)[0]
    ranks = _worker(tmp_path, "chunkstar", 2, 2)
    got = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    assert_losses_close(got, want["losses"], RTOL, "two ranks' mean loss")
    assert ranks[0]["lrs"] == pytest.approx(want["lrs"], rel=1e-12)
    # Lightning's launcher sets no LOCAL_WORLD_SIZE: the strategy does, so each engine takes its
    # share of the node's cores (and host memory budget), not the whole node's
    assert [r["local_world_size"] for r in ranks] == ["2", "2"]
    assert all(r["host_worker_threads"] == r["share_of_two"] for r in ranks)
    merged = merge_checkpoint(tmp_path / "chunkstar-2" / "last.ckpt", tied=True)
    plain = torch.load(tmp_path / "ddp-1" / "last.ckpt", weights_only=True)["state_dict"]
    _assert_states_close({k: v.float() for k, v in merged.items()}, {k: v.float() for k, v in plain.items()}, atol=1e-5)


def test_lightning_is_imported_only_by_the_strategys_module() -> None:
    script = (
        "import sys\n"
        "sys.modules['lightning'] = None  # 'import lightning' now raises ModuleNotFoundError\n"
        "import chunkstar, chunkstar.integrations\n"
        "try:\n"
        "    import chunkstar.integrations.lightning\n"
        "except ImportError as e:\n"
        "    assert \"chunkstar[lightning]\" in str(e), e\n"
        "    print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# ---------------------------------------------------------------------- a model built in configure_model
class _Lazy(Case):
    """The network made in ``configure_model``, as for a model too large to build whole."""

    def __init__(self, kind: str) -> None:
        L.LightningModule.__init__(self)
        self.save_hyperparameters({"kind": kind, "schedule": False, "lr": 1e-3, "freeze_first": False})
        self.losses, self.val_losses, self.lrs = [], [], []

    def configure_model(self) -> None:
        if not hasattr(self, "net"):
            self.net = build(self.hparams["kind"])


@pytest.mark.parametrize("kind", ["llama", "cnn"])
def test_a_model_built_in_configure_model_is_built_into_the_chunks(tmp_path: Path, kind: str) -> None:
    """configure_model builds the parameters on the meta device (the buffers, Llama's rotary
    frequencies and the CNN's batch-norm statistics, for real): the engine builds every
    parameter in its chunk and initialises it there; a plain Lightning checkpoint's weights
    then load over them, and validation equals the plain module's."""
    plain, t = _fit(kind, "auto", tmp_path, module=Case(kind, schedule=False), max_epochs=1)
    t.save_checkpoint(tmp_path / "plain.ckpt")
    lazy = _Lazy(kind)
    t2 = trainer(ChunkstarStrategy(engine_config(kind)), tmp_path)
    t2.validate(lazy, loader(kind, 4, 1000), ckpt_path=str(tmp_path / "plain.ckpt"))
    strategy = t2.strategy
    assert isinstance(strategy, ChunkstarStrategy)
    report = strategy.engine.construction
    assert report.meta_params == len(list(lazy.parameters())) and report.initialised
    assert lazy.val_losses == pytest.approx(plain.val_losses[-2:], rel=1e-5)

    trained = _Lazy(kind)
    _fit(kind, ChunkstarStrategy(engine_config(kind)), tmp_path, module=trained, max_epochs=1)
    assert len(trained.losses) == 7 and all(math.isfinite(x) for x in trained.losses)
    release(trained)
    assert not any(t.is_meta for t in [*trained.parameters(), *trained.buffers()])
