"""chunkstar under PyTorch Lightning: :class:`ChunkstarStrategy`.

A LightningModule trains with its parameters, gradients and Adam state in
chunkstar's chunks by naming the strategy::

    import chunkstar.integrations.lightning  # registers "chunkstar"
    trainer = L.Trainer(strategy=ChunkstarStrategy(device_memory_budget="2GB"), precision="bf16-mixed",
                        accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(module, datamodule)

The engine config (the one of :func:`chunkstar.initialize_engine`) is the
strategy's first argument (a dict or a DeepSpeed-style JSON file's path) plus
any top-level keys given as keyword arguments; ``Trainer(strategy="chunkstar")``
takes the defaults (on a machine without CUDA the engine needs a
``device_memory_budget``, so there it needs the instance). What Lightning
decides comes from Lightning, as with the Hugging Face integration: the
optimizer and its groups from ``configure_optimizers``, clipping from
``gradient_clip_val``, accumulation from ``accumulate_grad_batches``, the
precision from ``precision``, the device from the accelerator (a key set in
both must agree: a difference is a ConfigError naming both).

Note [lightning seams]: the engine owns the parameters, their gradients
(accumulation, clipping by the global norm, reduction across ranks), the
optimizer state, the precision and the checkpoint. Lightning's loop, data,
logging, callbacks and schedulers run unchanged; each seam below hands one of
the engine's parts over:

* :meth:`ChunkstarStrategy.setup` builds the engine around the LightningModule
  (``initialize_engine(lambda: module)``); the groups come from the module's own
  ``configure_optimizers`` (an AdamW or Adam, called once, before the engine),
  and its schedulers are turned onto the engine's ``ChunkAdam``
  (:func:`_hand_schedulers_over`). ``strategy.model`` is an ``nn.Module`` whose
  forward runs the engine (``EngineFace``), so Lightning's forward redirection runs
  ``training_step`` (and the validation, test and predict steps) inside the
  engine's forward: its hooks and its autocast see them as they would see a
  plain forward. A module that an earlier Trainer's engine holds is reused for
  validate/test/predict, and given back (:func:`release`) before a new ``fit``,
  which starts with new optimizer state, as a new torch optimizer does;
* the precision plugin (:class:`_EnginePrecision`, which replaces the one
  Lightning picked) autocasts nothing (the engine does), calls
  ``engine.backward(loss, last=..., divide=False)`` for ``loss.backward()``
  (Lightning divided the loss by ``accumulate_grad_batches`` already, and
  decides where a window ends: an epoch's last window may be short, Note
  [windows the loop decides] in :mod:`chunkstar.runtime.gradients`), and clips
  nothing (the engine clips by the global norm inside ``optimizer.step()``);
* :meth:`ChunkstarStrategy.block_backward_sync` is how Lightning says a
  micro-batch does not end its window (it wraps exactly those); the engine needs
  no other gradient synchronisation;
* checkpoints (:meth:`ChunkstarStrategy.save_checkpoint`): a Lightning
  checkpoint path becomes a folder holding the engine's checkpoint (each rank's
  shard of masters and Adam state) with Lightning's own dictionary (loops,
  callbacks, schedulers, hyper-parameters, less the state dict and optimizer
  states, which are the shards) as the save's client state, published with the
  shards in one step (Note [client state] in :mod:`chunkstar.checkpoint.resume`).
  ``ckpt_path=`` resumes from such a folder bit for bit; a plain Lightning
  checkpoint file loads its weights (Adam starts afresh, with a warning).
  :func:`convert_checkpoint` writes a folder out as a single-file Lightning
  checkpoint that ``LightningModule.load_from_checkpoint`` reads.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Literal, Mapping

import torch
from torch import nn

try:
    import lightning
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import GradClipAlgorithmType
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn
except ImportError as e:  # pragma: no cover - an extra
    raise ImportError(
        f"chunkstar.integrations.lightning needs PyTorch Lightning 2.x ({e}): pip install 'chunkstar[lightning]'"
    ) from e

from chunkstar import initialize_engine
from chunkstar.checkpoint import CheckpointError, merge_checkpoint, read_client_state
from chunkstar.checkpoint.directory import POINTER, resolve
from chunkstar.checkpoint.shard import SHARD_NAME
from chunkstar.construction.init import meta_parameters
from chunkstar.errors import ConfigError
from chunkstar.integrations._common import ConfigLike, EngineFace, device_agrees, device_name, same, user_config
from chunkstar.optim.adam import ChunkAdam
from chunkstar.runtime.engine import ChunkEngine

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import LRSchedulerConfig

__all__ = ["ChunkstarStats", "ChunkstarStrategy", "convert_checkpoint", "release"]

_PRECISIONS = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}
"""Lightning's precision settings the engine implements, and the engine config section each turns on."""

