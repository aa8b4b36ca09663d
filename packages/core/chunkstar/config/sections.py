"""The config's sections: frozen dataclasses grouped by owner, one field per key.

Each field names its user-facing key and help text in its metadata (:func:`_key`),
so the parser's allowed keys, its error messages and the rank agreement's names
(distributed/startup.py) come from one place (Note [config sections] in
:mod:`chunkstar.config`). Nothing here parses or validates: :mod:`.parse` does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import torch

from chunkstar.chunk.lists import ChunkList

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
]


_MISSING: Any = object()


class Precision(enum.Enum):
    """Dtype of the param chunks (the compute copy); masters are always fp32."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


class ActivationPolicy(enum.Enum):
    """What the blocks do with the tensors their forward saves for the backward (Note
    [activation policies] in :mod:`chunkstar.activations`)."""

    AUTO = "auto"
    """Per block, the fastest of the three below that fits the budget, planned from the warm-up's
    measurements (Note [activation plan] in :mod:`chunkstar.activations.plan`)."""
    KEEP = "keep"
    """Saved on the device until the backward (PyTorch's own behaviour)."""
    CHECKPOINT = "checkpoint"
    """Not saved: each block's forward runs again in its backward (non-reentrant checkpointing)."""
    OFFLOAD = "offload"
    """Copied to host memory as the forward saves them, back to the device for the backward."""


class EvictionPolicyName(enum.Enum):
    FURTHEST_NEXT_USE = "furthest_next_use"
    LRU = "lru"


def _key(key: str, help: str, default: Any = _MISSING, **kw: Any) -> Any:
    """A config field: its key in the user's config and the help its errors show (Note [config sections])."""
    if default is not _MISSING:
        kw["default"] = default
    return field(metadata={"key": key, "help": help}, **kw)


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling with DeepSpeed's keys and meanings."""

    static_scale: float = _key("fp16.loss_scale", "0 (dynamic scaling) or a fixed scale from 2**-40 to 2**40", 0.0)
    """A fixed scale, or 0 for dynamic scaling."""
    initial_scale_power: int = _key("fp16.initial_scale_power", "an integer 0-63", 16)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = _key("fp16.loss_scale_window", "an integer 1-10,000,000", 1000)
    """Steps without overflow before the scale doubles."""
    hysteresis: int = _key("fp16.hysteresis", "an integer 1-1000", 2)
    """Overflows tolerated before the scale halves."""
    min_loss_scale: float = _key("fp16.min_loss_scale", "a number from 2**-40 to 2**63", 1.0)
    """The scale never drops below this."""

    @property
    def dynamic(self) -> bool:
        return self.static_scale == 0.0


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and what its step applies (:mod:`chunkstar.optim`): Adam (L2 penalty in
    the gradient) or AdamW (decoupled decay), clipping, gradient accumulation, where Adam
    runs and fp16 loss scaling."""

    decoupled: bool = _key("optimizer.type", '"AdamW" (default) or "Adam"', True)
    """True for AdamW, False for Adam."""
    lr: float = _key("optimizer.params.lr", "a number >= 0", 1e-3)
    betas: tuple[float, float] = _key("optimizer.params.betas", "two numbers in [0, 1]", (0.9, 0.999))
    eps: float = _key("optimizer.params.eps", "a normal float32 number, 1.2e-38 to 3.4e38", 1e-8)
    weight_decay: float = _key(
        "optimizer.params.weight_decay", "a number >= 0, at most 1e4 for Adam (default 0.01 for AdamW, 0 for Adam)", 0.01
    )
    gradient_clipping: float = _key("gradient_clipping", "a number >= 0", 0.0)
    """Max global L2 norm of the gradients; 0 disables clipping."""
    accumulation_steps: int = _key("gradient_accumulation_steps", "an integer from 1 to 1,000,000", 1)
    """engine.backward divides the loss by this; the user steps every N micro-batches."""
    hybrid_adam: bool = _key("hybrid_adam", "true or false", True)
    """Run Adam on the device for the chunks that fit in the margin after the warm-up peak;
    resolved off when the state lives on disk (it is updated on the host there)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 loss scaling (its defaults unless fp16 is enabled)."""

    @property
    def type_name(self) -> str:
        return "AdamW" if self.decoupled else "Adam"


@dataclass(frozen=True)
class PlacementConfig:
    """Where the chunks live and how they travel (the chunk store, its eviction policy and
    copy engine); the engine resolves the capacity it plans with from it, once."""

    device: torch.device = _key("device", '"cpu", "cuda" or "cuda:N"')
    """Where compute happens: ``cpu`` (a virtual device held under the budget) or ``cuda:N``."""
    budget: int | None = _key("device_memory_budget", 'bytes as an integer, or a string like "512MB" / "1.5GiB"', None)
    """Bytes the engine may use on the device (chunks + non-model data); None = the GPU's capacity."""
    slack: float = _key(
        "device_memory_slack", "a fraction in [0, 0.5) of the device capacity kept free (default 0.1 on cuda, 0 on cpu)", 0.0
    )
    """Fraction of the device capacity kept free for allocator fragmentation and communication
    buffers: the engine plans with ``capacity * (1 - slack)``. ``parse_config`` defaults it to
    0.1 on CUDA (Gemini keeps 10%) and 0.0 on the cpu virtual device."""
    chunk_size: int | None = _key("default_chunk_size", 'an integer number of elements > 0, or "auto"', None)
    """Elements per chunk; None means search the size that wastes least ("auto")."""
    eviction_policy: EvictionPolicyName = _key("eviction_policy", '"furthest_next_use" or "lru"', EvictionPolicyName.FURTHEST_NEXT_USE)
    overlap: bool = _key("overlap", "true or false", True)
    """Chunk copies run on the device's copy engine (CUDA copy stream, the CPU virtual
    device's copy thread) beside compute; false keeps the serial reference path."""
    link_bandwidth: float | None = _key(
        "device_link_bandwidth", 'bytes per second as a number or a string like "16GB/s" (cpu device only)', None
    )
    """CPU virtual device only: bytes per second every chunk copy takes at least, so the
    run behaves like a device behind a PCIe link (None: copies take what memcpy takes)."""
    device_size: int | None = None
    """A GPU's own memory, which no budget changes: the total memory of ``cuda:N``, or of a
    dry run's target (None: the CPU virtual device, whose budget is its size; or a driver that
    cannot say). What "auto" sizes chunks against (Note [chunks sized to the device] in
    :mod:`chunkstar.runtime.start_checks`)."""


