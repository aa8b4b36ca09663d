"""The step-time table: chunkstar beside plain PyTorch and DeepSpeed, with the issue's ratio targets.

What it measures
    One training step (the harness's: forward, backward, clipping at 1.0,
    AdamW, zero_grad; bf16) of a zoo GPT-2 -- by default ``gpt2-51m``, 51.5M
    parameters, batch 4 x seq 256 -- for these rows, each run its own process:

    ``pytorch``             fp32 params, ``torch.autocast(bfloat16)``, fused AdamW
    ``chunkstar``           chunkstar with a device budget far above the model data (``--free-budget-gib``)
    ``chunkstar-pressure``  chunkstar with a budget of the non-model peak the ``chunkstar`` row
                            measured in its warm-up plus ``--pressure-fraction`` of the bf16
                            parameter bytes (the device holds activations too, so a budget of
                            that fraction alone could not even hold them); without a
                            ``chunkstar`` row before it, the estimated activations stand in
                            (``chunkstar_budget="params:F"``), and ``--pressure-budget-mib``
                            overrides both
    ``deepspeed``           DeepSpeed ZeRO-3, params and optimizer offloaded to CPU, bf16
    ``fsdp2``               FSDP2 with CPUOffloadPolicy (not run unless asked for)

    and the overhead case, a workload of its own where the step is short and every
    chunk is resident, so what chunkstar adds to plain PyTorch (hooks, the optimizer's
    passes, the heap) shows: ``gpt2-49m-v8k`` (48.9M parameters: hidden 768, 6 layers,
    vocab 8192), batch 4 x 128, no gradient clipping (``--overhead-model``,
    ``--overhead-batch``, ``--overhead-seq``):

    ``pytorch-overhead``    plain PyTorch as above, on the overhead case
    ``chunkstar-overhead``  chunkstar with the free budget, on the overhead case

How to read it
    ``median s`` pools the timed steps of every round (``min``/``max`` show the
    spread; a shared machine's seconds vary, so compare ratios from one run).
    ``first loss`` and ``last loss`` should agree across rows to about 1e-2
    (same weights, same batches, same AdamW steps; bf16 rounding differs): a
    row whose losses drift trains something else and its time means nothing.
    ``other load`` is how many cores other processes kept busy during the
    timed steps; above :data:`~chunkstar_bench.comparisons.rounds.BUSY_CORES`
    the report warns. The targets (:data:`TARGETS`): chunkstar at most 1.10x
    PyTorch's step time without pressure and 1.30x under pressure, DeepSpeed at
    least 1.8x slower than chunkstar, chunkstar's peak RSS below DeepSpeed's, and
    on the overhead case chunkstar at most 1.05x PyTorch (issue 17, section 4).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from chunkstar.config import host_memory_bytes
from chunkstar_bench.comparisons.rounds import BUSY_CORES, Pooled, Row, Target, Verdict, notes, text_table, verdict_table
from chunkstar_bench.runner import RunRecord, RunSpec
from chunkstar_bench.units import GIB, MIB
from chunkstar_bench.zoo import get, n_params

__all__ = ["DEFAULT_ROWS", "OVERHEAD_ROWS", "ROW_NAMES", "TARGETS", "StepTimeSettings", "report", "rows"]

ROW_NAMES: tuple[str, ...] = (
    "pytorch", "chunkstar", "chunkstar-pressure", "deepspeed", "fsdp2", "pytorch-overhead", "chunkstar-overhead",
)  # fmt: skip
"""Every row the table knows, in the order they run and print."""
OVERHEAD_ROWS: tuple[str, ...] = ("pytorch-overhead", "chunkstar-overhead")
"""The rows of the overhead case (their own model, batch and no clipping)."""
DEFAULT_ROWS: tuple[str, ...] = ("pytorch", "chunkstar", "chunkstar-pressure", "deepspeed", *OVERHEAD_ROWS)
"""The rows run unless ``--systems`` says otherwise."""

TARGETS: tuple[Target, ...] = (
    Target("chunkstar", "pytorch", "step", "<=", 1.10),
    Target("chunkstar-pressure", "pytorch", "step", "<=", 1.30),
    Target("deepspeed", "chunkstar", "step", ">=", 1.80),
    Target("deepspeed", "chunkstar-pressure", "step", ">=", 1.80),
    Target("deepspeed", "pytorch", "step", None),
    Target("fsdp2", "chunkstar", "step", None),
    Target("chunkstar", "deepspeed", "rss", "<", 1.00),
    Target("chunkstar-pressure", "deepspeed", "rss", "<", 1.00),
    Target("chunkstar-overhead", "pytorch-overhead", "step", "<=", 1.05),
)
"""The benchmark issue's targets (``None``: context only)."""


