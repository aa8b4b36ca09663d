"""DeepSpeed under test: ``deepspeed`` (ZeRO-3, params and optimizer offloaded to CPU) and
``deepspeed-nvme`` (ZeRO-Infinity: the optimizer state, and with ``nvme_params`` the params,
swapped to files through DeepSpeed's async I/O op).

On CPU: gloo, ``DS_ACCELERATOR=cpu``, DeepSpeedCPUAdam JIT-built (cached under
``~/.cache/torch_extensions``) before timing, torch AdamW if that build fails
(said in the record's ``notes``). The model is built outside ``zero.Init`` on
CPU (HF's weight init would otherwise see empty partitions and the weights would
differ from the other systems'); on CUDA it is built under ``zero.Init`` with
parameters kept on the offload device, since the paper's models do not fit one
GPU (or, times eight ranks, the host) unpartitioned.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from chunkstar_bench.harness import ADAMW, Context, ensure_dist_env, timed_record
from chunkstar_bench.runner import DISK_DIR_ENV
from chunkstar_bench.zoo import ModelSpec

__all__ = ["largest_param_numel", "require_async_io", "run", "run_nvme", "zero3_offload_config"]

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


def zero3_offload_config(
    *, batch: int, adamw: dict[str, Any], pin_memory: bool, ds_cpu_adam: bool,
    nvme_path: str | None = None, nvme_params: bool = False, largest_param_numel: int = 0, clip: float = 1.0,
) -> dict[str, Any]:  # fmt: skip
    """ZeRO-3 with params and optimizer offloaded to CPU (or, with ``nvme_path``, to disk), bf16, clipping at ``clip`` (0: none).

    ``pin_memory`` only helps DMA to a real device; on a CPU-only machine it would
    just lock RAM. With ``ds_cpu_adam`` DeepSpeed builds DeepSpeedCPUAdam(adamw_mode)
    from the ``optimizer`` entry; without it (the C++ op could not be built) the
    caller hands DeepSpeed a torch optimizer, which these keys allow with offload.

    With ``nvme_path`` (ZeRO-Infinity) the optimizer state and gradients are
    swapped to files there, and with ``nvme_params`` the bf16 parameters too
    (``max_in_cpu`` 0: none kept on the host), through ``buffer_count`` host
    buffers each big enough for the largest parameter *and* the largest optimizer
    sub-group (DeepSpeed initialises the fp32 master from those buffers), hence
    ``largest_param_numel``."""
    zero: dict[str, Any] = {
        "stage": 3,
        "offload_param": {"device": "cpu", "pin_memory": pin_memory},
        "offload_optimizer": {"device": "cpu", "pin_memory": pin_memory},
    }
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
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


def require_async_io(builder: Any = None) -> str:
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


def _run_zero3(ctx: Context, *, nvme_path: str | None) -> dict[str, Any]:
    """ZeRO-3 with params and optimizer offloaded to CPU, or to ``nvme_path`` (ZeRO-Infinity)."""
    if ctx.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_dist_env()
    import deepspeed
    import torch

    notes: list[str] = []
    extra: dict[str, Any] = {}
    if nvme_path is not None:
        extra["async_io_op"] = require_async_io()  # before the CPU Adam build: a missing libaio fails in seconds
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        ds_cpu_adam = True
    except Exception as exc:  # noqa: BLE001  (any build failure means: fall back)
        ds_cpu_adam = False
        notes.append(f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}: {exc}); used torch AdamW")

    deepspeed.init_distributed(dist_backend="nccl" if ctx.device == "cuda" else "gloo", auto_mpi_discovery=False)
    config = zero3_offload_config(
        batch=ctx.spec.batch, adamw=ADAMW, pin_memory=ctx.device == "cuda", ds_cpu_adam=ds_cpu_adam,
        nvme_path=nvme_path, nvme_params=ctx.spec.nvme_params, largest_param_numel=largest_param_numel(ctx.model),
        clip=ctx.spec.clip,
    )  # fmt: skip
    if ctx.device == "cuda":
        torch.cuda.set_device(ctx.local_rank)
        remote = config["zero_optimization"]["offload_param"]["device"]
        with deepspeed.zero.Init(remote_device=remote, config_dict_or_path=config):
            model = ctx.build()
    else:
        model = ctx.build()
    client_optimizer = None if ds_cpu_adam else torch.optim.AdamW(model.parameters(), **ADAMW)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_optimizer, config=config
    )
    inner = getattr(optimizer, "optimizer", optimizer)

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clipping, optimizer step and zero_grad
        return float(loss.item())

    record = timed_record(ctx, step, f"{type(optimizer).__name__} over {type(inner).__module__}.{type(inner).__name__}")
    return {**record, **extra, "deepspeed_config": config, "notes": notes}


def run(ctx: Context) -> dict[str, Any]:
    """``deepspeed``: ZeRO-3 with offload_param + offload_optimizer to CPU, bf16; the per-rank record."""
    return _run_zero3(ctx, nvme_path=None)


def run_nvme(ctx: Context) -> dict[str, Any]:
    """``deepspeed-nvme``: ZeRO-Infinity, the optimizer state (and with ``spec.nvme_params`` the
    params) swapped to files, bf16; otherwise as ``deepspeed``.

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