# torch's Adam/AdamW options that only choose an implementation (same result), and those
# that change what is computed, which chunkstar's AdamW does not do
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
_UNSUPPORTED = {"amsgrad": False, "maximize": False}
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


# ---------------------------------------------------------------------- the engine a module is in
# The engine holding a module, by the module's id: the engine's hooks on the module keep it
# alive as long as the module is, so a weak value is enough, and it goes with the module.
_HELD: weakref.WeakValueDictionary[int, ChunkEngine] = weakref.WeakValueDictionary()


def _engine_of(module: nn.Module) -> ChunkEngine | None:
    engine = _HELD.get(id(module))
    return engine if engine is not None and engine.module is module else None


def release(module: nn.Module) -> nn.Module:
    """Take ``module`` out of the chunk engine a :class:`ChunkstarStrategy` put it in:
    its parameters become ordinary fp32 tensors on the CPU holding the trained values
    (the masters), the engine's hooks come off and its threads and files go. Use it to
    go on with the module in plain PyTorch; a new ``Trainer.fit`` with the strategy
    does it itself. With several processes every rank must call it (the values are
    gathered). Returns the module; a module no engine holds is returned as it is."""
    engine = _engine_of(module)
    if engine is None:
        return module
    values = engine.state_dict()  # fp32 masters by the module's keys (a collective with several ranks)
    engine.close()
    engine.remove_hooks()
    del _HELD[id(module)]
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.data = values[name].detach().to("cpu", torch.float32, copy=True)
        for name, b in module.named_buffers():
            if name in values:
                b.data = values[name].detach().to("cpu", copy=True)
    return module


