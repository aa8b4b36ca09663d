"""The planner's memory model: the bytes each system needs per GPU, on the host and on disk. A PREDICTION.

Arithmetic on parameter shapes and chunk layouts, not a measurement: for one
system, one zoo model, one node (:class:`Hardware`) and one :class:`Workload`,
:func:`footprint` says what must fit where, and :func:`predict_max` walks the
zoo to the largest model that fits. The system names are the canonical ones of
:data:`chunkstar_bench.published.PLAN_SYSTEMS` (older spellings such as
``fsdp2-offload`` and ``pytorch-ddp`` are read as aliases). Formatting is
:mod:`~chunkstar_bench.plan.format`'s, the command :mod:`~chunkstar_bench.plan.command`'s.

Note [the memory model]. Per system, for a model of ``P`` parameters on a node
of ``n`` GPUs with ``C`` usable bytes each and ``H`` usable host bytes:

* activations ``A`` per GPU (bf16), after Korthikanti et al. 2022 ("Reducing
  activation recomputation in large transformer models"): one layer's full
  activations are ``B*s*(34h + 5*a*s)`` bytes. With activation checkpointing the
  device keeps every layer's input (``2*B*s*h`` bytes each, ``L`` of them) plus
  one layer being recomputed; without, all ``L`` layers. Both add the LM head's
  logits, ``B*s*V*6`` bytes (bf16 logits and the fp32 log-softmax of the loss),
  which Korthikanti's per-layer figure leaves out and which dominates small models.
* **chunkstar** (docs/design.md, 'Chunks' and 'Many processes'): model data is 14 bytes per *chunk element*
  (bf16 param/grad 2 + fp32 master 4 + exp_avg 4 + exp_avg_sq 4), and the
  elements are those of the real chunk layout (``build_layout`` with the
  ``search_chunk_size`` choice for ``n`` ranks, so packing waste and the padding
  of the last group count). Each rank owns 1/n of the chunks of all four lists.
  The device must hold ``A`` plus the working set (two gathered groups of ``n``
  param chunks: the current one and the prefetched one); whatever device memory
  is left holds model data (resident param chunks, then hybrid-Adam state
  chunks, ``chunkstar.placement.optimizer``); the host holds the rest.
* **chunkstar-disk** (chunkstar with the disk tier, Note [disk tier] in
  ``chunkstar.runtime.disk_tier``; only on a node with a disk, ``D`` bytes free
  for the chunk files): the state lists (``chunkstar.config.DEFAULT_DISK_LISTS``: fp32
  master, exp_avg, exp_avg_sq, 12 bytes per chunk element) live in files on the
  disk, which must hold them all; the host holds the bf16 param chunks (2 per
  element) the GPUs cannot, plus each process's staging buffers (the
  ``staging_budget``; the engine's auto, ``staging_shape``, is two slices of
  the usual chunk's state, here two of the uniform chunk size). Device Adam is off with the disk tier, so spare
  device memory holds param chunks only. The device need is chunkstar's. A
  staging budget below the least the engine takes (one fp32 state chunk, which
  a between-step access stages whole; the step works in slices) is refused:
  the model does not fit (binding ``staging``).
* **deepspeed** (ZeRO-3, ``offload_param`` + ``offload_optimizer`` to CPU): 18
  bytes per parameter on the host: the fp16/bf16 parameter partition (2, since
  the parameters are offloaded), the fp32 gradient partition that DeepSpeedCPUAdam
  reads (4), the fp32 master (4) and Adam's two moments (8). (16 is the figure
  without parameter offload, with the 2-byte partition left on the GPU.) None of
  it can use spare GPU memory. The device holds ``A`` plus its working set:
  two layers' gathered 16-bit parameters and gradients (fetch + prefetch) and the
  default ``reduce_bucket_size`` (5e8 elements, 16-bit).
* **fsdp2** (FSDP2 with ``CPUOffloadPolicy``, as the runner's ``fsdp2``):
  16 bytes per parameter on the host (fp32 sharded params, grads, Adam's two
  moments); the device holds ``A`` plus two layers' unsharded fp32 parameters
  and gradients.
* **pytorch** (DDP, as the runner's ``pytorch``): every GPU holds 16 bytes per parameter (fp32 weights 4,
  fp32 gradients 4, Adam 8; autocast runs the maths in bf16) plus ``A``.
* **pytorch-fsdp** (FULL_SHARD, no CPU offload): 16 bytes per parameter split
  over ``n`` GPUs, plus ``A`` and two layers' unsharded bf16 parameters and
  gradients.

Fixed overheads (``DEVICE_RESERVED_BYTES``, ``DEVICE_FRAGMENTATION``,
``HOST_RESERVED_BYTES``, ``HOST_PER_PROCESS_BYTES``) are taken off the
capacities first (the disk's ``D`` is taken as it is: the engine checks the free
space against the files' exact size). A model fits a system when its device
need, its host need and (chunkstar-disk) its disk need fit; the predicted
maximum is the largest zoo model that fits, and the *binding* constraint is the one the next larger zoo model breaks.

What this is not: a throughput model, or a check that a run will succeed (a
run can also fail on pinned-memory limits, allocator fragmentation beyond the
margin, or bugs). The ``maxscale`` suite measures; this predicts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from chunkstar.chunk.layout import ChunkLayout, build_layout, search_chunk_size
from chunkstar.chunk.lists import ChunkList
from chunkstar.config import DEFAULT_DISK_LISTS
from chunkstar.runtime.disk_tier import staging_shape

from chunkstar_bench import published, zoo
from chunkstar_bench.plan.nodes import NODE_NAMES, Node, node_named
from chunkstar_bench.units import GIB
from chunkstar_bench.zoo import ModelSpec

__all__ = [
    "DISK_SYSTEMS",
    "GIB",
    "HARDWARE",
    "SYSTEMS",
    "Footprint",
    "Hardware",
    "Prediction",
    "Workload",
    "activation_bytes",
    "chunk_layout",
    "default_systems",
    "footprint",
    "gpt2_param_shapes",
    "model_data_bytes_per_param",
    "models_named",
    "predict_max",
]

SYSTEMS: tuple[str, ...] = published.PLAN_SYSTEMS
"""Systems the planner predicts for (Note [the memory model])."""
DISK_SYSTEMS: tuple[str, ...] = tuple(s for s in SYSTEMS if published.system_info(s).disk)
"""Systems that need a disk (``Hardware.disk_bytes``): planned only for a node that has one."""

CHUNKSTAR_BYTES_PER_ELEMENT = 2 + 4 + 4 + 4
"""bf16 param (its gradient overwrites it) + fp32 master + exp_avg + exp_avg_sq (docs/design.md, 'Chunks')."""
CHUNKSTAR_PARAM_BYTES_PER_ELEMENT = 2
"""The bf16 param chunk's share of those (its gradient overwrites it)."""
DISK_BYTES_PER_ELEMENT = 4 * len(DEFAULT_DISK_LISTS)
"""The fp32 state lists the disk tier keeps in files (master, exp_avg, exp_avg_sq): 12 of the 14."""
DEEPSPEED_OFFLOAD_BYTES_PER_PARAM = 2 + 4 + 4 + 4 + 4
"""Host bytes of ZeRO-3 with params and optimizer offloaded: 16-bit param partition,
fp32 grad partition, fp32 master, exp_avg, exp_avg_sq (Note [the memory model])."""
TORCH_BYTES_PER_PARAM = 4 + 4 + 4 + 4
"""fp32 weights + fp32 grads + Adam's two fp32 moments (autocast keeps weights fp32)."""
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size``; the bucket is 16-bit."""
LOGIT_BYTES = 2 + 4
"""Per logit element at the loss: the bf16 logits and their fp32 log-softmax."""

DEVICE_RESERVED_BYTES = 1 * GIB
"""Per GPU, never available to the model: CUDA context, cuBLAS/NCCL workspaces."""
DEVICE_FRAGMENTATION = 0.05
"""Fraction of each GPU's memory the caching allocator loses to fragmentation."""
HOST_RESERVED_BYTES = 8 * GIB
"""Per node: the operating system and everything else running on it."""
HOST_PER_PROCESS_BYTES = 3 * GIB
"""Per training process (one per GPU): Python, torch, the CUDA runtime's host side."""


