"""One benchmark run, inside its own process: ``python -m chunkstar_bench.child --spec JSON``.

This is what runs *in* the subprocess that :func:`chunkstar_bench.runner.run`
starts (under ``torchrun`` when the run has several processes, one per GPU).
It builds the zoo model with a fixed seed, trains it for ``warmup + steps``
steps on random token batches with the system under test, and prints one
``RESULT_PREFIX`` JSON line per rank on stdout. It decides nothing about
suites, databases or host-memory caps (the parent watches memory from outside).

Note: what one step is, for every system
    forward + loss, backward, global-norm gradient clipping at 1.0, an AdamW
    step (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) and zeroing
    the gradients, in bf16 compute with fp32 master weights. The first
    ``warmup`` steps run untimed (chunkstar's first iteration is its tracer
    warm-up; the other systems allocate optimizer state lazily); the reported
    step time is the median of the timed steps. On CUDA every step is bracketed
    by ``torch.cuda.synchronize``; on CPU kernels are synchronous.

Note: peak memory
    Host: ``ru_maxrss`` of this rank. Device: on CUDA
    ``torch.cuda.max_memory_allocated``; on chunkstar's CPU *virtual* device the
    peak chunk bytes plus the warm-up non-model peak (both from
    ``engine.stats()``); none for the other systems on CPU (they have no device
    tier there). The record's ``peak_device_kind`` says which.

The module level imports only the standard library and the torch-free parts of
this package; torch, transformers, chunkstar and deepspeed are imported by the
system that needs them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from chunkstar_bench.runner import DISK_DIR_ENV, RESULT_DIR_ENV, RESULT_PREFIX, RunSpec
from chunkstar_bench.zoo import ModelSpec, build_hf, get, n_params

__all__ = ["main"]

_ADAMW: dict[str, Any] = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
"""The optimizer every system gets, in DeepSpeed's (and chunkstar's) JSON shape."""

_PRESSURE_FRACTION = 0.6
"""Default chunkstar budget on the CPU virtual device: this share of the bf16 parameter
bytes beside the estimated activations (0.6, not 0.5: the tied embedding and one
block's chunk must fit together; see README "Measured")."""

_OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "bad_alloc")


class _Context:
    """Where this rank runs: its rank, the world, the torch device, the model, the batches."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.model: ModelSpec = get(spec.model)
        self.seq = spec.seq_len or self.model.seq_len
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = "cuda" if spec.device == "cuda" else "cpu"

    def torch_device(self) -> Any:
        import torch

        return torch.device(f"cuda:{self.local_rank}") if self.device == "cuda" else torch.device("cpu")

    def build(self) -> Any:
        """The zoo model in fp32 on CPU; the same seed gives every system the same weights."""
        import torch

        torch.manual_seed(self.spec.seed)
        return build_hf(self.model)

    def batches(self) -> Iterator[Any]:
        """``warmup + steps`` random token batches [batch, seq] (int64, CPU), different per rank."""
        import torch

        gen = torch.Generator().manual_seed(self.spec.seed + 1 + self.rank)
        for _ in range(self.spec.warmup + self.spec.steps):
            yield torch.randint(0, self.model.vocab, (self.spec.batch, self.seq), generator=gen)

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


def _progress(ctx: _Context, message: str) -> None:
    if ctx.rank == 0:
        print(f"[{ctx.spec.system} {ctx.spec.model}] {message}", file=sys.stderr, flush=True)


def _time_steps(ctx: _Context, step: Callable[[Any], float], before_timed: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``step(ids) -> loss`` over every batch; per-step times and losses of the timed steps."""
    times: list[float] = []
    losses: list[float] = []
    total = ctx.spec.warmup + ctx.spec.steps
    busy0 = own0 = clock0 = 0.0
    for i, ids in enumerate(ctx.batches()):
        if i == ctx.spec.warmup:
            if before_timed is not None:
                before_timed()
            busy0, own0, clock0 = _machine_busy_s() or 0.0, _own_cpu_s(), time.perf_counter()
        if ctx.device == "cuda":
            ids = ids.to(ctx.torch_device(), non_blocking=True)
        ctx.sync()
        start = time.perf_counter()
        loss = step(ids)
        ctx.sync()
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= ctx.spec.warmup:
            times.append(elapsed)
        kind = "warm-up" if i < ctx.spec.warmup else "timed"
        _progress(ctx, f"step {i + 1}/{total} ({kind}) {elapsed:.3f} s, loss {loss:.4f}")
    # Foreign CPU load during the timed steps, in cores: machine-wide busy time
    # minus this process's own, over the wall time. On a 2-core machine one busy
    # foreign core can slow a step several times over; the record says so.
    wall = time.perf_counter() - clock0
    busy1 = _machine_busy_s()
    other = None if busy1 is None or wall <= 0 else max(0.0, (busy1 - busy0 - (_own_cpu_s() - own0)) / wall)
    return {"step_times_s": times, "losses": losses, "other_load_cores": other}


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has spent busy since boot (``/proc/stat``); None without it."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ensure_dist_env() -> None:
    """A one-process job still needs the env:// rendezvous variables (torchrun sets them otherwise)."""
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))


