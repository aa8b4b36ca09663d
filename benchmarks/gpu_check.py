"""``./dev gpu-check``: chunkstar on one CUDA GPU, in one table, within 8 minutes.

What it runs
    * **parity under eviction**: a small GPT-2 trained a few steps by chunkstar
      under a device budget that forces chunk moves in every step, against
      plain PyTorch on the same seed and batches. fp32: the losses must agree
      to 1e-5 relative and the final parameters (chunkstar's fp32 masters) to
      1e-6 + 1e-5 |p| (the test suite's tolerances); bf16: chunkstar's bf16 chunks against PyTorch's
      autocast bf16 with fp32 weights, losses within 3e-2 relative. A row whose
      engine moved no chunk to the device in some step FAILs: it proved nothing.
    * **step time** of a GPT-2 of 1.56B parameters (GPT-2 XL's shape) and of
      6.16B (the zoo's ``GPT3_6B``), bf16: once under a budget that holds all
      the model data (the no-movement reference, where it fits), and twice
      under a budget that leaves the chunks room for only ``--room-fraction``
      of the bf16 param bytes beside the non-model peak the reference measured
      (far below the 14 bytes/param of model data, so param chunks move in
      every forward and backward and all Adam state stays on the host), with
      ``overlap`` true and false. Reported: median s/step, TFLOPS (Megatron's
      count without recompute, :mod:`chunkstar_bench.flops`), bytes moved per
      step (``bytes_to_device + bytes_to_host`` of ``engine.stats()``) and the
      share of copy time hidden behind compute,
      ``(t_serial - t_overlap) / (t_serial - t_resident)`` clamped to [0, 1].
      The denominator also holds the host Adam time that the pressured runs
      pay and the resident one does not, so it understates the copies hidden.

How it keeps to 8 minutes
    Each row runs in its own subprocess (GPU memory and pinned host memory go
    back when it exits), under a per-run timeout cut to what is left of a
    global deadline (``--deadline-s``); a row that times out, fails or is not
    started in time prints its reason in the table. The parent samples each
    child's resident memory and kills it past ``--host-mem-cap-gib``.

Note: host memory of the big models
    Models are built directly on the device (``with torch.device(...)``, Hugging
    Face's own initialisation): on the GPU that takes seconds where 6.16B normal
    draws on the CPU take minutes, and the host never holds an fp32 copy of
    the model. The engine copies the parameters into host chunks chunk by
    chunk, freeing each parameter's GPU storage as it goes, so host memory
    peaks at the chunks' own bytes (14 per parameter: 84 GiB for 6.16B).
    Only the param chunks (2 bytes per parameter) are pinned, in exactly-sized
    buffers the engine registers with the driver (``chunkstar/device/pinned.py``;
    PyTorch's caching host allocator would round each up to a power of two),
    so the throughput runs keep ``"auto"`` chunk sizes.

    python benchmarks/gpu_check.py                      # one CUDA GPU
    python benchmarks/gpu_check.py --smoke              # the same code on the CPU virtual device, tiny models
    python benchmarks/gpu_check.py --json runs/gpu_check.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

_REPO = Path(__file__).resolve().parent.parent
for _pkg in ("core", "bench"):
    if str(_REPO / "packages" / _pkg) not in sys.path:
        sys.path.insert(0, str(_REPO / "packages" / _pkg))

from chunkstar_bench import flops  # noqa: E402  (torch-free; after the path set-up above)
from chunkstar_bench.systems.chunkstar import chunkstar_budget_bytes  # noqa: E402  (torch-free too)
from chunkstar_bench.watch import watch  # noqa: E402
from chunkstar_bench.zoo import ModelSpec, get, n_params  # noqa: E402

_RESULT = "GPU_CHECK_RESULT "
_PROGRESS = "GPU_CHECK_PROGRESS "

_SEED = 0
_ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
_CLIP = 1.0
_SLACK = {"cuda": 0.1, "cpu": 0.0}
"""device_memory_slack of the throughput runs: the engine's own defaults, written out so the record shows them."""