@dataclass(frozen=True)
class Hardware:
    """One node: ``gpus`` GPUs of ``gpu_mem_bytes`` each, ``host_mem_bytes`` of CPU memory and
    ``disk_bytes`` free on a disk for chunk files (0: none, so no chunkstar-disk).

    A preset is :meth:`from_node` of an entry of :data:`chunkstar.dryrun.HARDWARE`, the one table of
    these facts (see :mod:`~chunkstar_bench.plan.nodes`); ``--hardware custom`` and the
    ``--gpu-mem``/``--host-mem`` overrides build one by hand."""

    name: str
    gpus: int
    gpu_mem_bytes: int
    """Bytes of one GPU: a preset's is the entry's ``device_memory`` (what one process may use, the CUDA
    context already off); :attr:`device_usable` takes the formula's own reservations off it."""
    host_mem_bytes: int
    note: str = ""
    disk_bytes: int = 0
    """Free bytes on the node's disk for the disk tier's chunk files (all processes' together). The formula's
    alone: the core table has a disk's speed (``disk_read``), not its free space, so a preset has none
    until ``--disk`` says how much."""

    @classmethod
    def from_node(cls, node: Node, gpus: int | None = None) -> Hardware:
        """The formula's node for a :class:`chunkstar.dryrun.Hardware`: its GPUs (or ``gpus`` of them),
        device and host memory and description; no disk space (:attr:`disk_bytes`)."""
        return cls(node.name, node.gpus_per_node if gpus is None else gpus, int(node.device_memory), int(node.host_memory), node.description)

    @property
    def device_usable(self) -> int:
        """Bytes per GPU left for a training process after the fixed reservations."""
        return max(0, int(self.gpu_mem_bytes * (1 - DEVICE_FRAGMENTATION)) - DEVICE_RESERVED_BYTES)

    def host_usable(self, processes: int) -> int:
        """Host bytes left for model data with ``processes`` training processes running."""
        return max(0, self.host_mem_bytes - HOST_RESERVED_BYTES - processes * HOST_PER_PROCESS_BYTES)


