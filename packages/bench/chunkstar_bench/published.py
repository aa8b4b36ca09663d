"""The published figures chunkstar is measured against, and the one table of system names.

Two facts live here and nowhere else (STYLE 13):

* :data:`SYSTEMS` -- every system any part of the project names: the ones the
  runner trains (``chunkstar``, ``deepspeed``, ...), the ones the capacity
  planner predicts for (``pytorch-fsdp`` too) and the ones the paper published
  (``patrickstar``, ``deepspeed-mp2``, ...), each under one canonical name with
  its display label. Older spellings (the planner's ``fsdp2-offload`` and
  ``pytorch-ddp``, the CSV's ``deepspeed_mp2``) are aliases, read by
  :func:`system_info` and never written.
* :func:`load_published` -- the packaged ``data/paper_results.csv`` (the
  PatrickStar README's figures, read off the plots), parsed once into typed
  :class:`PublishedResult` rows, with :func:`parse_label` reading its size
  labels (``"18B"``) and each label resolved to the zoo model that carries it.

Published numbers are the bar to beat, never a result of this project: whatever
shows them says "published" (:data:`SOURCE`).

The model configurations behind the labels (``data/paper_models.csv``) are the
zoo's (:mod:`chunkstar_bench.zoo`): this module reads them only through it.
Imports only the standard library and the zoo (no torch, no pandas).
"""

from __future__ import annotations

import csv
import functools
import io
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Literal

from chunkstar_bench.zoo import ZOO, n_params, paper_label

__all__ = [
    "DISK_SYSTEMS",
    "PLAN_SYSTEMS",
    "PUBLISHED_SYSTEMS",
    "RUN_SYSTEMS",
    "SOURCE",
    "SYSTEMS",
    "PublishedResult",
    "SystemInfo",
    "canonical_system",
    "largest_published",
    "load_published",
    "parse_label",
    "parse_results",
    "published_for",
    "system_info",
]

SOURCE = "published (PatrickStar README, read off plots)"
"""How every published figure is labelled wherever it is shown."""


@dataclass(frozen=True)
class SystemInfo:
    """One system, under its canonical name."""

    name: str
    """Canonical name: what RunSpecs, result rows, plans and published rows carry."""
    label: str
    """Short display name for tables, legends and charts (``"FSDP2 + CPU offload"``)."""
    description: str
    """One line on what it is and how it is set up."""
    runs: bool = False
    """The bench runner trains it (``chunkstar_bench.systems``)."""
    planned: bool = False
    """The capacity planner predicts for it (``chunkstar_bench.plan``)."""
    published: bool = False
    """It has rows in the published figures."""
    disk: bool = False
    """It swaps model data to files on a disk."""
    stands_beside: str | None = None
    """A published system: the system of ours its figures are compared with (chunkstar for
    PatrickStar, which it re-creates; itself for a system we also run or plan); None: none."""
    aliases: tuple[str, ...] = ()
    """Older spellings still accepted on input (never written)."""


