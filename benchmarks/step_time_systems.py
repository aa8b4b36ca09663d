"""The four training set-ups timed by ``benchmarks/step_time.py``, one per child process.

This module is what runs *inside* a benchmark child: it builds the same
Hugging Face GPT-2 (same config, same seed, so the same initial weights), feeds
it the same random token batches, times whole training steps, and returns one
JSON-able record. It is not the orchestrator and it prints no table; the parent
(``step_time.py``) starts one child per system, so each child's peak RSS
(``ru_maxrss``) is that system's alone.

The module level imports only the standard library: the parent imports
``RunSpec`` from here without paying for torch, which keeps the parent's RSS
small (a child starts from a fresh ``exec``, but keeping the parent light costs
nothing). torch, transformers, chunkstar and deepspeed are imported inside the
runner that needs them.

Note: what one "step" is, for every system
    forward + loss, backward, global-norm gradient clipping at 1.0, AdamW step
    (lr 1e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on every
    parameter), and zeroing the gradients. The first ``warmup`` steps are run
    and discarded (chunkstar's first iteration is its tracer warm-up; DeepSpeed
    and PyTorch allocate their optimizer state lazily), the next ``steps`` are
    timed one by one with ``time.perf_counter``. On CPU every kernel is
    synchronous, so no device synchronisation is needed around the clock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SYSTEMS: tuple[str, ...] = ("pytorch", "chunkstar", "chunkstar-pressure", "deepspeed")
"""Every system the benchmark knows, in the order they are run and printed."""

RESULT_PREFIX = "STEP_TIME_RESULT "
"""A child's stdout line that starts with this carries its JSON result."""

PROGRESS_PREFIX = "STEP_TIME_PROGRESS "
"""A child's output line that starts with this is echoed live by the parent."""

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything a child needs to run one system; identical for all systems but ``system``."""

    system: str
    """Which set-up to run, one of ``SYSTEMS`` (any label when ``child_main`` is handed the runner)."""
    steps: int
    """Timed steps (the median of these is the reported step time)."""
    warmup: int
    """Steps run before timing starts and left out of every figure but the losses."""
    batch: int
    """Sequences per step."""
    seq: int
    """Tokens per sequence (at most ``n_positions``)."""
    seed: int
    """Seeds the model initialisation and the token batches."""
    n_embd: int
    n_layer: int
    n_head: int
    vocab_size: int
    n_positions: int
    lr: float
    """AdamW learning rate (the other AdamW settings are fixed, see the module Note)."""
    free_budget_bytes: int
    """chunkstar's device budget when there is no pressure (far above the model data)."""
    pressure_fraction: float
    """chunkstar-pressure's budget as a fraction of the model's bf16 parameter bytes."""
    pressure_budget_bytes: int | None = None
    """chunkstar-pressure's budget in bytes; overrides ``pressure_fraction`` when set."""
    threads: int | None = None
    """``torch.set_num_threads`` in every child; None keeps torch's default (one per core)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


# --------------------------------------------------------------------------- shared helpers


def _progress(message: str) -> None:
    """One progress line; the parent echoes these to its stderr while the child runs."""
    print(PROGRESS_PREFIX + message, file=sys.stderr, flush=True)


def _current_rss_mib() -> float:
    """Resident set size right now (``VmRSS``), in MiB; -1 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return -1.0


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu_busy_seconds() -> float | None:
    """CPU seconds all processes on the machine have spent busy since boot (from /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _gpt2_config(spec: RunSpec) -> Any:
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=spec.vocab_size,
        n_positions=spec.n_positions,
        n_embd=spec.n_embd,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    # Named explicitly so transformers does not warn about an unset loss type.
    config.loss_type = "ForCausalLM"
    return config


def build_model(spec: RunSpec) -> Any:
    """The GPT-2 under test, fp32 on CPU; seeding here gives every system the same weights."""
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(spec.seed)
    return GPT2LMHeadModel(_gpt2_config(spec))


def count_parameters(spec: RunSpec) -> int:
    """Exact parameter count (tied ``wte``/``lm_head`` once), from a meta-device model."""
    import torch
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(_gpt2_config(spec))
    return sum(p.numel() for p in model.parameters())


def batches(spec: RunSpec) -> Iterator[Any]:
    """``warmup + steps`` token batches, int64 [batch, seq] on CPU, the same in every child."""
    import torch

    generator = torch.Generator().manual_seed(spec.seed + 1)
    for _ in range(spec.warmup + spec.steps):
        yield torch.randint(0, spec.vocab_size, (spec.batch, spec.seq), generator=generator)


def adamw_params(spec: RunSpec) -> dict[str, Any]:
    """The AdamW settings every system gets, in DeepSpeed's (and chunkstar's) JSON shape."""
    return {"lr": spec.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _time_steps(
    spec: RunSpec, step: Callable[[Any], float], before_timed: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Run ``step(ids) -> loss`` over every batch; times and losses of the timed steps.

    ``before_timed`` is called once, after the warm-up steps and outside the clock.
    """
    losses: list[float] = []
    times: list[float] = []
    total = spec.warmup + spec.steps
    busy0 = own0 = clock0 = 0.0
    for i, ids in enumerate(batches(spec)):
        if i == spec.warmup:
            if before_timed is not None:
                before_timed()
            busy0, own0, clock0 = _cpu_busy_seconds() or 0.0, _own_cpu_seconds(), time.perf_counter()
        start = time.perf_counter()
        loss = step(ids)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        if i >= spec.warmup:
            times.append(elapsed)
        kind = "warm-up" if i < spec.warmup else "timed"
        _progress(f"{spec.system}: step {i + 1}/{total} ({kind}) {elapsed:.3f} s, loss {loss:.4f}")
    # How busy the rest of the machine was during the timed steps, in cores:
    # machine-wide busy CPU time minus this process's own, over the wall time.
    # On a 2-core machine even one foreign busy core can slow a 2-thread torch
    # step several times over, so the report flags it.
    wall = time.perf_counter() - clock0
    busy1 = _cpu_busy_seconds()
    own_cpu = _own_cpu_seconds() - own0
    other_load = None if busy1 is None else max(0.0, (busy1 - busy0 - own_cpu) / wall)
    return {
        "step_times_s": times,
        "losses": losses,
        "timed_cpu_per_wall": own_cpu / wall,
        "other_load_cores": other_load,
    }


