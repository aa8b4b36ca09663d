"""chunkstar under the Hugging Face ``Trainer``: :class:`ChunkstarTrainer`.

``ChunkstarTrainer`` takes ``transformers.Trainer``'s arguments plus
``chunkstar_config`` (the engine config of :func:`chunkstar.initialize_engine`)
and trains the model with its parameters, gradients and Adam state in chunks::

    trainer = ChunkstarTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                               chunkstar_config={"device": "cpu", "device_memory_budget": "2GB"})
    trainer.train(); trainer.evaluate(); trainer.save_model("out")

Learning rate, betas, eps, weight decay, ``max_grad_norm``, gradient
accumulation and bf16/fp16 come from ``TrainingArguments`` (:func:`engine_config`
merges them into the engine config; a key set in both must agree). The
Trainer's loop, data, scheduler, logging, callbacks and checkpoint folders run
unchanged. This module is not a training loop of its own, and it does not
change the engine: it replaces only the Trainer's seams where the Trainer would
otherwise own what the engine owns (Note [trainer seams]).

Note [trainer seams]: the engine owns the parameters (their chunks and
device), the gradients (accumulation, clipping by the global norm, reduction
across ranks), the optimizer state and the precision. Each override below hands
one of these to the engine:

* construction (``__init__``, :meth:`call_model_init`): the model is built by
  ``initialize_engine(model_func=...)``, whose ``model_func`` returns the given
  model or ``model_init()``, at construction (so ``evaluate()`` works before
  ``train()``), and again at every ``train()`` with ``model_init`` (as the
  Trainer re-initialises it). ``self.model`` is the user's model (its
  parameters now live in chunks), so the Trainer's introspection, PEFT checks
  and ``save_pretrained`` see the model they expect;
* :meth:`_build_accelerator_args`: Accelerate gets ``mixed_precision="no"``,
  since the engine autocasts and scales the loss itself (bf16/fp16 from
  ``TrainingArguments``); and :meth:`_move_model_to_device` does nothing;
* :meth:`_wrap_model` returns an :class:`EngineModule` (the Trainer's
  ``model_wrapped``). Because it is not ``self.model``, the Trainer hands only
  the optimizer to ``accelerator.prepare``: no DDP wrapper (the engine reduces
  gradients across ranks itself) and no autocast wrapper;
* :meth:`create_optimizer` returns the ``ChunkAdam`` that ``initialize_engine``
  built, with the Trainer's two groups (decay / no decay, from
  ``get_decay_parameter_names``), as an already-prepared Accelerate optimizer
  that reports an fp16 overflow's skipped step (so the scheduler does not step);
  the Trainer's scheduler drives it through ``param_groups``;
* :meth:`training_step` calls ``engine.backward`` instead of
  ``accelerator.backward``, with the loss as the Trainer divides it and the
  window's end where the Trainer puts it (Note [loss scaling for accumulation]);
* :meth:`_clip_grad_norm` / :meth:`_get_grad_norm` compute nothing: the engine
  clips inside ``optimizer.step()`` by the global norm it measures there, and
  :meth:`_maybe_log_save_evaluate` logs that norm (``ChunkAdam.last_grad_norm``);
* :meth:`_save`: the full state dict (fp32 values under the model's own keys)
  from ``engine.state_dict()``, a collective with several ranks, written by
  the model's ``save_pretrained`` (safetensors) on the saving rank;
* :meth:`_save_optimizer_and_scheduler`: ``engine.save_checkpoint`` into
  ``checkpoint-N/chunkstar/`` (each rank its shard: masters, Adam moments and
  steps, groups' settings, loss scale), beside the Trainer's ``scheduler.pt``,
  RNG states and ``trainer_state.json``;
* :meth:`_load_from_checkpoint` only checks that the folder holds a chunkstar
  checkpoint; :meth:`_load_optimizer_and_scheduler` loads it, then the
  scheduler. It runs after the scheduler was created (whose creation writes
  its first lr into the groups): the checkpoint's lr must be the one that
  stays, as with the Trainer's own ``optimizer.pt``;

Note [loss scaling for accumulation]: the Trainer divides a per-batch loss by
the micro-batches of its window (``current_gradient_accumulation_steps``: fewer
in an epoch's last window when the epoch is not a multiple of
``gradient_accumulation_steps``), and leaves a loss already normalised over the
whole window (``num_items_in_batch``, as Hugging Face causal LMs do) as it is.
:meth:`training_step` does the same and hands the loss to ``engine.backward``
undivided (``divide=False``), with ``last`` from the Trainer's
``sync_gradients``, so an epoch's short last window steps after its own
micro-batches, as with the plain Trainer.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, cast

import torch
from torch import nn

try:
    import transformers
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import PreTrainedModel, Trainer, TrainingArguments
    from transformers.trainer import SCHEDULER_NAME
    from transformers.trainer_pt_utils import reissue_pt_warnings
    from transformers.trainer_utils import _is_peft_model
except ImportError as e:  # pragma: no cover - an extra
    raise ImportError(
        f"chunkstar.integrations.transformers needs transformers and accelerate ({e}): pip install 'chunkstar[hf]'"
    ) from e

from chunkstar import initialize_engine
from chunkstar.config import Precision
from chunkstar.errors import ConfigError
from chunkstar.integrations._common import ConfigLike, EngineFace, device_agrees, device_name, same, user_config
from chunkstar.optim.adam import ChunkAdam
from chunkstar.runtime.engine import ChunkEngine

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

__all__ = ["CHECKPOINT_DIR", "ChunkstarTrainer", "EngineModule", "engine_config"]

CHECKPOINT_DIR = "chunkstar"
"""The engine checkpoint's folder inside the Trainer's ``checkpoint-N`` folder."""

_ADAMW = ("adamw_torch", "adamw_torch_fused")
"""``TrainingArguments.optim`` values chunkstar's AdamW implements (fused AdamW semantics)."""

