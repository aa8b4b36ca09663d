"""The paper, against DeepSpeed: chunkstar's dry run and DeepSpeed's estimator beside every published point.

Rows only (text is :mod:`~chunkstar_bench.plan.format`'s, the command
:mod:`~chunkstar_bench.plan.command`'s):

* :func:`paper_points` -- the published points of ``data/paper_results.csv``
  on the nodes the dry run has a description of, one per (node, GPUs, model),
  each with every system's published TFLOPS;
* :func:`paper_rows` -- each point with chunkstar's dry run
  (:func:`~chunkstar_bench.plan.dryrun.dry_run_point`) and DeepSpeed's verdict
  (:mod:`~chunkstar_bench.plan.deepspeed`);
* :func:`largest_rows` -- per node, the largest ladder model chunkstar's dry run
  fits (:func:`~chunkstar_bench.plan.dryrun.largest_fitting`), the largest
  DeepSpeed's estimator accepts, the formula planner's answer as a cross-check,
  and the largest the paper (or the anchor's own paper) published.

Three kinds of figure, kept apart in every row: published (the paper's),
predicted (the dry run's, the estimator's, the formula's), and never measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chunkstar_bench import zoo
from chunkstar_bench.plan.deepspeed import DeepSpeedVerdict, deepspeed_largest, deepspeed_verdict
from chunkstar_bench.plan.dryrun import DryRunPoint, LargestSearch, largest_fitting
from chunkstar_bench.plan.model import Hardware as FormulaHardware
from chunkstar_bench.plan.model import Prediction as FormulaPrediction
from chunkstar_bench.plan.model import Workload, predict_max
from chunkstar_bench.plan.nodes import node_named
from chunkstar_bench.published import PublishedResult, load_published
from chunkstar_bench.zoo import ModelSpec

__all__ = [
    "ANCHORS",
    "DISAGREEMENT",
    "LARGEST_NODES",
    "PAPER_NODES",
    "LargestRow",
    "PaperPoint",
    "PaperRow",
    "PublishedMax",
    "largest_rows",
    "paper_points",
    "paper_rows",
]

PAPER_NODES: tuple[str, ...] = ("v100x8_240gb", "a100x8_1tb")
"""The nodes of the paper's figures (``data/paper_results.csv``) the dry run has a description of."""


@dataclass(frozen=True)
class PublishedMax:
    """The largest model a paper reports on a node (published, not ours)."""

    system: str
    label: str
    source: str


ANCHORS: dict[str, PublishedMax] = {
    "rtx4090_256gb_nvme": PublishedMax("LoHan/Ratel", "175B", "LoHan/Ratel (2024), with the optimizer state on an NVMe SSD"),
    "h200_1.5tb": PublishedMax("MegaTrain", "120B", "MegaTrain (2026), host memory only"),
}
"""The single-GPU anchors of the offload field: their node and the largest model their paper reports
(docs/benchmarks.md, 'Published figures')."""

LARGEST_NODES: tuple[tuple[str, int], ...] = (("v100x8_240gb", 8), ("a100x8_1tb", 8), ("rtx4090_256gb_nvme", 1), ("h200_1.5tb", 1))
"""The nodes of the largest-model table: the paper's two at 8 GPUs and the two anchors."""

DISAGREEMENT = 0.30
"""A prediction further than this from the published figure (relative) gets its binding resource printed."""


@dataclass(frozen=True)
class PaperPoint:
    """One published (node, GPUs, model) point with every system's published TFLOPS."""

    hardware: str
    gpus: int
    label: str
    """The figure's size label ("18B")."""
    spec: ModelSpec | None
    """The zoo model carrying the label; None where ``paper_models.csv`` has no config ("30B")."""
    published: dict[str, PublishedResult] = field(default_factory=dict)
    """Canonical system name -> the published row."""

    @property
    def n_params(self) -> int:
        if self.spec is not None:
            return zoo.n_params(self.spec)
        return next(iter(self.published.values())).nominal_params

    def published_tflops_per_gpu(self, system: str) -> float | None:
        r = self.published.get(system)
        return r.tflops_per_gpu if r is not None else None


def paper_points(
    hardware: Sequence[str] = PAPER_NODES, gpus: int | None = None, models: Sequence[str] | None = None
) -> list[PaperPoint]:
    """The published points on ``hardware`` (optionally only ``gpus`` GPUs, only the zoo ``models``),
    in the CSV's node order, then by GPUs and model size."""
    points: dict[tuple[str, int, str], PaperPoint] = {}
    for r in load_published():
        if r.hardware not in hardware or (gpus is not None and r.gpus != gpus):
            continue
        if models is not None and r.zoo_model not in models:
            continue
        key = (r.hardware, r.gpus, r.label)
        if key not in points:
            points[key] = PaperPoint(r.hardware, r.gpus, r.label, zoo.get(r.zoo_model) if r.zoo_model else None)
        points[key].published[r.system] = r
    order = {h: i for i, h in enumerate(hardware)}
    return sorted(points.values(), key=lambda p: (order[p.hardware], p.gpus, p.published[next(iter(p.published))].nominal_params))