# ---------------------------------------------------------------------- precision
class _EnginePrecision(Precision):
    """Lightning's precision plugin for the engine: the engine autocasts, scales fp16
    losses, and clips; this plugin routes backward and the step to it (Note [lightning
    seams]). ``precision`` is Lightning's name of the setting ("32-true", "bf16-mixed",
    "16-mixed")."""

    def __init__(self, precision: str) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(
                f"ChunkstarStrategy does not support precision={precision!r}: the engine trains in "
                f"{', '.join(repr(p) for p in _PRECISIONS)} (fp32 masters and Adam state, bf16/fp16 param chunks "
                "under autocast); '16-true'/'bf16-true' keep no fp32 master, and '64-true' and transformer-engine are "
                "not implemented"
            )
        self.precision = precision  # type: ignore[assignment]
        self.engine_clip: float | None = None
        """The engine's ``gradient_clipping`` (set by the strategy once the engine is built)."""

    @classmethod
    def from_lightning(cls, plugin: Precision) -> _EnginePrecision:
        """The plugin for the precision Lightning chose (``Trainer(precision=...)``)."""
        if isinstance(plugin, _EnginePrecision):
            return plugin
        if type(plugin) is Precision:
            return cls("32-true")
        if type(plugin) is MixedPrecision:
            return cls(str(plugin.precision))
        name = getattr(plugin, "precision", None)
        raise ValueError(
            f"ChunkstarStrategy does not support the precision plugin {type(plugin).__name__}"
            f"{f' (precision={name!r})' if name else ''}: use Trainer(precision=...) with one of "
            f"{', '.join(repr(p) for p in _PRECISIONS)}; the engine does the casting and the loss scaling itself"
        )

    def backward(  # type: ignore[override]
        self, tensor: torch.Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if args or kwargs:
            raise TypeError(
                "ChunkstarStrategy: backward arguments (manual_backward(loss, *args, **kwargs)) are not supported: "
                "the engine runs one backward per forward, with no retained graph"
            )
        if is_overridden("backward", model):
            rank_zero_warn(
                "ChunkstarStrategy ignores your LightningModule.backward override: the chunk engine runs the backward "
                "(engine.backward) itself"
            )
        _strategy_of(model).engine_backward(tensor)

    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        result = closure()
        self._after_closure(model, optimizer)
        if model.automatic_optimization and result is None:
            # training_step returned None: no backward ran for this micro-batch
            strategy = _strategy_of(model)
            if strategy.engine.gradients_pending():
                raise RuntimeError(
                    "ChunkstarStrategy: training_step returned None on the last micro-batch of an accumulation window "
                    "whose earlier micro-batches ran backward; the engine's window ends with a backward. Return a loss "
                    "(zero times the loss skips it) or skip whole windows"
                )
            return None  # no gradients: no step, as torch.optim's changes nothing without them
        return optimizer.step(**kwargs)

    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """The engine clips by the global norm inside ``optimizer.step()``, by the config's
        ``gradient_clipping`` (``Trainer(gradient_clip_val=...)``): a call asking for that
        is done there; anything else cannot be."""
        if not clip_val or clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "ChunkstarStrategy does not clip gradients by value (gradient_clip_algorithm='value'): the engine clips "
                "by the global norm; use gradient_clip_algorithm='norm'"
            )
        engine_clip = self.engine_clip
        if engine_clip is None or float(clip_val) != engine_clip:
            raise ValueError(
                f"ChunkstarStrategy: clip_gradients(gradient_clip_val={clip_val}) differs from the engine's clipping "
                f"({engine_clip}): the engine clips every step inside optimizer.step() by the config's "
                "gradient_clipping (Trainer(gradient_clip_val=...)), so a clip with another value, or only on some "
                "steps, cannot be honoured; set the value there"
            )

    def state_dict(self) -> dict[str, Any]:
        return {}  # the fp16 loss scale rides in the engine's checkpoint


def _strategy_of(model: pl.LightningModule) -> ChunkstarStrategy:
    strategy = model.trainer.strategy
    assert isinstance(strategy, ChunkstarStrategy)
    return strategy


