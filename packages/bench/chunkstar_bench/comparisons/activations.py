"""The activations table (issue 27): keep, recompute, offload and ``auto`` under one pressured device budget.

What it measures
    One training step (the harness's: forward, backward, clipping at 1.0, AdamW,
    zero_grad) of ``gpt2-30m-v8k-1k`` (29.9M parameters: GPT-2 hidden 512, 8
    layers, vocab 8192, 1024 positions), batch 2 x seq 256, with chunkstar on the
    CPU virtual device behind an emulated 8 GB/s link (``device_link_bandwidth``,
    every chunk and activation copy takes at least bytes / bandwidth; ``overlap``
    on), for these rows, each run its own process:

    ``keep-free``              ``keep`` (PyTorch's behaviour), a budget that holds everything
    ``hf-checkpointing-free``  Hugging Face's ``gradient_checkpointing_enable()`` (every block
                               recomputed; the engine's block wrapper steps aside), same free budget
    ``keep``                   ``keep`` at the *pressured* budget: expected to stop with
                               chunkstar's ``DeviceMemoryError``, shown as the row's result
    ``hf-checkpointing``       HF checkpointing at the pressured budget
    ``offload``                ``"activations": {"policy": "offload"}``: every block's saved
                               tensors to the host and back
    ``auto``                   ``"activations": {"policy": "auto"}``: measured with every block
                               offloaded in the warm-up, then keep / recompute / offload planned
                               per block within the budget (Note [activation plan])
    ``auto-free``              ``auto`` at the free budget (it should keep every block)

    The pressured budget is sized on the two free rows, which run first: their
    ``minimum_budget_bytes`` (the least ``device_memory_budget`` that held the
    warm-up) are keep's and full checkpointing's needs, and the budget is
    checkpointing's plus ``--pressure-fraction`` (0.5) of the gap, so keep cannot
    fit and checkpointing can; ``--pressure-budget-mib`` fixes it instead. The
    table's head says how it was chosen.

    Then the longest sequence that trains under that same budget, for ``auto``
    and ``hf-checkpointing``: ``--search-seqs`` (256, 384, 512, 768, 1024, i.e.
    1x-4x the table's), ascending, each its own short run -- HF checkpointing 2
    iterations (the engine's traced warm-up, where a budget too small shows),
    ``auto`` 3 (its measuring warm-up and the first iteration under its plan) --
    until the first that does not fit. The table's own rows answer for seq 256.

Why this workload, not the issue's 51.5M GPT-2 in bf16 at 2 x 1024
    Measured on this project's 2-core CPU machine (AMD EPYC, AVX2, no AVX-512 BF16
    or AMX) in December 2026: a bf16 matmul runs at ~0.3 GFLOP/s there against
    15-20 for fp32, and the first warm-up step of ``gpt2-51m`` at 2 x 1024 in
    bf16 took 1098 s. So the rows compute in fp32 (``--precision``; chunkstar's
    master and Adam state are fp32 either way), with an 8192-token vocabulary
    (GPT-2's 50257 would make the logits dominate both the compute and the
    non-model memory, which no block policy touches) at 2 x 256. The issue's
    workload is ``--model gpt2-51m --precision bf16 --seq 1024 --search-seqs
    1024`` (gpt2-51m has 1024 positions), on a machine with fast bf16.

How long it takes
    Default: 3 warm-up steps (auto: 7, the measuring warm-up, two traced steps
    under its plan, the first frozen one, timed per block, and two more traced
    should those times change the plan) + 4 timed steps per row and round;
    then the search's runs of 2-3 steps each. Measured on this machine with
    nothing else running: 10.1 minutes with ``--rounds 3`` (steps of 1.6-2.1
    s), the rounds interleaved row by row; under foreign load steps ran 2-10x
    slower.

How to read it
    ``s/step`` is the median of the timed steps (pooled over ``--rounds``).
    ``device peak`` is the engine's ``device_peak_bytes`` (the CPU device's
    meter: chunks plus the non-model bytes it measured at the same instant; with
    a free budget every chunk stays resident, so it is mostly the model's);
    ``needs`` its ``minimum_budget_bytes``. ``act MiB ->host / ->dev`` are the
    activation bytes the last step offloaded each way, ``blocks k/r/o`` the
    blocks kept / recomputed / offloaded (HF checkpointing: the model's own
    recomputation). ``loss @N`` is the loss of step N, the last step every row
    ran (auto's warm-up is longer): it should agree across rows (same weights
    and batches; recomputation and offloading are exact). The targets
    (:data:`TARGETS`, :data:`SEQ_TARGET`): ``auto`` at most 0.85x HF
    checkpointing's step time and faster than ``offload`` under pressure,
    ``auto-free`` within 2% of ``keep-free``, and ``auto``'s longest sequence at
    least HF checkpointing's. A MISS is a finding; the command exits 0.

    Compare the free rows with each other and the pressured rows with each
    other, as the targets do, not across: on a busy machine the free rows ran
    2x slower here, an OpenMP effect, not chunkstar's work (docs/benchmarks.md,
    "Activations").
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chunkstar.config import host_memory_bytes
from chunkstar_bench.comparisons.rounds import (
    BUSY_CORES, Pooled, Row, Target, Unrunnable, Verdict, judge_value, notes, other_load, text_table, verdict_table,
)  # fmt: skip
from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.units import GIB, MIB
from chunkstar_bench.zoo import get, n_params

__all__ = [
    "DEFAULT_SEARCH", "PRESSURED_ROWS", "ROW_NAMES", "SEARCHED", "SEQ_TARGET", "SIZING_ROWS", "TARGETS",
    "ActivationsSettings", "Attempt", "Sizing", "attempt_of", "judge_search", "longest", "loss_step", "report", "rows",
    "search", "size_budget", "sizing",
]  # fmt: skip

SIZING_ROWS: tuple[str, ...] = ("keep-free", "hf-checkpointing-free")
"""The free rows whose measured needs size the pressured budget; they run first."""
PRESSURED_ROWS: tuple[str, ...] = ("keep", "hf-checkpointing", "offload", "auto")
"""The rows under the pressured budget."""
ROW_NAMES: tuple[str, ...] = (*SIZING_ROWS, *PRESSURED_ROWS, "auto-free")
"""Every row, in the order they run and print."""

_POLICY: dict[str, str | None] = {
    "keep-free": None, "hf-checkpointing-free": None, "keep": None, "hf-checkpointing": None,
    "offload": "offload", "auto": "auto", "auto-free": "auto",
}  # fmt: skip
"""Each row's ``activations.policy`` (None: the engine's default, keep)."""

TARGETS: tuple[Target, ...] = (
    Target("auto", "hf-checkpointing", "step", "<=", 0.85, "step time auto / hf-checkpointing (pressured)"),
    Target("auto", "offload", "step", "<", 1.00, "step time auto / offload (pressured)"),
    Target("auto-free", "keep-free", "step", "<=", 1.02, "step time auto-free / keep-free"),
    Target("offload", "hf-checkpointing", "step", None, text="step time offload / hf-checkpointing (pressured)"),
    Target("hf-checkpointing-free", "keep-free", "step", None, text="step time hf-checkpointing-free / keep-free"),
)
"""The issue's step-time targets (``None``: context only)."""
SEQ_TARGET = Target("auto", "hf-checkpointing", "seq", ">=", 1.00, "longest sequence auto / hf-checkpointing")
"""The issue's sequence target, judged on :func:`search` (:func:`judge_search`)."""

