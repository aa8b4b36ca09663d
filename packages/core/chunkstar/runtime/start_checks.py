"""What the engine checks and resolves at start-up, before any chunk exists.

The device capacity it plans with, the chunk size "auto" may pick with the disk
tier, and the refusals of what it cannot train: a chunk size the device cannot
hold or the model cannot fill, sparse gradients, a compiled module whose chunks
cannot be resident at once, and another optimizer's step over the engine's
parameters (Note [foreign optimizers]). Each names the key or the module and
what to change; the engine (:mod:`chunkstar.runtime.engine`) calls them in
order while it builds.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from chunkstar.chunk.lists import ChunkList
from chunkstar.config import EngineConfig
from chunkstar.errors import ChunkStateError, ConfigError
from chunkstar.hooks.module_hooks import HookedModule
from chunkstar.memory.budget import device_capacity
from chunkstar.memory.probes import cuda_usable_bytes
from chunkstar.runtime.chunk_manager import ChunkManager

__all__ = [
    "DISK_AUTO_CHUNK_CAP", "check_inputs", "check_units_fit", "device_capacity_of", "disk_chunk_cap",
    "refuse_foreign_optimizers", "refuse_sparse_gradients",
]  # fmt: skip


class EngineParams(Protocol):
    """What the foreign-optimizer check reads of the engine: its parameters' slots."""

    @property
    def mgr(self) -> ChunkManager: ...
    def param_index(self, p: torch.Tensor) -> int | None: ...


def device_capacity_of(cfg: EngineConfig) -> int:
    """Bytes the engine plans with (:func:`chunkstar.memory.budget.device_capacity`)."""
    usable = cuda_usable_bytes(cfg.device) if cfg.device.type == "cuda" else None  # else the budget is the size
    return device_capacity(cfg.placement.budget, cfg.placement.slack, usable)


def check_inputs(model: nn.Module, cfg: EngineConfig, n_elements: int, capacity: int) -> None:
    """Refuse, before any chunk is built, a ``default_chunk_size`` the device cannot hold
    or the model cannot fill."""
    size = cfg.placement.chunk_size
    if size is None:  # "auto" searches a size that fits the parameters
        return
    if size > n_elements:
        raise ConfigError(
            "default_chunk_size",
            f"{size} elements is more than the whole model has ({n_elements} parameter elements), so every chunk "
            f"would be mostly padding; use \"auto\" or a size <= {n_elements}",
        )
    chunk_bytes = size * cfg.precision.dtype.itemsize
    if chunk_bytes > capacity:
        raise ConfigError(
            "default_chunk_size",
            f"one param chunk of {size} elements x {cfg.precision.dtype.itemsize} bytes ({cfg.precision.value}) is "
            f"{chunk_bytes} bytes, more than the device can hold: {capacity} bytes (device_memory_budget "
            f"{cfg.placement.budget} on {cfg.device}, less device_memory_slack {cfg.placement.slack}). "
            "Lower default_chunk_size, use \"auto\", or raise device_memory_budget",
        )


def refuse_sparse_gradients(model: nn.Module) -> None:
    """A module asked for sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``):
    a gradient is folded over its parameter's dense slot, so there is nothing sparse to keep."""
    for name, mod in model.named_modules():
        if getattr(mod, "sparse", False) is True and any(p.requires_grad for p in mod.parameters(recurse=False)):
            raise ValueError(
                f"module '{name or type(mod).__name__}' ({type(mod).__name__}) has sparse=True: chunkstar keeps each "
                "gradient dense, in its parameter's chunk slot (and its Adam state dense beside it), so sparse "
                "gradients cannot be kept. Build it with sparse=False (the default); the update is the same as "
                "dense Adam's"
            )


