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

import os
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from chunkstar.chunk.layout import ChunkLayout
from chunkstar.chunk.lists import CHUNK_LISTS, STATE_LISTS, ChunkList
from chunkstar.config import EngineConfig, parse_bytes
from chunkstar.device.threads import processes_on_node
from chunkstar.errors import ChunkStateError, ConfigError, HostMemoryError, _fmt
from chunkstar.hooks.module_hooks import HookedModule
from chunkstar.memory.budget import device_capacity
from chunkstar.memory.host import HOST_MEMORY_ENV, HostPlan, host_budget
from chunkstar.memory.probes import cuda_usable_bytes
from chunkstar.runtime.chunk_manager import ChunkManager
from chunkstar.runtime.disk_tier import staging_shape

__all__ = [
    "DISK_AUTO_CHUNK_CAP", "check_inputs", "check_units_fit", "device_capacity_of", "disk_chunk_cap", "host_plan",
    "plan_host_memory", "refuse_foreign_optimizers", "refuse_sparse_gradients", "staging_budget_of",
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
    # fp32 master and moments, and the param chunk in its dtype (when on disk, or "auto" may put it there)
    per_element = sum(cfg.precision.dtype.itemsize if n is ChunkList.PARAM else 4 for n in cfg.disk.lists)
    if cfg.disk.lists_auto and ChunkList.PARAM not in cfg.disk.lists:
        per_element += cfg.precision.dtype.itemsize
    return max(64, cfg.disk.staging_budget // (2 * per_element))


def host_plan(cfg: EngineConfig, layout: ChunkLayout, rank: int, disk_lists: tuple[ChunkList, ...], credit: int) -> HostPlan:
    """What this rank's run holds in host memory at most (Note [host memory plan] in
    :mod:`chunkstar.memory.host`), with ``disk_lists`` on disk; ``credit``: the bytes of the
    model's real host parameters, freed as their values go into the chunks."""
    own = [cid for cid in range(layout.n_chunks) if layout.owner(cid) == rank]
    item = cfg.precision.dtype.itemsize
    param = sum(layout.chunk_sizes[c] for c in own) * item
    trainable = sum(layout.chunk_sizes[c] for c in own if c not in layout.frozen)
    parts: dict[str, int] = {}
    if ChunkList.PARAM not in disk_lists:
        parts["param chunks"] = param
    in_memory = [n for n in STATE_LISTS if n not in disk_lists or cfg.disk is None]
    if in_memory:
        parts[f"{' and '.join(n.value for n in in_memory)} chunks"] = 4 * trainable * len(in_memory)
    if cfg.disk is not None:
        parts["disk staging"] = staging_budget_of(cfg, layout, rank, disk_lists)
    if cfg.optimizer.accumulation_steps > 1:
        parts["gradient accumulators"] = 4 * trainable
    # the cpu virtual device lives in host memory (a dry run for one: the meta device with no
    # GPU size, PlacementConfig.device_size): its budget, or the chunks it could ever hold if
    # fewer (every param chunk, gathered ones too, and hybrid Adam's state): a budget far above
    # the model, as a run with everything resident sets, is not memory the run takes
    if cfg.device.type == "cpu" or cfg.device.type == "meta" and cfg.placement.device_size is None:
        could_hold = item * sum(layout.chunk_sizes) + (0 if cfg.disk is not None else 12 * trainable)
        parts["the cpu virtual device"] = min(device_capacity(cfg.placement.budget, cfg.placement.slack, None), could_hold)
    return HostPlan(parts, credit)


def staging_budget_of(cfg: EngineConfig, layout: ChunkLayout, rank: int, disk_lists: tuple[ChunkList, ...]) -> int:
    """The disk tier's staging budget for ``disk_lists``: the config's, or the default
    (:func:`chunkstar.runtime.disk_tier.staging_shape`, Note [the step in slices])."""
    assert cfg.disk is not None
    if cfg.disk.staging_budget is not None:
        return cfg.disk.staging_budget
    item = cfg.precision.dtype.itemsize
    sizes: dict[ChunkList, dict[int, tuple[int, int]]] = {}
    for cid in range(layout.n_chunks):
        if layout.owner(cid) != rank:
            continue
        lists = [ChunkList.PARAM] if cid in layout.frozen else list(CHUNK_LISTS)
        for n in lists:
            if n in disk_lists:
                sizes.setdefault(n, {})[cid] = (layout.chunk_sizes[cid], item if n is ChunkList.PARAM else 4)
    return staging_shape(sizes, None).budget


def plan_host_memory(cfg: EngineConfig, layout: ChunkLayout, rank: int, credit: int) -> tuple[tuple[ChunkList, ...], HostPlan, int | None]:
    """Note [host memory plan]: the disk lists this run uses (with ``lists`` left to the
    engine, the param list joins the state lists when that is what fits), the plan, and its
    budget; a plan over its budget is a :class:`chunkstar.errors.HostMemoryError` raised now,
    before anything is built."""
    lists = cfg.disk.lists if cfg.disk is not None else ()
    if cfg.device.type == "meta" and cfg.host_memory_budget is None:
        # a dry run: this machine's memory says nothing of the target's (the report shows the plan)
        return lists, host_plan(cfg, layout, rank, lists, credit), None
    machine = os.environ.get(HOST_MEMORY_ENV)
    budget, budget_from = host_budget(
        cfg.host_memory_budget, processes_on_node(),
        parse_bytes(machine, HOST_MEMORY_ENV) if machine else None,
    )  # fmt: skip
    plan = host_plan(cfg, layout, rank, lists, credit)
    if budget is None or plan.total <= budget:
        return lists, plan, budget
    if cfg.disk is not None and cfg.disk.lists_auto and ChunkList.PARAM not in lists:
        with_params = (ChunkList.PARAM, *lists)
        other = host_plan(cfg, layout, rank, with_params, credit)
        if other.total <= budget:
            return with_params, other, budget
    raise HostMemoryError(plan.total, budget, plan.describe(), budget_from, _host_advice(cfg, layout, rank, lists, plan, budget))


def _host_advice(
    cfg: EngineConfig, layout: ChunkLayout, rank: int, lists: tuple[ChunkList, ...], plan: HostPlan, budget: int
) -> str:
    """What to change so that a plan fits its budget, the most effective first."""
    todo: list[str] = []
    if cfg.disk is None:
        todo.append('put the optimizer state (12 bytes per parameter) on disk: "disk": {"path": "/a/fast/disk"}')
    elif ChunkList.PARAM not in lists:
        whole = host_plan(cfg, layout, rank, (ChunkList.PARAM, *STATE_LISTS), plan.credit).total
        todo.append(
            f'put the param chunks on disk too: "disk": {{"lists": ["param", "master", "exp_avg", "exp_avg_sq"]}} '
            f"(the plan then needs {_fmt(whole)})"
        )
    staging = plan.parts.get("disk staging", 0)
    if staging:
        todo.append(
            f"lower the staging (now {_fmt(staging)}): a smaller default_chunk_size, or a disk.staging_budget "
            "down to the master and param bytes of the largest chunk (the step updates a larger chunk in slices)"
        )
    device = plan.parts.get("the cpu virtual device", 0)
    if device:
        todo.append(f"lower device_memory_budget ({_fmt(device)} of host memory on the cpu virtual device)")
    if plan.parts.get("gradient accumulators"):
        todo.append("accumulate fewer micro-batches (gradient_accumulation_steps 1 keeps no accumulators)")
    todo.append(f"or raise host_memory_budget above {_fmt(plan.total)} if the machine has it")
    return "; ".join(todo)


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