SEARCHED: dict[str, tuple[int, int]] = {"hf-checkpointing": (1, 1), "auto": (2, 1)}
"""The rows whose longest sequence is searched, and each attempt's (warm-up, timed) steps: the
engine's two traced warm-up iterations for HF checkpointing (where a budget too small shows);
auto's two measuring iterations and the first under its plan."""
DEFAULT_SEARCH: tuple[int, ...] = (256, 384, 512, 768, 1024)
"""The sequence lengths searched: 1x-4x the table's 256."""

_FREE_BUDGET = min(16 * GIB, host_memory_bytes() or 16 * GIB)  # all resident, and at most what the host has


@dataclass(frozen=True)
class ActivationsSettings:
    """The workload of every row, the budgets, and the search."""

    model: str = "gpt2-30m-v8k-1k"
    batch: int = 2
    seq: int = 256
    precision: str = "fp32"
    """``"fp32"`` or ``"bf16"`` (:attr:`~chunkstar_bench.runner.RunSpec.chunkstar_precision`)."""
    steps: int = 4
    """Timed steps per row and round."""
    warmup: int = 3
    """Untimed steps of the fixed policies: the engine's two traced iterations and the first frozen one."""
    auto_warmup: int = 7
    """Untimed steps of the auto rows: two measuring, two traced under the plan, the first frozen
    (timed per block, Note [activation plan]) and, should its times change the plan, two traced again."""
    seed: int = 0
    threads: int | None = None
    """torch threads in every run; None: the cores."""
    link: str = "8GB/s"
    """The emulated device link of every row (``device_link_bandwidth``)."""
    free_budget_bytes: int = _FREE_BUDGET
    pressure_fraction: float = 0.5
    """The pressured budget: HF checkpointing's measured need plus this fraction of the gap to keep's."""
    pressure_budget_bytes: int | None = None
    """The pressured budget in bytes; overrides the measured one."""
    search_seqs: tuple[int, ...] = DEFAULT_SEARCH
    """The longest-sequence search's lengths (empty: no search)."""
    hardware: str = "cpu"

    def check(self) -> None:
        """A ValueError for settings no run could take (checked before anything runs)."""
        model = get(self.model)  # a KeyError naming the zoo
        for seq in (self.seq, *self.search_seqs):
            if not 0 < seq <= model.seq_len:
                raise ValueError(f"seq_len {seq} is not within {self.model}'s 1-{model.seq_len} positions")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision {self.precision!r} is not fp32 or bf16")
        if not 0.0 < self.pressure_fraction < 1.0:
            raise ValueError(f"the pressure fraction must be within (0, 1), got {self.pressure_fraction}")