def refuse_foreign_optimizers(engine: EngineParams) -> Callable[[], None]:
    """Note [foreign optimizers]: ``torch.optim.AdamW(engine.parameters())`` would read the
    gradients' read-only copies and write the parameters through the guard, bypassing the
    engine's masters, Adam state and step bookkeeping (with fused kernels it fails inside
    them; with foreach ones it seems to run). A process-wide step pre-hook refuses the step of
    any optimizer but the engine's own that holds one of the engine's parameters. It holds the
    engine weakly; the returned function removes it."""
    ref = weakref.ref(engine)

    def check(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        eng = ref()
        if eng is None or getattr(optimizer, "_engine", None) is eng:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                i = eng.param_index(p)
                if i is not None:
                    raise ChunkStateError(
                        f"{type(optimizer).__name__}.step() would update parameter '{eng.mgr.slots[i].name}' of a "
                        "chunkstar engine: the engine keeps the parameters, their fp32 masters, gradients and Adam "
                        "state in its chunks, so an optimizer of your own over engine.parameters() cannot update "
                        "them. Use the optimizer initialize_engine returned (its param_groups take per-group lr, "
                        "betas and weight_decay; the config's 'optimizer' section picks the type)"
                    )

    remove = register_optimizer_step_pre_hook(check).remove
    weakref.finalize(engine, remove)  # an engine never closed takes its hook along when collected
    return remove


DISK_AUTO_CHUNK_CAP = 24 * 2**20
"""Elements per chunk at most when "auto" picks the size and the disk tier is on without a
staging budget: at most 302 MB of fp32 master and Adam state per chunk, large sequential I/O,
and a default staging pool (two chunks' state) of at most 604 MB rather than gigabytes. Not a
power of two, on purpose: transformer matrices are (4096 x 4096, 2048 x 8192 = 2**24
elements), and a cap of exactly 2**24 left "auto" only sizes at which such a matrix fills a
chunk with nothing beside it. A 2.1B GPT-2 (width 2048) was 39% padding at the size it chose
under that cap (8.3M elements: its 16.8M-element matrices alone in chunks, the rest packed
around them) and 64% at 2**24 itself; under this cap it picks 16,788,224, 0.7% padding."""


def disk_chunk_cap(cfg: EngineConfig) -> int | None:
    """The largest chunk "auto" may pick with the disk tier: two chunks' state must fit the
    staging budget (one is updated while the next is read ahead)."""
    if cfg.disk is None:
        return None
    if cfg.disk.staging_budget is None:
        return DISK_AUTO_CHUNK_CAP
    per_element = 4 * len(cfg.disk.lists)  # fp32 master and moments
    return max(64, cfg.disk.staging_budget // (2 * per_element))


def memory_chunk_cap(cfg: EngineConfig, world_size: int, scratch_on_device: bool) -> int | None:
    """The largest chunk "auto" may pick on a GPU (None: no bound, the CPU virtual device).

    Note [chunks sized to the device]: one group's chunks in the param dtype, with a
    collective's flat temporaries beside them when they are device memory (NCCL: the
    gather's ``world_size`` chunks, the reduction's ``world_size + 1`` in the reduce
    dtype), take at most a quarter of the GPU. A moment holds its groups and the next
    moment's, gathered ahead, beside its non-model memory, so a group must be a small
    part of the device. Bounded by the model's size alone (chunk/layout.py), 175B
    parameters on 8 A100s got chunks of 1.4 billion elements: a gradient reduction needed
    25 GiB of chunks and 46 GiB of NCCL scratch (9 chunks in fp32) at once, more than the device (the dry run found
    it). The bound is the GPU's own size (:attr:`PlacementConfig.device_size`), never the
    budget: a layout that changed with the budget would make the smallest budget a
    ``DeviceMemoryError`` names, measured with one layout, wrong for the layout that budget
    gives. The CPU virtual device has no size but its budget, and gloo's collectives hold
    no device scratch: no bound there."""
    size = cfg.placement.device_size
    if size is None:
        return None
    item = cfg.precision.dtype.itemsize
    scratch = max(world_size * item, (world_size + 1) * cfg.reduce_dtype.itemsize) if scratch_on_device else 0
    usable = int(size * (1.0 - cfg.placement.slack))
    return max(64, usable // 4 // (world_size * item + scratch))


def check_units_fit(modules: list[HookedModule], unit_keys: list[int], mgr: ChunkManager) -> None:
    """Refuse a compiled module whose chunks the device cannot hold at once: it is one
    moment (Note [compiled units]), so all of them must be resident while it runs."""
    for key in unit_keys:
        mod = modules[key]
        chunk_ids = sorted({mgr.slots[i].chunk_id for i in mod.own})
        need = sum(mgr.chunks.chunk(ChunkList.PARAM, c).nbytes for c in chunk_ids)
        if need > mgr.capacity:
            whole = len(mod.own) == len(mgr.slots)  # the model itself is compiled
            raise ConfigError(
                "device_memory_budget",
                f"the compiled module '{mod.label}' runs as one unit, so its {len(chunk_ids)} param chunks "
                f"({need} bytes) must be on the device at once, and the device holds {mgr.capacity} bytes. "
                + ("Compile the model's blocks instead of the whole model (for block in model.transformer.h: "
                   "block.compile()), " if whole else "Compile smaller modules, ")
                + "lower default_chunk_size, or raise device_memory_budget",
            )
