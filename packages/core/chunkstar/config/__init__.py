"""Typed, validated engine configuration.

The user hands ``initialize_engine`` a DeepSpeed-style dict (or a path to a
JSON file holding one). It is parsed exactly once, here, into frozen
dataclasses; the rest of the engine reads only those. Unknown keys and bad
values fail at once with a :class:`~chunkstar.errors.ConfigError` naming the
key and what is allowed.

Note [config sections]: :class:`EngineConfig` is grouped by owner, and each
section travels whole to the part that owns it: :class:`PlacementConfig` to the
chunk store (:class:`~chunkstar.runtime.chunk_manager.ChunkManager`, with the
device capacity the engine resolves from it once) and its copy engine,
:class:`ScheduleConfig` to the iteration (prefetch; "auto" window resolved by
the engine from the layout), :class:`OptimizerConfig` to the optimizer
(:class:`~chunkstar.optim.adam.ChunkAdam`: Adam's hyperparameters, clipping,
the type) with the few values other parts own handed to them alone
(``gradient_accumulation_steps`` to the gradients, which everyone else asks;
hybrid Adam to the iteration, which plans it; fp16 loss scaling to the loss
scaler), :class:`DiskConfig` to the disk tier. Values derived from several keys
are resolved here, once: hybrid Adam is off when the state lives on disk, the
disk lists are :class:`~chunkstar.chunk.lists.ChunkList` members. Each field
names its config key and help text in its metadata, so the allowed keys, their
help in error messages and the rank agreement's names of the keys
(distributed/startup.py) come from one place (:mod:`.sections`; parsing is
:mod:`.parse`). This module does not touch devices beyond asking
whether CUDA is available for the default device and how much memory the
machine has (Note [sizes the machine could hold]).
"""


from chunkstar.config.parse import host_memory_bytes, parse_bytes, parse_config, read_config_file
from chunkstar.config.sections import (
    DEFAULT_DISK_LISTS,
    DISK_LISTS,
    ActivationPolicy,
    ActivationsConfig,
    DiskConfig,
    EngineConfig,
    EvictionPolicyName,
    LossScaleConfig,
    OptimizerConfig,
    PlacementConfig,
    Precision,
    ScheduleConfig,
    config_key,
)

__all__ = [
    "DEFAULT_DISK_LISTS",
    "DISK_LISTS",
    "ActivationPolicy",
    "ActivationsConfig",
    "DiskConfig",
    "EngineConfig",
    "EvictionPolicyName",
    "LossScaleConfig",
    "OptimizerConfig",
    "PlacementConfig",
    "Precision",
    "ScheduleConfig",
    "config_key",
    "host_memory_bytes",
    "parse_bytes",
    "parse_config",
    "read_config_file",
]