@dataclass(frozen=True)
class Sizing:
    """The pressured budget and where it came from."""

    budget: int
    keep_needs: int | None = None
    """``keep-free``'s ``minimum_budget_bytes``; None when the budget was given."""
    hf_needs: int | None = None
    """``hf-checkpointing-free``'s."""
    fraction: float | None = None

    def describe(self) -> str:
        if self.keep_needs is None or self.hf_needs is None or self.fraction is None:
            return f"pressured budget: {self.budget / MIB:.1f} MiB, as given (--pressure-budget-mib)"
        return (
            f"pressured budget: {self.budget / MIB:.1f} MiB = hf-checkpointing-free's need {self.hf_needs / MIB:.1f} MiB "
            f"+ {self.fraction:g} x (keep-free's need {self.keep_needs / MIB:.1f} MiB - {self.hf_needs / MIB:.1f} MiB), "
            "the needs being each free row's minimum_budget_bytes (the least device_memory_budget that held its warm-up): "
            "keep cannot fit, full checkpointing can"
        )


def size_budget(keep_needs: int, hf_needs: int, fraction: float) -> int:
    """A budget between full checkpointing's need and keep's: ``hf + fraction * (keep - hf)``."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the pressure fraction must be within (0, 1), got {fraction}")
    if keep_needs <= hf_needs:
        raise ValueError(
            f"keep needs {keep_needs} bytes, no more than full checkpointing's {hf_needs}: "
            "no budget keeps keep out and lets checkpointing in"
        )
    return hf_needs + int(fraction * (keep_needs - hf_needs))


def _needs(record: RunRecord | None) -> int | None:
    """A run's ``minimum_budget_bytes`` from its engine stats; a DeviceMemoryError's smallest budget; None."""
    if record is None:
        return None
    if record.status == "ok":
        value = record.details.get("chunkstar_stats", {}).get("minimum_budget_bytes")
    else:
        value = (record.details.get("device_memory_error") or {}).get("minimum_budget_bytes")
    return int(value) if value else None


def sizing(settings: ActivationsSettings, latest: Mapping[str, RunRecord]) -> Sizing:
    """The pressured budget for ``settings`` from the free rows' latest records; :class:`Unrunnable`
    when they did not run or failed (and no budget was given)."""
    if settings.pressure_budget_bytes is not None:
        return Sizing(settings.pressure_budget_bytes)
    found = {name: latest.get(name) for name in SIZING_ROWS}
    missing = [name for name, r in found.items() if r is None or r.status != "ok" or _needs(r) is None]
    if missing:
        raise Unrunnable(f"the pressured budget is sized on {' and '.join(SIZING_ROWS)}, and {', '.join(missing)} did not measure")
    keep, hf = _needs(found["keep-free"]), _needs(found["hf-checkpointing-free"])
    assert keep is not None and hf is not None
    try:
        budget = size_budget(keep, hf, settings.pressure_fraction)
    except ValueError as err:
        raise Unrunnable(str(err)) from None
    return Sizing(budget, keep, hf, settings.pressure_fraction)


def _spec(settings: ActivationsSettings, name: str, budget: int | str | None, seq: int | None = None) -> RunSpec:
    policy = _POLICY[name]
    return RunSpec(
        system="chunkstar", model=settings.model, batch=settings.batch, seq_len=seq or settings.seq,
        steps=settings.steps, warmup=settings.auto_warmup if policy == "auto" else settings.warmup, seed=settings.seed,
        threads=settings.threads, hardware=settings.hardware, chunkstar_budget=budget, chunkstar_link=settings.link,
        chunkstar_activations=policy, chunkstar_precision=settings.precision,
        hf_checkpointing=name.startswith("hf-checkpointing"),
    )  # fmt: skip


def rows(settings: ActivationsSettings, names: Sequence[str] = ROW_NAMES) -> list[Row]:
    """The rows ``names`` (in :data:`ROW_NAMES` order) for ``settings``; the pressured ones size their
    budget on the free rows' records as they run (:func:`sizing`)."""
    unknown = sorted(set(names) - set(ROW_NAMES))
    if unknown:
        raise ValueError(f"unknown rows {unknown}; choose from {', '.join(ROW_NAMES)}")
    settings.check()
    if settings.pressure_budget_bytes is None and set(names) & set(PRESSURED_ROWS) and not set(SIZING_ROWS) <= set(names):
        raise ValueError(
            f"the pressured rows' budget is sized on {' and '.join(SIZING_ROWS)}: run them too, or give --pressure-budget-mib"
        )

    def pressured(spec: RunSpec, latest: Mapping[str, RunRecord]) -> RunSpec:
        return dataclasses.replace(spec, chunkstar_budget=sizing(settings, latest).budget)

    out = []
    for name in ROW_NAMES:
        if name not in names:
            continue
        if name in PRESSURED_ROWS:
            # the budget is set before each run (refine); until then the given one, or none yet
            out.append(Row(name, name, _spec(settings, name, settings.pressure_budget_bytes), refine=pressured))
        else:
            out.append(Row(name, name, _spec(settings, name, settings.free_budget_bytes)))
    return out