@dataclass(frozen=True)
class PaperRow:
    """A published point, chunkstar's dry run of it and DeepSpeed's estimator on it."""

    point: PaperPoint
    chunkstar: DryRunPoint | None
    """None where the point has no zoo config."""
    deepspeed: DeepSpeedVerdict | None

    @property
    def ratio(self) -> float | None:
        """Predicted chunkstar TFLOPS per GPU over PatrickStar's published (None without either)."""
        pub = self.point.published_tflops_per_gpu("patrickstar")
        pred = self.chunkstar.tflops_per_gpu if self.chunkstar is not None else None
        if pub is None or pred is None:
            return None
        return pred / pub

    @property
    def disagrees(self) -> bool:
        """The prediction is more than :data:`DISAGREEMENT` away from the published figure."""
        r = self.ratio
        return r is not None and abs(r - 1) > DISAGREEMENT


Runner = Callable[[ModelSpec, str, int], DryRunPoint]
"""``run(spec, hardware, gpus)``: one dry run (the command's closes over batch, ranks and chunk size, and caches)."""


def _node(hardware: str) -> tuple[int, int, int]:
    """(GPUs per node, bytes one process may use per GPU, host bytes) of a node of ``chunkstar.dryrun.HARDWARE``
    (or an alias of one, :func:`~chunkstar_bench.plan.nodes.node_named`)."""
    hw = node_named(hardware)
    return hw.gpus_per_node, int(hw.device_memory), int(hw.host_memory)


def paper_rows(points: Sequence[PaperPoint], run: Runner, progress: Callable[[str], None] | None = None) -> list[PaperRow]:
    """Each point with its dry run (``run``) and DeepSpeed's verdict."""
    say = progress or (lambda _line: None)
    rows: list[PaperRow] = []
    todo = [p for p in points if p.spec is not None]
    done = 0
    for p in points:
        if p.spec is None:
            rows.append(PaperRow(p, None, None))
            continue
        done += 1
        say(f"[{done}/{len(todo)}] {p.hardware} x{p.gpus} {p.label} ({p.spec.name})")
        _, device, host = _node(p.hardware)
        rows.append(PaperRow(p, run(p.spec, p.hardware, p.gpus), deepspeed_verdict(p.spec, p.gpus, host, device)))
    return rows


@dataclass(frozen=True)
class LargestRow:
    """The largest model on one node, by every source."""

    hardware: str
    gpus: int
    chunkstar: LargestSearch
    deepspeed_best: DeepSpeedVerdict | None
    deepspeed_blocked: DeepSpeedVerdict | None
    formula: FormulaPrediction
    """The bytes-per-parameter planner's chunkstar prediction (``plan`` without ``--dry-run``): the cross-check."""
    published: dict[str, PublishedMax] = field(default_factory=dict)
    """System label -> the largest model its paper reports on this node."""


def _formula_hardware(hardware: str, gpus: int) -> FormulaHardware:
    """The formula planner's node: the same ``chunkstar.dryrun.HARDWARE`` entry the dry run runs on, at ``gpus`` GPUs."""
    return FormulaHardware.from_node(node_named(hardware), gpus)


def _published_max(hardware: str, gpus: int) -> dict[str, PublishedMax]:
    out: dict[str, PublishedMax] = {}
    tops: dict[str, PublishedResult] = {}
    for r in load_published():
        if r.hardware == hardware and r.gpus == gpus and r.system in ("patrickstar", "deepspeed"):
            if r.system not in tops or r.nominal_params > tops[r.system].nominal_params:
                tops[r.system] = r
    for system, r in tops.items():
        name = {"patrickstar": "PatrickStar", "deepspeed": "DeepSpeed"}[system]
        out[name] = PublishedMax(name, r.label, "PatrickStar README (read off its figures)")
    anchor = ANCHORS.get(hardware)
    if anchor is not None:
        out[anchor.system] = anchor
    return out


def largest_rows(
    nodes: Sequence[tuple[str, int]],
    models: Sequence[ModelSpec],
    run: Runner,
    batch: int,
    progress: Callable[[str], None] | None = None,
) -> list[LargestRow]:
    """Per node, the largest of ``models`` each source fits (chunkstar by bisection of dry runs)."""
    say = progress or (lambda _line: None)
    rows: list[LargestRow] = []
    for hardware, gpus in nodes:
        say(f"largest model on {hardware} x{gpus}: bisecting {len(models)} models")
        _, device, host = _node(hardware)
        search = largest_fitting(models, lambda spec: run(spec, hardware, gpus), hardware, gpus)
        ds_best, ds_blocked = deepspeed_largest(models, gpus, host, device)
        formula = predict_max("chunkstar", _formula_hardware(hardware, gpus), Workload(batch=batch, checkpointing=True), models)
        rows.append(LargestRow(hardware, gpus, search, ds_best, ds_blocked, formula, _published_max(hardware, gpus)))
    return rows