HARDWARE: dict[str, Hardware] = {name: Hardware.from_node(node_named(name)) for name in NODE_NAMES}
"""Preset nodes: every entry of :data:`chunkstar.dryrun.HARDWARE` (GPUs, device and host memory as it states
them, with its sources), then the older names of :data:`chunkstar_bench.plan.nodes.ALIASES`."""


@dataclass(frozen=True)
class Workload:
    """What is trained and how: per-GPU micro-batch, sequence length (None: the model's own),
    activation checkpointing, chunkstar's chunk size in elements (None: the engine's ``"auto"``)
    and chunkstar-disk's staging budget per process in bytes (None: the engine's ``"auto"``)."""

    batch: int = 8
    seq_len: int | None = None
    checkpointing: bool = True
    chunk_size: int | None = None
    staging_budget: int | None = None


# ---------------------------------------------------------------------------------------------- shapes


def gpt2_param_shapes(spec: ModelSpec, seq_len: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """The unique parameters of ``zoo.build_hf(spec)`` in registration order, computed, not allocated.

    HF GPT-2 uses ``Conv1D`` (weight ``(in, out)``); ``lm_head`` is tied to ``wte``.
    """
    h, s = spec.hidden, seq_len or spec.seq_len
    shapes: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (spec.vocab, h)), ("transformer.wpe.weight", (s, h))]
    for i in range(spec.layers):
        p = f"transformer.h.{i}."
        shapes += [
            (p + "ln_1.weight", (h,)), (p + "ln_1.bias", (h,)),
            (p + "attn.c_attn.weight", (h, 3 * h)), (p + "attn.c_attn.bias", (3 * h,)),
            (p + "attn.c_proj.weight", (h, h)), (p + "attn.c_proj.bias", (h,)),
            (p + "ln_2.weight", (h,)), (p + "ln_2.bias", (h,)),
            (p + "mlp.c_fc.weight", (h, 4 * h)), (p + "mlp.c_fc.bias", (4 * h,)),
            (p + "mlp.c_proj.weight", (4 * h, h)), (p + "mlp.c_proj.bias", (h,)),
        ]  # fmt: skip
    shapes += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
    return shapes


def _layer_params(spec: ModelSpec) -> int:
    h = spec.hidden
    return 12 * h * h + 13 * h


@functools.lru_cache(maxsize=256)
def chunk_layout(spec: ModelSpec, world_size: int = 1, chunk_size: int | None = None) -> ChunkLayout:
    """chunkstar's layout of ``spec`` for ``world_size`` ranks; ``chunk_size`` None is the engine's ``"auto"``.

    Note: ``"auto"`` keeps 16-256 chunks, so for tens of billions of parameters
    a chunk holds billions of elements and a gathered group of 8 is a large
    share of the model; the working set (and the plan) then binds on the
    device. A fixed ``chunk_size`` (PatrickStar used tens to hundreds of
    millions of elements) shows what a tuned run would fit.
    """
    shapes = gpt2_param_shapes(spec)
    numels = [math.prod(s) for _, s in shapes]
    size = chunk_size or search_chunk_size(numels, world_size=world_size)
    return build_layout([n for n, _ in shapes], [s for _, s in shapes], size, world_size=world_size)