# --------------------------------------------------------------------------- the longest sequence


@dataclass(frozen=True)
class Attempt:
    """One sequence length tried under the fixed budget."""

    row: str
    seq: int
    outcome: str
    """``fits``, ``DeviceMemoryError``, ``oom`` (host memory) or ``error``."""
    needs: int | None = None
    """The smallest budget the engine said would have held it (a DeviceMemoryError's), or what it needed."""
    message: str = ""
    from_table: bool = False
    """The table's own row at this length and budget, not a run of the search."""

    @property
    def fits(self) -> bool:
        return self.outcome == "fits"

    def cell(self) -> str:
        if self.fits:
            return "fits"
        if self.outcome == "DeviceMemoryError":
            return "DME" + (f" (needs {self.needs / MIB:.0f})" if self.needs else "")
        return self.outcome

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def attempt_of(row: str, seq: int, record: RunRecord, from_table: bool = False) -> Attempt:
    """What a run at ``seq`` says of fitting: it trained, or the engine refused the budget, or it failed otherwise."""
    if record.status == "ok":
        return Attempt(row, seq, "fits", _needs(record), from_table=from_table)
    dme = record.details.get("device_memory_error")
    outcome = "DeviceMemoryError" if dme is not None else record.status
    return Attempt(row, seq, outcome, _needs(record), record.message, from_table)