SYSTEMS: dict[str, SystemInfo] = {
    s.name: s
    for s in (
        SystemInfo(
            "chunkstar", "chunkstar", "chunk-based CPU-GPU memory manager, bf16, hybrid Adam",
            runs=True, planned=True,
        ),
        SystemInfo(
            "chunkstar-disk", "chunkstar + disk tier",
            "chunkstar with master and Adam state in chunk files, the model built on the meta device",
            runs=True, planned=True, disk=True,
        ),
        SystemInfo(
            "deepspeed", "DeepSpeed", "DeepSpeed ZeRO-3, params and optimizer offloaded to CPU, bf16",
            runs=True, planned=True, published=True, stands_beside="deepspeed",
        ),
        SystemInfo(
            "deepspeed-nvme", "DeepSpeed ZeRO-Infinity",
            "DeepSpeed ZeRO-3 with the optimizer state (optionally the params) swapped to files",
            runs=True, disk=True,
        ),
        SystemInfo(
            "fsdp2", "FSDP2 + CPU offload", "PyTorch FSDP2 (fully_shard per block) with CPUOffloadPolicy, bf16 params",
            runs=True, planned=True, aliases=("fsdp2-offload",),
        ),
        SystemInfo(
            "pytorch", "PyTorch", "plain PyTorch: fp32 params, bf16 autocast, fused AdamW; DDP on several GPUs",
            runs=True, planned=True, published=True, stands_beside="pytorch", aliases=("pytorch-ddp",),
        ),
        SystemInfo(
            "pytorch-fsdp", "PyTorch FSDP", "PyTorch FSDP FULL_SHARD without CPU offload (planned only)",
            planned=True,
        ),
        SystemInfo(
            "patrickstar", "PatrickStar", "PatrickStar (Fang et al., 2021), the system chunkstar re-creates",
            published=True, stands_beside="chunkstar",
        ),
        SystemInfo(
            "deepspeed-mp2", "DeepSpeed + MP 2", "DeepSpeed with 2-way model parallelism, as the paper ran it",
            published=True, aliases=("deepspeed_mp2",),
        ),
        SystemInfo(
            "deepspeed-mp4", "DeepSpeed + MP 4", "DeepSpeed with 4-way model parallelism, as the paper ran it",
            published=True, aliases=("deepspeed_mp4",),
        ),
    )
}  # fmt: skip
"""Canonical name -> :class:`SystemInfo`, every system the project names, in display order."""

RUN_SYSTEMS: tuple[str, ...] = tuple(s.name for s in SYSTEMS.values() if s.runs)
"""The systems the bench runner trains."""
PLAN_SYSTEMS: tuple[str, ...] = tuple(s.name for s in SYSTEMS.values() if s.planned)
"""The systems the capacity planner predicts for."""
PUBLISHED_SYSTEMS: tuple[str, ...] = tuple(s.name for s in SYSTEMS.values() if s.published)
"""The systems with published figures."""
DISK_SYSTEMS: tuple[str, ...] = tuple(s.name for s in SYSTEMS.values() if s.disk)
"""The systems that swap to a disk folder."""

_BY_ALIAS: dict[str, str] = {alias: s.name for s in SYSTEMS.values() for alias in (s.name, *s.aliases)}


def system_info(name: str) -> SystemInfo:
    """The entry of ``name`` (a canonical name or an alias); a KeyError naming every system otherwise."""
    try:
        return SYSTEMS[_BY_ALIAS[name]]
    except KeyError:
        raise KeyError(f"unknown system {name!r}; systems: {', '.join(SYSTEMS)}") from None


def canonical_system(name: str) -> str:
    """``name``'s canonical spelling (``"pytorch-ddp"`` -> ``"pytorch"``); KeyError when unknown."""
    return system_info(name).name


def published_for(system: str) -> str | None:
    """The published system whose figures stand beside ``system`` of ours (chunkstar -> patrickstar,
    deepspeed -> deepspeed); None when there is none (or ``system`` is not a known name)."""
    ours = _BY_ALIAS.get(system, system)
    return next((s.name for s in SYSTEMS.values() if s.published and s.stands_beside == ours), None)


# --------------------------------------------------------------------------- size labels

_LABEL_UNITS = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_LABEL = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMBT])\s*", re.IGNORECASE)


def parse_label(label: str) -> int:
    """A size label of the paper's figures in parameters: ``"18B"`` -> 18_000_000_000, ``"1.5b"``, ``"350M"``.

    Units K, M, B, T (powers of 1000, any case); a ValueError naming the label otherwise."""
    match = _LABEL.fullmatch(label)
    if not match:
        raise ValueError(f"not a model-size label: {label!r} (say 350M, 1.5B or 18B)")
    return round(float(match.group(1)) * _LABEL_UNITS[match.group(2).upper()])


# --------------------------------------------------------------------------- the published results


