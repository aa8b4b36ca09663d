"""The time model: a recorded step replayed on a hardware description.

Note [time model]: a :class:`StepRecord` (what one rank's step did, moment by
moment: FLOPs, chunk moves, collective bytes, Adam work) is replayed on
:class:`Hardware` with the runtime's own overlap rules. Six resources each do
one thing at a time, in the order the step issued their work: the device's
compute, the host-to-device link, the device-to-host link, the interconnect
(collectives), the host's cores (CPU Adam) and the disk.

* A moment's compute runs at ``peak_flops x efficiency`` once the moment's
  chunks are in: what it fetched on demand (reason ``access`` or ``optimizer``),
  what it gathered from the other ranks, and what earlier moments prefetched for
  it (a prefetch issued in moment ``m`` is there for moment ``m + 1``: the
  runtime issues it ahead by its window, and whatever is still on the link when
  the next moment starts holds that moment up).
* An on-demand copy to the device waits for the evictions of its moment to have
  left (they make its room); a prefetch only for the link.
* Copies to the host (evictions, gradients offloaded for CPU Adam) run on their
  own link beside the compute. A chunk's CPU Adam starts once its gradients
  are on the host (overlap on: the host worker updates chunks as the backward
  sends them), on the host's cores, in arrival order; the rest of the host's
  Adam and the device's Adam run in the optimizer step. The optimizer step's
  copies to the device carry chunks the host's Adam updated: they leave once
  that Adam is done (a param chunk's copy waits for its update's event).
* Gradient reductions run on the interconnect beside the compute; the step ends
  when every resource is done.
* Shared cores (:attr:`Hardware.shared_cores`, the CPU virtual device whose
  compute threads and host worker together want more cores than the process
  has): the host's Adam does not run beside the compute but takes its cores, so
  each second of it in the forward and backward is a second more of compute,
  and in the optimizer step the host's and the device's Adam run one after the
  other.

With ``overlap`` off (the serial reference path, ``"overlap": false``) nothing
runs beside anything: the step is the sum of every resource's work. The result
names the resource that binds the step: the one busy the longest.

A step's FLOPs are the ops' own (``torch.utils.flop_counter``'s formulas on the
meta run: matrix products, attention), which is what the device executes; the
bench's TFLOPS use its two published counts over the predicted seconds.

Note [this machine]: :func:`calibrate_this_machine` describes the CPU virtual
device by measurement, never by fitting a step time. Its ``peak_flops`` is the
best rate of a square matrix product in the compute dtype; a model's own
products run at another rate, which on a CPU depends on the shapes and the
memory layout far more than on a GPU (measured on a 2-core AVX2 EPYC, one
thread, bf16: a 1024-square product 0.3 GFLOP/s, GPT-2's ``x @ W`` of a
512-token MLP 0.2 GFLOP/s, its gradient products up to 4.6 GFLOP/s; fp32 runs
30 GFLOP/s). So given a ``workload`` (the model and a micro-batch) it runs the
forward and backward on the meta device, collects every op with its shapes,
strides, dtypes and arguments, times each distinct one on made-up tensors here
(:func:`measure_compute`; the eight blocks of a GPT-2 cost one block's time, not
eight), and the workload's rate is its FLOPs over the time of all its ops: the
ops without a formula (norms, activations, the loss: under 1% of a bf16 step
here, 3-4% in fp32, more for a small model) give the products' FLOPs their time. The efficiency is that
rate over the peak. What the replay cannot see: the engine's own work per
moment (hooks, chunk bookkeeping) and caches an op finds cold in a real step
and warm when timed alone, so the prediction leans short. The host's
Adam rate is measured as the engine runs it (the bf16 gradients' fp32 copy,
the fused AdamW, the cast back); the links of an emulated device
(``device_link_bandwidth``) take at least ``bytes / bandwidth`` per copy and
never less than the copy itself (:class:`chunkstar.device.copy_engine._Pace`
copies, then sleeps out the rest), so their rate is the lesser of the two. The
emulated link's sleep takes no core; its memory copy does, which the model does
not count against the compute (a few percent at most: a 4-8 GB/s copy against
the 1 and 8 GB/s links of the bench). Foreign load on the machine is not
modelled: it slows the measured step, and the calibration only as much as it
happened to be there while it ran.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from chunkstar.dryrun.record import _FORMULAS, Move, StepRecord

__all__ = [
    "HARDWARE", "ComputeRate", "Hardware", "Prediction", "calibrate_this_machine", "hardware_named", "measure_compute",
    "predict",
]  # fmt: skip

_GB = 1e9
_GIB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """A machine to predict a step on; per device unless a field says per node."""

    name: str
    description: str
    gpus_per_node: int
    device_memory: int
    """Bytes one process may use on its device (the total less what the CUDA context takes)."""
    peak_flops: float
    """Dense bf16/fp16 FLOP/s of one device (fp32 for a CPU)."""
    efficiency: float
    """The fraction of ``peak_flops`` a transformer's forward and backward reach when nothing waits."""
    h2d_bandwidth: float
    """Bytes/s host to device for one device while every device of the node copies."""
    d2h_bandwidth: float
    host_memory: int
    """Bytes of host memory per node."""
    host_adam_params_per_s: float
    """CPU Adam updates per second for the whole node (split among its ranks)."""
    device_adam_params_per_s: float
    """Adam updates per second on one device (memory-bound)."""
    interconnect_bandwidth: float
    """Bytes/s into or out of one device in a ring collective (NVLink, PCIe, or the network)."""
    disk_read: float = 0.0
    """Bytes/s per node read from the disk tier (0: no disk)."""
    disk_write: float = 0.0
    shared_cores: bool = False
    """The host's Adam takes the cores the device computes on (the CPU virtual device whose compute
    threads and host worker want more cores than the process has): their work adds up (Note [time model])."""
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        positive = (
            "device_memory", "peak_flops", "h2d_bandwidth", "d2h_bandwidth", "host_memory", "host_adam_params_per_s",
            "device_adam_params_per_s",
        )  # fmt: skip
        for f in positive:
            v = getattr(self, f)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Hardware {self.name!r}: {f} must be a positive number, got {v!r}")
        for f in ("interconnect_bandwidth", "disk_read", "disk_write"):  # 0: none (one device; no disk tier)
            v = getattr(self, f)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Hardware {self.name!r}: {f} must be a number >= 0 (0: none), got {v!r}")
        if isinstance(self.efficiency, bool) or not (isinstance(self.efficiency, (int, float)) and 0 < self.efficiency <= 1):
            raise ValueError(f"Hardware {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: gpus_per_node must be an int >= 1, got {self.gpus_per_node!r}")


