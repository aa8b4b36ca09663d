"""``./dev gpu-check``: chunkstar on one CUDA GPU, in one table, well inside 7 minutes.

Written for a GPU machine nobody has tried it on: no network, no DeepSpeed, no
psutil or pandas; torch, transformers and safetensors as found there. It
installs nothing, imports nothing else beyond the standard library, and runs
from the source tree (``packages/core`` and ``packages/bench`` go on
``sys.path``), so a chunkstar that is not installed is fine.

What it runs, in priority order (the global deadline skips from the end)
    * **api**: torch, CUDA, driver, GPU; then every torch API the engine calls on
      CUDA, one small probe each (:mod:`chunkstar_bench.torch_api`): a missing or
      broken one is a FAILED line naming it, not a traceback in a training run.
    * **parity fp32 / parity bf16 under eviction**: a 14.7M GPT-2 (``--smoke``'s
      bf16: 2.1M) trained a few steps by chunkstar under a device budget that forces
      chunk moves in every step, against plain PyTorch on the same seed and batches. fp32: losses
      within 1e-5 relative and final parameters (chunkstar's fp32 masters) within
      1e-6 + 1e-5 |p| (the test suite's tolerances); bf16 (against autocast bf16
      with fp32 weights): losses within 3e-2 relative. A row whose engine moved no
      chunk to the device in some step FAILs: it proved nothing.
    * **GPT2-XL overlap / serial** (1.56B, batch 4 x 1024, bf16): under pressure,
      a budget of the bench's activation estimate plus room for ``--room-fraction``
      of the bf16 param bytes (far below the 14 bytes/param of model data: param
      chunks move in every forward and backward, Adam state stays on the host),
      with ``overlap`` on, then off.
    * **GPT3_6B capped** (6.16B, batch 2 x 1024): ``device_memory_budget`` 24 GB,
      a 24 GB GPU emulated on the big one; model data 86 GB.
    * **GPT2-XL resident**: the no-movement reference (every chunk on the GPU), for
      the hidden-copy share ``(t_serial - t_overlap) / (t_serial - t_resident)``.

What each row reports
    parity where it applies; s/step (median of the timed steps, after the two
    warm-up iterations the engine traces); TFLOPS (Megatron's count without
    recompute, :mod:`chunkstar_bench.flops`) and MFU against the GPU's dense bf16
    peak; bytes moved to the device and to the host per timed step; and the
    **real device memory**, measured by this script, not the engine's
    bookkeeping: ``torch.cuda.max_memory_allocated()`` (and ``..._reserved()``)
    from the end of the engine's construction to its last step, minus what the
    process held before the engine was built, beside the budget. The engine's own
    memory probe resets the allocator's peak at every moment of its warm-up, so
    the script folds the peak in before each reset (it wraps
    ``torch.cuda.reset_peak_memory_stats``). A row whose real peak passes its
    budget by more than 5% FAILs, and so does one whose reserved peak (the
    allocator's cached blocks included: what a GPU of the budget's size would
    have had to give) passes it by more than 5%. Construction is outside that window: the models
    are built on the GPU in fp32 (seconds, where 6.16B normal draws on the CPU take
    minutes; the engine then copies them into host chunks), which a 24 GB GPU
    could not do; its peak is recorded beside. ``engine.stats()["device_peak_bytes"]``
    is recorded too; on the CPU virtual device (``--smoke``) it is the real-memory
    column (the device's own meter), n/a when the engine has no such stat.

How it keeps to the time
    Each row is a subprocess of its own (GPU memory and pinned host memory go back
    when it exits), under a per-row limit cut to what is left of a global deadline
    (``--deadline-s``, default 390 s). A row the deadline leaves no time for, or
    stops, is a SKIP, not a failure; a row that fails, runs out of memory or passes
    its own limit is. Every SKIP says why, on stderr as it happens and again under
    the table. The parent samples each child's resident memory and kills it
    past ``--host-mem-cap-gib``; a row whose model data cannot fit host memory is
    skipped before it starts, except the capped row, which runs the most blocks of
    its model's shape the host can hold (its note says how many). Host memory of the big rows is the chunks' own
    (14 bytes/param: 86 GB for 6.16B); only the param chunks (2 bytes/param) are
    pinned.

Exit status: 0 when every row that ran passed (SKIPs allowed), 1 otherwise, 2
without CUDA (and without ``--smoke``).

    python benchmarks/gpu_check.py                      # one CUDA GPU
    python benchmarks/gpu_check.py --json runs/gpu_check.json
    python benchmarks/gpu_check.py --only 6B            # a rerun of some rows (substrings of their names)
    python benchmarks/gpu_check.py --smoke              # the same code on the CPU virtual device, tiny models
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
for _pkg in ("core", "bench"):
    if str(_REPO / "packages" / _pkg) not in sys.path:
        sys.path.insert(0, str(_REPO / "packages" / _pkg))

# standard library only at module level (the parent never imports transformers or chunkstar)
from chunkstar_bench import flops  # noqa: E402
from chunkstar_bench.systems.chunkstar import chunkstar_budget_bytes  # noqa: E402
from chunkstar_bench import watch as _watch_module  # noqa: E402
from chunkstar_bench.watch import watch  # noqa: E402
from chunkstar_bench.zoo import ModelSpec, get, n_params  # noqa: E402

_RESULT = "GPU_CHECK_RESULT "
_PROGRESS = "GPU_CHECK_PROGRESS "

_SEED = 0
_ADAMW: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
_CLIP = 1.0
_SLACK = {"cuda": 0.1, "cpu": 0.0}
"""device_memory_slack of the throughput rows: the engine's own defaults, written out so the record shows them."""
_MEMORY_TOLERANCE = 0.05
"""A row FAILs when its real device peak passes its budget by more than this share."""

# parity tolerances: the test suite's (tests/core/runtime/test_parity.py, tests/core/device/test_cuda.py)
_LOSS_RTOL = {"fp32": 1e-5, "bf16": 3e-2}
_PARAM_RTOL, _PARAM_ATOL = 1e-5, 1e-6
_PARITY_ROOM = 0.5
"""Parity budget: room for this share of the param bytes beside the measured non-model peak."""
_PARITY_STEPS = 4
_PARITY_MODEL = ModelSpec(name="gpt2-14.7m", hidden=512, layers=4, heads=8, seq_len=32, vocab=4096,
                          note="params dominate activations at 2 x 32 tokens, so a budget can force eviction")  # fmt: skip