# parity tolerances: the test suite's (tests/core/test_parity.py, tests/core/test_cuda.py)
_LOSS_RTOL = {"fp32": 1e-5, "bf16": 3e-2}
_PARAM_RTOL, _PARAM_ATOL = 1e-5, 1e-6
_PARITY_ROOM = 0.5
"""Parity budget: room for this share of the param bytes beside the measured non-model peak."""
_PARITY_STEPS = 4

_PARITY_MODEL = ModelSpec(name="gpt2-14.7m", hidden=512, layers=4, heads=8, seq_len=32, vocab=4096,
                          note="params dominate activations at 2 x 32 tokens, so a budget can force eviction")  # fmt: skip
_GPU_MODELS: tuple[tuple[ModelSpec, int], ...] = (
    (ModelSpec(name="GPT2-XL", hidden=1600, layers=48, heads=25, seq_len=1024, note="GPT-2 XL shape"), 4),
    (get("GPT3_6B"), 2),  # batch 2: 86 GB of model data and the activations fit the resident run on 141 GB
)
_SMOKE_MODELS: tuple[tuple[ModelSpec, int], ...] = (
    (ModelSpec(name="tiny-a", hidden=128, layers=2, heads=4, seq_len=64, vocab=1024), 2),
    (ModelSpec(name="tiny-b", hidden=192, layers=3, heads=4, seq_len=64, vocab=1024), 2),
)
_MODES = ("resident", "overlap", "serial")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One row of the table: what its subprocess runs."""

    name: str
    """The row's label."""
    kind: str
    """``parity`` or ``throughput``."""
    device: str
    """``cuda`` or ``cpu`` (the virtual device of ``--smoke``)."""
    model: ModelSpec
    batch: int
    precision: str
    """``fp32`` or ``bf16``."""
    warmup: int
    steps: int
    timeout_s: float
    mode: str = ""
    """Throughput only: ``resident``, ``overlap`` or ``serial``."""
    budget: int | None = None
    """Throughput only: device_memory_budget in bytes; None on cuda = the GPU's own size."""
    budget_note: str = ""
    threads: int | None = None
    """torch threads in the child; None: torch's own choice (all cores, for host Adam)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> Plan:
        raw = json.loads(text)
        return Plan(**{**raw, "model": ModelSpec(**raw["model"])})


# --------------------------------------------------------------------------- the child


def _progress(plan: Plan, message: str) -> None:
    print(f"{_PROGRESS}{plan.name}: {message}", file=sys.stderr, flush=True)


def _build(spec: ModelSpec, device: Any) -> Any:
    """The Hugging Face GPT-2 of ``spec``, initialised on ``device`` from the fixed seed."""
    import torch

    from chunkstar_bench.zoo import build_hf

    torch.manual_seed(_SEED)
    with torch.device(device):
        return build_hf(spec)


def _batches(plan: Plan, device: Any, count: int) -> list[Any]:
    import torch

    gen = torch.Generator().manual_seed(_SEED + 1)
    shape = (plan.batch, plan.model.seq_len)
    return [torch.randint(0, plan.model.vocab, shape, generator=gen).to(device) for _ in range(count)]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: Any) -> int:
    """Device bytes the CUDA allocator holds for tensors now (0 on the cpu virtual device,
    whose non-model probe counts only what the engine's own warm-up allocates)."""
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _release(device: Any) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _engine_step(engine: Any, optimizer: Any, ids: Any) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.item())


def _base_config(plan: Plan) -> dict[str, Any]:
    config: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": _ADAMW},
        "gradient_clipping": _CLIP,
        "device": plan.device,
    }
    if plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _reference(plan: Plan, device: Any, batches: list[Any]) -> tuple[list[float], dict[str, Any]]:
    """Plain PyTorch: fp32 weights (bf16 through autocast), fused AdamW, global-norm clipping.
    Its losses and final parameters (fp32, on the CPU)."""
    import torch

    model = _build(plan.model, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=_ADAMW["lr"], betas=tuple(_ADAMW["betas"]), eps=_ADAMW["eps"],
                            weight_decay=_ADAMW["weight_decay"], fused=True)  # fmt: skip
    losses: list[float] = []
    for ids in batches:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=plan.precision == "bf16"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), _CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.item()))
    return losses, {name: p.detach().float().cpu() for name, p in model.named_parameters()}