# Note [hardware table]: the nodes the paper ran on, today's GPU nodes, and the two single-GPU
# anchors of the offload field. Peak FLOPs are the vendors' dense fp16/bf16 figures. Links: a
# PCIe 3.0 x16 link moves about 12 GB/s each way and 4.0 about 24 GB/s, 5.0 about 50; two
# GPUs share a switch on the V100 and A100 boards, so with all eight copying each gets about
# half. The efficiency is what a GPT block's matrix products reach with the data on the device
# (Megatron-LM reports 40-55% of peak on V100/A100 at these widths; FlashAttention-2 era H100
# runs 45-60%). CPU Adam rates follow DeepSpeed's CPU-Adam figures (about 1 billion updates/s
# on a 2-socket server of 2020, AVX-512), scaled by cores for the newer nodes. Device Adam is
# memory-bound: about 28 bytes per parameter (fp32 master, two moments read and written, the
# gradient read, the param written) at 70% of HBM bandwidth.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "v100x8_240gb", "8x V100 SXM2 32 GB, 240 GB host, PCIe 3.0 (PatrickStar's first node)", 8,
            int(31.5 * _GIB), 125e12, 0.45, 6 * _GB, 6 * _GB, 240 * _GIB, 1.0e9, 0.7 * 900e9 / 28, 60 * _GB,
            source="NVIDIA V100 datasheet; PCIe 3.0 x16 shared by 2 GPUs; NVLink ring",
        ),
        Hardware(
            "a100x8_1tb", "8x A100 SXM4 80 GB, 1 TB host, PCIe 4.0 (PatrickStar's second node)", 8,
            int(79 * _GIB), 312e12, 0.45, 12 * _GB, 12 * _GB, 1000 * _GIB, 2.0e9, 0.7 * 2039e9 / 28, 150 * _GB,
            source="NVIDIA A100 datasheet; PCIe 4.0 x16 shared by 2 GPUs; NVLink 3 ring",
        ),
        Hardware(
            "h100x8_2tb", "8x H100 SXM5 80 GB, 2 TB host, PCIe 5.0", 8,
            int(79 * _GIB), 989e12, 0.45, 25 * _GB, 25 * _GB, 2000 * _GIB, 3.0e9, 0.7 * 3350e9 / 28, 300 * _GB,
            source="NVIDIA H100 datasheet; PCIe 5.0 x16 per GPU pair; NVLink 4 ring",
        ),
        Hardware(
            "h200x8_2tb", "8x H200 SXM 141 GB, 2 TB host, PCIe 5.0", 8,
            int(140 * _GIB), 989e12, 0.45, 25 * _GB, 25 * _GB, 2000 * _GIB, 3.0e9, 0.7 * 4800e9 / 28, 300 * _GB,
            source="NVIDIA H200 datasheet (H100's compute die, more and faster HBM)",
        ),
        Hardware(
            "rtx4090_256gb_nvme", "1x RTX 4090 24 GB, 256 GB host, PCIe 4.0 NVMe (LoHan/Ratel's machine)", 1,
            int(23.5 * _GIB), 165e12, 0.5, 24 * _GB, 24 * _GB, 256 * _GIB, 1.0e9, 0.7 * 1008e9 / 28, 0.0,
            disk_read=6 * _GB, disk_write=4 * _GB,
            source="NVIDIA Ada whitepaper (dense fp16 with fp32 accumulate 165 TFLOPS); PCIe 4.0 NVMe",
        ),
        Hardware(
            "h200_1.5tb", "1x H200 141 GB, 1.5 TB host, PCIe 5.0 (MegaTrain's machine)", 1,
            int(140 * _GIB), 989e12, 0.45, 50 * _GB, 50 * _GB, 1500 * _GIB, 1.5e9, 0.7 * 4800e9 / 28, 0.0,
            source="NVIDIA H200 datasheet; PCIe 5.0 x16 to one GPU",
        ),
    )
}