_SMOKE_BF16_PARITY_MODEL = ModelSpec(name="gpt2-2.1m", hidden=256, layers=2, heads=4, seq_len=32, vocab=2048,
                                     note="--smoke's bf16 parity: bf16 matmuls are slow on a CPU")  # fmt: skip
"""--smoke's bf16 parity model. Its fp32 parity keeps the 14.7M model: at this size GPT-2's key
bias (a gradient of pure rounding noise, which Adam scales up) ends a few 1e-6 apart, beyond the
fp32 parameter tolerance, with the losses still bit-identical and every chunk resident alike."""

_XL = ModelSpec(name="GPT2-XL", hidden=1600, layers=48, heads=25, seq_len=1024, note="GPT-2 XL shape")
_CAP_BYTES = 24 * 10**9
"""device_memory_budget of the capped row: a 24 GB GPU."""
_SMOKE_A = ModelSpec(name="tiny-a", hidden=128, layers=2, heads=4, seq_len=64, vocab=1024)
_SMOKE_B = ModelSpec(name="tiny-b", hidden=192, layers=3, heads=4, seq_len=64, vocab=1024)
_SMOKE_CAP_FRACTION = 0.6
"""--smoke's capped row: the bench's default CPU budget (activations + 0.6 x the bf16 params)."""

_DEFAULT_DEADLINE_S = {"cuda": 390.0, "cpu": 600.0}

# The parent samples each row's resident memory by scanning /proc: 20 times a second (the
# watcher's default) costs a tenth of a core on a 2-core CI machine; 4 a second is plenty here.
if hasattr(_watch_module, "_POLL_S"):
    _watch_module._POLL_S = 0.25


@dataclasses.dataclass(frozen=True)
class Plan:
    """One row of the table: what its subprocess runs."""

    name: str
    kind: str
    """``api``, ``parity`` or ``throughput``."""
    device: str
    """``cuda`` or ``cpu`` (the virtual device of ``--smoke``)."""
    timeout_s: float
    """The row's own limit (passing it FAILs the row)."""
    min_start_s: float = 20.0
    """Not started (SKIP) when less than this is left of the global deadline."""
    model: ModelSpec | None = None
    batch: int = 0
    precision: str = "bf16"
    """``fp32`` or ``bf16``."""
    warmup: int = 0
    steps: int = 0
    mode: str = ""
    """Throughput only: ``overlap``, ``serial`` (both under pressure), ``capped`` (overlap under a
    fixed budget far below the model data) or ``resident`` (everything on the device)."""
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
        model = raw.get("model")
        return Plan(**{**raw, "model": ModelSpec(**model) if model else None})

    @property
    def pressured(self) -> bool:
        """Whether chunks must move every step (a row that moved none proved nothing)."""
        return self.kind == "parity" or self.mode in ("overlap", "serial", "capped")


# --------------------------------------------------------------------------- the child


def _progress(plan: Plan, message: str) -> None:
    print(f"{_PROGRESS}{plan.name}: {message}", file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _build(spec: ModelSpec, device: Any) -> Any:
    """The Hugging Face GPT-2 of ``spec``, initialised on ``device`` from the fixed seed."""
    import torch

    from chunkstar_bench.zoo import build_hf

    torch.manual_seed(_SEED)
    with torch.device(device):
        return build_hf(spec)


def _batches(plan: Plan, device: Any, count: int) -> list[Any]:
    import torch

    assert plan.model is not None
    gen = torch.Generator().manual_seed(_SEED + 1)
    shape = (plan.batch, plan.model.seq_len)
    return [torch.randint(0, plan.model.vocab, shape, generator=gen).to(device) for _ in range(count)]


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: Any) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class _Meter:
    """Real device memory, measured by this script around an engine (CUDA only).

    ``baseline()`` records what the process holds before the engine is built;
    ``window()`` starts a new peak window; ``peaks()`` is the window's peak allocated
    and reserved bytes over the baseline. The engine's memory probe resets the
    allocator's peak at every moment of its warm-up, so ``torch.cuda.reset_peak_memory_stats``
    is wrapped (before chunkstar is imported) to fold the peak in first: the window's
    peak is the peak since ``window()``, whoever reset the allocator's in between."""

    def __init__(self, device: Any) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.base_allocated = 0
        self.base_reserved = 0
        self._allocated = 0
        self._reserved = 0
        if self.cuda:
            import torch
            import torch.cuda.memory as cuda_memory

            original = cuda_memory.reset_peak_memory_stats
            self._reset = original

            def folding_reset(device: Any = None) -> None:
                try:
                    self._fold()
                except Exception:  # noqa: BLE001  (measuring must never break the engine)
                    pass
                original(device)

            cuda_memory.reset_peak_memory_stats = folding_reset
            torch.cuda.reset_peak_memory_stats = folding_reset

    def _fold(self) -> None:
        import torch

        stats = torch.cuda.memory_stats(self.device)  # one read for both (max_memory_allocated/_reserved's source)
        self._allocated = max(self._allocated, int(stats.get("allocated_bytes.all.peak", 0)))
        self._reserved = max(self._reserved, int(stats.get("reserved_bytes.all.peak", 0)))

    def baseline(self) -> int:
        """What the process holds on the device now (0 on the CPU virtual device); a new window."""
        if self.cuda:
            import torch

            _sync(self.device)
            self.base_allocated = int(torch.cuda.memory_allocated(self.device))
            self.base_reserved = int(torch.cuda.memory_reserved(self.device))
            self.window()
        return self.base_allocated

    def window(self) -> None:
        if self.cuda:
            _sync(self.device)
            self._reset(self.device)
            self._allocated = self._reserved = 0

    def peaks(self) -> dict[str, int | None]:
        if not self.cuda:
            return {"allocated": None, "reserved": None}
        _sync(self.device)
        self._fold()
        return {"allocated": self._allocated - self.base_allocated, "reserved": self._reserved - self.base_reserved}


