"""Typed, validated engine configuration.

The user hands ``initialize_engine`` a DeepSpeed-style dict (or a path to a
JSON file holding one). It is parsed exactly once, here, into frozen
dataclasses; the rest of the engine reads only those. Unknown keys and bad
values fail at once with a :class:`~chunkstar.errors.ConfigError` naming the
key and what is allowed.

Note [config sections]: :class:`EngineConfig` is grouped by owner, and each
section travels whole to the part that owns it: :class:`PlacementConfig` to the
chunk store and its copy engine (where chunks live, how big, how they travel),
:class:`ScheduleConfig` to the iteration (prefetch), :class:`OptimizerConfig`
to the optimizer step (Adam's hyperparameters, clipping, accumulation, where
Adam runs, fp16 loss scaling), :class:`DiskConfig` to the disk tier. Values
derived from several keys are resolved here, once: hybrid Adam is off when the
state lives on disk, the disk lists are :class:`~chunkstar.chunk.lists.ChunkList`
members. Each field names its config key and help text in its metadata, so the
allowed keys, their help in error messages and the rank agreement's names of
the keys (distributed/startup.py) come from one place. This module does not touch devices beyond asking
whether CUDA is available for the default device and how much memory the
machine has (Note [sizes the machine could hold]).
"""


from chunkstar.config.parse import host_memory_bytes, parse_bytes, parse_config
from chunkstar.config.sections import (
    DISK_LISTS,
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
    "DISK_LISTS",
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
]
