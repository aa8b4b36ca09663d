"""The plan's rows: each system's predicted maximum beside the published and the measured one.

:func:`plan` runs the memory model (:mod:`~chunkstar_bench.plan.model`) for
every system and workload and sets beside each prediction the largest model the
paper published for the system standing beside it on that node
(:func:`chunkstar_bench.published.largest_published`: PatrickStar beside
chunkstar) and, given a results database, the largest model we trained there
(:func:`measured_max`). Three kinds of figure, kept apart: predicted, published,
measured. Nothing here formats text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chunkstar_bench.plan.model import Hardware, Prediction, Workload, default_systems, predict_max
from chunkstar_bench.published import PublishedResult, canonical_system, largest_published, published_for
from chunkstar_bench.zoo import ModelSpec

__all__ = ["MeasuredMax", "PlanRow", "measured_max", "plan"]


@dataclass(frozen=True)
class MeasuredMax:
    """The largest model one system trained (status ``ok``) in a results database."""

    model: str
    n_params: int
    nprocs: int


@dataclass(frozen=True)
class PlanRow:
    system: str
    checkpointing: bool
    prediction: Prediction
    published: PublishedResult | None
    """The largest published model of the system standing beside this one (``published_for``), or None."""
    measured: MeasuredMax | None


def measured_max(db_path: str, hardware: str, gpus: int | None = None) -> dict[str, MeasuredMax]:
    """The largest model each system trained with status ``ok`` on ``hardware`` in a results database
    (ours, measured; the file is opened read-only). With ``gpus``, only runs on that many processes count.
    Keys are canonical system names."""
    from chunkstar_bench.results import ResultsDB

    runs = ResultsDB(db_path, read_only=True).runs()
    if runs.empty:
        return {}
    runs = runs[(runs["status"] == "ok") & (runs["hardware"] == hardware)]
    if gpus is not None:
        runs = runs[runs["nprocs"] == gpus]
    out: dict[str, MeasuredMax] = {}
    for system, group in runs.groupby("system"):
        top = group.sort_values("n_params").iloc[-1]
        try:
            name = canonical_system(str(system))
        except KeyError:
            name = str(system)  # a system this version does not know: shown under its own name
        out[name] = MeasuredMax(model=str(top["model"]), n_params=int(top["n_params"]), nprocs=int(top["nprocs"]))
    return out


def plan(
    hw: Hardware,
    workloads: Sequence[Workload] = (Workload(checkpointing=True), Workload(checkpointing=False)),
    systems: Sequence[str] | None = None,
    db_path: str | None = None,
    measured_hardware: str | None = None,
    models: Sequence[ModelSpec] | None = None,
) -> list[PlanRow]:
    """One row per system and workload: the prediction, the published maximum and, with a DB, the
    measured one. ``systems`` None: :func:`~chunkstar_bench.plan.model.default_systems`."""
    names = default_systems(hw) if systems is None else tuple(canonical_system(s) for s in systems)
    published = largest_published(hw.name, hw.gpus)
    measured = measured_max(db_path, measured_hardware or hw.name, hw.gpus) if db_path else {}
    rows: list[PlanRow] = []
    for system in names:
        beside = published_for(system)
        for wl in workloads:
            prediction = predict_max(system, hw, wl, models)
            rows.append(PlanRow(system, wl.checkpointing, prediction, published.get(beside or ""), measured.get(system)))
    return rows