def longest(attempts: Sequence[Attempt]) -> int | None:
    """The longest length that trained before the first that did not (ascending); None: not even the first."""
    best = None
    for a in sorted(attempts, key=lambda a: a.seq):
        if not a.fits:
            break
        best = a.seq
    return best


def search(
    settings: ActivationsSettings, budget: int, pooled: Mapping[str, Pooled], timeout_s: float,
    on_record: Callable[[Row, RunRecord], None] | None = None, runner: Callable[[RunSpec, float], RunRecord] | None = None,
) -> dict[str, list[Attempt]]:
    """For each row of :data:`SEARCHED` among ``pooled``, the lengths of ``settings.search_seqs``
    tried in ascending order under ``budget`` until the first that does not fit, each run by
    ``runner`` (default :func:`chunkstar_bench.runner.run`). At the table's own length the
    table's row (run at this budget) answers without another run."""
    runner = runner or run
    out: dict[str, list[Attempt]] = {}
    for name, (warmup, steps) in SEARCHED.items():
        if name not in pooled:
            continue
        tried: list[Attempt] = []
        for seq in sorted(set(settings.search_seqs)):
            own = pooled[name]
            first = own.records[0] if own.records else None
            if seq == settings.seq and first is not None and first.spec.chunkstar_budget == budget and first.status != "error":
                tried.append(attempt_of(name, seq, first, from_table=True))
            else:
                spec = dataclasses.replace(_spec(settings, name, budget, seq), warmup=warmup, steps=steps)
                print(f"[longest sequence] {name} at seq {seq} under {budget / MIB:.1f} MiB ...", file=sys.stderr, flush=True)
                record = runner(spec, timeout_s)
                record.details["row"] = f"longest-seq {name} {seq}"
                if on_record is not None:
                    on_record(Row(record.details["row"], record.details["row"], spec), record)
                tried.append(attempt_of(name, seq, record))
                print(f"[longest sequence] {name} at seq {seq}: {tried[-1].cell()}", file=sys.stderr, flush=True)
            if not tried[-1].fits:
                break
        out[name] = tried
    return out


def judge_search(found: Mapping[str, Sequence[Attempt]]) -> Verdict | None:
    """:data:`SEQ_TARGET` on the search; None when one of its rows was not searched."""
    t = SEQ_TARGET
    if t.numerator not in found or t.denominator not in found:
        return None
    num, den = longest(found[t.numerator]), longest(found[t.denominator])
    if num is None and den is None:
        return judge_value(t, None)
    if den is None:
        return judge_value(t, float("inf"))
    return judge_value(t, (num or 0) / den)


# --------------------------------------------------------------------------- the report


def _stats(p: Pooled) -> dict[str, Any]:
    return dict(p.records[0].details.get("chunkstar_stats", {})) if p.records else {}