@dataclass(frozen=True)
class StepTimeSettings:
    """The workload of every row of the table."""

    model: str = "gpt2-51m"
    """A zoo name."""
    batch: int = 4
    seq: int = 256
    steps: int = 8
    """Timed steps per row and round."""
    warmup: int = 2
    seed: int = 0
    threads: int | None = None
    """torch threads in every run; None: the cores."""
    free_budget_bytes: int = min(16 * GIB, host_memory_bytes() or 16 * GIB)  # the cpu device is host memory
    """``chunkstar``'s device budget (far above the model data)."""
    pressure_fraction: float = 0.6
    """``chunkstar-pressure``: room for chunks as this fraction of the bf16 parameter bytes. 0.6, not 0.5:
    gpt2-51m's tied 50257 x 512 embedding alone is 52% of them and must sit on the device beside one block's chunk."""
    pressure_budget_bytes: int | None = None
    """``chunkstar-pressure``'s budget in bytes; overrides the measured one."""
    hardware: str = "cpu"
    overhead_model: str = "gpt2-49m-v8k"
    """The overhead case's zoo model (its rows: :data:`OVERHEAD_ROWS`)."""
    overhead_batch: int = 4
    overhead_seq: int = 128


def _spec(settings: StepTimeSettings, system: str, chunkstar_budget: int | str | None = None) -> RunSpec:
    return RunSpec(
        system=system, model=settings.model, batch=settings.batch, seq_len=settings.seq, steps=settings.steps,
        warmup=settings.warmup, seed=settings.seed, threads=settings.threads, hardware=settings.hardware,
        chunkstar_budget=chunkstar_budget,
    )  # fmt: skip


def _overhead_spec(settings: StepTimeSettings, system: str, chunkstar_budget: int | None = None) -> RunSpec:
    """The overhead case: its own model and batch, no gradient clipping."""
    return dataclasses.replace(
        _spec(settings, system, chunkstar_budget), model=settings.overhead_model, batch=settings.overhead_batch,
        seq_len=settings.overhead_seq, clip=0.0,
    )  # fmt: skip


def rows(settings: StepTimeSettings, names: Sequence[str] = DEFAULT_ROWS) -> list[Row]:
    """The rows ``names`` (in :data:`ROW_NAMES` order) for ``settings``."""
    unknown = sorted(set(names) - set(ROW_NAMES))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(ROW_NAMES)}")
    model = get(settings.model)
    pressure_room = int(settings.pressure_fraction * 2 * n_params(model))

    def measured_pressure(spec: RunSpec, latest: Mapping[str, RunRecord]) -> RunSpec:
        free = latest.get("chunkstar")
        if settings.pressure_budget_bytes is not None or free is None or free.status != "ok":
            return spec
        # the device holds activations too: the non-model peak chunkstar measured in its
        # own warm-up, plus the fraction of the bf16 parameter bytes for the chunks
        non_model = int(free.details.get("chunkstar_stats", {}).get("warmup_non_model_peak_bytes") or 0)
        return dataclasses.replace(spec, chunkstar_budget=non_model + pressure_room)

    pressure_budget: int | str = (
        settings.pressure_budget_bytes if settings.pressure_budget_bytes is not None
        else f"params:{settings.pressure_fraction}"
    )  # fmt: skip
    every = {
        "pytorch": Row("pytorch", "pytorch", _spec(settings, "pytorch")),
        "chunkstar": Row("chunkstar", "chunkstar", _spec(settings, "chunkstar", chunkstar_budget=settings.free_budget_bytes)),
        "chunkstar-pressure": Row(
            "chunkstar-pressure", "chunkstar-pressure", _spec(settings, "chunkstar", chunkstar_budget=pressure_budget),
            refine=measured_pressure,
        ),
        "deepspeed": Row("deepspeed", "deepspeed", _spec(settings, "deepspeed")),
        "fsdp2": Row("fsdp2", "fsdp2", _spec(settings, "fsdp2")),
        "pytorch-overhead": Row("pytorch-overhead", "pytorch-overhead", _overhead_spec(settings, "pytorch")),
        "chunkstar-overhead": Row(
            "chunkstar-overhead", "chunkstar-overhead",
            _overhead_spec(settings, "chunkstar", chunkstar_budget=settings.free_budget_bytes),
        ),
    }
    return [every[name] for name in ROW_NAMES if name in names]


