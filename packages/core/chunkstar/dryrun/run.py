"""``chunkstar.dry_run``: the real engine at any scale, on the meta device, rank by rank.

Note [dry run]: a dry run builds the model on the meta device and trains it for a
few steps with the real engine (Note [the meta device] in
:mod:`chunkstar.device.tiers`): the layout and chunk-size search, the warm-up
trace, the per-moment budgets, eviction, prefetch, hybrid Adam's placement and,
over several ranks, each rank's chunk groups and collectives are the code a real
run executes, deciding on the sizes a real run would see. No tensor has bytes:
a 68B model costs what its Python objects cost. Each rank of ``world_size`` runs
in turn with a simulated process group (Note [simulated ranks] in
:mod:`chunkstar.dryrun.comm`); the forward and backward run on meta tensors with
the fused attention a real device takes (Note [meta kernels] in
:mod:`chunkstar.dryrun.meta_ops`), so activations are measured from the tensors
the model creates.

The config is the one the real run will use, for its target device (``"cuda"`` by
default): it is parsed for a device of the hardware's memory (or the config's
budget) without asking torch about one. The report of each rank has the keys of
``engine.stats()`` after each step, plus whether the run fits, the smallest budget
that fits (the ``minimum`` a real run's :class:`DeviceMemoryError` names; for a
run that fits, the least budget that held its warm-up), the collectives' bytes,
and the last step's :class:`StepRecord`, which the time model replays on a
hardware description (:mod:`chunkstar.dryrun.timing`).

What the meta device cannot give: values. A step that reads them (the global
gradient norm for clipping or fp16's loss scale) runs without them; a model whose
control flow depends on its data (a mixture of experts' routing, a loss that
skips padding by counting it) takes the shapes a meta tensor gives, which for
routing means every token to every chosen expert's full capacity or an error from
the model's own code, which the report passes on.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from chunkstar.config import EngineConfig, Precision, parse_config
from chunkstar.config.hyperparams import validate_param_group
from chunkstar.dryrun.comm import SimulatedComm
from chunkstar.dryrun.disk import SimulatedDisk
from chunkstar.dryrun.meta_ops import autocast_like, loss_of, meta_kernels, on_meta, value_read
from chunkstar.dryrun.record import StepRecord, StepRecorder
from chunkstar.dryrun.timing import Hardware, Prediction, hardware_named, predict
from chunkstar.errors import ConfigError, DeviceMemoryError
from chunkstar.optim.adam import ChunkAdam
from chunkstar.runtime.engine import ChunkEngine

__all__ = ["DryRunError", "DryRunReport", "RankReport", "dry_run"]


class DryRunError(RuntimeError):
    """The model cannot run without values: it read one (Note [meta kernels])."""

Inputs = Mapping[str, Any] | Sequence[Any] | torch.Tensor
LossFn = Callable[[Any], torch.Tensor]


@dataclass
class RankReport:
    """One simulated rank's run."""

    rank: int
    fits: bool
    minimum_budget: int
    """The smallest ``device_memory_budget`` (bytes) that fits what was measured."""
    steps: list[dict[str, Any]] = field(default_factory=list)
    """``engine.stats()`` after each step, with the collectives' bytes beside."""
    error: str = ""
    """Why it does not fit (the :class:`DeviceMemoryError`'s message), when it does not."""
    record: StepRecord | None = None
    """The last step, as the time model replays it."""
    seconds: float = 0.0
    """Wall time of this rank's dry run (construction and steps)."""

    @property
    def stats(self) -> dict[str, Any]:
        """The last step's figures (``{}`` when not one step finished)."""
        return self.steps[-1] if self.steps else {}

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "fits": self.fits, "minimum_budget": self.minimum_budget, "error": self.error,
            "seconds": self.seconds, "steps": self.steps, "record": self.record.as_dict() if self.record else None,
        }  # fmt: skip