def _policy(spec: RunSpec) -> str:
    return "HF checkpointing" if spec.hf_checkpointing else spec.chunkstar_activations or "keep"


def _blocks(p: Pooled, layers: int) -> str:
    """Blocks kept / recomputed / offloaded: the engine's counts, or what the fixed policy means."""
    counts = _stats(p).get("activation_blocks") or {}
    if counts:
        return f"{counts.get('keep', 0)}/{counts.get('checkpoint', 0)}/{counts.get('offload', 0)}"
    if p.row.spec.hf_checkpointing:
        return f"0/{layers}/0 (HF)"
    return f"{layers}/0/0"


def _result(p: Pooled) -> str:
    failure = p.failure
    if failure is None:
        return "ok"
    dme = failure.details.get("device_memory_error")
    if dme is not None:
        needs = dme.get("minimum_budget_bytes")
        return "DeviceMemoryError" + (f", needs {needs / MIB:.1f} MiB" if needs else "")
    return failure.status


def _budget(p: Pooled) -> str:
    budget = p.records[0].spec.chunkstar_budget if p.records else None
    return f"{budget / MIB:.1f}" if isinstance(budget, int) else "-"


def loss_step(pooled: Mapping[str, Pooled]) -> int | None:
    """The last step every row that ran has a loss for (1-based): the rows run different warm-ups
    (auto's is longer), so their last losses are of different steps; this one's should agree."""
    counts = [len(p.losses) for p in pooled.values() if p.ok and p.losses]
    return min(counts) if counts else None


def _row_cells(p: Pooled, layers: int, step: int | None) -> list[str]:
    cells = [p.row.name, _policy(p.row.spec), _budget(p), _result(p)]
    if not p.ok:
        return [*cells, *["-"] * 7]
    stats = _stats(p)
    peak = stats.get("device_peak_bytes")
    needs = stats.get("minimum_budget_bytes")
    return [
        *cells, f"{p.median_s:.3f}", "-" if peak is None else f"{peak / MIB:.1f}", "-" if not needs else f"{needs / MIB:.1f}",
        f"{(stats.get('activation_step_bytes_to_host') or 0) / MIB:.1f}",
        f"{(stats.get('activation_step_bytes_to_device') or 0) / MIB:.1f}", _blocks(p, layers),
        "-" if step is None else f"{p.losses[step - 1]:.4f}",
    ]  # fmt: skip


def _search_table(settings: ActivationsSettings, found: Mapping[str, Sequence[Attempt]], budget: int | None) -> list[str]:
    if not found:
        return []
    seqs = sorted(set(settings.search_seqs))
    lines = []
    for name, tried in found.items():
        by_seq = {a.seq: a.cell() for a in tried}
        best = longest(tried)
        ceiling = " (the longest searched)" if best is not None and best == seqs[-1] else ""
        lines.append([name, *(by_seq.get(s, "-") for s in seqs), ("none" if best is None else str(best)) + ceiling])
    where = "-" if budget is None else f"{budget / MIB:.1f} MiB"
    head = (
        f"longest sequence under the pressured budget ({where}), batch {settings.batch}, ascending until the first "
        "that does not fit (DME: DeviceMemoryError, with the smallest budget in MiB it named; "
        + ", ".join(f"{n}: {w} warm-up + {s} step" for n, (w, s) in SEARCHED.items())
        + f"; at seq {settings.seq} the table's row answers):"
    )
    return [head, text_table(["row", *(str(s) for s in seqs), "longest"], lines), ""]