def _non_model_peak(plan: Plan, device: Any, config: dict[str, Any], ids: Any) -> int:
    """What chunkstar's warm-up measures beside the chunks for this model and batch, with
    everything resident (the GPU's own size, or a virtual device far above the model data)."""
    import chunkstar

    base = _allocated(device)
    roomy = {} if device.type == "cuda" else {"device_memory_budget": 8 * 14 * n_params(plan.model) + (256 << 20)}
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(plan.model, device), 0, {**config, **roomy})
    _engine_step(engine, optimizer, ids)
    return max(0, int(engine.stats()["warmup_non_model_peak_bytes"]) - base)


def _train_under(plan: Plan, device: Any, config: dict[str, Any], batches: list[Any], budget: int) -> dict[str, Any]:
    """chunkstar under ``budget``: losses, moves to the device per step, fp32 masters, stats."""
    import chunkstar

    engine, optimizer = chunkstar.initialize_engine(
        lambda: _build(plan.model, device), 0, {**config, "device_memory_budget": budget}
    )
    losses: list[float] = []
    moves: list[int] = []
    for ids in batches:
        losses.append(_engine_step(engine, optimizer, ids))
        moves.append(int(engine.stats()["chunk_moves_to_device"]) - sum(moves))
    return {"losses": losses, "moves": moves, "masters": engine.state_dict(), "stats": dict(engine.stats())}


def _parity(plan: Plan) -> dict[str, Any]:
    """PyTorch; chunkstar with everything resident (to measure its non-model peak); chunkstar
    under a budget of that peak plus half the param bytes; the two compared."""
    import torch

    import chunkstar

    device = torch.device(plan.device)
    # Deterministic kernels on both sides: GPT-2's key bias has a gradient of pure rounding
    # noise (softmax ignores a per-row constant), and Adam turns the sign of noise into a full
    # lr-sized step, so a non-deterministic attention backward alone would break fp32 parity.
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    batches = _batches(plan, device, plan.steps)
    want, want_params = _reference(plan, device, batches)
    _release(device)
    _progress(plan, f"PyTorch losses {', '.join(f'{x:.4f}' for x in want)}")

    config = {**_base_config(plan), "default_chunk_size": "auto", "device_memory_slack": 0.0}
    non_model = _non_model_peak(plan, device, config, batches[0])
    _release(device)
    param_bytes = n_params(plan.model) * (4 if plan.precision == "fp32" else 2)
    base = _allocated(device)  # what the process holds besides an engine (the batches, cuBLAS workspaces)
    margin = (8 << 20) if device.type == "cuda" else (1 << 20)
    budget = base + int(1.25 * non_model) + margin + int(_PARITY_ROOM * param_bytes)
    raised_from: int | None = None
    try:
        run = _train_under(plan, device, config, batches, budget)
    except chunkstar.DeviceMemoryError as exc:
        # One retry at the smallest budget the engine says holds what it measured: a one-off GPU
        # run should report parity, not this script's margin. The moves check still applies.
        if exc.minimum is None or exc.minimum <= budget:
            raise
        _progress(plan, f"budget {_fmt_bytes(budget)} too small ({exc.where}); retrying at the engine's minimum")
        raised_from, budget = budget, int(exc.minimum * 1.02)
        run = None
    if run is None:
        _release(device)  # the failed engine (held by the exception's traceback until here)
        run = _train_under(plan, device, config, batches, budget)
    got, moves = run["losses"], run["moves"]
    _progress(plan, f"chunkstar losses {', '.join(f'{x:.4f}' for x in got)}; moves to device per step {moves}")

    loss_abs = max(abs(g - w) for g, w in zip(got, want))
    loss_rel = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    param_abs, params_close = 0.0, True
    for name, w in want_params.items():
        diff = (run["masters"][name].float() - w).abs()
        param_abs = max(param_abs, float(diff.max()))
        params_close = params_close and bool((diff <= _PARAM_ATOL + _PARAM_RTOL * w.abs()).all())
    failures: list[str] = []
    if not all(math.isfinite(x) for x in got):
        failures.append("non-finite loss")
    if loss_rel > _LOSS_RTOL[plan.precision]:
        failures.append(f"losses differ by {loss_rel:.2e} relative > {_LOSS_RTOL[plan.precision]:g}")
    if plan.precision == "fp32" and not params_close:
        failures.append(f"parameters differ beyond {_PARAM_ATOL:g} + {_PARAM_RTOL:g}*|p|")
    if min(moves) <= 0:
        failures.append(f"no chunk moved to the device in some step (per step: {moves})")
    return {
        "status": "ok",
        "verdict": "FAIL" if failures else "PASS",
        "failures": failures,
        "losses": got,
        "reference_losses": want,
        "max_abs_loss_diff": loss_abs,
        "max_rel_loss_diff": loss_rel,
        "max_abs_param_diff": param_abs,
        "moves_to_device_per_step": moves,
        "budget_bytes": budget,
        "budget_raised_from": raised_from,
        "non_model_peak_bytes": non_model,
        "param_bytes": param_bytes,
        "chunkstar_stats": run["stats"],
    }