def _init_process_group(ctx: _Context) -> None:
    import torch
    import torch.distributed as dist

    _ensure_dist_env()
    if not dist.is_initialized():
        backend = "nccl" if ctx.device == "cuda" else "gloo"
        if ctx.device == "cuda":
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group(backend=backend)


def _cuda_peak(ctx: _Context) -> tuple[int | None, str | None]:
    if ctx.device != "cuda":
        return None, None
    import torch

    return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"


# --------------------------------------------------------------------------- the systems


def _run_pytorch(ctx: _Context) -> dict[str, Any]:
    """Plain PyTorch: fp32 params, bf16 autocast, fused AdamW (DDP when several processes)."""
    import torch

    model = ctx.build().to(ctx.torch_device())
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, **_ADAMW, fused=True)
    wrapped: Any = model
    if ctx.world > 1:
        _init_process_group(ctx)
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.local_rank] if ctx.device == "cuda" else None
        )

    def step(ids: Any) -> float:
        with torch.autocast(ctx.device, dtype=torch.bfloat16):
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    record = _time_steps(ctx, step)
    peak, kind = _cuda_peak(ctx)
    return {**record, "peak_device_bytes": peak, "peak_device_kind": kind, "optimizer": "torch.optim.AdamW(fused=True)"}


def chunkstar_budget_bytes(model: ModelSpec, batch: int, seq: int, budget: str | int | None) -> int | None:
    """The chunkstar device budget for a run, from the spec's ``chunkstar_budget``.

    * an int, or a size string (``"2GiB"``): that many bytes;
    * ``"params:F"``: estimated activations + ``F`` x the bf16 parameter bytes;
    * None or ``"auto"``: ``"params:0.6"`` -- on the CPU virtual device, only
      60% of the parameters fit beside the activations, so chunks move every
      step (the pressure chunkstar exists for).

    The activation estimate is ``B*s*(16*V + 34*h*L)`` bytes: bf16 logits, their
    fp32 upcast and gradients (16 bytes per logit) plus Korthikanti et al.'s
    ``34*s*b*h`` per layer (flash/SDPA attention, no score matrices), times
    1.25 (the estimate is slack enough to hold the few chunks one module needs at once).
    """
    from chunkstar import parse_bytes

    if isinstance(budget, int):
        return budget
    if budget is not None and budget != "auto" and not budget.startswith("params:"):
        return int(parse_bytes(budget))
    fraction = _PRESSURE_FRACTION if budget in (None, "auto") else float(budget.split(":", 1)[1])
    h, layers, vocab = model.hidden, model.layers, model.vocab
    activations = int(1.25 * batch * seq * (16 * vocab + 34 * h * layers))
    param_room = int(fraction * 2 * n_params(model))
    return activations + param_room