def hardware_named(name: str) -> Hardware:
    """A :data:`HARDWARE` entry, or ``"this-machine"``: this CPU, measured now
    (:func:`calibrate_this_machine`)."""
    if name == "this-machine":
        return calibrate_this_machine()
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join([*HARDWARE, 'this-machine'])}") from None


Workload = tuple[Callable[[], nn.Module], Any]
"""A model and one micro-batch of its inputs (as :func:`chunkstar.dry_run` takes them): what
:func:`calibrate_this_machine` times the compute on."""


@dataclass(frozen=True)
class _Basics:
    """What :func:`calibrate_this_machine` measures whatever the workload: per dtype and thread count."""

    peak_flops: float
    square: int
    adam: float
    copy: float


_BASICS: dict[tuple[str, int], _Basics] = {}


def calibrate_this_machine(
    dtype: torch.dtype = torch.bfloat16, link_bandwidth: float | None = None, *, workload: Workload | None = None
) -> Hardware:
    """This machine as the CPU virtual device, measured now at torch's current thread count
    (Note [this machine]): its square matrix-product rate in ``dtype`` (the peak), its Adam
    rate as the engine runs it, its memory copy rate (cached per process, dtype and threads).

    ``link_bandwidth`` (bytes/s) is an emulated link's (the config's ``device_link_bandwidth``):
    the links run at it, or at the copy rate where that is slower. ``workload`` (a model
    function and one micro-batch of inputs) sets the efficiency: the rate its own forward and
    backward ops reach here (:func:`measure_compute`), over the peak; without one the
    efficiency is 1 (the square product's rate, which a model's products may not reach)."""
    if link_bandwidth is not None and not (math.isfinite(link_bandwidth) and link_bandwidth > 0):
        raise ValueError(f"link_bandwidth must be a positive number of bytes/s, got {link_bandwidth!r}")
    threads = torch.get_num_threads()
    key = (str(dtype), threads)
    basics = _BASICS.get(key)
    if basics is None:
        basics = _BASICS[key] = _measure_basics(dtype)
    peak, efficiency = basics.peak_flops, 1.0
    compute = ""
    if workload is not None:
        rate = measure_compute(workload[0], workload[1], dtype)
        if rate.flops_per_s <= 0:
            raise ValueError("the workload runs no op with a FLOP formula (a matrix product, attention): nothing to time")
        # a model's products can beat the square one (bf16 on a CPU without bf16 units): the
        # peak is then the best rate measured, the workload's
        peak = max(peak, rate.flops_per_s)
        efficiency = min(1.0, rate.flops_per_s / peak)
        compute = (
            f", the workload's {rate.distinct} distinct ops {rate.flops_per_s / 1e9:.2f} GFLOP/s (its {rate.flop_ops} "
            f"FLOP ops {rate.flops / rate.flop_seconds / 1e9:.2f}, the rest {1 - rate.flop_seconds / rate.seconds:.1%} of the time)"
        )
    copy = basics.copy
    link = min(float(link_bandwidth), copy) if link_bandwidth else copy
    from chunkstar.config.parse import host_memory_bytes
    from chunkstar.device.threads import host_worker_width, rank_share_of_cores

    # the compute thread's OpenMP team and the host worker's (which widens to torch's width
    # once it runs updates: Note [one OpenMP team]) beside each other on the process's cores
    shared = threads + host_worker_width() > rank_share_of_cores()
    memory = host_memory_bytes() or (16 * _GIB)
    hw = Hardware(
        "this-machine", f"this CPU as the virtual device ({threads} threads), measured", 1,
        memory, peak, efficiency, link, link, memory, basics.adam, basics.adam, copy, shared_cores=shared,
        source=(
            f"measured: {dtype} {basics.square}-square mm {basics.peak_flops / 1e9:.2f} GFLOP/s{compute}, AdamW "
            f"{basics.adam / 1e6:.0f} M params/s, copy {copy / 1e9:.1f} GB/s"
            + (f", link {link_bandwidth / 1e9:g} GB/s emulated" if link_bandwidth else "")
        ),
    )  # fmt: skip
    return hw


