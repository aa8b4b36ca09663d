"""The overlap table: chunkstar's copies overlapped vs serial under an emulated device link, beside PyTorch and DeepSpeed.

What it measures
    One training step of ``gpt2-30m-v8k`` (29.5M parameters: hidden 512, 8
    layers, vocab 8192; batch 4 x seq 128, bf16, AdamW, clipping 1.0; one torch
    thread, so the other core is free for the copy threads) for these rows,
    each run its own process, interleaved over the rounds:

    ``pytorch``                PyTorch: fp32 params, autocast bf16, fused AdamW
    ``chunkstar-1gb-serial``   chunkstar, device budget of ``--budget-fraction`` of the bf16
    ``chunkstar-1gb-overlap``  parameter bytes plus :data:`NON_MODEL_BYTES`, on the CPU virtual
    ``chunkstar-8gb-serial``   device with ``device_link_bandwidth`` 1 GB/s or 8 GB/s (each chunk
    ``chunkstar-8gb-overlap``  copy takes at least bytes / bandwidth) and ``overlap`` false (the
                               serial reference) or true
    ``deepspeed``              DeepSpeed ZeRO-3, params and optimizer offloaded to CPU, bf16. It
                               runs WITHOUT the emulated link: its copies are plain memcpy on this
                               machine, so its time is for reference only
    ``chunkstar-free``         chunkstar with a budget that holds everything (no pressure): with
                               ``pytorch``, the pair the peak-RSS target compares

How to read it
    ``median s/step`` pools the timed steps of every round. ``last loss`` should
    agree across rows to about 1e-2 (same weights, same batches). The targets
    (:data:`TARGETS`): overlapped/serial step time at 1 GB/s <= 0.70, overlapped
    at 8 GB/s <= 1.10x PyTorch, chunkstar's peak RSS without pressure <= PyTorch's.

The time model beside it
    Once the rows ran, each chunkstar row is also predicted (unless ``--no-predict``):
    :func:`chunkstar.dryrun.dry_run` runs the row's model, batch and engine config
    (the CPU device, its budget, overlap and link) on the meta device, and the
    step it records is replayed on this machine as
    :func:`chunkstar.dryrun.calibrate_this_machine` measures it, at the row's torch
    threads, with the row's model and batch as the workload whose own ops set the
    compute rate, and the row's emulated link (Note [time model], Note [this
    machine] in :mod:`chunkstar.dryrun.timing`). Nothing is fitted to the
    measured rows: ``predicted / measured`` is the model's error on this machine
    (its target: within 20%, i.e. 0.80-1.20). The calibration runs in this process
    after the rows, so foreign load then and during the rows (the last line) is
    what can make the two disagree beyond the model's own error.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkstar.config import host_memory_bytes
from chunkstar_bench.comparisons.rounds import Pooled, Row, Target, Verdict, notes, other_load, text_table, verdict_table
from chunkstar_bench.runner import RunSpec
from chunkstar_bench.units import GIB, MIB
from chunkstar_bench.zoo import build_hf, get, n_params

__all__ = ["MODEL", "NON_MODEL_BYTES", "ROW_NAMES", "TARGETS", "OverlapSettings", "Predicted", "predict_rows", "report", "rows"]

MODEL = "gpt2-30m-v8k"
_BATCH, _SEQ, _THREADS = 4, 128, 1
NON_MODEL_BYTES = 200_000_000
"""Room the pressured budgets leave for activations and temporaries: the warm-up non-model
peak of this model and batch, measured at ~186 MB (``chunkstar-free`` notes what it measured)."""
_FREE_BUDGET = min(16 * GIB, host_memory_bytes() or 16 * GIB)  # all resident, and at most what the host has


@dataclass(frozen=True)
class _Link:
    name: str
    label: str
    link: str
    overlap: bool


_LINKED: tuple[_Link, ...] = (
    _Link("chunkstar-1gb-serial", "chunkstar link 1GB/s overlap off", "1GB/s", False),
    _Link("chunkstar-1gb-overlap", "chunkstar link 1GB/s overlap on", "1GB/s", True),
    _Link("chunkstar-8gb-serial", "chunkstar link 8GB/s overlap off", "8GB/s", False),
    _Link("chunkstar-8gb-overlap", "chunkstar link 8GB/s overlap on", "8GB/s", True),
)

ROW_NAMES: tuple[str, ...] = ("pytorch", *(x.name for x in _LINKED), "deepspeed", "chunkstar-free")
"""Every row, in the order they run in a round and print."""

TARGETS: tuple[Target, ...] = (
    Target("chunkstar-1gb-overlap", "chunkstar-1gb-serial", "step", "<=", 0.70, "overlapped / serial step time at 1 GB/s"),
    Target("chunkstar-8gb-overlap", "pytorch", "step", "<=", 1.10, "overlapped at 8 GB/s / PyTorch step time"),
    Target("chunkstar-free", "pytorch", "rss", "<=", 1.00, "peak RSS chunkstar without pressure / PyTorch"),
)
"""The issue's three targets."""