def _throughput(plan: Plan) -> dict[str, Any]:
    import torch

    import chunkstar

    device = torch.device(plan.device)
    spec = plan.model
    n = n_params(spec)
    slack = _SLACK[device.type]
    if plan.mode == "resident" and device.type == "cuda":
        total = int(torch.cuda.mem_get_info(device)[1])
        need = 14 * n + chunkstar_budget_bytes(spec, plan.batch, spec.seq_len, "params:0")
        if need > total * (1 - slack):
            return {"status": "skipped", "message": f"does not fit: ~{_fmt_bytes(need)} of model data and activations, "
                    f"{_fmt_bytes(int(total * (1 - slack)))} usable"}  # fmt: skip
    config = {
        **_base_config(plan),
        "overlap": plan.mode != "serial",
        "default_chunk_size": "auto",
        "device_memory_slack": slack,
    }
    if plan.budget is not None:
        config["device_memory_budget"] = plan.budget
    t0 = time.perf_counter()
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(spec, device), 0, config)
    _release(device)  # the model's fp32 blocks, freed into the allocator's cache as the engine took them
    init_s = time.perf_counter() - t0
    _progress(plan, f"engine built in {init_s:.1f} s ({engine.stats()['n_chunks']} chunks); host RSS "
              f"{_fmt_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)} peak")  # fmt: skip

    times: list[float] = []
    losses: list[float] = []
    before: dict[str, Any] = {}
    total_steps = plan.warmup + plan.steps
    for i, ids in enumerate(_batches(plan, device, total_steps)):
        if i == plan.warmup:
            before = dict(engine.stats())
        _sync(device)
        start = time.perf_counter()
        losses.append(_engine_step(engine, optimizer, ids))
        _sync(device)
        elapsed = time.perf_counter() - start
        if i >= plan.warmup:
            times.append(elapsed)
        _progress(plan, f"step {i + 1}/{total_steps} ({'timed' if i >= plan.warmup else 'warm-up'}) "
                  f"{elapsed:.3f} s, loss {losses[-1]:.4f}")  # fmt: skip
    stats = dict(engine.stats())
    per_step = {
        key: (int(stats[key]) - int(before.get(key, 0))) / plan.steps
        for key in ("bytes_to_device", "bytes_to_host", "chunk_moves_to_device", "chunk_moves_to_host")
    }
    median = statistics.median(times)
    tflops = flops.tflops(flops.megatron_flops(spec, plan.batch, False, seq=spec.seq_len), median)
    return {
        "status": "ok",
        "step_times_s": times,
        "median_step_s": median,
        "tflops": tflops,
        "losses": losses,
        "bytes_moved_per_step": per_step["bytes_to_device"] + per_step["bytes_to_host"],
        "per_timed_step": per_step,
        "non_model_peak_bytes": stats.get("warmup_non_model_peak_bytes"),
        "init_s": init_s,
        "config": config,
        "chunkstar_stats": stats,
    }


