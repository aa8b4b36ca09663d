"""The plan as text: one table per node, headed by what it is (a PREDICTION) and what it assumed.

Formats :class:`~chunkstar_bench.plan.rows.PlanRow` lists; computes nothing
(the figures are :mod:`~chunkstar_bench.plan.model`'s).
"""

from __future__ import annotations

from collections.abc import Sequence

from chunkstar.config import DISK_LISTS

from chunkstar_bench.plan.model import DISK_BYTES_PER_ELEMENT, DISK_SYSTEMS, Hardware, Workload
from chunkstar_bench.plan.rows import PlanRow
from chunkstar_bench.units import GIB, MIB

__all__ = ["format_plan"]


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
            f"element on disk ({' + '.join(DISK_LISTS)}), 2 (param/grad) on device or host, plus staging per process: {staging}"
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
