"""What every system's training loop shares inside a benchmark child: where it runs, the batches, the clock.

A system module (:mod:`chunkstar_bench.systems`) builds its model and optimizer
and hands :func:`timed_record` a ``step(ids) -> loss`` (a torch.optim system ends
its step with :func:`torch_optim_step`); this module supplies the rest: the
:class:`Context` (rank, world, device, the zoo model with its fixed seed, the
token batches), the process-group set-up (one :func:`free_port`), the clock and
the foreign-load measurement (:func:`time_steps`), the CUDA peak, and the record
every system returns (which it may extend). It is not the entry point
(:mod:`chunkstar_bench.child` is) and it knows no system.

Note [what one step is]: the same for every system.
    forward + loss, backward, global-norm gradient clipping at the spec's ``clip``
    (1.0 unless a comparison turns it off with 0), an AdamW
    step (:data:`ADAMW`: lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay
    0.01) and zeroing the gradients, in bf16 compute with fp32 master weights.
    The first ``warmup`` steps run untimed (chunkstar's first iteration is its
    tracer warm-up; the other systems allocate optimizer state lazily); the
    reported step time is the median of the timed steps. On CUDA every step is
    bracketed by ``torch.cuda.synchronize``; on CPU kernels are synchronous.
    Past the forward, the systems differ only where their optimizers do:
    PyTorch and FSDP2 (torch.optim) end the step with :func:`torch_optim_step`;
    chunkstar's optimizer clips in its own step, at the config's
    ``gradient_clipping`` (the spec's ``clip``), and DeepSpeed's ``engine.step()``
    clips there too and zeroes the gradients as well.

The module level imports only the standard library and the torch-free parts of
this package; torch is imported where it is used.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkstar_bench.runner import RunSpec
from chunkstar_bench.zoo import ModelSpec, build_hf, get

__all__ = [
    "ADAMW", "Context", "cuda_peak", "ensure_dist_env", "free_port", "hf_checkpointing", "init_process_group", "progress",
    "time_steps", "timed_record", "torch_optim_step",
]  # fmt: skip

ADAMW: dict[str, Any] = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
"""The optimizer every system gets, in DeepSpeed's (and chunkstar's) JSON shape."""


class Context:
    """Where this rank runs: its rank, the world, the torch device, the model, the batches."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.model: ModelSpec = get(spec.model)
        self.seq = spec.seq
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = "cuda" if spec.device == "cuda" else "cpu"

    def torch_device(self) -> Any:
        import torch

        return torch.device(f"cuda:{self.local_rank}") if self.device == "cuda" else torch.device("cpu")

    def build(self) -> Any:
        """The zoo model in fp32 on the current default device; the same seed gives every system the same weights.
        With the spec's ``hf_checkpointing`` the model checkpoints its own blocks (:func:`hf_checkpointing`)."""
        import torch

        torch.manual_seed(self.spec.seed)
        model = build_hf(self.model)
        if self.spec.hf_checkpointing:
            hf_checkpointing(model)
        return model

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


def hf_checkpointing(model: Any) -> None:
    """Hugging Face's own activation checkpointing on every block of ``model``:
    ``gradient_checkpointing_enable()``, which transformers 5 renamed
    ``activation_checkpointing_enable()`` (the old name still works there, with a FutureWarning);
    non-reentrant by default in both."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def progress(ctx: Context, message: str) -> None:
    """One progress line on stderr (rank 0 only); the runner echoes the per-step ones."""
    if ctx.rank == 0:
        print(f"[{ctx.spec.system} {ctx.spec.model}] {message}", file=sys.stderr, flush=True)


def time_steps(ctx: Context, step: Callable[[Any], float], before_timed: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``step(ids) -> loss`` over every batch; per-step times and losses of the timed steps.

    ``before_timed`` is called once, after the warm-up steps and outside the clock.
    The record also holds the resident set size when the first step starts (the
    system's set-up done) and the foreign CPU load during the timed steps."""
    times: list[float] = []
    losses: list[float] = []
    total = ctx.spec.warmup + ctx.spec.steps
    busy0 = own0 = clock0 = 0.0
    rss_after_setup = _current_rss_bytes()
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
        progress(ctx, f"step {i + 1}/{total} ({kind}) {elapsed:.3f} s, loss {loss:.4f}")
    # Foreign CPU load during the timed steps, in cores: machine-wide busy time
    # minus this process's own, over the wall time. On a 2-core machine one busy
    # foreign core can slow a step several times over; the record says so.
    wall = time.perf_counter() - clock0
    busy1 = _machine_busy_s()
    other = None if busy1 is None or wall <= 0 else max(0.0, (busy1 - busy0 - (_own_cpu_s() - own0)) / wall)
    return {"step_times_s": times, "losses": losses, "other_load_cores": other, "rss_after_setup_bytes": rss_after_setup}


def timed_record(
    ctx: Context, step: Callable[[Any], float], optimizer: str, before_timed: Callable[[], None] | None = None
) -> dict[str, Any]:
    """:func:`time_steps` over ``step``, then the device peak (:func:`cuda_peak`) and ``optimizer``, what
    the record names the optimizer: the per-rank record every system returns, to which it may add its own keys
    (a peak of None is one the system may fill in: Note [peak memory] in :mod:`chunkstar_bench.child`)."""
    record = time_steps(ctx, step, before_timed)
    peak, kind = cuda_peak(ctx)
    return {**record, "peak_device_bytes": peak, "peak_device_kind": kind, "optimizer": optimizer}


def torch_optim_step(loss: Any, params: list[Any], optimizer: Any, clip: float) -> float:
    """The rest of one step (Note [what one step is]) after the forward, for a ``torch.optim`` optimizer:
    backward, global-norm clipping of ``params`` at ``clip`` (0: none), the optimizer step and the
    gradients set to None; the loss as a float."""
    import torch

    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.item())


def _current_rss_bytes() -> int | None:
    """Resident set size right now (``VmRSS``); None where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a one-process rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ensure_dist_env() -> None:
    """A one-process job still needs the env:// rendezvous variables (torchrun sets them otherwise)."""
    if "MASTER_ADDR" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))


def init_process_group(ctx: Context) -> None:
    """``torch.distributed`` for this rank: NCCL on CUDA, gloo on CPU (a world of one is fine)."""
    import torch
    import torch.distributed as dist

    ensure_dist_env()
    if not dist.is_initialized():
        backend = "nccl" if ctx.device == "cuda" else "gloo"
        if ctx.device == "cuda":
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group(backend=backend)


def cuda_peak(ctx: Context) -> tuple[int | None, str | None]:
    """``(torch.cuda.max_memory_allocated, how)`` on CUDA; ``(None, None)`` on CPU."""
    if ctx.device != "cuda":
        return None, None
    import torch

    return int(torch.cuda.max_memory_allocated()), "torch.cuda.max_memory_allocated"