def _is_oom(exc: BaseException) -> bool:
    names = {cls.__name__ for cls in type(exc).__mro__}
    return isinstance(exc, MemoryError) or bool(names & {"OutOfMemoryError", "DeviceMemoryError"})


def _child(plan: Plan) -> dict[str, Any]:
    """Run ``plan`` here; a result record, never an exception."""
    import torch

    result: dict[str, Any] = {"name": plan.name}
    if plan.threads is not None:
        torch.set_num_threads(plan.threads)
    try:
        result.update(_parity(plan) if plan.kind == "parity" else _throughput(plan))
    except Exception as exc:  # noqa: BLE001  (the record carries the reason; the traceback goes to stderr)
        traceback.print_exc(file=sys.stderr)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        message = f"{type(exc).__name__}: {first}"[:300]
        if getattr(exc, "minimum", None) is not None:  # a DeviceMemoryError that knows what would fit
            message += f" ... smallest budget that fits: {exc.minimum} bytes"  # type: ignore[attr-defined]
        result.update(status="oom" if _is_oom(exc) else "error", message=message)
    result["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if plan.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["device_name"] = props.name
        result["device_total_bytes"] = int(props.total_memory)
    else:
        result["device_name"] = "cpu (chunkstar's virtual device)"
    return result


# --------------------------------------------------------------------------- the parent


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _run_child(plan: Plan, timeout_s: float, cap_bytes: int, why_limit: str) -> dict[str, Any]:
    """``plan`` in a fresh interpreter, watched for time and host memory; its record or the reason it has none."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if plan.kind == "parity":  # deterministic cuBLAS (read when CUDA starts); the timed runs keep the default
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", plan.to_json()]
    tail: collections.deque[str] = collections.deque(maxlen=20)
    records: list[dict[str, Any]] = []

    def on_line(line: str) -> None:
        if line.startswith(_RESULT):
            try:
                records.append(json.loads(line[len(_RESULT):]))
            except json.JSONDecodeError:
                tail.append(line[:200])
        elif line.startswith(_PROGRESS):
            print(f"  {line[len(_PROGRESS):]}", file=sys.stderr, flush=True)
        elif line.strip():
            tail.append(line)

    done = watch(command, env, on_line, timeout_s, cap_bytes)
    returncode, sampled_peak, wall = done.returncode, done.sampled_peak_rss_bytes, done.wall_s
    killed: tuple[str, str] | None = None  # (status, why)
    if done.timed_out:
        killed = "timeout", f"killed after {timeout_s:.0f} s ({why_limit})"
    elif done.killed_for is not None:
        killed = "oom", f"killed: {done.killed_for}"
    if records and killed is None:
        record = records[-1]
    else:
        if killed is None:  # SIGKILL from outside is most often the kernel's OOM killer
            killed = "error", f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        last = next((line for line in reversed(tail) if line.strip()), "")
        message = killed[1] + (f"; last output: {last}" if last else "")
        record = {"name": plan.name, "status": killed[0], "message": message[:400]}
    if record.get("status") not in ("ok", "skipped"):
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    record["wall_s"] = wall
    record["sampled_peak_rss_bytes"] = sampled_peak
    return record


def _plans(args: argparse.Namespace) -> list[Plan]:
    device = "cpu" if args.smoke else "cuda"
    # One compute thread on the CPU check: tiny ops on a shared 2-core machine otherwise stall
    # for up to a second per step whenever another process takes a core from torch's pool.
    threads = 1 if args.smoke else None
    parity_timeout = 180.0 if args.smoke else 120.0
    plans = [
        Plan(name=f"parity {precision}", kind="parity", device=device, model=_PARITY_MODEL, batch=2,
             precision=precision, warmup=0, steps=_PARITY_STEPS, timeout_s=parity_timeout, threads=threads)  # fmt: skip
        for precision in ("fp32", "bf16")
    ]
    for spec, batch in _SMOKE_MODELS if args.smoke else _GPU_MODELS:
        big = n_params(spec) > 3e9
        timeout = 180.0 if args.smoke else 240.0 if big else 150.0
        for mode in _MODES:
            plans.append(Plan(name=f"{spec.name} {mode}", kind="throughput", device=device, model=spec, batch=batch,
                              precision="bf16", warmup=args.warmup, steps=args.steps, timeout_s=timeout, mode=mode,
                              threads=threads))  # fmt: skip
    return plans


def _pressure_budget(plan: Plan, resident: dict[str, Any] | None, room: float) -> tuple[int, str]:
    """Room for ``room`` x the bf16 param bytes beside the non-model peak the resident run
    measured (the bench's activation estimate when it has none), over (1 - slack)."""
    slack = _SLACK[plan.device]
    param_bytes = 2 * n_params(plan.model)
    measured = (resident or {}).get("non_model_peak_bytes")
    if resident is not None and resident.get("status") == "ok" and measured:
        non_model, how = int(1.1 * int(measured)), f"1.1 x the measured non-model peak {_fmt_bytes(int(measured))}"
    else:
        full = chunkstar_budget_bytes(plan.model, plan.batch, plan.model.seq_len, "params:0")
        non_model, how = full, f"the estimated activations {_fmt_bytes(full)} (no resident measurement)"
    budget = int((non_model + room * param_bytes) / (1 - slack))
    note = (f"budget {_fmt_bytes(budget)} = ({how} + {room:g} x {_fmt_bytes(param_bytes)} bf16 params) / "
            f"(1 - slack {slack:g}); model data {_fmt_bytes(14 * n_params(plan.model))}")  # fmt: skip
    return budget, note


def _resident_budget(plan: Plan) -> tuple[int | None, str]:
    if plan.device == "cuda":
        return None, "budget: the GPU's own size (no device_memory_budget)"
    budget = 8 * 14 * n_params(plan.model) + (256 << 20)
    return budget, f"budget {_fmt_bytes(budget)} (far above the model data)"


def _hidden(results: dict[str, dict[str, Any]], model: str) -> str:
    """(t_serial - t_overlap) / (t_serial - t_resident), clamped; n/a without a usable reference."""
    r, o, s = (results.get(f"{model} {mode}", {}) for mode in _MODES)
    if not all(x.get("status") == "ok" for x in (r, o, s)):
        return "n/a"
    if r["bytes_moved_per_step"] > 0:
        return "n/a"  # the "resident" run moved chunks: not a no-movement reference
    denominator = s["median_step_s"] - r["median_step_s"]
    if denominator <= 0:
        return "n/a"
    return f"{min(1.0, max(0.0, (s['median_step_s'] - o['median_step_s']) / denominator)):.2f}"


def _row(plan: Plan, r: dict[str, Any], hidden: str) -> list[str]:
    status = r.get("status", "error")
    if status != "ok":
        return [plan.name, "SKIP" if status == "skipped" else status.upper(), "-", "-", "-", "-", r.get("message", "")]
    if plan.kind == "parity":
        tol = f"tol {_LOSS_RTOL[plan.precision]:g} rel"
        param = (f"max|dparam| {r['max_abs_param_diff']:.2e} "
                 + ("(info)" if plan.precision == "bf16" else f"(tol {_PARAM_ATOL:g} + {_PARAM_RTOL:g}|p|)"))  # fmt: skip
        notes = (f"max|dloss| {r['max_abs_loss_diff']:.2e} ({r['max_rel_loss_diff']:.1e} rel, {tol}); {param}; "
                 f"moves to device per step {r['moves_to_device_per_step']}; budget {_fmt_bytes(r['budget_bytes'])} "
                 f"< params {_fmt_bytes(r['param_bytes'])} + non-model {_fmt_bytes(r['non_model_peak_bytes'])}")  # fmt: skip
        if r.get("budget_raised_from"):
            notes += f" (raised from {_fmt_bytes(r['budget_raised_from'])} after a DeviceMemoryError)"
        if r["failures"]:
            notes += "; FAILED: " + "; ".join(r["failures"])
        return [plan.name, r["verdict"], "-", "-", "-", "-", notes]
    mfu = flops.mfu(r["tflops"], r.get("device_name", "cpu"))
    moves = r["per_timed_step"]
    notes = f"{moves['chunk_moves_to_device']:.0f}/{moves['chunk_moves_to_host']:.0f} chunk moves to device/host per step"
    if mfu is not None:
        notes += f"; MFU {mfu:.1%}"
    if plan.mode == "resident" and r["bytes_moved_per_step"] > 0:
        notes += "; moved chunks: not a no-movement reference"
    if r["chunkstar_stats"].get("schedule") != "frozen":
        notes += f"; schedule {r['chunkstar_stats'].get('schedule')}"
    tflops = f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}"
    return [plan.name, "ok", f"{r['median_step_s']:.3f}", tflops, _fmt_bytes(r["bytes_moved_per_step"]), hidden, notes]


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]
    numeric = {2, 3, 4, 5}

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _report(args: argparse.Namespace, plans: list[Plan], results: dict[str, dict[str, Any]], versions: dict[str, str]) -> str:
    device = next((r["device_name"] for r in results.values() if "device_name" in r), "(no run reached the device)")
    total = next((r["device_total_bytes"] for r in results.values() if "device_total_bytes" in r), None)
    hidden = {plan.model.name: _hidden(results, plan.model.name) for plan in plans if plan.kind == "throughput"}
    rows = [_row(p, results[p.name], hidden[p.model.name] if p.mode == "overlap" else "-") for p in plans]
    head = [
        f"chunkstar gpu-check{' --smoke' if args.smoke else ''}: {device}"
        + (f", {total / 2**30:.1f} GiB" if total else "")
        + f"; torch {versions.get('torch')}, transformers {versions.get('transformers')}, chunkstar {versions.get('chunkstar')}",
        f"parity: {_PARITY_MODEL.name} (h {_PARITY_MODEL.hidden}, {_PARITY_MODEL.layers} layers, vocab {_PARITY_MODEL.vocab}), "
        f"batch 2 x {_PARITY_MODEL.seq_len}, {_PARITY_STEPS} steps, AdamW lr {_ADAMW['lr']:g}, clipping {_CLIP:g}",
        f"throughput: bf16, {args.warmup} warm-up + {args.steps} timed steps; TFLOPS by {flops.FORMULA_MEGATRON}; "
        f"hidden = (t_serial - t_overlap) / (t_serial - t_resident), clamped to [0, 1]",
    ]
    details: list[str] = []
    for p in plans:
        r = results[p.name]
        parts: list[str] = []
        if p.kind == "throughput":
            parts += [f"{_fmt_count(n_params(p.model))} params, batch {p.batch} x {p.model.seq_len}", p.budget_note]
            if r.get("status") == "ok":
                parts.append(f"chunks of {r['config']['default_chunk_size']} elements x {r['chunkstar_stats']['n_chunks']}, "
                             f"engine built in {r['init_s']:.0f} s")  # fmt: skip
        if "wall_s" not in r:  # never started
            details.append(f"{p.name}: " + "; ".join(x for x in parts if x))
            continue
        peak_host = max(r.get("peak_host_bytes") or 0, r.get("sampled_peak_rss_bytes") or 0)
        stats = r.get("chunkstar_stats") or {}
        parts.append(f"peak host RSS {_fmt_bytes(peak_host)}" + (
            f", device peaks: chunks {_fmt_bytes(stats['device_chunk_bytes_peak'])}, non-model "
            f"{_fmt_bytes(stats.get('warmup_non_model_peak_bytes') or 0)} (engine.stats())" if stats else ""))  # fmt: skip
        parts.append(f"{r.get('wall_s', 0):.0f} s in all")
        details.append(f"{p.name}: " + "; ".join(x for x in parts if x))
    body = _table(["run", "status", "s/step", "TFLOPS", "moved/step", "hidden", "notes"], rows)
    return "\n".join([*head, "", body, "", *details])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="the same runs on the CPU virtual device with tiny models (what the CPU test runs)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per throughput run (the engine traces two)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per throughput run")
    ap.add_argument("--room-fraction", type=float, default=0.5,
                    help="under pressure, the chunks' room beside the non-model peak, in bf16 param bytes")  # fmt: skip
    ap.add_argument("--deadline-s", type=float, help="global deadline in seconds (default 435 on a GPU, 600 with --smoke)")
    ap.add_argument("--host-mem-cap-gib", type=float, default=110.0, help="kill a run whose resident memory passes this")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write plans, results and versions here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or not 0 < args.room_fraction < 1:
        ap.error("--steps must be >= 1, --warmup >= 0 and --room-fraction in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child is not None:
        plan = Plan.from_json(args.child)
        print(_RESULT + json.dumps(_child(plan), default=str), flush=True)
        return 0

    import torch  # the parent only asks whether CUDA is there (no context, no device memory)

    if not args.smoke and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "it needs one, or run `python benchmarks/gpu_check.py --smoke` for the CPU check", file=sys.stderr)  # fmt: skip
        return 2
    from chunkstar_bench.runner import git_commit, versions

    start = time.monotonic()
    deadline = start + (args.deadline_s if args.deadline_s is not None else 600.0 if args.smoke else 435.0)
    plans = _plans(args)
    results: dict[str, dict[str, Any]] = {}
    for i, plan in enumerate(plans):
        label = f"[gpu-check {i + 1}/{len(plans)}] {plan.name}"
        if plan.kind == "throughput":
            if plan.mode == "resident":
                budget, note = _resident_budget(plan)
            else:
                budget, note = _pressure_budget(plan, results.get(f"{plan.model.name} resident"), args.room_fraction)
            plan = dataclasses.replace(plan, budget=budget, budget_note=note)
            plans[i] = plan
        left = deadline - time.monotonic()
        if left < min(30.0, plan.timeout_s / 4):
            why = f"not started: {max(0.0, left):.0f} s left of the global deadline"
            results[plan.name] = {"status": "skipped", "message": why}
            print(f"{label}: not started (global deadline)", file=sys.stderr, flush=True)
            continue
        timeout, why = (plan.timeout_s, "the per-run limit") if plan.timeout_s <= left else (left, "the global deadline")
        print(f"{label} ... (limit {timeout:.0f} s)", file=sys.stderr, flush=True)
        r = _run_child(plan, timeout, int(args.host_mem_cap_gib * 2**30), why)
        results[plan.name] = r
        summary = r.get("verdict") or r.get("status", "error")
        if r.get("status") == "ok" and plan.kind == "throughput":
            summary = f"{r['median_step_s']:.3f} s/step"
        elif r.get("status") != "ok":
            summary += f": {r.get('message', '')}"
        print(f"{label}: {summary} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)

    found = versions()
    print(_report(args, plans, results, found))
    print(f"total {time.monotonic() - start:.0f} s", file=sys.stderr)
    if args.json is not None:
        document = {
            "benchmark": "gpu_check",
            "created_unix": time.time(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
            "versions": found,
            "git_commit": git_commit(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "flops_formula": flops.FORMULA_MEGATRON,
            "plans": [dataclasses.asdict(p) for p in plans],
            "results": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    # 0: every row ran (a resident run that does not fit the GPU is not a failure) and parity passed
    good = [
        r.get("status") == "ok" and r.get("verdict", "PASS") == "PASS"
        or (p.mode == "resident" and r.get("status") == "skipped" and str(r.get("message")).startswith("does not fit"))
        for p, r in ((p, results[p.name]) for p in plans)
    ]
    return 0 if all(good) else 1


if __name__ == "__main__":
    sys.exit(main())