@dataclass(frozen=True)
class OverlapSettings:
    """What the command line may change; the model, batch and threads are the table's own."""

    steps: int = 6
    warmup: int = 3
    budget_fraction: float = 0.5
    """The pressured rows' room for chunks, as a fraction of the bf16 parameter bytes."""
    seed: int = 0
    hardware: str = "cpu"


def rows(settings: OverlapSettings, names: Sequence[str] = ROW_NAMES) -> list[Row]:
    """The rows ``names`` (in :data:`ROW_NAMES` order) for ``settings``."""
    unknown = sorted(set(names) - set(ROW_NAMES))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(ROW_NAMES)}")

    def spec(system: str, budget: int | None = None, link: str | None = None, overlap: bool | None = None) -> RunSpec:
        return RunSpec(
            system=system, model=MODEL, batch=_BATCH, seq_len=_SEQ, steps=settings.steps, warmup=settings.warmup,
            seed=settings.seed, threads=_THREADS, hardware=settings.hardware,
            chunkstar_budget=budget, chunkstar_link=link, chunkstar_overlap=overlap,
        )  # fmt: skip

    budget = int(settings.budget_fraction * 2 * n_params(get(MODEL))) + NON_MODEL_BYTES
    every = {
        "pytorch": Row("pytorch", "PyTorch (autocast bf16)", spec("pytorch")),
        **{x.name: Row(x.name, x.label, spec("chunkstar", budget=budget, link=x.link, overlap=x.overlap)) for x in _LINKED},
        "deepspeed": Row("deepspeed", "DeepSpeed ZeRO-3 offload (no emulated link)", spec("deepspeed")),
        "chunkstar-free": Row("chunkstar-free", "chunkstar, no pressure (budget holds all)", spec("chunkstar", budget=_FREE_BUDGET)),
    }
    return [every[name] for name in ROW_NAMES if name in names]


@dataclass(frozen=True)
class Predicted:
    """A row's step as the time model predicts it (:func:`predict_rows`)."""

    seconds: float = 0.0
    binding: str = ""
    """The resource busy the longest (compute, h2d, d2h, host_adam, ...)."""
    busy: dict[str, float] = field(default_factory=dict)
    """Seconds each resource works in the step."""
    hardware: str = ""
    """How this machine was measured (:attr:`chunkstar.dryrun.Hardware.source`)."""
    error: str = ""
    """Why there is no prediction (the dry run failed or did not fit), when there is none."""

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "binding": self.binding, "busy": dict(self.busy), "hardware": self.hardware, "error": self.error}