# --------------------------------------------------------------------------- the systems


def _run_pytorch(spec: RunSpec) -> dict[str, Any]:
    """Plain PyTorch: fp32 params, bf16 autocast, fused AdamW, global-norm clipping."""
    import torch

    model = build_model(spec)
    model.train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, **adamw_params(spec), fused=True)

    def step(ids: torch.Tensor) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    rss_setup = _current_rss_mib()
    record = _time_steps(spec, step)
    return {**record, "rss_after_setup_mib": rss_setup, "optimizer": "torch.optim.AdamW(fused=True)"}


def import_chunkstar() -> Any:
    """``chunkstar`` as installed, else from this checkout's ``packages/core``."""
    try:
        import chunkstar
    except ImportError:
        sys.path.insert(0, str(_REPO_ROOT / "packages" / "core"))
        import chunkstar
    if not hasattr(chunkstar, "initialize_engine"):
        where = getattr(chunkstar, "__file__", None) or list(getattr(chunkstar, "__path__", []))
        raise RuntimeError(f"chunkstar (from {where}) has no initialize_engine yet")
    return chunkstar


def chunkstar_config(spec: RunSpec, budget: int) -> dict[str, Any]:
    """chunkstar's config for this benchmark: bf16, clipping at 1.0, AdamW, the CPU virtual
    device with a ``budget``-byte device tier, chunk size searched."""
    return {
        "optimizer": {"type": "AdamW", "params": adamw_params(spec)},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": "auto",
    }