def _measure_basics(dtype: torch.dtype) -> _Basics:
    # the peak: a square product as large as keeps one call under ~20 ms, so a slow dtype
    # (bf16 without bf16 units: 20-100x slower than fp32) costs no more time than a fast one
    n = 128
    while True:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if time.perf_counter() - t0 > 0.02 or n >= 2048:
            break
        n *= 2
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3 or reps < 2:
        torch.mm(a, b)
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)

    # Adam as the engine runs it on the host (chunkstar.optim.adam): the gradients' fp32
    # copy, the fused AdamW over fp32 master and moments, the cast back into the params
    numel = 1 << 22
    low = dtype if dtype.is_floating_point else torch.float32
    params, grads = torch.zeros(numel, dtype=low), torch.randn(numel).to(low)
    master, scratch = torch.zeros(numel), torch.empty(numel)
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.ones(())

    def adam() -> None:
        scratch.copy_(grads)
        torch._fused_adamw_(
            [master], [scratch], [m], [v], [], [step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8,
            amsgrad=False, maximize=False,
        )  # fmt: skip
        params.copy_(master)

    adam()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        adam()
        reps += 1
    adam_rate = numel * reps / (time.perf_counter() - t0)

    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        dst.copy_(src)
        reps += 1
    copy = src.numel() * reps / (time.perf_counter() - t0)
    return _Basics(flops, n, adam_rate, copy)


@dataclass(frozen=True)
class ComputeRate:
    """A forward and backward's ops, each timed on this machine (:func:`measure_compute`)."""

    flops: int
    """FLOPs of the ops timed, each as often as one forward and backward runs it."""
    seconds: float
    """The time of every op timed here (with a FLOP formula or not), each op's time times its count."""
    flop_seconds: float
    """The part of ``seconds`` spent in the ops with a FLOP formula (products, attention)."""
    distinct: int
    """Distinct ops (op, shapes, strides, dtypes, arguments) timed."""
    flop_ops: int
    """Of them, the ops with a FLOP formula."""
    skipped: int = 0
    """Distinct ops that could not run on made-up tensors (left out of the rate)."""
    unmeasured_flops: int = 0
    """FLOPs of the skipped ops."""

    @property
    def flops_per_s(self) -> float:
        """The step's own rate: its FLOPs over the time of all its ops."""
        return self.flops / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _SeqSpec:
    items: tuple[Hashable, ...]
    is_list: bool


@dataclass(frozen=True)
class _DictSpec:
    items: tuple[tuple[str, Hashable], ...]


def _spec(x: Any) -> Hashable:
    """An op argument as a hashable description: tensors by shape, strides and dtype, the meta
    device as the CPU (a factory op made there is made here when timed)."""
    if isinstance(x, torch.Tensor):
        return _TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype)
    if isinstance(x, torch.device):
        return torch.device("cpu") if x.type == "meta" else x
    if isinstance(x, (list, tuple)):
        return _SeqSpec(tuple(_spec(v) for v in x), isinstance(x, list))
    if isinstance(x, Mapping):
        return _DictSpec(tuple((str(k), _spec(v)) for k, v in x.items()))
    return x  # type: ignore[no-any-return]