def _memory_verdict(meter: _Meter, peaks: dict[str, int | None], stats: dict[str, Any], room: int | None) -> tuple[dict[str, Any], list[str]]:
    """The real-memory record of a run, and its failure (if the real peak passed ``room``)."""
    engine_peak = stats.get("device_peak_bytes")
    if meter.cuda:
        real, source = peaks["allocated"], "torch.cuda.max_memory_allocated() over the baseline"
    elif engine_peak is not None:
        real, source = int(engine_peak), "engine.stats()['device_peak_bytes'] (the virtual device's meter)"
    else:
        real, source = None, "n/a (the engine reports no device_peak_bytes)"
    record = {
        "real_peak_allocated_bytes": real,
        "real_peak_reserved_bytes": peaks["reserved"],
        "real_peak_source": source,
        "engine_device_peak_bytes": engine_peak,
        "baseline_allocated_bytes": meter.base_allocated,
        "budget_room_bytes": room,
    }
    failures: list[str] = []
    if real is not None and room is not None and real > (1 + _MEMORY_TOLERANCE) * room:
        failures.append(f"real device peak {_fmt_bytes(real)} > budget {_fmt_bytes(room)} + {_MEMORY_TOLERANCE:.0%}")
    # what the allocator reserved, cached blocks included, is what a GPU of the budget's size would
    # have had to give: past it, a real card of that size runs out (or frees its cache and syncs)
    # where this one had room to spare
    reserved = peaks["reserved"]
    if meter.cuda and reserved is not None and room is not None and reserved > (1 + _MEMORY_TOLERANCE) * room:
        failures.append(
            f"reserved device peak {_fmt_bytes(reserved)} (torch.cuda.max_memory_reserved() over the baseline) > "
            f"budget {_fmt_bytes(room)} + {_MEMORY_TOLERANCE:.0%}: a GPU of the budget's size would run out"
        )
    return record, failures


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
        "device": "cuda:0" if plan.device == "cuda" else "cpu",
    }
    if plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _device(plan: Plan) -> Any:
    import torch

    if plan.device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


# ---------------------------------------------------------------- api


def _api(plan: Plan) -> dict[str, Any]:
    import torch

    from chunkstar_bench.torch_api import probe

    device = _device(plan)
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, device_total_bytes=int(props.total_memory),
                    capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                    cudnn=torch.backends.cudnn.version())  # fmt: skip
        try:
            import torch.cuda.nccl as nccl

            info["nccl"] = ".".join(str(v) for v in nccl.version())
        except Exception as exc:  # noqa: BLE001
            info["nccl"] = _first_line(exc)
        _progress(plan, f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability {info['capability']}")

    def show(entry: dict[str, str]) -> None:
        _progress(plan, f"{entry['name']} ({entry['device']}): {entry['status']} - {entry['detail']}")

    probes = probe(device, show)
    failed = [p for p in probes if p["status"] == "FAILED"]
    return {
        "status": "ok",
        "verdict": "FAIL" if failed else "PASS",
        "failures": [f"{p['name']} ({p['device']}): {p['detail']}" for p in failed],
        "probes": probes,
        "torch_info": info,
    }


# ---------------------------------------------------------------- parity


def _reference(plan: Plan, device: Any, batches: list[Any]) -> tuple[list[float], dict[str, Any]]:
    """Plain PyTorch: fp32 weights (bf16 through autocast), fused AdamW, global-norm clipping.
    Its losses and final parameters (fp32, on the CPU)."""
    import torch

    assert plan.model is not None
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


def _non_model_peak(plan: Plan, device: Any, config: dict[str, Any], ids: Any, base: int) -> int:
    """What chunkstar's warm-up measures beside the chunks for this model and batch, with
    everything resident (the GPU's own size, or a virtual device far above the model data)."""
    import chunkstar

    assert plan.model is not None
    model = plan.model
    roomy = {} if device.type == "cuda" else {"device_memory_budget": 8 * 14 * n_params(model) + (256 << 20)}
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(model, device), 0, {**config, **roomy})
    _engine_step(engine, optimizer, ids)
    peak = max(0, int(engine.stats()["warmup_non_model_peak_bytes"]) - base)
    _close(engine)
    return peak


def _close(engine: Any) -> None:
    """Stop the engine's threads, so that it and its device chunks can be collected."""
    try:
        engine.close()
    except Exception as exc:  # noqa: BLE001  (an engine without close, or one that failed)
        print(f"engine.close(): {_first_line(exc)}", file=sys.stderr)


def _train_under(plan: Plan, device: Any, config: dict[str, Any], batches: list[Any], budget: int, meter: _Meter) -> dict[str, Any]:
    """chunkstar under ``budget``: losses, moves to the device per step, fp32 masters, stats, real peaks."""
    import chunkstar

    assert plan.model is not None
    model = plan.model
    meter.baseline()
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(model, device), 0, {**config, "device_memory_budget": budget})
    construction = meter.peaks()
    _release(device)
    meter.window()
    losses: list[float] = []
    moves: list[int] = []
    for ids in batches:
        losses.append(_engine_step(engine, optimizer, ids))
        moves.append(int(engine.stats()["chunk_moves_to_device"]) - sum(moves))
    peaks = meter.peaks()
    masters = {k: v.detach().float().cpu() for k, v in engine.state_dict().items()}
    stats = dict(engine.stats())
    _close(engine)
    return {"losses": losses, "moves": moves, "masters": masters, "stats": stats, "peaks": peaks,
            "construction_peaks": construction}  # fmt: skip