# The seams ChunkstarTrainer overrides must be the ones this Trainer's loop calls (Note
# [trainer seams]); a Trainer without them (an older transformers) would train around the engine.
_SEAMS = ("_build_accelerator_args", "_wrap_model", "training_step", "_run_epoch",
          "_maybe_log_save_evaluate", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")  # fmt: skip
_missing = [name for name in _SEAMS if not hasattr(Trainer, name)]
if _missing:  # pragma: no cover - depends on the installed transformers
    raise ImportError(
        f"ChunkstarTrainer needs a transformers.Trainer with {', '.join(_missing)} (transformers 5.x; tested with "
        f"5.24); found transformers {transformers.__version__}"
    )


# ---------------------------------------------------------------------- the engine config
def _conflict(config_key: str, config_value: Any, args_name: str, args_value: Any, what: str) -> ConfigError:
    return ConfigError(
        config_key,
        f"chunkstar_config sets {config_key} = {config_value!r} but TrainingArguments.{args_name} is "
        f"{args_value!r}. ChunkstarTrainer takes {what} from TrainingArguments: remove {config_key} from "
        "chunkstar_config or give both the same value",
    )


def _device_of(args: TrainingArguments) -> str:
    name = device_name(args.device)
    if name is None:
        raise ValueError(
            f"ChunkstarTrainer: TrainingArguments puts training on {args.device}; chunkstar runs on cpu (a virtual "
            "device under device_memory_budget) or cuda. Set use_cpu=True or run on a CUDA machine"
        )
    return name


def engine_config(args: TrainingArguments, chunkstar_config: ConfigLike | None = None) -> dict[str, Any]:
    """The engine config for ``args``: ``chunkstar_config`` (a dict or a JSON file's
    path) plus what ``TrainingArguments`` decides, the optimizer (AdamW with
    ``learning_rate``, ``adam_beta1``/``adam_beta2``, ``adam_epsilon``,
    ``weight_decay``), ``gradient_clipping`` (``max_grad_norm``),
    ``gradient_accumulation_steps``, ``bf16``/``fp16`` and the ``device``. A
    setting given in both must have the same value: a difference is a
    :class:`~chunkstar.errors.ConfigError` naming both."""
    user = user_config(chunkstar_config, "chunkstar_config")
    cfg = dict(user)

    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in _ADAMW:
        raise ValueError(
            f"ChunkstarTrainer: TrainingArguments.optim is {optim!r}; chunkstar's optimizer is AdamW over chunks: "
            f"use one of {', '.join(_ADAMW)} (the default)"
        )
    if args.optim_args:
        raise ValueError(f"ChunkstarTrainer: TrainingArguments.optim_args ({args.optim_args!r}) are not supported")
    params = {"lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
              "weight_decay": args.weight_decay}  # fmt: skip
    args_of = {"lr": "learning_rate", "betas": "adam_beta1/adam_beta2", "eps": "adam_epsilon",
               "weight_decay": "weight_decay"}  # fmt: skip
    opt = user.get("optimizer")
    if opt is not None:
        if not isinstance(opt, Mapping):
            raise ConfigError("optimizer", f"expected an object/dict, got {type(opt).__name__}")
        if opt.get("type", "AdamW") != "AdamW":
            raise _conflict("optimizer.type", opt["type"], "optim", optim, "the optimizer")
        given = opt.get("params", {})
        if not isinstance(given, Mapping):
            raise ConfigError("optimizer.params", f"expected an object/dict, got {type(given).__name__}")
        for k, v in given.items():
            if k in params and not same(v, params[k]):
                raise _conflict(f"optimizer.params.{k}", v, args_of[k], params[k], "the optimizer's settings")
        unknown = sorted(set(given) - set(params))
        if unknown:
            allowed = ", ".join(sorted(params))
            raise ConfigError(f"optimizer.params.{unknown[0]}", f"unknown key; allowed here: {allowed}")
    cfg["optimizer"] = {"type": "AdamW", "params": params}

    clip = float(args.max_grad_norm) if args.max_grad_norm is not None and args.max_grad_norm > 0 else 0.0
    if "gradient_clipping" in user and not same(user["gradient_clipping"], clip):
        raise _conflict("gradient_clipping", user["gradient_clipping"], "max_grad_norm", args.max_grad_norm, "clipping")
    cfg["gradient_clipping"] = clip

    gas = int(args.gradient_accumulation_steps)
    if "gradient_accumulation_steps" in user and not same(user["gradient_accumulation_steps"], gas):
        raise _conflict(
            "gradient_accumulation_steps", user["gradient_accumulation_steps"], "gradient_accumulation_steps", gas,
            "gradient accumulation",
        )  # fmt: skip
    cfg["gradient_accumulation_steps"] = gas

    for name in ("bf16", "fp16"):
        section = user.get(name, {})
        if not isinstance(section, Mapping):
            raise ConfigError(name, f"expected an object/dict, got {type(section).__name__}")
        on = bool(getattr(args, name))
        if "enabled" in section and not same(section["enabled"], on):
            raise _conflict(f"{name}.enabled", section["enabled"], name, on, "the precision")
        cfg[name] = {**section, "enabled": on}

    device = _device_of(args)
    if "device" in user:
        if not device_agrees(user["device"], device):
            raise _conflict("device", user["device"], "device", str(args.device), "the device")
    cfg["device"] = device
    return cfg


def _refuse_unsupported(args: TrainingArguments, optimizers: tuple[Any, Any], optimizer_cls_and_kwargs: Any) -> None:
    """Trainer features that cannot work with the engine, refused before anything is built."""

    def no(what: str, why: str) -> ValueError:
        return ValueError(f"ChunkstarTrainer does not support {what}: {why}")

    if args.deepspeed:
        raise no("TrainingArguments.deepspeed", "chunkstar and DeepSpeed both manage the model's memory; use one")
    if args.fsdp:
        raise no("TrainingArguments.fsdp", "chunkstar and FSDP both shard the model; use one")
    if args.parallelism_config is not None:
        raise no("TrainingArguments.parallelism_config", "tensor/context/sequence parallelism is not implemented")
    if args.torch_compile:
        raise no("TrainingArguments.torch_compile", "the engine's module hooks run in eager mode")
    if args.fp16_full_eval or args.bf16_full_eval:
        raise no("fp16_full_eval / bf16_full_eval", "the engine keeps one precision, set by bf16/fp16")
    if args.use_liger_kernel:
        raise no("TrainingArguments.use_liger_kernel", "it patches the model after the engine has hooked it")
    if args.auto_find_batch_size:
        raise no("TrainingArguments.auto_find_batch_size", "a DeviceMemoryError names the budget to raise instead")
    if args.n_gpu > 1:
        raise no(
            f"DataParallel over {args.n_gpu} GPUs in one process",
            "launch one process per GPU with torchrun (the engine shards across ranks)",
        )
    if optimizers[0] is not None or optimizers[1] is not None:
        raise no("optimizers=", "the optimizer is chunkstar's (its state lives in chunks); the scheduler comes from "
                 "TrainingArguments.lr_scheduler_type, or override create_scheduler")  # fmt: skip
    if optimizer_cls_and_kwargs is not None:
        raise no("optimizer_cls_and_kwargs=", "the optimizer is chunkstar's AdamW; set it through TrainingArguments")


# ---------------------------------------------------------------------- what the Trainer holds
class EngineModule(EngineFace):
    """The Trainer's ``model_wrapped`` (:class:`~chunkstar.integrations._common.EngineFace`);
    ``zero_grad()`` drops gradients no step consumed (the engine's, not ``p.grad``)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine.optimizer is not None:
            self.engine.optimizer.zero_grad()

    def _get_name(self) -> str:
        # the Trainer names the model to decide whether labels shift (causal LM label smoothing)
        inner: Any = self.module
        if _is_peft_model(inner):
            inner = inner.base_model.model
        return str(inner._get_name())


class _EngineOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """``ChunkAdam`` as an already-prepared Accelerate optimizer: no device placement
    (its state is in chunks), no grad scaler (the engine scales fp16 losses), and
    ``step_was_skipped`` when the engine's loss scaler skipped the step on an overflow,
    so the Trainer does not step the scheduler, as with Accelerate's own scaler."""

    def __init__(self, optimizer: ChunkAdam) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._is_accelerate_prepared = True

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        skipped = self.optimizer.skipped_steps
        super().step(closure)
        self._is_overflow = self.optimizer.skipped_steps > skipped


# ---------------------------------------------------------------------- the Trainer
class ChunkstarTrainer(Trainer):
    """``transformers.Trainer`` with the model in chunkstar's chunks (module docstring).

    Takes ``Trainer``'s arguments plus ``chunkstar_config``: the engine config of
    :func:`chunkstar.initialize_engine` (a dict or a JSON file's path) without the
    settings ``TrainingArguments`` decides (:func:`engine_config`). On a machine
    without CUDA it needs ``"device_memory_budget"``. The engine is ``self.engine``;
    ``self.model`` is the user's model, ``self.model_wrapped`` an :class:`EngineModule`.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., Any] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[..., Any] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
        *,
        chunkstar_config: ConfigLike | None = None,
    ) -> None:
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")  # the Trainer's own default
        # the Trainer's device and process-group set-up (it makes this call itself): world size
        # and device are known, and the process group exists before the engine shards across it
        args._setup_devices  # noqa: B018
        _refuse_unsupported(args, optimizers, optimizer_cls_and_kwargs)
        self._engine_config = engine_config(args, chunkstar_config)
        self._engine: ChunkEngine | None = None
        self._chunk_optimizer: ChunkAdam | None = None
        self._engine_module: EngineModule | None = None
        self.args = args  # _build_engine reads it (the Trainer sets it again)
        if model is not None and model_init is None:
            given: nn.Module = model
            self._build_engine(lambda: given)
            model = self.engine.module
        # with model_init, the Trainer calls call_model_init (below) after seeding, and again in train()
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        if self._engine_module is not None:
            self.model_wrapped = self._engine_module  # what a forward must go through, from the start
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # set by an `accelerate launch` config
            raise ValueError(
                "ChunkstarTrainer does not support DeepSpeed or FSDP from the Accelerate launch config: chunkstar "
                "manages the model's memory itself; launch with torchrun or a plain accelerate config"
            )

    # ------------------------------------------------------------------ the engine
    @property
    def engine(self) -> ChunkEngine:
        """The chunk engine that holds the model (a new one at each ``train()`` with ``model_init``)."""
        if self._engine is None:
            raise RuntimeError("ChunkstarTrainer has no engine yet (no model or model_init was given)")
        return self._engine

    @property
    def chunk_optimizer(self) -> ChunkAdam:
        """The engine's ``ChunkAdam`` (``self.optimizer`` wraps it for Accelerate)."""
        if self._chunk_optimizer is None:
            raise RuntimeError("ChunkstarTrainer has no engine yet (no model or model_init was given)")
        return self._chunk_optimizer

    def _param_groups(self, model: nn.Module) -> list[dict[str, Any]]:
        """The Trainer's groups (weights decay, biases and norms do not:
        ``get_decay_parameter_names``), with frozen parameters too (the engine lays every
        parameter out; a frozen one has no optimizer state and never gets a gradient)."""
        decay = set(self.get_decay_parameter_names(model))
        named = list(model.named_parameters())
        groups: list[dict[str, Any]] = [
            {"params": [p for n, p in named if n in decay]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def _build_engine(self, model_func: Callable[[], nn.Module]) -> None:
        if self._engine is not None:  # model_init: the new model replaces the old one
            self._engine.close()
            self._engine.remove_hooks()
        self._engine = self._chunk_optimizer = self._engine_module = None
        engine, optimizer = initialize_engine(
            model_func, max(self.args.local_rank, 0), self._engine_config, param_groups_fn=self._param_groups
        )
        # the Trainer logs the global gradient norm every step, clipping or not (its own
        # _get_grad_norm measures it with max_grad_norm 0 too): the engine measures it then
        optimizer.measure_grad_norm = True
        self._engine, self._chunk_optimizer = engine, optimizer
        self._engine_module = EngineModule(engine)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """``model_init()`` (or ``model_init(trial)``), built into a new engine."""
        self._build_engine(lambda: super(ChunkstarTrainer, self).call_model_init(trial))
        return self.engine.module

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        out: dict[str, Any] = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"  # the engine's precision (TrainingArguments.bf16/fp16, engine_config)
        return out

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing to move: the engine placed the chunks (and the buffers) on its device."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: DataLoader | None = None) -> nn.Module:
        assert self._engine_module is not None
        return self._engine_module

    # ------------------------------------------------------------------ optimizer
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            # the Trainer's accelerator.prepare(self.optimizer) then registers it as it is
            self.optimizer = _EngineOptimizer(self.chunk_optimizer)
        return self.optimizer

    # ------------------------------------------------------------------ one micro-batch
    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward through the engine, then ``engine.backward`` (Note [loss scaling for accumulation])."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = cast(torch.Tensor, self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch))
        del inputs
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0 and torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.loss_is_scaled_for_ga is not None:
            scaled = self.loss_is_scaled_for_ga
        else:  # the Trainer's rule: normalised by num_items_in_batch, by the model or by compute_loss_func
            by_model = self.model_accepts_loss_kwargs and num_items_in_batch is not None
            scaled = by_model or self.compute_loss_func is not None
        if not scaled:
            # the Trainer's division: by the micro-batches of this window (fewer in an epoch's last)
            loss = loss / self.current_gradient_accumulation_steps
        # the Trainer marks the micro-batch that ends its window (sync_gradients): an epoch's
        # last window may be short (Note [windows the loop decides] in runtime/gradients.py)
        self.engine.backward(loss, last=bool(self.accelerator.sync_gradients), divide=False)
        return loss.detach()

    # ------------------------------------------------------------------ clipping and its norm
    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips inside ``optimizer.step()`` (config ``gradient_clipping`` = max_grad_norm)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Measured by the engine during the step: :meth:`_maybe_log_save_evaluate` logs it."""
        return None

    def _last_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last step; inf when fp16 overflowed."""
        opt = self.chunk_optimizer
        if opt.step_count == 0:
            return None
        return opt.last_grad_norm if opt.last_grad_norm is not None else math.inf

    def _maybe_log_save_evaluate(
        self,
        tr_loss: torch.Tensor,
        grad_norm: torch.Tensor | float | None,
        model: nn.Module,
        trial: Any,
        epoch: float,
        ignore_keys_for_eval: list[str] | None,
        start_time: float,
        learning_rate: float | None = None,
    ) -> None:
        super()._maybe_log_save_evaluate(
            tr_loss, self._last_grad_norm(), model, trial, epoch, ignore_keys_for_eval, start_time,
            learning_rate=learning_rate,
        )  # fmt: skip

    # ------------------------------------------------------------------ saving
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """A Hugging Face checkpoint (safetensors) of the fp32 values, which ``from_pretrained`` loads."""
        if state_dict is None:
            state_dict = self.engine.state_dict()  # every rank: a collective with several
            # one tensor under a tied parameter's names (copies to the CPU made two), so
            # save_pretrained writes it once, as it does for the model's own state dict
            for first, others in self.engine.parameter_aliases().items():
                for name in others:
                    state_dict[name] = state_dict[first]
        if not self.args.should_save:
            return
        out = output_dir if output_dir is not None else self.args.output_dir
        assert out is not None  # TrainingArguments gives output_dir a default
        super()._save(out, state_dict=state_dict)
        model = self.model
        if isinstance(model, PreTrainedModel) and self.engine.config.precision is not Precision.FP32:
            # save_pretrained wrote the params' dtype (bf16/fp16 chunks) as the config's; the
            # values written are the fp32 masters, and from_pretrained's dtype="auto" reads it
            config = copy.deepcopy(model.config)
            config.dtype = "float32"
            config.save_pretrained(out)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """This rank's engine shard into ``output_dir/chunkstar/``, the scheduler beside it."""
        self.engine.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR))
        assert self.lr_scheduler is not None  # the Trainer saves checkpoints while it trains
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Checks the folder only: :meth:`_load_optimizer_and_scheduler` loads it, once the scheduler exists."""
        where = os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)
        if not os.path.isdir(where):
            raise ValueError(
                f"{resume_from_checkpoint}: no {CHECKPOINT_DIR}/ folder, so no chunkstar state to resume from (was it "
                "written by ChunkstarTrainer, without save_only_model?). To start from its weights instead, pass the "
                "model loaded with from_pretrained and train without resume_from_checkpoint"
            )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        # masters, Adam moments and steps, the groups' lr, the loss scale: bit for bit
        self.engine.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR))
        path = os.path.join(checkpoint, SCHEDULER_NAME)
        assert self.lr_scheduler is not None  # the Trainer loads after creating it
        if os.path.isfile(path):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
            reissue_pt_warnings(caught)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The fp16 loss scale rides in the engine checkpoint."""

    def end(self) -> None:
        """Finish the engine's work in flight and delete its disk tier's files (if any), then
        the Trainer's own end (trackers, the process group). Call it once, at the very end."""
        if self._engine is not None:
            self._engine.close()
        super().end()