def _made_up(spec: Hashable) -> Any:
    """A real CPU tensor (or argument) matching ``spec``: random floats, zero integers, with the
    spec's strides over a storage just large enough."""
    if isinstance(spec, _TensorSpec):
        size = 1 + sum((n - 1) * st for n, st in zip(spec.shape, spec.stride)) if all(spec.shape) else 0
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            base = torch.randn(size).to(spec.dtype)
        else:
            base = torch.zeros(size, dtype=spec.dtype)
        return base.as_strided(spec.shape, spec.stride)
    if isinstance(spec, _SeqSpec):
        seq = [_made_up(v) for v in spec.items]
        return seq if spec.is_list else tuple(seq)
    if isinstance(spec, _DictSpec):
        return {k: _made_up(v) for k, v in spec.items}
    return spec


class _OpCapture(TorchDispatchMode):
    """Every op, by (op, argument specs): how often it ran and its FLOPs (0 without a formula)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[tuple[Any, Hashable, Hashable], list[int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        key = (func, _spec(tuple(args)), _spec(kwargs))
        entry = self.ops.get(key)
        if entry is None:
            formula = _FORMULAS.get(func._overloadpacket)
            entry = self.ops[key] = [0, int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0]
        entry[0] += 1
        return out


_RATES: dict[tuple[int, frozenset[tuple[Any, ...]]], ComputeRate] = {}


def measure_compute(
    model_func: Callable[[], nn.Module], inputs: Any, dtype: torch.dtype = torch.bfloat16, *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None, min_time_s: float = 0.1,
) -> ComputeRate:  # fmt: skip
    """The rate one forward and backward of ``model_func()``'s model (in ``dtype``) on ``inputs``
    reaches here, by its own ops (Note [this machine]): the forward and backward run on the
    meta device, each distinct op (with its shapes, strides, dtypes and arguments) is timed on
    made-up tensors at torch's current thread count (once to warm up, then again for at least
    ``min_time_s``, or once only where a call takes longer than that), and the rate is the
    FLOPs of the ops with a formula over the time of all of them, each op counted as often as
    the step runs it: the products and attention carry the time of the norms, activations and
    loss between them. Cached per process by thread count and the ops."""
    from chunkstar.dryrun.meta_ops import loss_of, meta_kernels, on_meta

    with torch.device("meta"):
        model = model_func()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    if dtype.is_floating_point:
        model.to(dtype)  # the engine's compute dtype: its params are in it (the norms' upcast moves no FLOPs)
    capture = _OpCapture()
    meta_inputs = on_meta(inputs)
    with meta_kernels(), capture:
        if isinstance(meta_inputs, Mapping):
            out = model(**meta_inputs)
        elif isinstance(meta_inputs, (list, tuple)):
            out = model(*meta_inputs)
        else:
            out = model(meta_inputs)
        (loss_fn or loss_of)(out).backward()
    key = (torch.get_num_threads(), frozenset((k[0], k[1], k[2], v[0], v[1]) for k, v in capture.ops.items()))
    cached = _RATES.get(key)
    if cached is not None:
        return cached
    flops = unmeasured = skipped = timed = flop_ops = 0
    seconds = flop_seconds = 0.0
    with torch.no_grad():
        for (func, args_spec, kwargs_spec), (count, op_flops) in capture.ops.items():
            try:
                args, kwargs = _made_up(args_spec), _made_up(kwargs_spec)
                t0 = time.perf_counter()
                func(*args, **kwargs)
                first = time.perf_counter() - t0
                times = [first]
                if first < min_time_s:  # the first call warmed it up: time it again
                    times, t0 = [], time.perf_counter()
                    while time.perf_counter() - t0 < min_time_s and len(times) < 1000:
                        t1 = time.perf_counter()
                        func(*args, **kwargs)
                        times.append(time.perf_counter() - t1)
            except (RuntimeError, TypeError, ValueError, IndexError, NotImplementedError):
                # an op made-up values cannot run (an in-place op on an expanded tensor): left out
                skipped += 1
                unmeasured += count * op_flops
                continue
            op_seconds = count * statistics.median(times)
            timed += 1
            seconds += op_seconds
            if op_flops:
                flops += count * op_flops
                flop_seconds += op_seconds
                flop_ops += 1
    rate = _RATES[key] = ComputeRate(flops, seconds, flop_seconds, timed, flop_ops, skipped, unmeasured)
    return rate


@dataclass
class Prediction:
    """A predicted step on one rank."""

    seconds: float
    flops: int
    """The step's FLOPs on this rank (every op with a formula)."""
    hardware: str
    binding: str
    """The resource busy the longest: compute, h2d, d2h, interconnect, host_adam, device_adam or disk."""
    busy: dict[str, float] = field(default_factory=dict)
    """Seconds each resource works in the step."""
    waits: float = 0.0
    """Seconds the compute stood idle waiting for chunks (the rest of the step beyond its busy time)."""
    moment_starts: list[float] = field(default_factory=list)
    """When each moment's compute starts, in seconds from the step's start, in the record's order."""
    move_spans: dict[int, tuple[float, float]] = field(default_factory=dict)
    """When each move runs, (start, end) in seconds from the step's start, by its :attr:`Move.seq`
    (moves between two tiers the model gives no time, host to host, have none)."""

    @property
    def tflops(self) -> float:
        """Achieved TFLOPS of this device, by the step's own FLOPs."""
        return self.flops / self.seconds / 1e12 if self.seconds > 0 else 0.0

    def mfu(self, hardware: Hardware) -> float:
        return self.flops / self.seconds / hardware.peak_flops if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tflops"] = self.tflops
        return d