def model_data_bytes_per_param(system: str, n_gpus: int = 1) -> float:
    """Model-data bytes per parameter the system keeps in total on one node (all tiers, all GPUs).

    chunkstar's 14 is per chunk element (padding included in :func:`footprint`);
    DDP replicates its 16 on every GPU.
    """
    return {
        "chunkstar": float(CHUNKSTAR_BYTES_PER_ELEMENT),
        "chunkstar-disk": float(CHUNKSTAR_BYTES_PER_ELEMENT),  # 12 of them on disk
        "deepspeed": float(DEEPSPEED_OFFLOAD_BYTES_PER_PARAM),
        "fsdp2": float(TORCH_BYTES_PER_PARAM),
        "pytorch": float(TORCH_BYTES_PER_PARAM * n_gpus),
        "pytorch-fsdp": float(TORCH_BYTES_PER_PARAM),
    }[_planned(system)]


def activation_bytes(spec: ModelSpec, batch: int, seq_len: int | None = None, checkpointing: bool = True) -> int:
    """Peak activation bytes per GPU (bf16) for one micro-batch (Note [the memory model])."""
    s = seq_len or spec.seq_len
    h, layers, a = spec.hidden, spec.layers, spec.heads
    per_layer = batch * s * (34 * h + 5 * a * s)
    logits = batch * s * spec.vocab * LOGIT_BYTES
    if checkpointing:
        return 2 * batch * s * h * layers + per_layer + logits
    return layers * per_layer + logits


# ---------------------------------------------------------------------------------------------- footprints


@dataclass(frozen=True)
class Footprint:
    """What one system needs to train one model on one node, against what the node has."""

    system: str
    model: str
    n_params: int
    device_need: int
    """Bytes per GPU that must be on the device at the peak (activations + working set [+ model data])."""
    host_need: int
    """Bytes of model data on the node's host memory (after using spare device memory where the system can)."""
    device_usable: int
    host_usable: int
    activations: int
    """The ``device_need`` share that is activations."""
    chunk_elements: int = 0
    """chunkstar only: the layout's largest chunk, in elements."""
    disk_need: int = 0
    """chunkstar-disk only: bytes of the chunk files (every process's state chunks)."""
    disk_usable: int = 0
    staging: int = 0
    """chunkstar-disk only: host bytes of staging buffers per process (part of ``host_need``)."""
    staging_min: int = 0
    """chunkstar-disk only: the least staging budget the engine accepts (one chunk's state)."""

    @property
    def device_fits(self) -> bool:
        return self.device_need <= self.device_usable

    @property
    def host_fits(self) -> bool:
        return self.host_need <= self.host_usable

    @property
    def disk_fits(self) -> bool:
        return self.disk_need <= self.disk_usable

    @property
    def staging_fits(self) -> bool:
        return self.staging >= self.staging_min

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits and self.disk_fits and self.staging_fits

    @property
    def binding(self) -> str | None:
        """``"device"``, ``"host"``, ``"disk"`` or ``"staging"`` when the model does not fit
        (in that order), else None."""
        if not self.device_fits:
            return "device"
        if not self.host_fits:
            return "host"
        if not self.disk_fits:
            return "disk"
        if not self.staging_fits:
            return "staging"
        return None