def _parity(plan: Plan) -> dict[str, Any]:
    """PyTorch; chunkstar with everything resident (to measure its non-model peak); chunkstar
    under a budget of that peak plus half the param bytes; the two compared."""
    import torch

    device = _device(plan)
    meter = _Meter(device)  # before chunkstar is imported

    import chunkstar

    assert plan.model is not None
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
    base_before = meter.baseline()  # what the process holds besides an engine (the batches, cuBLAS workspaces)
    non_model = _non_model_peak(plan, device, config, batches[0], base_before)
    _release(device)
    param_bytes = n_params(plan.model) * (4 if plan.precision == "fp32" else 2)
    base = meter.baseline()
    if base > base_before + (1 << 20):
        _progress(plan, f"the roomy engine left {_fmt_bytes(base - base_before)} on the device after close and gc")
    margin = (8 << 20) if device.type == "cuda" else (1 << 20)
    budget = base + int(1.25 * non_model) + margin + int(_PARITY_ROOM * param_bytes)
    raised_from: int | None = None
    run: dict[str, Any] | None = None
    try:
        run = _train_under(plan, device, config, batches, budget, meter)
    except chunkstar.DeviceMemoryError as exc:
        # One retry at the smallest budget the engine says holds what it measured: a one-off GPU
        # run should report parity, not this script's margin. The moves check still applies.
        if exc.minimum is None or exc.minimum <= budget:
            raise
        _progress(plan, f"budget {_fmt_bytes(budget)} too small ({exc.where}); retrying at the engine's minimum")
        raised_from, budget = budget, int(exc.minimum * 1.02)
    if run is None:
        _release(device)  # the failed engine (held by the exception's traceback until here)
        run = _train_under(plan, device, config, batches, budget, meter)
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
    # the budget holds the process's own bytes (base) too, as the engine's CUDA probe counts them:
    # the real peak over the base is held to what is left for the engine
    memory, over = _memory_verdict(meter, run["peaks"], run["stats"], budget - base)
    failures += over
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
        "device_left_by_roomy_engine_bytes": base - base_before,
        "memory": memory,
        "construction_peak_allocated_bytes": run["construction_peaks"]["allocated"],
        "chunkstar_stats": run["stats"],
    }


# ---------------------------------------------------------------- throughput