@dataclass(frozen=True)
class PublishedResult:
    """One published point: a system's aggregate throughput on one node and GPU count, for one model size."""

    hardware: str
    """The node it was measured on (``v100x8_240gb``, ``a100x8_1tb``, ``superpod_8gpu_per_node``)."""
    system: str
    """Canonical system name (``patrickstar``, ``deepspeed``, ``deepspeed-mp2``, ...)."""
    gpus: int
    """GPUs in the run."""
    label: str
    """The figure's model-size label (``"18B"``)."""
    tflops_total: float
    """Aggregate TFLOPS of all GPUs, FLOPs counted as ``8 * params * batch * seq`` per step."""
    read: Literal["label", "est"]
    """``label``: the plot prints the number; ``est``: estimated from the curve."""
    nominal_params: int
    """The label's value (``parse_label``)."""
    zoo_model: str | None
    """The zoo model carrying this label (``GPT3_18B``); None when the zoo has no config for it (``"30B"``)."""
    n_params: int
    """The exact parameter count of ``zoo_model``; ``nominal_params`` without one."""

    @property
    def tflops_per_gpu(self) -> float:
        return self.tflops_total / self.gpus


def _zoo_by_label() -> dict[str, str]:
    """Figure label ("1B") -> zoo name ("GPT2_1B") for the paper models."""
    return {label: name for name, spec in ZOO.items() if (label := paper_label(spec)) is not None}


@functools.lru_cache(maxsize=1)
def _published() -> tuple[PublishedResult, ...]:
    return parse_results(resources.files("chunkstar_bench.data").joinpath("paper_results.csv").read_text())


def parse_results(text: str) -> tuple[PublishedResult, ...]:
    """The rows of a ``paper_results.csv`` text (``#`` lines are comments), systems under their
    canonical names; a ValueError naming the row for a value that does not parse or an unknown system."""
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    by_label = _zoo_by_label()
    rows: list[PublishedResult] = []
    for i, row in enumerate(csv.DictReader(io.StringIO("\n".join(lines))), start=1):
        where = f"paper_results.csv data row {i}"
        read: Literal["label", "est"]
        if row["read"].strip() == "label":
            read = "label"
        elif row["read"].strip() == "est":
            read = "est"
        else:
            raise ValueError(f"{where}: read is {row['read']!r}, not 'label' or 'est'")
        try:
            tflops = float(row["tflops_total"])
            gpus = int(row["gpus"])
        except ValueError:
            raise ValueError(f"{where}: gpus {row['gpus']!r} or tflops_total {row['tflops_total']!r} is not a number") from None
        if not (tflops > 0 and math.isfinite(tflops)) or gpus < 1:
            raise ValueError(f"{where}: gpus {gpus} and tflops_total {tflops} must be positive")
        label = row["model"].strip()
        try:
            nominal = parse_label(label)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        try:
            system = canonical_system(row["system"].strip())
        except KeyError as err:
            raise ValueError(f"{where}: {err.args[0]}") from None
        zoo_model = by_label.get(label)
        rows.append(
            PublishedResult(
                hardware=row["hardware"].strip(), system=system,
                gpus=gpus, label=label, tflops_total=tflops, read=read,
                nominal_params=nominal, zoo_model=zoo_model,
                n_params=n_params(ZOO[zoo_model]) if zoo_model is not None else nominal,
            )
        )  # fmt: skip
    return tuple(rows)


def load_published() -> list[PublishedResult]:
    """Every row of the packaged ``paper_results.csv`` (comment lines dropped), in file order."""
    return list(_published())


def largest_published(hardware: str, gpus: int | None = None) -> dict[str, PublishedResult]:
    """Per published system, its largest model (by ``nominal_params``) on ``hardware``; with ``gpus``,
    only runs on that many GPUs count. Keys are canonical system names."""
    out: dict[str, PublishedResult] = {}
    for r in _published():
        if r.hardware != hardware or (gpus is not None and r.gpus != gpus):
            continue
        cur = out.get(r.system)
        if cur is None or r.nominal_params > cur.nominal_params:
            out[r.system] = r
    return out