def _run_chunkstar(ctx: _Context) -> dict[str, Any]:
    """chunkstar, bf16; on CPU a virtual device under a budget that forces chunk moves.
    Several processes (torchrun) shard the chunks' master and Adam state over ranks."""
    if ctx.world > 1:
        _init_process_group(ctx)  # the engine finds the process group and shards over it
    import chunkstar

    budget = chunkstar_budget_bytes(ctx.model, ctx.spec.batch, ctx.seq, ctx.spec.chunkstar_budget)
    if ctx.device == "cuda" and ctx.spec.chunkstar_budget in (None, "auto"):
        budget = None  # on a real GPU the device's own size is the budget
    config: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": _ADAMW},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "device": "cpu" if ctx.device == "cpu" else f"cuda:{ctx.local_rank}",
        "default_chunk_size": "auto",
    }
    if budget is not None:
        config["device_memory_budget"] = budget
    build = ctx.build
    if ctx.spec.system == "chunkstar-disk":
        # the disk tier (master and Adam state in files), and the model built on the meta
        # device straight into the chunks: its fp32 weights never exist whole in host memory
        # the runner makes (and removes) the run's own folder; run without it, a temporary one
        config["disk"] = {"path": os.environ.get(DISK_DIR_ENV) or tempfile.mkdtemp(prefix="chunkstar-disk-", dir=ctx.spec.disk_dir)}
        if ctx.spec.chunkstar_staging is not None:
            config["disk"]["staging_budget"] = ctx.spec.chunkstar_staging

        def build() -> Any:
            import torch

            torch.manual_seed(ctx.spec.seed)
            with torch.device("meta"):
                return build_hf(ctx.model)

    engine, optimizer = chunkstar.initialize_engine(model_func=build, local_rank=ctx.local_rank, config=config)
    _progress(ctx, f"engine built: {engine.construction.meta_params} parameters from the meta device, {engine.stats()['n_chunks']} chunks")

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    before: dict[str, Any] = {}
    record = _time_steps(ctx, step, before_timed=lambda: before.update(engine.stats()))
    stats = dict(engine.stats())
    moves = {
        key: (stats[key] - before.get(key, 0)) / max(ctx.spec.steps, 1)
        for key in ("chunk_moves_to_device", "chunk_moves_to_host", "bytes_to_device", "bytes_to_host",
                    "disk_bytes_read", "disk_bytes_written")  # fmt: skip
        if isinstance(stats.get(key), (int, float))
    }
    if "disk_bytes_read" in moves:  # the disk tier's traffic per timed step, and its rate
        step_s = statistics.median(record["step_times_s"]) if record["step_times_s"] else 0.0
        disk = moves["disk_bytes_read"] + moves["disk_bytes_written"]
        record["disk_bytes_per_step"] = disk
        record["disk_bytes_per_s"] = disk / step_s if step_s > 0 else None
        record["disk_file_bytes"] = int(stats["disk_file_bytes"])
        # the chunk files stay until the runner measures and removes the run's folder
    peak, kind = _cuda_peak(ctx)
    if peak is None:
        peak = int(stats["device_chunk_bytes_peak"]) + int(stats["warmup_non_model_peak_bytes"] or 0)
        kind = "chunkstar virtual device: device_chunk_bytes_peak + warmup_non_model_peak_bytes"
    return {
        **record,
        "peak_device_bytes": peak,
        "peak_device_kind": kind,
        "device_budget_bytes": budget,
        "chunkstar_stats": stats,
        "chunk_moves_per_timed_step": moves,
        "optimizer": "chunkstar ChunkAdam (AdamW)",
    }


_NVME_SUB_GROUP_ELEMENTS = 10_000_000
"""ZeRO-3 ``sub_group_size`` with NVMe offload: the optimizer swaps one sub-group's fp32
master, moments and gradient in and out at a time, through four host buffers of the largest
sub-group's size, so DeepSpeed's default (1e9 elements: one sub-group for every model of the CPU
ladder) would bring the whole optimizer state back to the host at once and defeat the offload."""