def predict(record: StepRecord, hw: Hardware, *, overlap: bool = True, ranks_per_node: int | None = None) -> Prediction:
    """Replay ``record`` on ``hw`` (Note [time model])."""
    per_node = ranks_per_node or min(hw.gpus_per_node, max(1, record.world_size))
    rate = hw.peak_flops * hw.efficiency
    host_adam_rate = hw.host_adam_params_per_s / per_node
    disk_read = hw.disk_read / per_node if hw.disk_read > 0 else 0.0
    disk_write = hw.disk_write / per_node if hw.disk_write > 0 else 0.0
    coll = hw.interconnect_bandwidth
    dtype_bytes = max(1, record.dtype_bytes)
    moment_reduce = sum(m.reduce_bytes for m in record.moments)
    if coll <= 0 and (record.gather_bytes or record.reduce_bytes or moment_reduce or any(m.gather_bytes for m in record.moments)):
        raise ValueError(
            f"hardware {hw.name!r} has no interconnect (interconnect_bandwidth 0) but the record's rank "
            f"{record.rank} of {record.world_size} runs collectives"
        )

    busy = dict.fromkeys(("compute", "h2d", "d2h", "interconnect", "host_adam", "device_adam", "disk"), 0.0)

    def disk_seconds(mv_bytes: int, reading: bool) -> float:
        bw = disk_read if reading else disk_write
        return mv_bytes / bw if bw > 0 else 0.0

    # the free time of each resource (overlap), or one clock for all of them in the order the
    # step issued their work (serial)
    free = dict.fromkeys(busy, 0.0)
    clock = 0.0
    prefetched_until = 0.0  # when the prefetches issued so far are in
    host_adam_done_params = 0
    moment_starts: list[float] = []
    spans: dict[int, tuple[float, float]] = {}
    # a chunk's CPU Adam follows its last gradient offload of the step (with accumulation, the
    # micro-steps before offload partial sums), once per chunk
    last_offload: dict[int, tuple[int, int]] = {}
    for mi, m in enumerate(record.moments):
        for vi, mv in enumerate(m.moves):
            if mv.src == "device" and mv.dst == "host" and mv.reason == "offload" and mv.chunk_list == "param":
                last_offload[mv.chunk_id] = (mi, vi)

    def run(res: str, start: float, seconds: float) -> float:
        """``seconds`` of work on ``res`` from ``start`` or once it is free; when it ends."""
        nonlocal clock
        busy[res] += seconds
        if overlap:
            begin = max(free[res], start)
            free[res] = begin + seconds
        else:
            begin = clock
            clock += seconds
        return begin + seconds

    def move(mv: Move, res: str, start: float, seconds: float) -> float:
        end = run(res, start, seconds)
        spans[mv.seq] = (end - seconds, end)
        return end

    for mi, m in enumerate(record.moments):
        compute_s = m.flops / rate
        t_issue = free["compute"]  # the moment begins when the compute before it is done
        evict_end = t_issue
        ready = max(t_issue, prefetched_until)
        for vi, mv in enumerate(m.moves):
            if mv.src == "device" and mv.dst == "host":
                end = move(mv, "d2h", t_issue, mv.nbytes / hw.d2h_bandwidth)
                if mv.reason == "eviction":
                    evict_end = max(evict_end, end)
                elif last_offload.get(mv.chunk_id) == (mi, vi):
                    # its gradients are on the host: its CPU Adam can start (overlap on); never
                    # more of it than the record's host Adam
                    params = min(mv.nbytes // dtype_bytes, record.host_adam_params - host_adam_done_params)
                    if overlap and params > 0:
                        adam_s = params / host_adam_rate
                        run("host_adam", end, adam_s)
                        host_adam_done_params += params
                        if hw.shared_cores:
                            free["compute"] += adam_s  # the Adam took the compute's cores meanwhile
            elif mv.src == "disk" or mv.dst == "disk":
                move(mv, "disk", t_issue, disk_seconds(mv.nbytes, mv.src == "disk"))
        for mv in m.moves:
            # a gathered chunk's bytes come over the interconnect (the moment's gather_bytes below),
            # not the host link: charged there once (charged here too, 8 ranks' steps were
            # predicted up to twice too long)
            if mv.src == "host" and mv.dst == "device" and not mv.gathered:
                seconds = mv.nbytes / hw.h2d_bandwidth
                if mv.reason == "prefetch" and mv.chunk_list == "activation":
                    # a block's saved tensors sent for one offloaded block ahead of its backward: they hold the
                    # link (chunk prefetches queue behind them), not this moment's compute
                    move(mv, "h2d", t_issue, seconds)
                elif mv.reason == "prefetch":
                    prefetched_until = max(prefetched_until, move(mv, "h2d", t_issue, seconds))
                else:
                    ready = max(ready, move(mv, "h2d", evict_end, seconds))
        if m.gather_bytes:
            ready = max(ready, run("interconnect", t_issue, m.gather_bytes / coll))
        if m.reduce_bytes:
            run("interconnect", t_issue, m.reduce_bytes / coll)
        moment_starts.append(run("compute", ready, compute_s) - compute_s)

    # the optimizer step: the rest of the host's Adam and the device's Adam (one after the other
    # on shared cores), then its copies to the device of the chunks the host updated
    t_opt = free["compute"]
    remaining = max(0, record.host_adam_params - host_adam_done_params)
    host_adam_end = run("host_adam", t_opt, remaining / host_adam_rate)
    run("device_adam", host_adam_end if hw.shared_cores else t_opt, record.device_adam_params / hw.device_adam_params_per_s)
    for mv in record.optimizer_moves:
        if mv.src == "host" and mv.dst == "device":
            move(mv, "h2d", max(t_opt, host_adam_end), mv.nbytes / hw.h2d_bandwidth)
        elif mv.src == "device" and mv.dst == "host":
            move(mv, "d2h", t_opt, mv.nbytes / hw.d2h_bandwidth)
        elif mv.src == "disk" or mv.dst == "disk":
            move(mv, "disk", t_opt, disk_seconds(mv.nbytes, mv.src == "disk"))
    if record.reduce_bytes > moment_reduce:  # reductions outside the moments
        run("interconnect", t_opt, (record.reduce_bytes - moment_reduce) / coll)

    seconds = max(free.values()) if overlap else sum(busy.values())
    binding = max(busy, key=lambda k: busy[k])
    return Prediction(
        seconds=seconds, flops=record.flops, hardware=hw.name, binding=binding, busy=busy,
        waits=max(0.0, seconds - busy["compute"]), moment_starts=moment_starts, move_spans=spans,
    )  # fmt: skip