def run_chunkstar(spec: RunSpec, *, pressure: bool, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """chunkstar on the CPU virtual device (``device: "cpu"``) under a device memory budget.

    Without pressure the budget is far above everything the step needs; with
    pressure it is ``pressure_fraction`` of the model's bf16 parameter bytes
    (or ``pressure_budget_bytes``), so chunks must be evicted to the host tier
    and fetched back within every step. ``extra_config`` keys are added to
    :func:`chunkstar_config`'s (``benchmarks/overlap.py`` sets ``overlap`` and
    ``device_link_bandwidth`` this way).
    """
    chunkstar = import_chunkstar()

    n_params = count_parameters(spec)
    if pressure and spec.pressure_budget_bytes is not None:
        budget: int = spec.pressure_budget_bytes
    elif pressure:
        budget = int(n_params * 2 * spec.pressure_fraction)
    else:
        budget = spec.free_budget_bytes
    config = {**chunkstar_config(spec, budget), **(extra_config or {})}
    engine, optimizer = chunkstar.initialize_engine(model_func=lambda: build_model(spec), local_rank=0, config=config)

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    rss_setup = _current_rss_mib()
    # Counters are snapshotted after the warm-up so the per-step move figures
    # below describe steady-state steps, not the tracer's warm-up iteration.
    stats_before: dict[str, Any] = {}

    def snapshot() -> None:
        stats_before.update(engine.stats())

    record = _time_steps(spec, step, before_timed=snapshot)
    stats_after = dict(engine.stats())
    per_step = {
        key: (stats_after[key] - stats_before.get(key, 0)) / spec.steps
        for key in ("chunk_moves_to_device", "chunk_moves_to_host", "bytes_to_device", "bytes_to_host")
        if isinstance(stats_after.get(key), (int, float))
    }
    return {
        **record,
        "rss_after_setup_mib": rss_setup,
        "device_budget_bytes": budget,
        "chunkstar_stats": stats_after,
        "chunkstar_moves_per_timed_step": per_step,
        "optimizer": "chunkstar AdamW",
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _deepspeed_config(spec: RunSpec, *, ds_cpu_adam: bool) -> dict[str, Any]:
    """The bench suite's ZeRO-3 offload config (one definition for both benchmarks)."""
    from chunkstar_bench.child import deepspeed_zero3_offload_config

    return deepspeed_zero3_offload_config(
        batch=spec.batch, adamw=adamw_params(spec), pin_memory=False, ds_cpu_adam=ds_cpu_adam
    )


def _run_deepspeed(spec: RunSpec) -> dict[str, Any]:
    """DeepSpeed ZeRO-3, offload of params and optimizer to CPU, bf16, one gloo process."""
    # A one-process "distributed" job: DeepSpeed needs torch.distributed, and
    # the env:// rendezvous reads these. DS_ACCELERATOR=cpu names the accelerator
    # DeepSpeed would auto-select on this machine anyway, without the detection warning.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_SIZE="1",
    )
    import deepspeed
    import torch

    notes: list[str] = []
    # Build (JIT, with ninja + the host compiler, cached under
    # ~/.cache/torch_extensions) or load DeepSpeed's C++ CPU Adam before timing.
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        ds_cpu_adam = True
    except Exception as exc:  # noqa: BLE001  (any build failure means: fall back)
        ds_cpu_adam = False
        notes.append(f"DeepSpeedCPUAdam unavailable ({type(exc).__name__}: {exc}); used torch AdamW(fused)")

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    # Built outside deepspeed.zero.Init on purpose: under zero.Init, transformers'
    # post-init weight initialisation sees already-partitioned (empty) params and
    # leaves torch's defaults (N(0, 1) embeddings, loss ~300 instead of ~10.8),
    # and the weights would differ from the other systems'. deepspeed.initialize
    # partitions and offloads the finished model instead.
    model = build_model(spec)
    config = _deepspeed_config(spec, ds_cpu_adam=ds_cpu_adam)
    client_optimizer = None
    if not ds_cpu_adam:
        client_optimizer = torch.optim.AdamW(model.parameters(), **adamw_params(spec), fused=True)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=client_optimizer, config=config
    )
    inner = getattr(optimizer, "optimizer", optimizer)

    def step(ids: torch.Tensor) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()  # clipping, optimizer step and zero_grad
        return float(loss.item())

    rss_setup = _current_rss_mib()
    record = _time_steps(spec, step)
    return {
        **record,
        "rss_after_setup_mib": rss_setup,
        "optimizer": f"{type(optimizer).__name__} over {type(inner).__module__}.{type(inner).__name__}",
        "deepspeed_config": config,
        "notes": notes,
    }


_RUNNERS: dict[str, Callable[[RunSpec], dict[str, Any]]] = {
    "pytorch": _run_pytorch,
    "chunkstar": lambda spec: run_chunkstar(spec, pressure=False),
    "chunkstar-pressure": lambda spec: run_chunkstar(spec, pressure=True),
    "deepspeed": _run_deepspeed,
}


def child_main(spec: RunSpec, runner: Callable[[RunSpec], dict[str, Any]] | None = None) -> int:
    """Run one system and print its record as one ``RESULT_PREFIX`` line on stdout.

    ``runner`` replaces the one ``SYSTEMS`` names for ``spec.system`` (how
    ``benchmarks/overlap.py`` runs chunkstar with its own config keys under the
    same timing, error handling and peak-RSS measurement). A failure is
    reported in the record (``status: "error: ..."``, traceback on stderr)
    rather than by crashing, so the parent can print the other rows.
    """
    # Offline by construction: models come from configs, never from the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    result: dict[str, Any] = {"system": spec.system}
    try:
        import torch

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        result["n_params"] = count_parameters(spec)
        result.update((runner or _RUNNERS[spec.system])(spec))
        result["torch_threads"] = torch.get_num_threads()  # after the run: a system may change it
        times = result["step_times_s"]
        result["median_step_s"] = statistics.median(times)
        result["min_step_s"] = min(times)
        result["max_step_s"] = max(times)
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001  (reported, not raised: see docstring)
        traceback.print_exc(file=sys.stderr)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        result["status"] = f"error: {type(exc).__name__}: {message}"[:300]
    result["peak_rss_mib"] = _peak_rss_mib()
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)
    return 0