# ---------------------------------------------------------------------- the optimizer
def _adam_of(optimizers: list[Any]) -> tuple[torch.optim.Optimizer, str]:
    """The one Adam/AdamW ``configure_optimizers`` returned, and its config type."""
    if len(optimizers) != 1:
        raise ValueError(
            f"ChunkstarStrategy needs configure_optimizers to return one optimizer, got {len(optimizers)}: the engine "
            "has one optimizer over every parameter (use parameter groups for different settings)"
        )
    opt = optimizers[0]
    if type(opt) is torch.optim.AdamW:
        kind = "AdamW"
    elif type(opt) is torch.optim.Adam:
        kind = "AdamW" if opt.defaults.get("decoupled_weight_decay") else "Adam"
    else:
        raise ValueError(
            f"ChunkstarStrategy does not support {type(opt).__module__}.{type(opt).__name__}: the engine's optimizer "
            "is Adam/AdamW over chunks; return torch.optim.AdamW (or Adam) from configure_optimizers"
        )
    for i, group in enumerate(opt.param_groups):
        for key, plain in _UNSUPPORTED.items():
            if group.get(key, plain) != plain:
                raise ValueError(
                    f"ChunkstarStrategy: {type(opt).__name__}({key}={group[key]!r}) (param group {i}) is not "
                    f"supported: chunkstar's Adam has no {key}"
                )
    return opt, kind


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The engine's groups: the torch optimizer's parameters and Adam settings, group by group."""
    out = []
    for group in opt.param_groups:
        g: dict[str, Any] = {"params": list(group["params"])}
        for key in _ADAM_KEYS:
            value = group[key]
            g[key] = tuple(float(v) for v in value) if key == "betas" else float(value)
        out.append(g)
    return out


def _hand_schedulers_over(configs: list[LRSchedulerConfig], old: torch.optim.Optimizer, new: ChunkAdam) -> None:
    """Turn the schedulers built on ``old`` (the module's torch optimizer) onto ``new``.

    A scheduler holds its optimizer and writes the groups' ``lr`` (``initial_lr``,
    OneCycleLR's ``max_lr``...) at each step. Its construction already ran its first
    step on ``old``'s groups, so what it wrote there is copied group by group, and
    ``new.step`` is marked as torch marks a scheduled optimizer's (so torch's check
    that ``optimizer.step()`` ran before ``scheduler.step()`` sees the engine's)."""
    for g_old, g_new in zip(old.param_groups, new.param_groups):
        for key, value in g_old.items():
            if key == "params" or key in _IMPLEMENTATION or key in _UNSUPPORTED or key == "decoupled_weight_decay":
                continue
            g_new[key] = tuple(value) if key == "betas" else value

    def retarget(scheduler: Any) -> None:
        for inner in getattr(scheduler, "_schedulers", ()):  # SequentialLR, ChainedScheduler
            retarget(inner)
        if getattr(scheduler, "optimizer", None) is old:
            scheduler.optimizer = new

    for config in configs:
        retarget(config.scheduler)
    if configs and not hasattr(new.step, "_wrapped_by_lr_sched"):
        step = new.step

        def stepped(*args: Any, **kwargs: Any) -> Any:
            new._opt_called = True  # type: ignore[attr-defined]
            return step(*args, **kwargs)

        stepped._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        new.step = stepped  # type: ignore[method-assign]


# ---------------------------------------------------------------------- the strategy
class ChunkstarStrategy(DDPStrategy):
    """Lightning strategy that trains the LightningModule in chunkstar's chunk engine
    (module docstring; Note [lightning seams]).

    ``config``: the engine config of :func:`chunkstar.initialize_engine`, a dict or a
    JSON file's path, without what the Trainer decides (optimizer, clipping,
    accumulation, precision, device); keyword arguments are top-level keys of it
    (``device_memory_budget="2GB"``). One process per device, launched as
    ``DDPStrategy`` launches them (``devices=N``, or torchrun/SLURM); the engine
    shards across the ranks. The engine is ``strategy.engine`` once set up."""

    strategy_name = "chunkstar"

    def __init__(
        self,
        config: ConfigLike | None = None,
        *,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **config_keys: Any,
    ) -> None:
        user = user_config(config, "ChunkstarStrategy(config=...)")
        for key, value in config_keys.items():
            if key in user and not same(user[key], value):
                raise ConfigError(key, f"given as {value!r} and as {user[key]!r} in config: give it once")
            user[key] = value
        self._user_config = user
        self._engine: ChunkEngine | None = None
        self._accumulating = False  # inside block_backward_sync: this micro-batch does not end its window
        ddp: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}  # None: DDPStrategy's default
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io, precision_plugin=precision_plugin,
            process_group_backend=process_group_backend, start_method=start_method, **ddp,
        )  # fmt: skip

    # ------------------------------------------------------------------ what Lightning asks of a strategy
    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else _EnginePrecision("32-true")

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # Lightning hands over the plugin for Trainer(precision=...): the engine's takes its place
        self._precision_plugin = None if plugin is None else _EnginePrecision.from_lightning(plugin)

    @property
    def engine(self) -> ChunkEngine:
        """The chunk engine holding the LightningModule (set up by ``trainer.fit/validate/...``)."""
        if self._engine is None:
            raise RuntimeError("ChunkstarStrategy has no engine yet: it is built when the Trainer sets the strategy up")
        return self._engine

    @property
    def handles_gradient_accumulation(self) -> bool:
        return False  # Lightning decides the windows and divides the loss; the engine is told (Note [lightning seams])

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a checkpoint loads into the engine, which setup builds

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # the optimizer's state is in the engine's shards

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning runs exactly the micro-batches that do not end a window in here."""
        self._accumulating = True
        try:
            yield None
        finally:
            self._accumulating = False

    def model_to_device(self) -> None:
        """Nothing to move: the engine placed the chunks and the buffers on its device."""

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where ``configure_model`` (and ``trainer.init_module()``) build the model: its
        parameters on the meta device (its buffers for real), so no full copy of it is ever
        made; the engine then builds each parameter straight into its chunk, each rank only
        the chunks it owns, and runs the modules' initialisers there (Note [construction] in
        :mod:`chunkstar.construction.materialize`), before a checkpoint's weights load over
        them. A model larger than host memory is built so."""
        with meta_parameters():
            yield

    def setup_environment(self) -> None:
        super().setup_environment()
        # The engine splits a node's host memory budget and its cores among the node's processes,
        # which it counts as the launcher says (chunkstar.device.threads.processes_on_node);
        # Lightning's own launcher says nothing, so each process would take the whole node's.
        # Lightning knows them: `devices`.
        os.environ.setdefault("LOCAL_WORLD_SIZE", str(max(1, self.num_processes)))

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:  # sync_batchnorm=True: before the engine lays the module out
            self._layer_sync.apply(module)  # replaces the norm layers inside the module
        if fitting:
            self._build_for_fit(trainer, module)
        else:
            held = _engine_of(module)
            if held is not None and self._suits(held):
                self._engine = held  # the module as trained, where it is
            else:
                self._build(trainer, module)  # (an engine of another precision or device: released)
            self.optimizers, self.lr_scheduler_configs = [], []
        self.model = EngineFace(self.engine)  # the step methods run inside the engine's forward
        plugin = self.precision_plugin
        assert isinstance(plugin, _EnginePrecision)
        plugin.engine_clip = self.engine.config.optimizer.gradient_clipping
        self.setup_precision_plugin()

    def _suits(self, engine: ChunkEngine) -> bool:
        """Whether an engine already holding the module runs in this Trainer's precision, on its device."""
        precision = _PRECISIONS[self.precision_plugin.precision] or "fp32"
        return engine.config.precision.value == precision and engine.device == self.root_device

    def _build_for_fit(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        release(module)  # an earlier fit's engine: this fit starts with new optimizer state
        self._check_trainer(trainer)
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
        if not optimizers or type(optimizers[0]).__name__ == "_MockOptimizer":
            raise ValueError(
                "ChunkstarStrategy needs configure_optimizers to return a torch.optim.AdamW (or Adam): the engine "
                "steps it; it returned none"
            )
        torch_opt, kind = _adam_of(optimizers)
        groups = _groups(torch_opt)
        engine = self._build(trainer, module, optimizer=(kind, _groups_defaults(torch_opt)), groups=groups)
        chunk_opt = engine.optimizer
        assert chunk_opt is not None
        _hand_schedulers_over(schedulers, torch_opt, chunk_opt)
        self.optimizers, self.lr_scheduler_configs = [chunk_opt], schedulers

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            raise ValueError(
                "ChunkstarStrategy does not clip gradients by value (gradient_clip_algorithm='value'): the engine "
                "clips by the global norm; use gradient_clip_algorithm='norm'"
            )
        module = trainer.lightning_module
        if is_overridden("configure_gradient_clipping", module):
            rank_zero_warn(
                "ChunkstarStrategy: your configure_gradient_clipping override runs, but the engine clips by "
                "Trainer(gradient_clip_val=...) inside every optimizer step; a clip_gradients call with another value "
                "is refused"
            )

    def _engine_config(self, trainer: pl.Trainer, optimizer: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
        """The user's config plus what the Trainer decides (a key set in both must agree)."""
        user = self._user_config
        cfg = dict(user)

        def conflict(key: str, mine: Any, trainer_arg: str, theirs: Any, what: str) -> ConfigError:
            return ConfigError(
                key,
                f"the strategy's config sets {key} = {mine!r} but {trainer_arg} is {theirs!r}. ChunkstarStrategy takes "
                f"{what} from the Trainer: remove {key} from the config or give both the same value",
            )

        def decide(key: str, value: Any, trainer_arg: str, what: str) -> None:
            if key in user and not same(user[key], value):
                raise conflict(key, user[key], trainer_arg, value, what)
            cfg[key] = value

        if optimizer is not None:
            kind, params = optimizer
            given = user.get("optimizer")
            if given is not None:
                if not isinstance(given, Mapping):
                    raise ConfigError("optimizer", f"expected an object/dict, got {type(given).__name__}")
                if given.get("type", kind) != kind:
                    raise conflict("optimizer.type", given["type"], "configure_optimizers()", kind, "the optimizer")
                for k, v in dict(given.get("params", {})).items():
                    if k not in params or not same(v, params[k]):
                        raise conflict(f"optimizer.params.{k}", v, "configure_optimizers()'s optimizer", params.get(k),
                                       "the optimizer's settings")  # fmt: skip
            cfg["optimizer"] = {"type": kind, "params": {**params, "betas": list(params["betas"])}}
            if trainer.lightning_module.automatic_optimization:
                clip = float(trainer.gradient_clip_val) if trainer.gradient_clip_val else 0.0
                decide("gradient_clipping", clip, "Trainer(gradient_clip_val=...)", "clipping")
                decide("gradient_accumulation_steps", _largest_window(trainer), "Trainer(accumulate_grad_batches=...)",
                       "gradient accumulation")  # fmt: skip
            # manual optimization: the loop is the user's (Lightning allows neither setting there), so the
            # config's gradient_clipping and gradient_accumulation_steps hold
        precision = self.precision_plugin.precision
        on = _PRECISIONS[precision]
        for section in ("bf16", "fp16"):
            given_section = user.get(section, {})
            if not isinstance(given_section, Mapping):
                raise ConfigError(section, f"expected an object/dict, got {type(given_section).__name__}")
            enabled = on == section
            if "enabled" in given_section and not same(given_section["enabled"], enabled):
                raise conflict(f"{section}.enabled", given_section["enabled"], "Trainer(precision=...)", precision,
                               "the precision")  # fmt: skip
            cfg[section] = {**given_section, "enabled": enabled}
        dev = device_name(self.root_device)
        if dev is None:
            raise ValueError(f"ChunkstarStrategy runs on cpu or cuda; the accelerator puts training on {self.root_device}")
        if dev == "cpu" and "device_memory_budget" not in user:
            raise ConfigError(
                "device_memory_budget",
                "required on a CPU, where the engine's device is a virtual one of that size: "
                'Trainer(strategy=ChunkstarStrategy(device_memory_budget="2GB"))',
            )
        if "device" in user and not device_agrees(user["device"], dev):
            raise conflict("device", user["device"], "the Trainer's device", dev, "the device")
        cfg["device"] = dev
        return cfg

    def _build(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        *,
        optimizer: tuple[str, dict[str, Any]] | None = None,
        groups: list[dict[str, Any]] | None = None,
    ) -> ChunkEngine:
        cfg = self._engine_config(trainer, optimizer)
        release(module)  # an engine holding it (another precision or device, an earlier fit): values back first
        engine, _ = initialize_engine(
            lambda: module, self.local_rank, cfg, param_groups_fn=(lambda _m: groups) if groups is not None else None
        )
        _HELD[id(module)] = engine
        self._engine = engine
        return engine

    # ------------------------------------------------------------------ backward
    def engine_backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` for Lightning: the engine's backward, told whether this
        micro-batch ends its window (automatic optimization: Lightning decides, Note
        [lightning seams]); the loss as Lightning divided it."""
        module = self.lightning_module
        assert module is not None
        last = (not self._accumulating) if module.automatic_optimization else None
        self.engine.backward(loss, last=last, divide=False)

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the weights are the engine's shards (save_checkpoint)

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # the Adam state is the engine's shards (save_checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Save into the folder ``filepath`` (every rank): the engine's shards, with
        Lightning's dictionary (less the state dict and optimizer states) as the save's
        client state (Note [lightning seams])."""
        if storage_options is not None:
            raise TypeError("ChunkstarStrategy.save_checkpoint does not take storage_options: the engine writes its files")
        path = str(self.broadcast(os.fspath(filepath)))  # one folder for every rank: rank 0's name
        if os.path.isfile(path):
            raise CheckpointError(
                f"{path} is a file; a chunkstar checkpoint is a folder (of every rank's shard): save to another name, "
                "or remove the file"
            )
        engine = self.engine
        inside_window = engine.gradients_pending()
        if inside_window:
            # Lightning's own checkpoints hold no gradients either: one saved inside an accumulation
            # window resumes without that window's micro-batches, with any strategy
            rank_zero_warn(
                f"ChunkstarStrategy: {path} is saved inside an accumulation window (after a micro-batch that did not "
                "end it): it holds the weights and optimizer state of the last step, not the gradients of the window "
                "so far, so a run resumed from it steps on the rest of the window only, as with Lightning's own "
                "strategies. Checkpoints on step boundaries (every_n_train_steps, val_check_interval a multiple of "
                "accumulate_grad_batches) resume exactly"
            )
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        client["chunkstar"] = {"lightning": lightning.__version__, "world_size": self.world_size}
        engine.save_checkpoint(path, client_state=client, drop_pending=inside_window)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = str(self.broadcast(os.fspath(checkpoint_path)))
        if not _is_engine_checkpoint(path):
            # a plain Lightning file (another strategy's): its weights load in load_model_state_dict
            self._from_file = True
            loaded = super().load_checkpoint(path, weights_only=weights_only)
            if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                rank_zero_warn(
                    f"ChunkstarStrategy: {path} is a single-file Lightning checkpoint: its weights, loops and "
                    "schedulers are restored, not its optimizer state (the engine's Adam state starts afresh). "
                    "Resume exactly from a checkpoint folder the strategy saved"
                )
            return dict(loaded)
        self._from_file = False
        engine = self.engine
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if fitting:
            saved_by = _world_size_of(path)
            if saved_by is not None and saved_by != self.world_size:
                raise CheckpointError(
                    f"{path} was saved by {saved_by} process(es) and this run has {self.world_size}: an exact resume "
                    "(each rank's shard of the Adam state) needs as many. To go on with another number, write it as "
                    f"one file, convert_checkpoint({path!r}, 'one.ckpt'), and pass ckpt_path='one.ckpt': the weights, "
                    "loops and schedulers load; the Adam state starts afresh"
                )
            engine.load_checkpoint(path)  # masters, Adam state, groups' lr, the loss scale: bit for bit
        else:
            # validate/test/predict: the weights only (this engine's optimizer need not match the save's)
            engine.load_state_dict(merge_checkpoint(path, tied=True), strict=True)
        client = read_client_state(path, weights_only=weights_only is not False)
        if client is None:
            raise CheckpointError(
                f"{path}: a chunkstar checkpoint without Lightning's state (no client_state.pt): was it saved by "
                "engine.save_checkpoint outside Lightning? Load its weights with engine.load_state_dict("
                "merge_checkpoint(path)) instead of ckpt_path="
            )
        client.pop("chunkstar", None)
        return client

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if getattr(self, "_from_file", False):
            self.engine.load_state_dict(dict(checkpoint["state_dict"]), strict=strict)
        # from a folder: load_checkpoint loaded the weights into the engine

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Lightning's teardown, less moving the module to the CPU: the engine keeps it,
        for a later validate/test/predict (:func:`release` gives it back)."""
        self.model = self.lightning_module
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register "chunkstar" (and not, as DDPStrategy's would, the "ddp" names)."""
        strategy_registry.register(
            cls.strategy_name, cls, override=True,
            description="chunkstar: parameters, gradients and Adam state in chunks that move between device and host",
        )  # fmt: skip


def _groups_defaults(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The torch optimizer's defaults as the config's optimizer params."""
    d = opt.defaults
    return {"lr": float(d["lr"]), "betas": tuple(float(b) for b in d["betas"]), "eps": float(d["eps"]),
            "weight_decay": float(d["weight_decay"])}  # fmt: skip


def _largest_window(trainer: pl.Trainer) -> int:
    """The most micro-batches a window holds: ``accumulate_grad_batches``, or the largest a
    GradientAccumulationScheduler sets (the engine's ``gradient_accumulation_steps``)."""
    sizes = [int(trainer.accumulate_grad_batches)]
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, GradientAccumulationScheduler):
            sizes.extend(int(v) for v in cb.scheduling.values())
    return max(sizes)


def _is_engine_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, POINTER))


def _world_size_of(path: str) -> int | None:
    """The number of processes that wrote the checkpoint folder's latest save (None: no shards)."""
    worlds = {int(m.group(2)) for f in resolve(Path(path)).iterdir() if (m := SHARD_NAME.fullmatch(f.name))}
    return worlds.pop() if len(worlds) == 1 else None


# ---------------------------------------------------------------------- figures
_STATS = (
    "device_chunk_bytes_peak", "device_peak_bytes", "chunk_moves_to_device", "chunk_moves_to_host",
    "bytes_to_device", "bytes_to_host", "skipped_steps",
)  # fmt: skip


class ChunkstarStats(Callback):
    """Logs figures of ``engine.stats()`` through the LightningModule's ``log_dict`` after
    each optimizer step (as ``chunkstar/<name>``), and with ``grad_norm`` the global
    gradient norm the engine measured in that step (before clipping). ``keys``: which
    numeric figures of ``engine.stats()`` to log (the default: peaks, chunk moves and
    bytes each way, skipped steps)."""

    def __init__(self, keys: Iterable[str] = _STATS, *, grad_norm: bool = True, prog_bar: bool = False) -> None:
        self.keys = tuple(keys)
        self.grad_norm = grad_norm
        self.prog_bar = prog_bar
        self._last_step = -1

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, ChunkstarStrategy):
            raise ValueError(f"ChunkstarStats needs Trainer(strategy=ChunkstarStrategy(...)), not {type(strategy).__name__}")
        stats = strategy.engine.stats()
        unknown = [k for k in self.keys if k not in stats]
        if unknown:
            raise ValueError(f"ChunkstarStats: engine.stats() has no {', '.join(unknown)}; it has {', '.join(sorted(stats))}")
        wrong = [k for k in self.keys if isinstance(stats[k], bool) or not isinstance(stats[k], (int, float))]
        if wrong:
            raise ValueError(f"ChunkstarStats logs numbers; {', '.join(wrong)} are not")
        if self.grad_norm and strategy.engine.optimizer is not None:
            strategy.engine.optimizer.measure_grad_norm = True  # every rank: the norm is a collective

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_step:
            return  # within an accumulation window: no step since the last log
        self._last_step = trainer.global_step
        strategy = trainer.strategy
        assert isinstance(strategy, ChunkstarStrategy)
        engine = strategy.engine
        stats = engine.stats()
        figures = {f"chunkstar/{k}": float(stats[k]) for k in self.keys}
        opt = engine.optimizer
        if self.grad_norm and opt is not None and opt.step_count:
            figures["chunkstar/grad_norm"] = opt.last_grad_norm if opt.last_grad_norm is not None else math.inf
        pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=self.prog_bar, rank_zero_only=True)


# ---------------------------------------------------------------------- one file
def convert_checkpoint(checkpoint: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the checkpoint folder ``checkpoint`` (saved by :class:`ChunkstarStrategy`)
    as one Lightning checkpoint file ``out``: the fp32 weights under the module's keys
    as ``state_dict``, with Lightning's loops, callbacks, schedulers and
    hyper-parameters; no optimizer state. ``MyModule.load_from_checkpoint(out)`` reads
    it, as does any strategy's ``ckpt_path=`` (weights, no Adam state). Run it in one
    process (no engine is needed); returns ``out``."""
    src = os.fspath(checkpoint)
    if not _is_engine_checkpoint(src):
        raise CheckpointError(f"{src}: not a chunkstar checkpoint folder (no '{POINTER}' in it)")
    dst = Path(out)
    if dst.exists() and dst.is_dir():
        raise CheckpointError(f"{dst} is a folder; give the path of the file to write")
    client = read_client_state(src)
    if client is None:
        raise CheckpointError(f"{src}: the save holds no Lightning state (client_state.pt): it was not saved by Lightning")
    client.pop("chunkstar", None)
    client["state_dict"] = merge_checkpoint(src, tied=True)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    torch.save(client, tmp)
    os.replace(tmp, dst)
    return dst


ChunkstarStrategy.register_strategies(StrategyRegistry)  # Trainer(strategy="chunkstar")
