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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from chunkstar.config import host_memory_bytes
from chunkstar_bench.comparisons.rounds import Pooled, Row, Target, Verdict, notes, text_table, verdict_table
from chunkstar_bench.runner import RunSpec
from chunkstar_bench.units import GIB, MIB
from chunkstar_bench.zoo import get, n_params

__all__ = ["MODEL", "NON_MODEL_BYTES", "ROW_NAMES", "TARGETS", "OverlapSettings", "report", "rows"]

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


def report(settings: OverlapSettings, pooled: Mapping[str, Pooled], verdicts: Sequence[Verdict], rounds: int) -> str:
    """The table as text: the workload, one line per row, the targets, per-row notes."""
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
    return "\n".join([head, "", body, "", verdict_table(verdicts), "", *notes(pooled, _details), *_other_load(pooled)])


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


def _other_load(pooled: Mapping[str, Pooled]) -> list[str]:
    """One line of the foreign CPU load every row saw (the table has no column for it)."""
    load = {name: p.other_load for name, p in pooled.items() if p.other_load is not None}
    if not load:
        return []
    return [
        "other load (cores busy elsewhere during the timed steps, max over rounds): "
        + ", ".join(f"{name} {v:.2f}" for name, v in load.items())
    ]