_AIO: dict[str, Any] = {
    "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
    "overlap_events": True,
}  # fmt: skip
"""DeepSpeed's documented ``aio`` defaults, written out so the record holds them."""


def deepspeed_zero3_offload_config(
    *, batch: int, adamw: dict[str, Any], pin_memory: bool, ds_cpu_adam: bool,
    nvme_path: str | None = None, nvme_params: bool = False, largest_param_numel: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """ZeRO-3 with params and optimizer offloaded to CPU (or, with ``nvme_path``, to disk), bf16, clipping 1.0.

    ``pin_memory`` only helps DMA to a real device; on a CPU-only machine it would
    just lock RAM. With ``ds_cpu_adam`` DeepSpeed builds DeepSpeedCPUAdam(adamw_mode)
    from the ``optimizer`` entry; without it (the C++ op could not be built) the
    caller hands DeepSpeed a torch optimizer, which these keys allow with offload.

    With ``nvme_path`` (ZeRO-Infinity) the optimizer state and gradients are
    swapped to files there, and with ``nvme_params`` the bf16 parameters too
    (``max_in_cpu`` 0: none kept on the host), through ``buffer_count`` host
    buffers each big enough for the largest parameter *and* the largest optimizer
    sub-group (DeepSpeed initialises the fp32 master from those buffers), hence
    ``largest_param_numel``. Shared with ``benchmarks/step_time.py``."""
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": pin_memory},
        "offload_optimizer": {"device": "cpu", "pin_memory": pin_memory},
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if nvme_path is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": pin_memory, "buffer_count": 4}
        zero["sub_group_size"] = _NVME_SUB_GROUP_ELEMENTS
        config["aio"] = dict(_AIO)
    elif nvme_params:
        raise ValueError("nvme_params needs an nvme_path")
    if nvme_params:
        if largest_param_numel < 1:
            raise ValueError("largest_param_numel is needed to size the NVMe parameter buffers")
        zero["offload_param"] = {
            "device": "nvme", "nvme_path": nvme_path, "pin_memory": pin_memory, "buffer_count": 5,
            # a sub-group stops at the first parameter that takes it past sub_group_size
            "buffer_size": _NVME_SUB_GROUP_ELEMENTS + largest_param_numel, "max_in_cpu": 0,
        }  # fmt: skip
        # Each gathered parameter holds one of the buffer_count swap buffers until it is
        # released: no prefetch, and no keeping a parameter for its reuse (DeepSpeed's
        # defaults keep up to 1e9 elements live, and the second step runs out of buffers).
        zero.update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    if ds_cpu_adam:
        config["optimizer"] = {"type": "AdamW", "params": adamw}
    else:
        config["zero_allow_untested_optimizer"] = True
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def largest_param_numel(model: ModelSpec) -> int:
    """Elements of the zoo GPT-2's largest tensor: the tied token embedding ``V*h``, or an MLP matrix ``4h*h``."""
    return max(model.vocab * model.hidden, 4 * model.hidden * model.hidden)


def _require_async_io(builder: Any = None) -> str:
    """Load DeepSpeed's async I/O op (JIT-built on first use: minutes); its module's path, or a RuntimeError saying why not.

    ``builder``: DeepSpeed's ``AsyncIOBuilder()`` for the current accelerator when None."""
    if builder is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise RuntimeError(
            "DeepSpeed's async I/O op (AsyncIOBuilder) cannot be built here: libaio's headers and library "
            "were not found (Debian: apt-get install libaio-dev; `./dev bench` installs it when run as root)"
        )
    try:
        return str(builder.load(verbose=False).__file__)
    except Exception as exc:  # noqa: BLE001  (a compiler or loader failure, said in the record)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise RuntimeError(f"DeepSpeed's async I/O op failed to build or load: {type(exc).__name__}: {first}") from exc


def _run_zero3(ctx: _Context, *, nvme_path: str | None) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with params and optimizer offloaded to CPU, or to ``nvme_path`` (ZeRO-Infinity).

    On CPU: gloo, ``DS_ACCELERATOR=cpu``, DeepSpeedCPUAdam JIT-built (cached
    under ~/.cache/torch_extensions) before timing, torch AdamW if that build
    fails (said in ``notes``). The model is built outside ``zero.Init`` on CPU
    (HF's weight init would otherwise see empty partitions and the weights
    would differ from the other systems'); on CUDA it is built under
    ``zero.Init`` with parameters kept on the offload device, since the paper's
    models do not fit one GPU (or, times eight ranks, the host) unpartitioned.
    """
    if ctx.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _ensure_dist_env()
    import deepspeed
    import torch

    notes: list[str] = []
    extra: dict[str, Any] = {}
    if nvme_path is not None:
        extra["async_io_op"] = _require_async_io()  # before the CPU Adam build: a missing libaio fails in seconds
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        ds_cpu_adam = True
    except Exception as exc:  # noqa: BLE001  (any build failure means: fall back)
        ds_cpu_adam = False
        notes.append(f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}: {exc}); used torch AdamW")

    deepspeed.init_distributed(dist_backend="nccl" if ctx.device == "cuda" else "gloo", auto_mpi_discovery=False)
    config = deepspeed_zero3_offload_config(
        batch=ctx.spec.batch, adamw=_ADAMW, pin_memory=ctx.device == "cuda", ds_cpu_adam=ds_cpu_adam,
        nvme_path=nvme_path, nvme_params=ctx.spec.nvme_params, largest_param_numel=largest_param_numel(ctx.model),
    )  # fmt: skip
    if ctx.device == "cuda":
        torch.cuda.set_device(ctx.local_rank)
        remote = config["zero_optimization"]["offload_param"]["device"]
        with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=config):
            model = ctx.build()
    else:
        model = ctx.build()
    client_optimizer = None if ds_cpu_adam else torch.optim.AdamW(model.parameters(), **_ADAMW)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_optimizer, config=config
    )
    inner = getattr(optimizer, "optimizer", optimizer)

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clipping, optimizer step and zero_grad
        return float(loss.item())

    record = _time_steps(ctx, step)
    peak, kind = _cuda_peak(ctx)
    return {
        **record,
        **extra,
        "peak_device_bytes": peak,
        "peak_device_kind": kind,
        "optimizer": f"{type(optimizer).__name__} over {type(inner).__module__}.{type(inner).__name__}",
        "deepspeed_config": config,
        "notes": notes,
    }


def _run_deepspeed(ctx: _Context) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with offload_param + offload_optimizer to CPU, bf16 (see :func:`_run_zero3`)."""
    return _run_zero3(ctx, nvme_path=None)


def _run_deepspeed_nvme(ctx: _Context) -> dict[str, Any]:
    """DeepSpeed ZeRO-Infinity: ZeRO-3 with the optimizer state (and with ``spec.nvme_params``
    the params) swapped to files, bf16; otherwise as ``deepspeed``.

    The files go to the run's own folder, which the runner makes under
    ``spec.disk_dir`` and removes afterwards (``CHUNKSTAR_BENCH_DISK_DIR``);
    run without the runner, a temporary folder there plays that part. A
    machine without libaio fails in seconds with status ``error`` and the reason.
    """
    given = os.environ.get(DISK_DIR_ENV)
    if given:
        return _run_zero3(ctx, nvme_path=given)
    with tempfile.TemporaryDirectory(prefix="chunkstar-bench-disk-", dir=ctx.spec.disk_dir) as own:
        return _run_zero3(ctx, nvme_path=own)


def _run_fsdp2(ctx: _Context) -> dict[str, Any]:
    """PyTorch FSDP2: ``fully_shard`` per block and at the root, CPU offload, bf16 params.

    ``CPUOffloadPolicy(pin_memory=False)`` on CPU (nothing to DMA to), pinned
    on CUDA; ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``;
    gloo on CPU (a world of one is fine), NCCL on CUDA.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _init_process_group(ctx)
    mesh = init_device_mesh(ctx.device, (ctx.world,))
    model = ctx.build()
    model.train()
    offload = CPUOffloadPolicy(pin_memory=ctx.device == "cuda")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, offload_policy=offload, mp_policy=mp)
    fully_shard(model, mesh=mesh, offload_policy=offload, mp_policy=mp)
    params = list(model.parameters())
    # foreach, not fused: the sharded params are DTensors on the host.
    optimizer = torch.optim.AdamW(params, **_ADAMW, foreach=True)

    def step(ids: Any) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    record = _time_steps(ctx, step)
    peak, kind = _cuda_peak(ctx)
    return {
        **record,
        "peak_device_bytes": peak,
        "peak_device_kind": kind,
        "optimizer": "torch.optim.AdamW(foreach=True) over FSDP2 DTensor shards",
    }


_SYSTEMS: dict[str, Callable[[_Context], dict[str, Any]]] = {
    "chunkstar": _run_chunkstar,
    "chunkstar-disk": _run_chunkstar,
    "deepspeed": _run_deepspeed,
    "deepspeed-nvme": _run_deepspeed_nvme,
    "fsdp2": _run_fsdp2,
    "pytorch": _run_pytorch,
}


def _is_oom(exc: BaseException) -> bool:
    """True for every way the systems report running out of memory (device, budget or host)."""
    if isinstance(exc, MemoryError):
        return True
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"OutOfMemoryError", "DeviceMemoryError"}:
        return True
    text = str(exc).lower()
    return any(marker in text for marker in _OOM_MARKERS)


def run_in_this_process(spec: RunSpec) -> dict[str, Any]:
    """Run ``spec`` here; the per-rank result dict (never raises for a failing system)."""
    ctx = _Context(spec)
    result: dict[str, Any] = {"rank": ctx.rank, "world": ctx.world, "n_params": n_params(ctx.model)}
    try:
        import torch

        if ctx.device == "cpu":
            # Share the cores among the ranks; torchrun would otherwise pin each to 1 thread.
            torch.set_num_threads(spec.threads or max(1, (os.cpu_count() or 1) // ctx.world))
        result.update(_SYSTEMS[spec.system](ctx))
        result["torch_threads"] = torch.get_num_threads()
        result["step_time_s"] = statistics.median(result["step_times_s"])
        result["status"] = "ok"
        result["message"] = ""
    except BaseException as exc:  # noqa: BLE001  (reported in the record, see module docstring)
        if isinstance(exc, KeyboardInterrupt):
            raise
        traceback.print_exc(file=sys.stderr)
        result["status"] = "oom" if _is_oom(exc) else "error"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result["message"] = f"{type(exc).__name__}: {first}"[:500]
    result["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one chunkstar-bench run in this process (per rank).")
    parser.add_argument("--spec", required=True, help="the RunSpec as JSON")
    args = parser.parse_args(argv)
    # Offline by construction: models come from configs, never from the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    spec = RunSpec.from_json(args.spec)
    result = run_in_this_process(spec)
    line = json.dumps(result, default=str)
    out_dir = os.environ.get(RESULT_DIR_ENV)
    if out_dir:
        # a file per rank: under torchrun the ranks share one stdout pipe, and a long
        # line from one rank can be cut by another's writes
        rank = result.get("rank", 0)
        tmp = os.path.join(out_dir, f"rank{rank}.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(line)
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.json"))
    else:
        print(RESULT_PREFIX + line, flush=True)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (teardown of a failed run must not hide its record)
        pass
    # A failed rank exits non-zero so torchrun tears down the other ranks instead of
    # leaving them blocked in a collective.
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
