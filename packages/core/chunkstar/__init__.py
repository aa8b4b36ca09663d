"""chunkstar: train models whose model data does not fit the device.

Parameters, gradients and Adam state live in fixed-size chunks that move
between the device and the host as a warm-up memory trace and a
furthest-next-use policy decide (see docs/design.md). The public surface::

    engine, optimizer = chunkstar.initialize_engine(model_func=..., local_rank=0, config={...})
    out = engine(**batch)
    engine.backward(loss)
    optimizer.step(); optimizer.zero_grad()
    engine.stats()

    report = chunkstar.dry_run(model_func, config, inputs, world_size=8, hardware="a100x8_1tb")
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping

from torch import nn

from chunkstar.checkpoint import CheckpointError
from chunkstar.config import EngineConfig, parse_bytes, parse_config
from chunkstar.config.hyperparams import validate_param_group
from chunkstar.construction import PretrainedError, init_weights
from chunkstar.construction.pretrained import PretrainedSource
from chunkstar.dryrun import DryRunReport, Hardware, dry_run
from chunkstar.distributed.comm import DistributedError
from chunkstar.errors import ChunkStateError, ConfigError, DeviceMemoryError, HostMemoryError
from chunkstar.events import EventBus, Stage, Tier
from chunkstar.optim.adam import ChunkAdam
from chunkstar.runtime.engine import ChunkEngine

__all__ = [
    "ChunkAdam",
    "ChunkEngine",
    "CheckpointError",
    "ChunkStateError",
    "ConfigError",
    "DeviceMemoryError",
    "DistributedError",
    "HostMemoryError",
    "DryRunReport",
    "EngineConfig",
    "EventBus",
    "Hardware",
    "Stage",
    "PretrainedError",
    "Tier",
    "dry_run",
    "init_weights",
    "initialize_engine",
    "no_decay_param_groups",
    "parse_bytes",
    "parse_config",
]

__version__ = "0.1.0"

ParamGroupsFn = Callable[[nn.Module], Iterable[Mapping[str, Any]]]


def no_decay_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Two groups: weights decay (the config's weight_decay), biases and norm weights do not.

    A parameter counts as "no decay" when it is 1-D (biases, LayerNorm/RMSNorm
    weights), the usual rule of GPT/BERT training recipes.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in model.named_parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    groups: list[dict[str, Any]] = [{"params": decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def initialize_engine(
    model_func: Callable[[], nn.Module],
    local_rank: int = 0,
    config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    param_groups_fn: ParamGroupsFn | None = None,
    *,
    pretrained: str | os.PathLike[str] | None = None,
) -> tuple[ChunkEngine, ChunkAdam]:
    """Build the model with ``model_func`` and wrap it in a chunk engine.

    ``model_func`` may build the model on the meta device (``with
    torch.device("meta"): ...``): its parameters are then materialised straight
    into the chunks, each rank only the chunks it owns, and initialised by the
    modules' own initialisers from torch's RNG (seed it alike on every rank; see
    :func:`chunkstar.init_weights`). ``pretrained`` is a ``.safetensors`` file or
    a Hugging Face checkpoint directory (``model.safetensors``, or a sharded
    ``model.safetensors.index.json``): its tensors are read one at a time
    straight into the chunks (bit-exact), so a model larger than host memory
    can be fine-tuned. ``engine.construction`` reports what was read and what
    was initialised.

    ``config`` is a DeepSpeed-style dict or a path to a JSON file (see
    :func:`chunkstar.config.parse_config`). ``param_groups_fn(model)`` may
    return torch-style parameter groups (dicts with ``params`` and optional
    ``lr``/``betas``/``eps``/``weight_decay``) holding every parameter that
    requires grad (frozen ones may be left out); by default all parameters form
    one group with the config's optimizer settings. ``local_rank`` picks the
    GPU when the config says ``"device": "cuda"``.
    """
    if not callable(model_func):
        raise TypeError(f"model_func must be a callable that returns an nn.Module, got {type(model_func).__name__}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, int) or local_rank < 0:
        raise TypeError(f"local_rank must be a non-negative int, got {local_rank!r}")
    cfg = parse_config(config if config is not None else {}, local_rank=local_rank)
    if pretrained is not None:
        PretrainedSource.check_path(pretrained)  # before the model is built, which can take long
    model = model_func()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_func must return a torch.nn.Module, it returned {type(model).__name__}")
    engine = ChunkEngine(model, cfg, model_func=model_func, pretrained=pretrained)
    try:
        opt = cfg.optimizer
        defaults: dict[str, Any] = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
        if param_groups_fn is None:
            groups: list[dict[str, Any]] = [{"params": list(engine.parameters())}]
        else:
            groups = [dict(g) for g in param_groups_fn(model)]
            seen: set[int] = set()
            for g in groups:
                if "params" not in g:
                    raise ValueError("each parameter group from param_groups_fn needs a 'params' entry")
                g["params"] = list(g["params"])
                for p in g["params"]:
                    engine.index_of(p)
                    if id(p) in seen:
                        raise ValueError("a parameter appears in more than one parameter group")
                    seen.add(id(p))
            # a frozen parameter has no optimizer state (Note [frozen chunks]): it may be left out, as
            # torch.optim users leave it out (``filter(lambda p: p.requires_grad, ...)``)
            missing = [n for n, p in model.named_parameters() if id(p) not in seen and p.requires_grad]
            if missing:
                raise ValueError(
                    f"param_groups_fn left out parameters that require grad: {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                    "(chunkstar would keep their gradients and never apply them); add them to a group, or freeze them "
                    "(requires_grad=False) in model_func"
                )
        # the config's checks for each group's own lr/betas/eps/weight_decay (betas become a tuple)
        groups = [validate_param_group(g, f"param_groups[{i}]", decoupled=opt.decoupled, defaults=defaults) for i, g in enumerate(groups)]
        optimizer = ChunkAdam(engine, opt, groups, defaults)
        engine.optimizer = optimizer  # the engine's checkpoints carry its state (the optimizer never sees the engine)
        return engine, optimizer
    except BaseException:
        engine.close()  # a failed start leaves no threads, chunk files or directory lock behind
        raise


