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
  Adam and the device's Adam run in the optimizer step.
* Gradient reductions run on the interconnect beside the compute; the step ends
  when every resource is done.

With ``overlap`` off (the serial reference path, ``"overlap": false``) nothing
runs beside anything: the step is the sum of every resource's work. The result
names the resource that binds the step: the one busy the longest.

A step's FLOPs are the ops' own (``torch.utils.flop_counter``'s formulas on the
meta run: matrix products, attention), which is what the device executes; the
bench's TFLOPS use its two published counts over the predicted seconds.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from chunkstar.dryrun.record import StepRecord

__all__ = ["HARDWARE", "Hardware", "Prediction", "calibrate_this_machine", "hardware_named", "predict"]

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
    source: str = ""
    """Where the figures come from."""

    def __post_init__(self) -> None:
        for f in ("device_memory", "peak_flops", "h2d_bandwidth", "d2h_bandwidth", "host_adam_params_per_s", "device_adam_params_per_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Hardware {self.name!r}: {f} must be a positive number, got {v!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"Hardware {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")
        if self.gpus_per_node < 1:
            raise ValueError(f"Hardware {self.name!r}: gpus_per_node must be at least 1")


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


_CALIBRATED: dict[tuple[str, float], Hardware] = {}


def calibrate_this_machine(dtype: torch.dtype = torch.bfloat16, link_bandwidth: float | None = None) -> Hardware:
    """This machine as the CPU virtual device: its matrix-product rate in ``dtype``, its
    Adam rate (torch's fused-for-CPU AdamW over one chunk-sized tensor), and its memory
    copy rate, measured now (cached per process). ``link_bandwidth`` replaces the
    copy rate by an emulated link's (the config's ``device_link_bandwidth``)."""
    key = (str(dtype), float(link_bandwidth or 0.0))
    if key in _CALIBRATED:
        return _CALIBRATED[key]
    n = 1024
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        torch.mm(a, b)
        reps += 1
    flops = 2 * n**3 * reps / (time.perf_counter() - t0)

    numel = 1 << 22
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)
    opt.step()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        opt.step()
        reps += 1
    adam = numel * reps / (time.perf_counter() - t0)

    src = torch.empty(1 << 26, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        dst.copy_(src)
        reps += 1
    copy = src.numel() * reps / (time.perf_counter() - t0)
    link = float(link_bandwidth) if link_bandwidth else copy
    from chunkstar.config.parse import host_memory_bytes

    hw = Hardware(
        "this-machine", f"this CPU as the virtual device ({torch.get_num_threads()} threads), measured", 1,
        host_memory_bytes() or (16 * _GIB), flops, 1.0, link, link, host_memory_bytes() or (16 * _GIB), adam, adam, copy,
        source=f"measured: {dtype} mm {flops / 1e9:.1f} GFLOP/s, AdamW {adam / 1e6:.0f} M params/s, copy {copy / 1e9:.1f} GB/s",
    )  # fmt: skip
    _CALIBRATED[key] = hw
    return hw


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

    busy = dict.fromkeys(("compute", "h2d", "d2h", "interconnect", "host_adam", "device_adam", "disk"), 0.0)

    def disk_seconds(mv_bytes: int, reading: bool) -> float:
        bw = disk_read if reading else disk_write
        return mv_bytes / bw if bw > 0 else 0.0

    # the free time of each resource (overlap), or one clock (serial)
    free = dict.fromkeys(busy, 0.0)
    prefetched_until = 0.0  # when the prefetches issued so far are in
    host_adam_done_params = 0

    def run(res: str, start: float, seconds: float) -> float:
        busy[res] += seconds
        if not overlap:
            return 0.0
        begin = max(free[res], start)
        free[res] = begin + seconds
        return free[res]

    for m in record.moments:
        compute_s = m.flops / rate
        t_issue = free["compute"]  # the moment begins when the compute before it is done
        evict_end = t_issue
        ready = max(t_issue, prefetched_until)
        for mv in m.moves:
            if mv.src == "device" and mv.dst == "host":
                end = run("d2h", t_issue, mv.nbytes / hw.d2h_bandwidth)
                if mv.reason == "eviction":
                    evict_end = max(evict_end, end)
                elif mv.reason == "offload" and mv.chunk_list == "param":
                    # its gradients are on the host: its CPU Adam can start (overlap on)
                    params = mv.nbytes // dtype_bytes
                    if overlap:
                        run("host_adam", end, params / host_adam_rate)
                        host_adam_done_params += params
            elif mv.src == "disk" or mv.dst == "disk":
                run("disk", t_issue, disk_seconds(mv.nbytes, mv.src == "disk"))
        for mv in m.moves:
            if mv.src == "host" and mv.dst == "device":
                seconds = mv.nbytes / hw.h2d_bandwidth
                if mv.reason == "prefetch":
                    prefetched_until = max(prefetched_until, run("h2d", t_issue, seconds))
                else:
                    ready = max(ready, run("h2d", evict_end, seconds))
        if m.gather_bytes:
            ready = max(ready, run("interconnect", t_issue, m.gather_bytes / coll))
        if m.reduce_bytes:
            run("interconnect", t_issue, m.reduce_bytes / coll)
        busy["compute"] += compute_s
        if overlap:
            free["compute"] = max(free["compute"], ready) + compute_s

    # the optimizer step: its own moves, the rest of the host's Adam, the device's Adam
    t_opt = free["compute"]
    for mv in record.optimizer_moves:
        if mv.src == "host" and mv.dst == "device":
            t_opt = max(t_opt, run("h2d", t_opt, mv.nbytes / hw.h2d_bandwidth))
        elif mv.src == "device" and mv.dst == "host":
            run("d2h", t_opt, mv.nbytes / hw.d2h_bandwidth)
        elif mv.src == "disk" or mv.dst == "disk":
            run("disk", t_opt, disk_seconds(mv.nbytes, mv.src == "disk"))
    remaining = max(0, record.host_adam_params - host_adam_done_params)
    run("host_adam", t_opt, remaining / host_adam_rate)
    run("device_adam", t_opt, record.device_adam_params / hw.device_adam_params_per_s)
    if record.reduce_bytes > sum(m.reduce_bytes for m in record.moments):  # reductions outside the moments
        run("interconnect", t_opt, (record.reduce_bytes - sum(m.reduce_bytes for m in record.moments)) / coll)

    if overlap:
        seconds = max(free.values())
    else:
        seconds = sum(busy.values())
    binding = max(busy, key=lambda k: busy[k])
    return Prediction(
        seconds=seconds, flops=record.flops, hardware=hw.name, binding=binding, busy=busy,
        waits=max(0.0, seconds - busy["compute"]),
    )  # fmt: skip