@dataclass
class DryRunReport:
    """What :func:`dry_run` found, per rank, and the predicted step on ``hardware``."""

    target: str
    """The device kind the config is for: "cuda" or "cpu"."""
    world_size: int
    ranks: list[RankReport]
    hardware: Hardware | None = None
    overlap: bool = True
    """The config's ``overlap``: whether the time model lets copies and host Adam run beside the compute."""
    config: dict[str, Any] = field(default_factory=dict)
    """The config as given."""
    prediction: Prediction | None = None
    """The predicted step of the slowest rank on ``hardware`` (None without hardware or when it does not fit)."""

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    @property
    def minimum_budget(self) -> int:
        """The smallest per-device budget that fits every rank."""
        return max(r.minimum_budget for r in self.ranks)

    @property
    def host_peak_bytes_per_node(self) -> int:
        """The host memory the chunks of one node's ranks hold at most, summed over the busiest
        node: each rank's host memory plan (Note [host memory plan] in
        :mod:`chunkstar.memory.host`: the chunks whose home is host memory, the disk tier's
        staging pool at its whole budget, the gradient accumulators). The chunks staged in
        at a moment are the pool's, counted once (the rank's measured peak of host chunk
        buffers plus the pool counted them twice). The processes' own memory (torch, the
        CUDA context, the activations' pinned copies a framework may keep) comes on top."""
        per_node = self.hardware.gpus_per_node if self.hardware is not None else self.world_size
        nodes: dict[int, int] = {}
        for r in self.ranks:
            s = r.stats
            node = r.rank // max(1, per_node)
            planned = s.get("host_memory_planned_bytes")
            if planned is None:  # a report of a version before the plan
                planned = int(s.get("host_chunk_bytes_peak", 0)) + int(s.get("disk_staging_budget_bytes", 0) or 0)
            nodes[node] = nodes.get(node, 0) + int(planned)
        return max(nodes.values(), default=0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target, "world_size": self.world_size, "fits": self.fits,
            "minimum_budget": self.minimum_budget, "host_peak_bytes_per_node": self.host_peak_bytes_per_node,
            "hardware": dataclasses.asdict(self.hardware) if self.hardware else None,
            "prediction": self.prediction.as_dict() if self.prediction else None,
            "ranks": [r.as_dict() for r in self.ranks],
        }  # fmt: skip


def _target_config(config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str], hardware: Hardware | None) -> tuple[EngineConfig, str]:
    """The config parsed for its target device, to run on meta: (config, "cuda" or "cpu")."""
    if isinstance(config, EngineConfig):
        if config.device.type != "meta":
            raise ConfigError("device", f"a parsed config for {config.device} cannot be dry-run; pass the config dict")
        return config, "cuda"
    if isinstance(config, (str, os.PathLike)):
        config = parse_config(config).raw  # read and checked as a file once; parsed again for the target
    raw = dict(config)
    target = "cpu" if raw.get("device") == "cpu" else "cuda"
    memory = hardware.device_memory if hardware is not None else None
    if memory is None:
        budget = raw.get("device_memory_budget")
        if budget is None:
            raise ConfigError(
                "device_memory_budget",
                "a dry run needs the target device's size: pass hardware= (a name from chunkstar.dryrun.HARDWARE "
                "or a Hardware) or give the config a device_memory_budget",
            )
        from chunkstar.config import parse_bytes

        memory = parse_bytes(budget)
    cfg = parse_config(raw, target_memory=memory)
    return cfg, target


def _call(engine: ChunkEngine, inputs: Any, target: str) -> Any:
    # the forward as under the real run's autocast (the engine has none on meta: Note [meta kernels])
    with autocast_like(target, _autocast_dtype(engine)):
        if isinstance(inputs, Mapping):
            return engine(**inputs)
        if isinstance(inputs, (list, tuple)):
            return engine(*inputs)
        return engine(inputs)


def _autocast_dtype(engine: ChunkEngine) -> torch.dtype | None:
    precision = engine.config.precision
    return None if precision is Precision.FP32 else precision.dtype


def _backward(engine: ChunkEngine, loss: torch.Tensor, target: str) -> None:
    # a checkpointed block's recomputation runs in the backward under the forward's autocast
    # (torch.utils.checkpoint restores it): so does the emulation
    with autocast_like(target, _autocast_dtype(engine)):
        engine.backward(loss)