@dataclass(frozen=True)
class ScheduleConfig:
    """The iteration's prefetch along the warm-up trace (:mod:`chunkstar.runtime.iteration`)."""

    prefetch: bool = _key("prefetch", "true or false", True)
    """Start copies of the next moments' chunks early, evicting chunks needed later."""
    prefetch_window: int | None = _key(
        "prefetch_window",
        'how far prefetch looks ahead, as the bytes of the chunks the next moments need: an integer or a string like "64MB", or "auto"',
        None,
    )
    """How far prefetch looks ahead: the bytes of the distinct chunks the next moments
    need, resident or not (so also a bound on the prefetch copies in flight). None:
    "auto", four times the largest param chunk."""


DISK_LISTS = ("param", "master", "exp_avg", "exp_avg_sq")
"""The chunk lists that may live on disk: all four (Note [disk tier] in :mod:`chunkstar.runtime.disk_tier`)."""
DEFAULT_DISK_LISTS = ("master", "exp_avg", "exp_avg_sq")
"""The lists on disk when the config names none: the optimizer's fp32 state (12 of the 14
bytes per parameter), read and written once per step. The param list is read by every
forward and backward, so it goes on disk only when asked for."""


@dataclass(frozen=True)
class DiskConfig:
    """The disk tier (Note [disk tier] in :mod:`chunkstar.runtime.disk_tier`): chunks of
    ``lists`` live in files under ``path``; host memory only stages them."""

    path: str = _key("disk.path", "a directory for the chunk files (created if missing)")
    """Directory for this run's chunk files (a cache, not a checkpoint: deleted at a clean end)."""
    lists: tuple[ChunkList, ...] = _key(
        "disk.lists",
        f"a list of {', '.join(DISK_LISTS)} (default: {', '.join(DEFAULT_DISK_LISTS)}, and param when host memory needs it)",
        tuple(ChunkList(n) for n in DEFAULT_DISK_LISTS),
    )
    """Which of param / master / exp_avg / exp_avg_sq live on disk, in the lists' own order
    (when the config names none: the three state lists, and the param list as well when the
    host memory plan needs it there, :attr:`lists_auto`)."""
    lists_auto: bool = False
    """The config named no ``lists``: the engine adds the param list when host memory cannot
    hold the param chunks beside the staging (Note [host memory plan] in :mod:`chunkstar.memory.host`)."""
    staging_budget: int | None = _key(
        "disk.staging_budget", 'host bytes for chunks between disk and the optimizer: an integer, a string like "1GB", or "auto"', None
    )
    """Host bytes for chunks on their way between disk and the optimizer (None: "auto")."""
    on_stale: str = _key("disk.on_stale", '"refuse" (default) or "wipe": what to do with chunk files another run left in path', "refuse")
    """Chunk files of another (dead) run found in ``path``: "refuse" (an error naming them) or "wipe"."""
    direct: bool = _key("disk.direct", "true (default) or false: O_DIRECT I/O where the filesystem allows it", True)
    """O_DIRECT reads and writes where the filesystem allows them (no page cache)."""
    verify: bool = _key("disk.verify", "true (default) or false: check each chunk read against the checksum of its last write", True)
    """Check every chunk read against the checksum of its last write (Note [chunk checks] in
    :mod:`chunkstar.disk.files`): about 0.35 CPU-seconds per GB moved."""