def _ok_cells(p: Pooled) -> list[str]:
    tokens = p.row.spec.batch * p.row.spec.seq
    times = p.step_times
    load = p.other_load
    return [
        "ok", f"{p.median_s:.3f}", f"{min(times):.3f}", f"{max(times):.3f}", f"{tokens / p.median_s:.0f}",
        f"{p.peak_host_bytes / MIB:.0f}", f"{p.losses[0]:.4f}", f"{p.losses[-1]:.4f}", "?" if load is None else f"{load:.2f}",
    ]  # fmt: skip


def report(settings: StepTimeSettings, pooled: Mapping[str, Pooled], verdicts: Sequence[Verdict], rounds: int) -> str:
    """The table as text: the workload, one line per row, the foreign-load warning, the targets, per-row notes."""
    model = get(settings.model)
    tokens = settings.batch * settings.seq
    params = n_params(model)
    head = [
        "chunkstar step-time benchmark"
        + ("" if settings.hardware == "cpu" else f" ({settings.hardware})"),
        f"model: {model.name} (GPT-2 hidden {model.hidden}, {model.layers} layers, {model.heads} heads, vocab "
        f"{model.vocab}, {model.seq_len} positions), {params:,} parameters ({params * 2 / MIB:.1f} MiB in bf16)",
        f"batch {settings.batch} x seq {settings.seq} = {tokens} tokens/step; {settings.warmup} warm-up + "
        f"{settings.steps} timed steps" + (f" per round, {rounds} rounds pooled" if rounds > 1 else "") + f"; seed {settings.seed}",
    ]
    if any(name in pooled for name in OVERHEAD_ROWS):
        small = get(settings.overhead_model)
        head.append(
            f"overhead case ({', '.join(OVERHEAD_ROWS)}): {small.name} (GPT-2 hidden {small.hidden}, {small.layers} layers, "
            f"vocab {small.vocab}), {n_params(small):,} parameters, batch {settings.overhead_batch} x seq "
            f"{settings.overhead_seq}, no gradient clipping, every chunk resident"
        )
    lines = []
    for name, p in pooled.items():
        lines.append([name, *(_ok_cells(p) if p.ok else [p.failure.status if p.failure else "error", *["-"] * 8])])
    headers = ["system", "status", "median s", "min s", "max s", "tokens/s", "peak RSS MiB", "first loss", "last loss", "other load"]
    body = text_table(headers, lines)
    busy = {name: p.other_load for name, p in pooled.items() if (p.other_load or 0.0) > BUSY_CORES}
    if busy:
        body += (
            "\nWARNING: other processes kept the CPU busy during the timed steps of "
            + ", ".join(f"{name} ({load:.2f} cores)" for name, load in busy.items())
            + "; those step times and ratios are not trustworthy (rerun on a quiet machine, or with --threads 1 or --rounds 3)."
        )
    return "\n".join([*head, "", body, "", verdict_table(verdicts), "", *notes(pooled, _details)])


def _details(name: str, p: Pooled) -> list[str]:
    """What the notes say of a row that ran: its budget and chunk moves, its per-round medians, optimizer and threads."""
    out: list[str] = []
    first = p.records[0]
    if first.details.get("device_budget_bytes") is not None:
        moves = first.details.get("chunk_moves_per_timed_step", {})
        moved = ", ".join(f"{k} {v:,.1f}" for k, v in moves.items() if not k.startswith("disk_"))
        non_model = first.details.get("chunkstar_stats", {}).get("warmup_non_model_peak_bytes")
        out.append(
            f"{name}: budget {first.details['device_budget_bytes'] / MIB:.1f} MiB"
            + (f" (warm-up non-model peak {non_model / MIB:.1f} MiB)" if non_model else "")
            + f"; per timed step: {moved or 'no counters'}"
        )
    if len(p.records) > 1:
        out.append(f"{name}: median per round (s): " + ", ".join(f"{r.step_time_s or 0:.3f}" for r in p.records))
    rss = first.details.get("rss_after_setup_bytes")
    out.append(
        f"{name}: optimizer {first.details.get('optimizer')}; torch threads {first.details.get('torch_threads')}"
        + (f"; RSS after set-up {rss / MIB:.0f} MiB" if rss else "")
    )
    return out