def _run_rank(
    model_func: Callable[[], nn.Module], cfg: EngineConfig, target: str, rank: int, world_size: int,
    inputs: Any, steps: int, loss_fn: LossFn, say: Callable[[str], None], hardware: Hardware | None = None,
) -> RankReport:  # fmt: skip
    t0 = time.perf_counter()
    comm = SimulatedComm(rank, world_size, "nccl" if target == "cuda" else "gloo")
    with torch.device("meta"):
        model = model_func()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_func must return a torch.nn.Module, it returned {type(model).__name__}")
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # a model moved to meta loses its ties; built on meta it keeps them (a no-op then)
    # the disk tier's files record bytes and hold none (Note [dry run disk])
    engine = ChunkEngine(model, cfg, model_func=model_func, comm=comm, disk_parts=SimulatedDisk() if cfg.disk else None)
    if hardware is not None:
        engine._target_costs(
            flop_seconds(hardware.peak_flops * hardware.efficiency), min(hardware.h2d_bandwidth, hardware.d2h_bandwidth),
            # the node's host Adam is shared by its ranks, as the time model shares it
            min(hardware.gpus_per_node, world_size) / hardware.host_adam_params_per_s,
        )
    report = RankReport(rank=rank, fits=True, minimum_budget=0)
    try:
        opt = cfg.optimizer
        defaults: dict[str, Any] = {"lr": opt.lr, "betas": opt.betas, "eps": opt.eps, "weight_decay": opt.weight_decay}
        groups = [validate_param_group({"params": list(engine.parameters())}, "param_groups[0]", decoupled=opt.decoupled, defaults=defaults)]
        optimizer = ChunkAdam(engine, opt, groups, defaults)
        engine.optimizer = optimizer
        micro = opt.accumulation_steps
        for step in range(steps):
            recorder = StepRecorder(engine) if step == steps - 1 else None
            try:
                if recorder is not None:
                    recorder.__enter__()
                try:
                    for _ in range(micro):
                        _backward(engine, loss_fn(_call(engine, inputs, target)), target)
                    optimizer.step()
                    optimizer.zero_grad()
                except (RuntimeError, NotImplementedError) as e:
                    if not value_read(e):
                        raise
                    raise DryRunError(
                        f"the model read the value of a tensor in step {step + 1} ({type(e).__name__}: {e}); a dry run "
                        "has shapes, not values. Leave out inputs that only steer the model by their values (an "
                        "attention_mask of all ones: a real run skips it too), or make the branch not depend on "
                        "values; the traceback above this one shows where the model reads"
                    ) from e
            except DeviceMemoryError as e:
                report.fits = False
                report.error = str(e)
                report.minimum_budget = int(e.minimum or 0)
                say(f"rank {rank}/{world_size}: step {step + 1} does not fit: needs at least {_gib(report.minimum_budget)}")
                break
            finally:
                if recorder is not None:
                    recorder.__exit__(None, None, None)
            disk = engine.mgr.chunks.disk
            if disk is not None:
                disk.drain()  # the step's write-behinds counted as issued, not as far as a lane thread got
            stats = dict(engine.stats())
            stats.update(comm.bytes.as_dict())
            report.steps.append(stats)
            report.minimum_budget = max(report.minimum_budget, int(stats["minimum_budget_bytes"]))
            if recorder is not None:
                report.record = recorder.record
            say(
                f"rank {rank}/{world_size}: step {step + 1}/{steps}: {stats['chunk_moves_to_device']} chunk moves to the "
                f"device so far, device peak {_gib(stats['device_peak_bytes'])} ({time.perf_counter() - t0:.1f} s)"
            )
    finally:
        engine.close()
    report.seconds = time.perf_counter() - t0
    return report


def flop_seconds(rate: float) -> Callable[[Callable[[], Any]], tuple[Any, float]]:
    """A block call's forward seconds on the target: its FLOPs (counted on the meta tensors) at
    ``rate`` FLOP/s. What "auto" plans with in a dry run, where nothing takes time to measure."""
    from torch.utils.flop_counter import FlopCounterMode

    def cost(run: Callable[[], Any]) -> tuple[Any, float]:
        with FlopCounterMode(display=False) as counter:
            out = run()
        return out, counter.get_total_flops() / rate

    return cost


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def dry_run(
    model_func: Callable[[], nn.Module],
    config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
    inputs: Inputs,
    world_size: int = 1,
    hardware: Hardware | str | None = None,
    steps: int = 3,
    *,
    loss_fn: LossFn | None = None,
    ranks: Sequence[int] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DryRunReport:
    """Train ``model_func()``'s model for ``steps`` steps with the real engine on the meta
    device, as each of ``world_size`` ranks would, and report what it decided (Note [dry run]).

    ``config`` is the real run's config (for ``"cuda"`` unless it says ``"cpu"``);
    ``inputs`` one micro-batch, as keyword arguments (a dict), positional ones (a
    tuple) or one tensor, real or meta (only shapes and dtypes count); the loss is
    the output's ``.loss`` unless ``loss_fn(output)`` says otherwise. ``hardware``
    (a :class:`Hardware` or a name in :data:`chunkstar.dryrun.HARDWARE`) sets the
    device's memory and, with it, the report's predicted step time. ``steps`` includes
    the two warm-up iterations, so at least 3 reach the frozen schedule a real run
    settles in. ``ranks`` simulates only those ranks (default: all); ``progress``
    receives a line per rank and step.
    """
    if not callable(model_func):
        raise TypeError(f"model_func must be a callable that returns an nn.Module, got {type(model_func).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    hw = hardware_named(hardware) if isinstance(hardware, str) else hardware
    cfg, target = _target_config(config, hw)
    chosen = list(range(world_size)) if ranks is None else sorted(set(ranks))
    if not chosen or any(not 0 <= r < world_size for r in chosen):
        raise ValueError(f"ranks must be some of 0..{world_size - 1}, got {list(ranks or [])}")
    say = progress or (lambda _line: None)
    meta_inputs = on_meta(inputs)
    reports = []
    with meta_kernels():
        for r in chosen:
            reports.append(_run_rank(model_func, cfg, target, r, world_size, meta_inputs, steps, loss_fn or loss_of, say, hw))
    report = DryRunReport(
        target=target, world_size=world_size, ranks=reports, hardware=hw, overlap=cfg.placement.overlap, config=dict(cfg.raw)
    )
    if hw is not None and report.fits:
        preds = [predict(r.record, hw, overlap=cfg.placement.overlap) for r in reports if r.record is not None]
        report.prediction = max(preds, key=lambda p: p.seconds, default=None)
    return report