@dataclass(frozen=True)
class ActivationsConfig:
    """Where the blocks' saved activations live (:mod:`chunkstar.activations`)."""

    policy: ActivationPolicy = _key(
        "activations.policy",
        '"keep" (default), "checkpoint" or "offload" (every block the same), or "auto" (each block planned from the warm-up)',
        ActivationPolicy.KEEP,
    )
    blocks: tuple[str, ...] | None = _key(
        "activations.blocks", '"auto" (default: the model\'s repeated layers) or a list of module class names', None
    )
    """The block classes by name (None: found in the model, :func:`chunkstar.activations.find_blocks`)."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, validated, in sections by owner (Note [config sections])."""

    placement: PlacementConfig
    precision: Precision = _key("bf16.enabled / fp16.enabled", "true or false", Precision.FP32)
    """Dtype of the param chunks: ``parse_config`` gives bf16 or fp16 when the config enables
    one, fp32 otherwise (as DeepSpeed does)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    reduce_dtype: torch.dtype = _key(
        "reduce_dtype", '"fp32" (default) or the param dtype ("bf16" / "fp16" when that precision is enabled)', torch.float32
    )
    """The dtype gradients are summed in across processes (several processes only): fp32
    by default, as FSDP2's ``reduce_dtype`` for bf16; the param dtype halves the bytes on
    the wire at the cost of rounding every partial sum. gloo always sums in fp32."""
    disk: DiskConfig | None = _key("disk", "{path, lists, staging_budget, on_stale, direct, verify}: chunks (optimizer state by default, params too if listed) in files under path", None)
    """The disk tier (None: every chunk's host home is host memory)."""
    host_memory_budget: int | None = _key(
        "host_memory_budget",
        'the host bytes the engine may plan for (an integer or a string like "8GiB"), or "auto" (default: 90% of what is available)',
        None,
    )
    """Host bytes the engine's plan may hold (chunks in host memory, staging, accumulators, the
    CPU virtual device); None: "auto" (Note [host memory plan] in :mod:`chunkstar.memory.host`)."""
    activations: ActivationsConfig = _key("activations", "{policy, blocks}: what the model's blocks do with their saved activations", default_factory=ActivationsConfig)
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The config as given (for run metadata)."""

    @property
    def device(self) -> torch.device:
        """Where compute happens (``placement.device``): read by nearly every part."""
        return self.placement.device


def _help_of(*classes: type) -> dict[str, str]:
    """Config key -> help text, from the fields' metadata (Note [config sections])."""
    return {f.metadata["key"]: f.metadata["help"] for cls in classes for f in fields(cls) if "key" in f.metadata}


def config_key(cls: type, name: str) -> str | None:
    """The user's config key of field ``name`` of section ``cls`` (None: a field no key sets)."""
    for f in fields(cls):
        if f.name == name:
            key = f.metadata.get("key")
            return key if isinstance(key, str) else None
    raise KeyError(name)


def _default(cls: type, name: str) -> Any:
    """Field ``name``'s default in section ``cls``: the config's default for its key."""
    for f in fields(cls):
        if f.name == name:
            return f.default
    raise KeyError(name)