def report(
    settings: ActivationsSettings, pooled: Mapping[str, Pooled], verdicts: Sequence[Verdict], rounds: int,
    chosen: Sizing | None = None, found: Mapping[str, Sequence[Attempt]] | None = None,
) -> str:  # fmt: skip
    """The table as text: the workload and how the budget was chosen, one line per row, the targets,
    the longest-sequence search, per-row notes (auto's plan), the foreign load."""
    model = get(settings.model)
    params = n_params(model)
    head = [
        "chunkstar activations benchmark: keep, recompute, offload, auto (issue 27)"
        + ("" if settings.hardware == "cpu" else f" ({settings.hardware})"),
        f"model: {model.name} (GPT-2 hidden {model.hidden}, {model.layers} layers, {model.heads} heads, vocab "
        f"{model.vocab}, {model.seq_len} positions), {params:,} parameters; {settings.precision}, AdamW, clipping 1.0",
        f"batch {settings.batch} x seq {settings.seq}; CPU virtual device behind an emulated {settings.link} link, overlap on; "
        f"{settings.warmup} warm-up (auto: {settings.auto_warmup}) + {settings.steps} timed steps"
        + (f" per round, {rounds} rounds pooled" if rounds > 1 else "") + f"; seed {settings.seed}",
        f"free budget: {settings.free_budget_bytes / GIB:.1f} GiB",
        chosen.describe() if chosen is not None else "pressured budget: not sized (its rows were not run, or the free rows failed)",
    ]
    step = loss_step(pooled)
    lines = [_row_cells(p, model.layers, step) for p in pooled.values()]
    headers = [
        "row", "policy", "budget MiB", "result", "s/step", "device peak MiB", "needs MiB", "act MiB ->host",
        "act MiB ->dev", "blocks k/r/o", "loss" if step is None else f"loss @{step}",
    ]  # fmt: skip
    body = text_table(headers, lines)
    ok_losses = [p.losses[step - 1] for p in pooled.values() if p.ok and step is not None]
    agree = (
        f"loss @{step}: the loss of step {step}, the last every row ran (auto's warm-up is longer); "
        f"the rows' are within {max(ok_losses) - min(ok_losses):.1e} of each other"
        if len(ok_losses) > 1 else ""
    )  # fmt: skip
    busy = {name: p.other_load for name, p in pooled.items() if (p.other_load or 0.0) > BUSY_CORES}
    warning = (
        "WARNING: other processes kept the CPU busy during the timed steps of "
        + ", ".join(f"{name} ({load:.2f} cores)" for name, load in busy.items())
        + "; read those step times and ratios with care (rerun on a quiet machine, or with --rounds 2)."
        if busy else ""
    )  # fmt: skip
    return "\n".join(
        [*head, "", body, *([agree] if agree else []), *([warning] if warning else []), "", verdict_table(verdicts), "",
         *_search_table(settings, found or {}, chosen.budget if chosen is not None else None),
         *notes(pooled, _details), *other_load(pooled)]
    )  # fmt: skip


def _details(name: str, p: Pooled) -> list[str]:
    """What the notes say of a row that ran: an auto row's plan, and its per-round medians."""
    out: list[str] = []
    stats = _stats(p)
    plan = stats.get("activation_plan")
    if plan:
        by_choice: dict[str, list[str]] = {}
        for block, choice in plan.get("blocks", {}).items():
            by_choice.setdefault(choice, []).append(block.rsplit(".", 1)[-1])
        choices = "; ".join(f"{choice} {','.join(blocks)}" for choice, blocks in by_choice.items())
        saved = sum(plan.get("saved_bytes", {}).values())
        link = plan.get("link_bytes_per_second") or 0.0
        out.append(
            f"{name}: plan per block (transformer.h.N) {choices}; predicted {plan.get('predicted_step_seconds', 0):.3f} "
            f"s for the parts of a step it changes; blocks' saved bytes {saved / MIB:.1f} MiB per step; link measured "
            f"{link / 1e9:.2f} GB/s; fits {plan.get('fits')}, least room {(plan.get('least_room_bytes') or 0) / MIB:.1f} MiB; "
            f"fallbacks {stats.get('activation_plan_fallbacks', 0)}"
        )
    if len(p.records) > 1:
        out.append(f"{name}: median per round (s): " + ", ".join(f"{r.step_time_s or 0:.3f}" for r in p.records))
    return out
