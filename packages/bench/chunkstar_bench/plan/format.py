"""The plan as text: one table per node, headed by what it is (a PREDICTION) and what it assumed.

Formats :class:`~chunkstar_bench.plan.rows.PlanRow` lists; computes nothing
(the figures are :mod:`~chunkstar_bench.plan.model`'s).
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkstar.config import DEFAULT_DISK_LISTS

from chunkstar_bench.plan.deepspeed import ADDITIONAL_BUFFER_FACTOR, DeepSpeedVerdict
from chunkstar_bench.plan.dryrun import PATRICKSTAR_CHUNK_ELEMENTS, DryRunPoint, DryRunSettings
from chunkstar_bench.plan.model import DISK_BYTES_PER_ELEMENT, DISK_SYSTEMS, HOST_PER_PROCESS_BYTES, HOST_RESERVED_BYTES, Hardware, Workload
from chunkstar_bench.plan.paper import DISAGREEMENT, LargestRow, PaperRow
from chunkstar_bench.plan.rows import PlanRow
from chunkstar_bench.units import GIB, MIB

__all__ = ["format_dry_run_head", "format_largest", "format_paper_table", "format_plan", "text_table"]


def _fmt_params(n: float) -> str:
    if n != n:  # NaN
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _fmt_gib(n: int) -> str:
    return f"{n / GIB:,.1f}"


def format_plan(hw: Hardware, rows: Sequence[PlanRow], workload: Workload) -> str:
    """The plan as a plain-text table, headed by what it is (a prediction) and what it assumed.

    A row of a disk system (``DISK_SYSTEMS``) adds a ``disk GiB`` column and a line on the disk."""
    with_disk = any(r.system in DISK_SYSTEMS for r in rows)
    head = [
        f"PREDICTION (bytes-per-parameter accounting, not a measurement) for {hw.name}: {hw.note or 'custom node'}",
        f"  {hw.gpus} GPU(s) x {_fmt_gib(hw.gpu_mem_bytes)} GiB ({_fmt_gib(hw.device_usable)} usable each), "
        f"host {_fmt_gib(hw.host_mem_bytes)} GiB ({_fmt_gib(hw.host_usable(hw.gpus))} usable); "
        f"micro-batch {workload.batch} per GPU, seq {workload.seq_len or 'model default'}, bf16",
        "  bytes/param: chunkstar 14 per chunk element (2 param/grad + 4 master + 4 + 4 Adam), sharded over ranks; "
        "deepspeed ZeRO-3 offload 18 on host; fsdp2 (CPU offload) 16 on host; pytorch (DDP) 16 per GPU; "
        "pytorch-fsdp 16/n per GPU",
    ]
    if with_disk:
        budget = workload.staging_budget
        staging = (
            "auto (2 chunks of every disk list)" if budget is None
            else f"{_fmt_gib(budget)} GiB" if budget >= GIB else f"{budget / MIB:,.0f} MiB"
        )  # fmt: skip
        head.append(
            f"  disk {_fmt_gib(hw.disk_bytes)} GiB free for chunk files; chunkstar-disk: {DISK_BYTES_PER_ELEMENT} per chunk "
            f"element on disk ({' + '.join(DEFAULT_DISK_LISTS)}), 2 (param/grad) on device or host, plus staging per process: {staging}"
        )
    head.append("")
    cols = (
        "system", "act.ckpt", "predicted max", "params", "binding", "device GiB/GPU", "host GiB",
        *(("disk GiB",) if with_disk else ()), "chunk elems", "published max", "measured max",
    )  # fmt: skip
    table: list[tuple[str, ...]] = []
    for r in rows:
        best = r.prediction.best
        pub = f"{r.published.label} ({r.published.system}, published)" if r.published else "-"
        meas = f"{r.measured.model} ({_fmt_params(r.measured.n_params)})" if r.measured else "-"
        disk_col = f"{_fmt_gib(best.disk_need)}/{_fmt_gib(best.disk_usable)}" if best and r.system in DISK_SYSTEMS else "-"
        table.append(
            (
                r.system,
                "on" if r.checkpointing else "off",
                best.model if best else "(none fits)",
                _fmt_params(best.n_params) if best else "-",
                r.prediction.binding,
                f"{_fmt_gib(best.device_need)}/{_fmt_gib(best.device_usable)}" if best else "-",
                f"{_fmt_gib(best.host_need)}/{_fmt_gib(best.host_usable)}" if best else "-",
                *((disk_col,) if with_disk else ()),
                f"{best.chunk_elements / 1e6:,.0f}M" if best and best.chunk_elements else "-",
                pub,
                meas,
            )
        )
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = head + [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*t) for t in table]
    lines += [
        "",
        "binding: the constraint the next larger zoo model breaks (device: activations + working set [+ model data] "
        "per GPU; host: model data the GPUs cannot hold"
        + ("; disk: the chunk files; staging: a staging budget below one chunk's state, which the engine refuses)." if with_disk else ")."),
        "published: the largest model the paper reports per system on this node at this GPU count (read off its figures).",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- dry runs


def text_table(cols: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> list[str]:
    """Left-aligned columns two spaces apart, a rule under the header; or a Markdown table."""
    if markdown:
        def cells(r: Sequence[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |"

        return [cells(cols), "|" + "|".join("---" for _ in cols) + "|"] + [cells(r) for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols).rstrip(), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r).rstrip() for r in rows]


def _chunk(p: DryRunPoint) -> str:
    used = p.chunk_elements or p.chunk_size
    text = "auto" if p.chunk_size is None else f"{p.chunk_size / 2**20:,.0f}M"
    if p.chunk_size is None and used:
        text = f"auto={used / 2**20:,.0f}M"
    if p.tries:
        text += " (" + "; ".join(p.tries) + ")"
    if p.disk:
        text += ", Adam state on disk"
    return text


def _verdict(p: DryRunPoint) -> str:
    why = p.why_not
    return "fits" if why is None else "ERROR" if why == "error" else f"no: {why}"


def _binding(p: DryRunPoint) -> str:
    """The busiest resource and the next two, each's busy seconds, over the step: ``compute 4.9, h2d 3.1,
    interconnect 1.9 of 9.9 s`` (a step longer than its busiest resource waits on the others' order)."""
    if not p.binding or not p.seconds:
        return "-"
    top = sorted((k for k, v in p.busy.items() if v > 0 and k != p.binding), key=lambda k: -p.busy[k])[:2]
    parts = [f"{k} {p.busy.get(k, 0.0):.1f}" for k in (p.binding, *top)]
    return f"{', '.join(parts)} of {p.seconds:.1f} s"


def _ds(v: DeepSpeedVerdict | None) -> str:
    if v is None:
        return "-"
    head = "fits" if v.fits else f"no: {v.binding}"
    return f"{head} ({v.cpu_bytes / GIB:,.0f}/{v.host_bytes / GIB:,.0f} host, {v.gpu_bytes / GIB:.1f}/{v.device_bytes / GIB:.1f} GPU)"


def _tf(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def format_dry_run_head(settings: DryRunSettings, markdown: bool = False) -> list[str]:
    """What every dry-run table assumed, in a few lines (Markdown: a list)."""
    chunk = (
        f"{settings.chunk_size:,} elements" if settings.chunk_size
        else f"the engine's auto; where auto does not fit the GPU, PatrickStar's {PATRICKSTAR_CHUNK_ELEMENTS / 2**20:.0f}M (its CS=256)"
    )  # fmt: skip
    lines = [
        "PREDICTION: chunkstar's engine dry-run on the meta device (chunkstar.dry_run) and DeepSpeed's own estimator; "
        "nothing here was measured.",
        f"  workload: Hugging Face GPT-2 (the zoo's paper configs), batch {settings.batch} x "
        f"{settings.seq_len or 'the model sequence (1024 for the paper models)'} tokens per GPU, bf16, "
        f"activation checkpointing {'on' if settings.checkpointing else 'off'}, {settings.steps} steps per dry run; "
        f"chunk size: {chunk}; ranks simulated: {settings.ranks}",
        f"  chunkstar fits: every simulated rank fits the GPU (the hardware description's device memory) and the node's "
        f"host holds the ranks' chunk buffers at their peak (unsimulated ranks counted as the largest) + "
        f"{HOST_RESERVED_BYTES / GIB:.0f} GiB + {HOST_PER_PROCESS_BYTES / GIB:.0f} GiB per process",
        "  predicted TFLOPS/GPU: PatrickStar's count 8*N*B*s over the time model's step (chunkstar.dryrun.timing), "
        "the slowest simulated rank",
        "  DeepSpeed: deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs, offload_param + "
        f"offload_optimizer to CPU, zero_init, buffer factor {ADDITIONAL_BUFFER_FACTOR}: model states only "
        "(no activations), host GiB needed/have per node, GPU GiB needed/have per GPU",
    ]
    if markdown:
        lines = [lines[0], ""] + ["- " + line.strip() for line in lines[1:]]
    return lines


def format_paper_table(rows: Sequence[PaperRow], settings: DryRunSettings, markdown: bool = False) -> str:
    """Every published point with chunkstar's dry run and DeepSpeed's estimator beside it."""
    cols = (
        "node", "GPUs", "model", "params", "PatrickStar", "DeepSpeed", "other published",
        "chunkstar", "min GiB/GPU", "host GiB", "chunk", "s/step", "TFLOPS/GPU", "pred/PS",
        f"binds (>{DISAGREEMENT:.0%} off)", "DeepSpeed estimator",
    )  # fmt: skip
    table: list[tuple[str, ...]] = []
    for r in rows:
        p, c = r.point, r.chunkstar
        others = ", ".join(
            f"{res.system} {res.tflops_per_gpu:.1f}" for s, res in sorted(p.published.items()) if s not in ("patrickstar", "deepspeed")
        )
        common = (
            p.hardware, str(p.gpus), p.label + (f" ({p.spec.name})" if p.spec else ""), _fmt_params(p.n_params),
            _tf(p.published_tflops_per_gpu("patrickstar")), _tf(p.published_tflops_per_gpu("deepspeed")), others or "-",
        )  # fmt: skip
        if c is None:
            table.append((*common, "no config in paper_models.csv", *("-",) * 7, _ds(r.deepspeed)))
            continue
        ratio = r.ratio
        table.append(
            (
                *common,
                _verdict(c),
                f"{c.minimum_budget / GIB:.1f}/{c.device_memory / GIB:.1f}" if c.minimum_budget else "-",
                f"{c.host_need / GIB:,.0f}/{c.host_memory / GIB:,.0f}" if c.host_need else "-",
                _chunk(c),
                f"{c.seconds:.2f}" if c.seconds else "-",
                _tf(c.tflops_per_gpu),
                f"{ratio:.2f}" if ratio is not None else "-",
                _binding(c) if r.disagrees else "-",
                _ds(r.deepspeed),
            )
        )
    lines = ["The paper's published points (TFLOPS per GPU), chunkstar's dry run and DeepSpeed's estimator", ""]
    lines += text_table(cols, table, markdown)
    errors = [r for r in rows if r.chunkstar is not None and r.chunkstar.error]
    if errors:
        lines += ["", "why not (first sentence of the engine's message):"]
        bullet = "- " if markdown else "  "
        lines += [f"{bullet}{r.point.hardware} x{r.point.gpus} {r.point.label}: {r.chunkstar.error}" for r in errors if r.chunkstar]
    lines += [
        "",
        "published: the PatrickStar README's figures, read off its plots (data/paper_results.csv). pred/PS: predicted "
        "TFLOPS/GPU over PatrickStar's published. binds: the resource the time model finds busiest, then the next two, "
        "with their busy seconds and the step's, where the prediction is more than "
        f"{DISAGREEMENT:.0%} off the published figure.",
    ]
    return "\n".join(lines)


def _point(p: DryRunPoint | None) -> str:
    if p is None:
        return "-"
    return f"{p.model} ({_fmt_params(p.n_params)})"


def _blocked(p: DryRunPoint | None) -> str:
    if p is None:
        return "none: the largest model fits"
    why = p.why_not
    if why == "device":
        detail = f"needs {p.minimum_budget / GIB:.1f}/{p.device_memory / GIB:.1f} GiB per GPU"
    elif why == "host":
        detail = f"host {p.host_need / GIB:,.0f}/{p.host_memory / GIB:,.0f} GiB"
    else:
        detail = p.error or "?"
    return f"{p.model} ({_fmt_params(p.n_params)}): {why}, {detail}"


def format_largest(rows: Sequence[LargestRow], markdown: bool = False) -> str:
    """The largest model per node: published, chunkstar's dry run, DeepSpeed's estimator, the formula."""
    cols = (
        "node", "GPUs", "published largest", "chunkstar dry run", "next (does not fit)", "s/step", "TFLOPS/GPU",
        "DeepSpeed estimator", "formula (cross-check)",
    )  # fmt: skip
    table: list[tuple[str, ...]] = []
    for r in rows:
        best = r.chunkstar.best
        pub = "; ".join(f"{m.label} ({name})" for name, m in r.published.items()) or "-"
        ds = f"{r.deepspeed_best.model} ({_fmt_params(r.deepspeed_best.n_params)})" if r.deepspeed_best else "(none fits)"
        if r.deepspeed_blocked is not None:
            ds += f"; next {r.deepspeed_blocked.model}: {r.deepspeed_blocked.binding}"
        f = r.formula.best
        formula = f"{f.model} ({_fmt_params(f.n_params)}); next: {r.formula.binding}" if f else f"(none fits): {r.formula.binding}"
        table.append(
            (
                r.hardware, str(r.gpus), pub,
                (_point(best) if best else "(none fits)") + (", Adam state on disk" if any(p.disk for p in r.chunkstar.tried) else ""),
                _blocked(r.chunkstar.blocked),
                f"{best.seconds:.2f}" if best and best.seconds else "-", _tf(best.tflops_per_gpu if best else None),
                ds, formula,
            )
        )  # fmt: skip
    lines = ["The largest paper-ladder model that fits each node", ""]
    lines += text_table(cols, table, markdown)
    lines += [
        "",
        "chunkstar: bisection of dry runs on the ladder (each answer a fitting model and the next larger, which does not "
        "fit). DeepSpeed: its estimator's arithmetic on the same ladder (model states only, so an upper bound). "
        "formula: `chunkstar-bench plan` without --dry-run (bytes-per-parameter accounting). published: the "
        "largest model each paper reports on that node. A node with a disk (LoHan/Ratel's NVMe SSD) runs chunkstar's "
        "disk tier: the fp32 master and Adam state in files, the param and gradient chunks in host memory.",
    ]
    return "\n".join(lines)