def footprint(system: str, spec: ModelSpec, hw: Hardware, workload: Workload = Workload()) -> Footprint:
    """Device and host bytes ``system`` needs for ``spec`` on ``hw`` (Note [the memory model])."""
    system = _planned(system)
    n = hw.gpus
    params = zoo.n_params(spec)
    act = activation_bytes(spec, workload.batch, workload.seq_len, workload.checkpointing)
    dev_cap, host_cap = hw.device_usable, hw.host_usable(n)
    layer16 = 2 * 2 * _layer_params(spec)  # one layer's 16-bit params + grads
    chunk_elements = 0
    disk: dict[str, int] = {}
    if system in ("chunkstar", "chunkstar-disk"):
        layout = chunk_layout(spec, n, workload.chunk_size)
        chunk_elements = max(layout.chunk_sizes)
        param_chunk = CHUNKSTAR_PARAM_BYTES_PER_ELEMENT * chunk_elements
        working = 2 * n * param_chunk  # two gathered groups: the current one and the prefetched one
        device_need = act + working
        spare = max(0, dev_cap - device_need) * n  # resident param chunks, then hybrid-Adam state
        if system == "chunkstar":
            host_need = max(0, CHUNKSTAR_BYTES_PER_ELEMENT * layout.total_elements - spare)
        else:  # the state in files; no device Adam, so the spare device memory holds param chunks only
            shape = staging_shape({ChunkList(name): {0: (chunk_elements, 4)} for name in DEFAULT_DISK_LISTS}, None)
            staging = workload.staging_budget or shape.budget
            params_on_host = max(0, CHUNKSTAR_PARAM_BYTES_PER_ELEMENT * layout.total_elements - spare)
            host_need = params_on_host + n * staging
            disk = {
                "disk_need": DISK_BYTES_PER_ELEMENT * layout.total_elements, "disk_usable": hw.disk_bytes,
                "staging": staging, "staging_min": shape.least,
            }  # fmt: skip
    elif system == "deepspeed":
        device_need = act + 2 * layer16 + 2 * DEEPSPEED_REDUCE_BUCKET_ELEMENTS
        host_need = DEEPSPEED_OFFLOAD_BYTES_PER_PARAM * params
    elif system == "fsdp2":
        device_need = act + 2 * 2 * layer16  # two layers' fp32 params + grads, unsharded
        host_need = TORCH_BYTES_PER_PARAM * params
    elif system == "pytorch":
        device_need = act + TORCH_BYTES_PER_PARAM * params
        host_need = 0
    elif system == "pytorch-fsdp":
        device_need = act + math.ceil(TORCH_BYTES_PER_PARAM * params / n) + 2 * layer16
        host_need = 0
    else:  # pragma: no cover  (_planned() admits only SYSTEMS)
        raise AssertionError(system)
    return Footprint(system, spec.name, params, device_need, host_need, dev_cap, host_cap, act, chunk_elements, **disk)


@dataclass(frozen=True)
class Prediction:
    """The largest zoo model ``system`` fits, and what stops the next one."""

    system: str
    best: Footprint | None
    """Footprint of the largest fitting model; None when not even the smallest fits."""
    blocked: Footprint | None
    """Footprint of the next larger zoo model (it does not fit); None when the largest zoo model fits."""

    @property
    def binding(self) -> str:
        if self.blocked is None:
            return "none: the largest zoo model fits"
        return str(self.blocked.binding)


def _by_size(models: Iterable[ModelSpec]) -> list[ModelSpec]:
    return sorted(models, key=zoo.n_params)


def models_named(which: str) -> list[ModelSpec]:
    """``paper`` (the paper's GPT configs, seq 1024: the default for GPU nodes), ``cpu`` (the CPU
    ladder, seq 128), ``all``, or comma-separated zoo names."""
    if which == "paper":
        return [m for m in zoo.ZOO.values() if zoo.paper_label(m) is not None]
    if which == "cpu":
        return [zoo.get(n) for n in zoo.cpu_ladder()]
    if which == "all":
        return list(zoo.ZOO.values())
    return [zoo.get(n.strip()) for n in which.split(",") if n.strip()]


def predict_max(
    system: str, hw: Hardware, workload: Workload = Workload(), models: Sequence[ModelSpec] | None = None
) -> Prediction:
    """Scan ``models`` (default: the paper's models) smallest first; the last that fits is the maximum.

    A model that fits after a larger one failed (possible: activations grow with
    ``h`` and ``s``, not with ``P``) does not count: the maximum is where the
    ladder first breaks, as a max-scale search would find it.
    """
    system = _planned(system)
    best: Footprint | None = None
    for spec in _by_size(models if models is not None else models_named("paper")):
        fp = footprint(system, spec, hw, workload)
        if not fp.fits:
            return Prediction(system, best, fp)
        best = fp
    return Prediction(system, best, None)


def default_systems(hw: Hardware) -> tuple[str, ...]:
    """The systems planned for ``hw`` unless asked otherwise: all, the disk ones only with a disk."""
    return tuple(s for s in SYSTEMS if hw.disk_bytes > 0 or s not in DISK_SYSTEMS)


def _planned(system: str) -> str:
    """``system``'s canonical name when the planner predicts for it; a ValueError naming the choices otherwise."""
    try:
        name = published.canonical_system(system)
    except KeyError:
        name = system
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    return name