def predict_rows(rows: Sequence[Row], say: Callable[[str], None] | None = None) -> dict[str, Predicted]:
    """The time model's step of each chunkstar row of ``rows``, by name (the module's "The time
    model beside it"): a dry run of the row's model, batch and engine config, replayed on this
    machine calibrated at the row's torch threads, with its model and batch as the workload and
    its emulated link. Runs in this process; torch's thread count is restored afterwards."""
    import torch

    from chunkstar.config import parse_config
    from chunkstar.dryrun import calibrate_this_machine, dry_run
    from chunkstar_bench.harness import Context
    from chunkstar_bench.systems.chunkstar import chunkstar_budget_bytes, engine_config

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    out: dict[str, Predicted] = {}
    threads_before = torch.get_num_threads()
    try:
        for row in rows:
            spec = row.spec
            if spec.system != "chunkstar" or spec.device != "cpu":
                continue  # the model replays chunkstar's own step, on the CPU virtual device here
            ctx = Context(spec)
            config = engine_config(ctx, chunkstar_budget_bytes(ctx.model, spec.batch, ctx.seq, spec.chunkstar_budget))
            link = parse_config(config).placement.link_bandwidth  # bytes/s, as the engine reads it
            # the row's torch threads, as its process had them (chunkstar_bench.child)
            torch.set_num_threads(spec.threads or max(1, os.cpu_count() or 1))
            ids = torch.zeros(spec.batch, ctx.seq, dtype=torch.long)
            inputs = {"input_ids": ids, "labels": ids}

            def build(model: Any = ctx.model) -> Any:
                return build_hf(model)

            say(f"[predict] {row.name}: calibrating this machine and dry-running the row ...")
            try:
                hw = calibrate_this_machine(torch.bfloat16, link_bandwidth=link, workload=(build, inputs))
                dry = dry_run(build, config, inputs, hardware=hw)
            except Exception as exc:  # noqa: BLE001  (a finding for the table, like a failed row)
                out[row.name] = Predicted(error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            if dry.prediction is None:
                out[row.name] = Predicted(hardware=hw.source, error=f"the dry run does not fit: {dry.ranks[0].error}"[:300])
                continue
            pred = dry.prediction
            out[row.name] = Predicted(pred.seconds, pred.binding, dict(pred.busy), hw.source)
            say(f"[predict] {row.name}: {pred.seconds:.3f} s/step predicted, bound by {pred.binding}")
    finally:
        torch.set_num_threads(threads_before)
    return out


def _model_table(pooled: Mapping[str, Pooled], predicted: Mapping[str, Predicted]) -> list[str]:
    """The measured and predicted s/step of each predicted row, their ratio, and what binds the prediction."""
    if not predicted:
        return []
    lines: list[list[str]] = []
    for name, pred in predicted.items():
        p = pooled.get(name)
        measured = p.median_s if p is not None and p.ok else None
        label = p.row.label if p is not None else name
        if pred.error:
            lines.append([label, "-" if measured is None else f"{measured:.3f}", "-", "-", pred.error])
            continue
        ratio = f"{pred.seconds / measured:.2f}" if measured else "-"
        busy = ", ".join(f"{k} {v:.3f}" for k, v in pred.busy.items() if v > 0)
        lines.append([label, "-" if measured is None else f"{measured:.3f}", f"{pred.seconds:.3f}", ratio, f"{pred.binding} ({busy})"])
    sources = sorted({pred.hardware.split(", link ")[0] for pred in predicted.values() if pred.hardware})
    return [
        "the time model (chunkstar.dryrun on this machine, calibrated by measurement; target: predicted / measured in 0.80-1.20):",
        text_table(["system", "measured s/step", "predicted s/step", "predicted / measured", "binding (busy s)"], lines),
        *(f"calibration: {src}" for src in sources),
        "",
    ]


def report(
    settings: OverlapSettings, pooled: Mapping[str, Pooled], verdicts: Sequence[Verdict], rounds: int,
    predicted: Mapping[str, Predicted] | None = None,
) -> str:  # fmt: skip
    """The table as text: the workload, one line per row, the targets, the time model's
    predictions beside the measured steps (when ``predicted``), per-row notes."""
    model = get(MODEL)
    params = n_params(model)
    head = (
        f"{MODEL} (GPT-2 hidden {model.hidden}, {model.layers} layers, vocab {model.vocab}), {params:,} parameters "
        f"({params * 2 / MIB:.1f} MiB in bf16); batch {_BATCH} x seq {_SEQ}; {_THREADS} torch thread; "
        f"{settings.warmup} warm-up + {settings.steps} timed steps x {rounds} rounds; pressured budgets: "
        f"{settings.budget_fraction:g} of the bf16 parameter bytes + {NON_MODEL_BYTES / 1e6:.0f} MB non-model"
    )
    base = pooled["pytorch"].median_s if "pytorch" in pooled and pooled["pytorch"].ok else None
    lines: list[list[str]] = []
    for p in pooled.values():
        if not p.ok:
            failure = p.failure
            lines.append([p.row.label, failure.status if failure else "error", "-", "-", "-"])
            continue
        ratio = f"{p.median_s / base:.2f}x" if base else "-"
        lines.append([p.row.label, f"{p.median_s:.3f}", ratio, f"{p.peak_host_bytes / MIB:.0f}", f"{p.losses[-1]:.4f}"])
    body = text_table(["system", "median s/step", "vs PyTorch", "peak RSS MiB", "last loss"], lines)
    return "\n".join(
        [head, "", body, "", verdict_table(verdicts), "", *_model_table(pooled, predicted or {}), *notes(pooled, _details),
         *other_load(pooled)]
    )  # fmt: skip


def _details(name: str, p: Pooled) -> list[str]:
    """What the notes say of a row that ran: its budget and chunk moves, and ``chunkstar-free``'s measured non-model peak."""
    out: list[str] = []
    first = p.records[0]
    moves = first.details.get("chunk_moves_per_timed_step")
    if moves is not None and first.details.get("device_budget_bytes") is not None:
        out.append(
            f"{name}: budget {first.details['device_budget_bytes'] / MIB:.0f} MiB, per timed step "
            f"{moves.get('chunk_moves_to_device', 0):.1f} chunk moves to the device, "
            f"{moves.get('chunk_moves_to_host', 0):.1f} to the host"
        )
    measured = first.details.get("chunkstar_stats", {}).get("warmup_non_model_peak_bytes")
    if name == "chunkstar-free" and measured:
        out.append(
            f"{name}: measured non-model peak {measured / 1e6:.0f} MB "
            f"(the pressured budgets leave {NON_MODEL_BYTES / 1e6:.0f} MB)"
        )
    return out