def _throughput(plan: Plan) -> dict[str, Any]:
    import torch

    device = _device(plan)
    meter = _Meter(device)  # before chunkstar is imported

    import chunkstar

    spec = plan.model
    assert spec is not None
    slack = _SLACK[device.type]
    room = plan.budget
    if room is None:  # cuda, no budget: the GPU's own size, as the engine sees it
        free, _total = torch.cuda.mem_get_info(device)
        room = int(free + torch.cuda.memory_reserved(device))
        need = 14 * n_params(spec) + chunkstar_budget_bytes(spec, plan.batch, spec.seq_len, "params:0")
        if need > room * (1 - slack):
            return {"status": "skipped", "message": f"does not fit: ~{_fmt_bytes(need)} of model data and activations, "
                    f"{_fmt_bytes(int(room * (1 - slack)))} usable"}  # fmt: skip
    config = {
        **_base_config(plan),
        "overlap": plan.mode != "serial",
        "default_chunk_size": "auto",
        "device_memory_slack": slack,
    }
    if plan.budget is not None:
        config["device_memory_budget"] = plan.budget
    total_steps = plan.warmup + plan.steps
    batches = _batches(plan, device, total_steps)
    meter.baseline()
    t0 = time.perf_counter()
    engine, optimizer = chunkstar.initialize_engine(lambda: _build(spec, device), 0, config)
    construction = meter.peaks()
    _release(device)  # the model's fp32 blocks, freed into the allocator's cache as the engine took them
    meter.window()
    init_s = time.perf_counter() - t0
    _progress(plan, f"engine built in {init_s:.1f} s ({engine.stats()['n_chunks']} chunks); host RSS "
              f"{_fmt_bytes(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)} peak")  # fmt: skip

    times: list[float] = []
    losses: list[float] = []
    before: dict[str, Any] = {}
    for i, ids in enumerate(batches):
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
    peaks = meter.peaks()
    stats = dict(engine.stats())
    per_step = {
        key: (int(stats[key]) - int(before.get(key, 0))) / plan.steps
        for key in ("bytes_to_device", "bytes_to_host", "chunk_moves_to_device", "chunk_moves_to_host")
    }
    median = statistics.median(times)
    tflops = flops.tflops(flops.megatron_flops(spec, plan.batch, False, seq=spec.seq_len), median)
    failures: list[str] = []
    if not all(math.isfinite(x) for x in losses):
        failures.append("non-finite loss")
    if plan.pressured and per_step["chunk_moves_to_device"] <= 0:
        failures.append("no chunk moved to the device in the timed steps: not under pressure")
    memory, over = _memory_verdict(meter, peaks, stats, room)
    failures += over
    return {
        "status": "ok",
        "verdict": "FAIL" if failures else "PASS",
        "failures": failures,
        "step_times_s": times,
        "median_step_s": median,
        "tflops": tflops,
        "losses": losses,
        "per_timed_step": per_step,
        "memory": memory,
        "construction_peak_allocated_bytes": construction["allocated"],
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
    result: dict[str, Any] = {"name": plan.name}
    try:
        import torch

        if plan.threads is not None:
            torch.set_num_threads(plan.threads)
        run = {"api": _api, "parity": _parity, "throughput": _throughput}[plan.kind]
        result.update(run(plan))
    except Exception as exc:  # noqa: BLE001  (the record carries the reason; the traceback goes to stderr)
        traceback.print_exc(file=sys.stderr)
        message = _first_line(exc)
        if getattr(exc, "minimum", None) is not None:  # a DeviceMemoryError that knows what would fit
            message += f" ... smallest budget that fits: {exc.minimum} bytes"  # type: ignore[attr-defined]
        result.update(status="oom" if _is_oom(exc) else "error", message=message)
    result["peak_host_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        import torch

        if plan.device == "cuda" and torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            result["device_name"] = props.name
            result["device_total_bytes"] = int(props.total_memory)
        else:
            result["device_name"] = "cpu (chunkstar's virtual device)"
    except Exception as exc:  # noqa: BLE001
        result["device_name"] = f"unknown ({_first_line(exc)})"
    return result


# --------------------------------------------------------------------------- the parent


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _nvidia_smi() -> dict[str, str]:
    """Driver, GPU name and memory from nvidia-smi (no CUDA context in this process); {} without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    first = out.strip().splitlines()[0] if out.strip() else ""
    cells = [c.strip() for c in first.split(",")]
    if len(cells) < 3:
        return {}
    return {"driver": cells[0], "name": cells[1], "memory": cells[2]}


def _versions(torch_version: str, cuda_build: str | None) -> dict[str, str]:
    found = {"python": platform.python_version(), "torch": torch_version, "cuda_build": str(cuda_build)}
    for dist in ("transformers", "safetensors"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    try:
        found["chunkstar"] = importlib.metadata.version("chunkstar") + " (installed; this run uses the source tree)"
    except importlib.metadata.PackageNotFoundError:
        found["chunkstar"] = "source tree (not installed)"
    return found


def _git_commit() -> str:
    """HEAD of the checkout, ``+dirty`` with local changes; "" outside git (a copied tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=_REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=_REPO,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _run_child(plan: Plan, timeout_s: float, cap_bytes: int, cut_by_deadline: bool) -> dict[str, Any]:
    """``plan`` in a fresh interpreter, watched for time and host memory; its record or the reason it has none."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    if plan.kind == "parity":  # deterministic cuBLAS (read when CUDA starts); the timed runs keep the default
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if plan.device == "cpu":  # the strict virtual device: backward on a device thread, the meter over every step
        env.setdefault("CHUNKSTAR_STRICT_DEVICE", "1")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", plan.to_json()]
    tail: collections.deque[str] = collections.deque(maxlen=20)
    records: list[dict[str, Any]] = []
    last_progress = [""]

    def on_line(line: str) -> None:
        if line.startswith(_RESULT):
            try:
                records.append(json.loads(line[len(_RESULT) :]))
            except json.JSONDecodeError:
                tail.append(line[:200])
        elif line.startswith(_PROGRESS):
            last_progress[0] = line[len(_PROGRESS) :]
            print(f"  {last_progress[0]}", file=sys.stderr, flush=True)
        elif line.strip():
            tail.append(line)

    done = watch(command, env, on_line, timeout_s, cap_bytes)
    returncode, sampled_peak, wall = done.returncode, done.sampled_peak_rss_bytes, done.wall_s
    if records and not done.timed_out and done.killed_for is None:
        record = records[-1]
    else:
        last = last_progress[0] or next((line for line in reversed(tail) if line.strip()), "")
        if done.timed_out and cut_by_deadline:
            status, why = "skipped", f"stopped at the global deadline after {timeout_s:.0f} s"
        elif done.timed_out:
            status, why = "timeout", f"passed its own limit of {timeout_s:.0f} s"
        elif done.killed_for is not None:
            status, why = "oom", f"killed: {done.killed_for}"
        else:  # SIGKILL from outside is most often the kernel's OOM killer
            status, why = "error", f"killed by signal {-returncode}" if returncode < 0 else f"exit status {returncode}"
        record = {"name": plan.name, "status": status, "message": (why + (f"; last: {last}" if last else ""))[:400]}
    if record.get("status") not in ("ok", "skipped") or record.get("verdict") == "FAIL":
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    record["wall_s"] = wall
    record["sampled_peak_rss_bytes"] = sampled_peak
    return record


def _parity_model(smoke: bool, precision: str) -> ModelSpec:
    return _SMOKE_BF16_PARITY_MODEL if smoke and precision == "bf16" else _PARITY_MODEL


def _plans(args: argparse.Namespace) -> list[Plan]:
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    # One compute thread on the CPU check: tiny ops on a shared 2-core machine otherwise stall
    # for up to a second per step whenever another process takes a core from torch's pool.
    threads = 1 if smoke else None
    plans = [Plan(name="api", kind="api", device=device, timeout_s=120.0 if smoke else 90.0, min_start_s=10.0, threads=threads)]
    for precision in ("fp32", "bf16"):
        plans.append(Plan(name=f"parity {precision}", kind="parity", device=device, timeout_s=180.0 if smoke else 150.0,
                          min_start_s=30.0, model=_parity_model(smoke, precision), batch=2, precision=precision, steps=_PARITY_STEPS,
                          threads=threads))  # fmt: skip
    pressured, pressured_batch = (_SMOKE_A, 2) if smoke else (_XL, 4)
    capped, capped_batch = (_SMOKE_B, 2) if smoke else (get("GPT3_6B"), 2)

    def row(spec: ModelSpec, batch: int, mode: str, steps: int, timeout: float, min_start: float) -> Plan:
        return Plan(name=f"{spec.name} {mode}", kind="throughput", device=device, timeout_s=timeout,
                    min_start_s=min_start, model=spec, batch=batch, precision="bf16", warmup=args.warmup,
                    steps=steps, mode=mode, threads=threads)  # fmt: skip

    big_steps = min(args.steps, 1)  # the 6B row: one timed step (its steps are host-Adam bound, seconds each)
    plans += [
        row(pressured, pressured_batch, "overlap", args.steps, 180.0, 20.0 if smoke else 60.0),
        row(pressured, pressured_batch, "serial", args.steps, 180.0, 20.0 if smoke else 60.0),
        row(capped, capped_batch, "capped", args.steps if smoke else big_steps, 180.0 if smoke else 300.0,
            20.0 if smoke else 150.0),
        row(pressured, pressured_batch, "resident", args.steps, 180.0 if smoke else 150.0, 20.0 if smoke else 45.0),
    ]
    for i, plan in enumerate(plans):
        if plan.kind == "throughput":
            budget, note = _budget(plan, args.room_fraction)
            plans[i] = dataclasses.replace(plan, budget=budget, budget_note=note)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        plans = [p for p in plans if p.kind == "api" or any(w in p.name for w in wanted)]
    return plans


def _host_need(plan: Plan) -> int:
    """Host bytes a row needs: its chunks (14 bytes/param, with 5% to spare) and, on a GPU, the
    process's own few GB; 0 for the rows whose models are small."""
    if plan.kind != "throughput" or plan.model is None:
        return 0
    return int(14 * 1.05 * n_params(plan.model)) + (3 << 30 if plan.device == "cuda" else 0)


def _sized_to_host(plan: Plan, limit: int) -> Plan | None:
    """The capped row with as many of its model's blocks as ``limit`` host bytes hold, when they
    cannot hold them all; None when no size that fits is still far above its budget (its point:
    model data the device cannot hold). The row keeps its name; its note says what it runs."""
    spec = plan.model
    assert spec is not None and plan.budget is not None
    for layers in range(spec.layers - 1, 0, -1):
        smaller = dataclasses.replace(spec, layers=layers)
        sized = dataclasses.replace(plan, model=smaller)
        if _host_need(sized) <= limit:
            if 14 * n_params(smaller) <= 2 * plan.budget:
                return None
            note = (f"{plan.budget_note}; sized to the host: {layers} of {spec.layers} blocks, {_fmt_count(n_params(smaller))} "
                    f"params ({_fmt_bytes(_host_need(plan))} of host memory for all of them, {_fmt_bytes(limit)} here)")  # fmt: skip
            return dataclasses.replace(sized, budget_note=note)
    return None


def _budget(plan: Plan, room: float) -> tuple[int | None, str]:
    """A throughput row's device_memory_budget and how it was made."""
    spec = plan.model
    assert spec is not None
    slack = _SLACK[plan.device]
    param_bytes = 2 * n_params(spec)
    data = f"model data {_fmt_bytes(14 * n_params(spec))}"
    if plan.mode == "resident":
        if plan.device == "cuda":
            return None, f"budget: the GPU's own size (no device_memory_budget); {data}"
        budget = 8 * 14 * n_params(spec) + (256 << 20)
        return budget, f"budget {_fmt_bytes(budget)} (far above the {data})"
    if plan.mode == "capped":
        if plan.device == "cuda":
            return _CAP_BYTES, f"budget {_fmt_bytes(_CAP_BYTES)}: a 24 GB GPU, slack {slack:g}; {data}"
        budget = chunkstar_budget_bytes(spec, plan.batch, spec.seq_len, f"params:{_SMOKE_CAP_FRACTION}")
        return budget, f"budget {_fmt_bytes(budget)} (the bench's CPU default, activations + {_SMOKE_CAP_FRACTION} x bf16 params); {data}"
    activations = chunkstar_budget_bytes(spec, plan.batch, spec.seq_len, "params:0")
    budget = int((activations + room * param_bytes) / (1 - slack))
    note = (f"budget {_fmt_bytes(budget)} = (estimated activations {_fmt_bytes(activations)} + {room:g} x "
            f"{_fmt_bytes(param_bytes)} bf16 params) / (1 - slack {slack:g}); {data}")  # fmt: skip
    return budget, note


def _hidden(results: dict[str, dict[str, Any]], plans: list[Plan], model: str) -> str:
    """(t_serial - t_overlap) / (t_serial - t_resident), clamped; n/a without a usable reference."""
    names = {p.mode: p.name for p in plans if p.model is not None and p.model.name == model}
    r, o, s = (results.get(names.get(mode, ""), {}) for mode in ("resident", "overlap", "serial"))
    if not all(x.get("status") == "ok" for x in (r, o, s)):
        return "n/a"
    moved = r["per_timed_step"]["bytes_to_device"] + r["per_timed_step"]["bytes_to_host"]
    if moved > 0:
        return "n/a"  # the "resident" run moved chunks: not a no-movement reference
    denominator = s["median_step_s"] - r["median_step_s"]
    if denominator <= 0:
        return "n/a"
    return f"{min(1.0, max(0.0, (s['median_step_s'] - o['median_step_s']) / denominator)):.2f}"


_HEADERS = ["run", "status", "s/step", "TFLOPS", "MFU", "to dev/step", "to host/step", "hidden", "real peak",
            "reserved", "budget", "notes"]  # fmt: skip
_NUMERIC = set(range(2, 11))


def _status(r: dict[str, Any]) -> str:
    status = r.get("status", "error")
    if status == "ok":
        return str(r.get("verdict", "PASS"))
    return "SKIP" if status == "skipped" else status.upper()


def _row(plan: Plan, r: dict[str, Any], hidden: str) -> list[str]:
    status = _status(r)
    dash = ["-"] * 9
    if r.get("status") != "ok":
        return [plan.name, status, *dash, r.get("message", "") or "-"]
    fails = ("; FAILED: " + "; ".join(r["failures"])) if r.get("failures") else ""
    if plan.kind == "api":
        probes = r["probes"]
        counts = collections.Counter(p["status"] for p in probes)
        notes = f"{counts['ok']} ok, {counts['FAILED']} failed, {counts['n/a']} n/a of {len(probes)} probes (table below)"
        return [plan.name, status, *dash, notes + fails]
    memory = r["memory"]
    real = _fmt_bytes(memory["real_peak_allocated_bytes"])
    reserved = _fmt_bytes(memory["real_peak_reserved_bytes"])
    budget = _fmt_bytes(memory["budget_room_bytes"])
    if plan.kind == "parity":
        tol = f"tol {_LOSS_RTOL[plan.precision]:g} rel"
        param = (f"max|dparam| {r['max_abs_param_diff']:.2e} "
                 + ("(info)" if plan.precision == "bf16" else f"(tol {_PARAM_ATOL:g} + {_PARAM_RTOL:g}|p|)"))  # fmt: skip
        notes = (f"max|dloss| {r['max_abs_loss_diff']:.2e} ({r['max_rel_loss_diff']:.1e} rel, {tol}); {param}; "
                 f"moves to device per step {r['moves_to_device_per_step']}; budget {_fmt_bytes(r['budget_bytes'])} "
                 f"< params {_fmt_bytes(r['param_bytes'])} + non-model {_fmt_bytes(r['non_model_peak_bytes'])}")  # fmt: skip
        if r.get("budget_raised_from"):
            notes += f" (raised from {_fmt_bytes(r['budget_raised_from'])} after a DeviceMemoryError)"
        return [plan.name, status, "-", "-", "-", "-", "-", "-", real, reserved, budget, notes + fails]
    mfu = flops.mfu(r["tflops"], r.get("device_name", "cpu"))
    moves = r["per_timed_step"]
    notes = f"{moves['chunk_moves_to_device']:.0f}/{moves['chunk_moves_to_host']:.0f} chunk moves to device/host per step"
    if plan.mode == "resident" and moves["bytes_to_device"] + moves["bytes_to_host"] > 0:
        notes += "; moved chunks: not a no-movement reference"
    if r["chunkstar_stats"].get("schedule") != "frozen":
        notes += f"; schedule {r['chunkstar_stats'].get('schedule')}"
    tflops = f"{r['tflops']:.1f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}"
    return [plan.name, status, f"{r['median_step_s']:.3f}", tflops, "n/a" if mfu is None else f"{mfu:.1%}",
            _fmt_bytes(moves["bytes_to_device"]), _fmt_bytes(moves["bytes_to_host"]), hidden, real, reserved, budget,
            notes + fails]  # fmt: skip


def _table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _header(args: argparse.Namespace, versions: dict[str, str], smi: dict[str, str]) -> str:
    gpu = (f"{smi['name']}, {smi['memory']}, driver {smi['driver']}" if smi else
           "cpu (chunkstar's virtual device)" if args.smoke else "driver unknown (no nvidia-smi)")  # fmt: skip
    return (f"chunkstar gpu-check{' --smoke' if args.smoke else ''}: {gpu}; torch {versions['torch']} "
            f"(CUDA {versions['cuda_build']}), transformers {versions['transformers']}, safetensors "
            f"{versions['safetensors']}, python {versions['python']}; chunkstar {versions['chunkstar']}")  # fmt: skip


def _report(args: argparse.Namespace, plans: list[Plan], results: dict[str, dict[str, Any]]) -> str:
    api = results.get("api", {})
    info = api.get("torch_info", {})
    lines: list[str] = []  # the head (versions) is stdout's first line already
    parity = [(precision, _parity_model(args.smoke, precision)) for precision in ("fp32", "bf16")]
    if info.get("device_name"):
        lines.append(f"torch sees: {info['device_name']}, {info['device_total_bytes'] / 2**30:.1f} GiB, compute capability "
                     f"{info.get('capability')}, cuDNN {info.get('cudnn')}, NCCL {info.get('nccl')}")  # fmt: skip
    lines += [
        "parity: " + ", ".join(f"{precision} {pm.name} (h {pm.hidden}, {pm.layers} layers, vocab {pm.vocab})"
                               for precision, pm in parity)
        + f"; batch 2 x {_PARITY_MODEL.seq_len}, {_PARITY_STEPS} steps, AdamW lr {_ADAMW['lr']:g}, clipping {_CLIP:g}",
        f"throughput: bf16, {args.warmup} warm-up + timed steps (see each row); TFLOPS by {flops.FORMULA_MEGATRON}; "
        f"MFU against the dense bf16 peak; hidden = (t_serial - t_overlap) / (t_serial - t_resident), clamped to [0, 1]",
        f"real peak: {'torch.cuda.max_memory_allocated()' if not args.smoke else 'engine device_peak_bytes'} over the "
        f"process's own bytes, from the end of construction to the last step (reserved: max_memory_reserved); "
        f"FAIL above the budget + {_MEMORY_TOLERANCE:.0%}",
    ]
    models = {p.model.name for p in plans if p.kind == "throughput" and p.model is not None}
    hidden = {m: _hidden(results, plans, m) for m in models}
    rows = [
        _row(p, results[p.name], hidden.get(p.model.name, "n/a") if p.mode == "overlap" and p.model else "-")
        for p in plans
    ]
    lines += ["", _table(_HEADERS, rows, _NUMERIC)]
    if api.get("probes"):
        probe_rows = [[p["name"], p["device"], p["status"], p["detail"]] for p in api["probes"]]
        lines += ["", "torch APIs the engine calls:", _table(["probe", "device", "status", "detail"], probe_rows, set())]
    details: list[str] = []
    for p in plans:
        r = results[p.name]
        parts: list[str] = []
        if p.kind == "throughput" and p.model is not None:
            parts += [f"{_fmt_count(n_params(p.model))} params, batch {p.batch} x {p.model.seq_len}, "
                      f"{p.warmup} warm-up + {p.steps} timed steps", p.budget_note]  # fmt: skip
            if r.get("status") == "ok":
                stats = r["chunkstar_stats"]
                parts.append(f"{stats['n_chunks']} chunks of {stats.get('chunk_size')} elements, engine built in "
                             f"{r['init_s']:.0f} s; step times {', '.join(f'{t:.2f}' for t in r['step_times_s'])} s")  # fmt: skip
        if "wall_s" not in r:  # never started
            details.append(f"{p.name}: " + "; ".join(x for x in [*parts, r.get("message", "")] if x))
            continue
        if r.get("memory"):
            m = r["memory"]
            if r.get("construction_peak_allocated_bytes") is not None:
                parts.append(f"construction peak {_fmt_bytes(r['construction_peak_allocated_bytes'])} (not held to the budget)")
            parts.append(f"engine device_peak_bytes {_fmt_bytes(m.get('engine_device_peak_bytes'))}")
        stats = r.get("chunkstar_stats") or {}
        if stats:
            parts.append(f"engine.stats(): chunks peak {_fmt_bytes(stats.get('device_chunk_bytes_peak'))}, warm-up non-model "
                         f"{_fmt_bytes(stats.get('warmup_non_model_peak_bytes'))}, device Adam chunks "
                         f"{stats.get('device_adam_chunks')}, replans {stats.get('replans')}")  # fmt: skip
        peak_host = max(r.get("peak_host_bytes") or 0, r.get("sampled_peak_rss_bytes") or 0)
        parts.append(f"peak host RSS {_fmt_bytes(peak_host)}; {r.get('wall_s', 0):.0f} s in all")
        details.append(f"{p.name}: " + "; ".join(x for x in parts if x))
    lines += ["", *details]
    skipped = [(p, results[p.name]) for p in plans if results[p.name].get("status") == "skipped"]
    if skipped:
        # SKIPs do not fail the check, so what they left unproven is said where it cannot be missed
        lines += ["", f"SKIPPED ({len(skipped)} of {len(plans)} rows: not failures, not proven either; rerun them with --only):"]
        lines += [f"  {p.name}: {r.get('message', '')}" for p, r in skipped]
    return "\n".join(lines)


def _passed(results: dict[str, dict[str, Any]], plans: list[Plan]) -> bool:
    """Every row that ran passed; a SKIP (deadline, does not fit) is no failure."""
    for p in plans:
        r = results[p.name]
        if r.get("status") == "skipped":
            continue
        if r.get("status") != "ok" or r.get("verdict", "PASS") != "PASS":
            return False
    return True


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="the same runs on the CPU virtual device with tiny models (what the CPU test runs)")  # fmt: skip
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per throughput row (the engine traces two)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per throughput row (the 6B row: one)")
    ap.add_argument("--room-fraction", type=float, default=0.5,
                    help="under pressure, the chunks' room beside the estimated activations, in bf16 param bytes")  # fmt: skip
    ap.add_argument("--deadline-s", type=float,
                    help=f"global deadline in seconds (default {_DEFAULT_DEADLINE_S['cuda']:.0f} on a GPU, "
                         f"{_DEFAULT_DEADLINE_S['cpu']:.0f} with --smoke)")  # fmt: skip
    ap.add_argument("--host-mem-cap-gib", type=float, default=110.0, help="kill a row whose resident memory passes this")
    ap.add_argument("--only", metavar="NAMES", help="comma-separated substrings: run only the rows they name (and api)")
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write versions, API probes, plans and results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or not 0 < args.room_fraction < 1:
        ap.error("--steps must be >= 1, --warmup >= 0 and --room-fraction in (0, 1)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child is not None:
        record = _child(Plan.from_json(args.child))
        print(_RESULT + json.dumps(record, default=str), flush=True)
        sys.stderr.flush()
        # no interpreter shutdown: finalizers (pinned buffers' unregistration, 86 GB of host
        # chunks freed page by page) cost time and prove nothing here; the OS takes it all back
        os._exit(0)

    import torch  # the parent asks only whether CUDA is there (no context, no device memory)

    if not args.smoke and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "it needs one, or run `python benchmarks/gpu_check.py --smoke` for the CPU check", file=sys.stderr)  # fmt: skip
        return 2
    start = time.monotonic()
    versions = _versions(torch.__version__, torch.version.cuda)
    smi = {} if args.smoke else _nvidia_smi()
    head = _header(args, versions, smi)
    print(head, flush=True)
    device = "cpu" if args.smoke else "cuda"
    deadline = start + (args.deadline_s if args.deadline_s is not None else _DEFAULT_DEADLINE_S[device])
    plans = _plans(args)
    cap_bytes = int(args.host_mem_cap_gib * 2**30)
    results: dict[str, dict[str, Any]] = {}
    for i, plan in enumerate(plans):
        label = f"[gpu-check {i + 1}/{len(plans)}] {plan.name}"
        left = deadline - time.monotonic()
        host_need = _host_need(plan)  # the host chunks (14 bytes/param) and, on a GPU, the process's own few GB
        available = _host_available_bytes()
        limit = min(cap_bytes, available or cap_bytes)
        if left < plan.min_start_s:
            results[plan.name] = {"status": "skipped", "message": f"not started: {max(0.0, left):.0f} s left of the "
                                  f"global deadline, the row needs {plan.min_start_s:.0f} s at least"}  # fmt: skip
            # a skip is no failure, so it must say why where it is seen (and again under the table)
            print(f"{label}: SKIP: {results[plan.name]['message']}", file=sys.stderr, flush=True)
            continue
        if host_need > limit and plan.mode == "capped":
            # the 6B row shows model data far above the device: on a host that cannot hold all of it, it
            # runs the largest model of its shape that fits rather than nothing
            sized = _sized_to_host(plan, limit)
            if sized is not None:
                plans[i] = plan = sized
                host_need = _host_need(plan)
                print(f"{label}: {plan.budget_note.rsplit('; ', 1)[-1]}", file=sys.stderr, flush=True)
        if host_need > limit:
            results[plan.name] = {"status": "skipped", "message": f"not started: ~{_fmt_bytes(host_need)} of host "
                                  f"chunks, {_fmt_bytes(available)} available, cap {args.host_mem_cap_gib:g} GiB"}  # fmt: skip
            print(f"{label}: SKIP: {results[plan.name]['message']}", file=sys.stderr, flush=True)
            continue
        cut = plan.timeout_s > left
        timeout = left if cut else plan.timeout_s
        print(f"{label} ... (limit {timeout:.0f} s{', the global deadline' if cut else ''})", file=sys.stderr, flush=True)
        r = _run_child(plan, timeout, cap_bytes, cut)
        results[plan.name] = r
        summary = _status(r)
        if r.get("status") == "ok" and plan.kind == "throughput":
            summary += f", {r['median_step_s']:.3f} s/step"
        if r.get("failures"):
            summary += ": " + "; ".join(r["failures"])
        elif r.get("status") != "ok":
            summary += f": {r.get('message', '')}"
        print(f"{label}: {summary} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)

    passed = _passed(results, plans)
    print(_report(args, plans, results))
    total = time.monotonic() - start
    n_skipped = sum(1 for p in plans if results[p.name].get("status") == "skipped")
    print(f"total {total:.0f} s; {'PASS' if passed else 'FAIL'}"
          + (f" ({n_skipped} row(s) SKIPPED, listed under the table)" if n_skipped else ""), file=sys.stderr)  # fmt: skip
    if args.json is not None:
        document = {
            "benchmark": "gpu_check",
            "created_unix": time.time(),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
            "versions": versions,
            "nvidia_smi": smi,
            "torch_info": results.get("api", {}).get("torch_info"),
            "api": results.get("api", {}).get("probes"),
            "git_commit": _git_commit(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "host_available_bytes": _host_available_bytes()},
            "flops_formula": flops.FORMULA_MEGATRON,
            "memory_tolerance": _MEMORY_TOLERANCE,
            "plans": [dataclasses.asdict(p) for p in plans],
            "results": results,
            "passed": passed,
            "total_s": total,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2, default=str) + "\n")
        print(f"results written to {args.json}", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
