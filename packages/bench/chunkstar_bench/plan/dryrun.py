"""The planner's dry runs: chunkstar's real engine on the meta device for one model on one node. A PREDICTION.

:func:`dry_run_point` trains a zoo GPT for a few steps with ``chunkstar.dry_run``
(Note [dry run] in :mod:`chunkstar.dryrun.run`) as the ranks of a node would, and
keeps what the planner shows: whether it fits the node's GPUs and host, the
smallest per-GPU budget that fits, and the predicted step on the node
(:mod:`chunkstar.dryrun.timing`). :func:`largest_fitting` finds the largest model
of a ladder that fits a node. Rows, text and the results database are
:mod:`~chunkstar_bench.plan.paper`'s, :mod:`~chunkstar_bench.plan.format`'s and
:mod:`~chunkstar_bench.plan.gate`'s.

Note [the paper's workload in a dry run]:

* the model is ``zoo.build_hf(spec)`` (Hugging Face ``GPT2LMHeadModel``, tied
  embeddings, dropout off) with activation checkpointing on, as in PatrickStar's
  runs (their scripts' ``CKP=1``; the paper's FLOP count ``8*N*B*s`` includes the
  recompute). The dry run builds it on the meta device itself;
* ``batch`` sequences of ``seq_len`` tokens per GPU (the paper's figures show the
  best of 4, 8 and 16 per point without saying which; the bench's paper suites fix
  8, and so does this by default), ``input_ids`` and ``labels`` only;
* the config is the real run's for CUDA, ``{"bf16": {"enabled": true}}``, the
  device's size taken from the hardware description; the chunk size is the
  engine's ``"auto"`` unless one is given. ``"auto"`` at tens of billions of
  parameters on 8 ranks picks chunks of over a billion elements, whose gathered
  groups alone do not fit a GPU; where ``"auto"`` does not fit the device,
  :func:`dry_run_point` tries again with PatrickStar's own chunk size for large
  models (256M elements: ``CS=256`` in its A100 benchmark scripts) and says so;
* the ranks simulated: by default the first and the last (``"ends"``); chunk
  groups are dealt round-robin, so the last rank holds the padding of the last
  group and the first the embedding's chunk, the two ends of the spread. The
  node's host need counts each rank not simulated as the most any simulated one
  held;
* the host: a rank's chunk buffers at their peak (``host_chunk_bytes_peak``, which
  includes the construction, when every chunk starts on the host) summed over the
  node, plus the formula planner's fixed overheads (``HOST_RESERVED_BYTES`` per
  node, ``HOST_PER_PROCESS_BYTES`` per process: the OS, Python, torch, the CUDA
  runtime's host side), against the node's host memory.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from chunkstar_bench import zoo
from chunkstar_bench.flops import patrickstar_flops
from chunkstar_bench.plan.model import HOST_PER_PROCESS_BYTES, HOST_RESERVED_BYTES
from chunkstar_bench.plan.nodes import node_named
from chunkstar_bench.zoo import ModelSpec

if TYPE_CHECKING:
    from chunkstar.dryrun import Hardware

__all__ = [
    "PATRICKSTAR_CHUNK_ELEMENTS",
    "RANK_CHOICES",
    "DryRunPoint",
    "DryRunSettings",
    "LargestSearch",
    "dry_run_point",
    "largest_fitting",
    "ranks_for",
]

PATRICKSTAR_CHUNK_ELEMENTS = 256 * 1024 * 1024
"""PatrickStar's chunk size for its large models (``CS=256``, millions of elements, in
``examples/benchmark/run_a100_benchmark_large_model.sh``): the fallback where ``"auto"`` does not fit."""

RankChoice = Literal["first", "ends", "all"]
RANK_CHOICES: tuple[str, ...] = ("first", "ends", "all")
"""Which ranks a dry run simulates: rank 0; rank 0 and the last; every rank."""

Progress = Callable[[str], None]


@dataclass(frozen=True)
class DryRunSettings:
    """How the planner dry-runs every point (Note [the paper's workload in a dry run])."""

    batch: int = 8
    """Sequences per GPU."""
    seq_len: int | None = None
    """Tokens per sequence; None: each model's own (1024 for the paper's)."""
    ranks: str = "ends"
    """One of :data:`RANK_CHOICES`."""
    chunk_size: int | None = None
    """Elements per chunk; None: the engine's ``"auto"``, then PatrickStar's where it does not fit."""
    steps: int = 3
    """Steps per dry run, the two warm-up iterations included."""
    checkpointing: bool = True


def ranks_for(choice: str, world_size: int) -> list[int]:
    """The ranks ``choice`` (:data:`RANK_CHOICES`) simulates of ``world_size``."""
    if choice == "first":
        return [0]
    if choice == "ends":
        return sorted({0, world_size - 1})
    if choice == "all":
        return list(range(world_size))
    raise ValueError(f"ranks must be one of {', '.join(RANK_CHOICES)}, not {choice!r}")


@dataclass(frozen=True)
class DryRunPoint:
    """One model on one node as the dry run saw it (a prediction, never a measurement)."""

    hardware: str
    gpus: int
    model: str
    n_params: int
    batch: int
    """Sequences per GPU."""
    seq_len: int
    device_fits: bool
    host_fits: bool
    minimum_budget: int
    """The smallest per-GPU budget that fits every simulated rank (bytes)."""
    device_memory: int
    """What one process may use of a GPU of this node (the hardware description's)."""
    host_need: int
    """Host bytes the node needs: the ranks' chunk buffers at their peak plus the fixed overheads."""
    host_memory: int
    chunk_size: int | None
    """The chunk size the config asked for (None: ``"auto"``)."""
    chunk_elements: int | None = None
    """The chunk size the engine used (None when not one step finished)."""
    seconds: float | None = None
    """The predicted step of the slowest simulated rank (None when it does not fit)."""
    binding: str | None = None
    """The resource the time model finds busiest in the step."""
    busy: dict[str, float] = field(default_factory=dict)
    ranks: tuple[int, ...] = ()
    wall_s: float = 0.0
    """What the dry run cost here (seconds, every try)."""
    error: str = ""
    """Why it does not fit on the device, or why the dry run failed (first sentence)."""
    failed: bool = False
    """The dry run itself failed (an error other than a verdict): no verdict."""
    tries: tuple[str, ...] = ()
    """What was tried before this verdict ("auto: needs 156.2 GiB per GPU")."""
    disk: bool = False
    """The optimizer state was on the node's disk (the disk tier), not in host memory."""

    @property
    def fits(self) -> bool:
        return not self.failed and self.device_fits and self.host_fits

    @property
    def why_not(self) -> str | None:
        """``"error"``, ``"device"`` or ``"host"`` when it does not fit, else None."""
        if self.failed:
            return "error"
        if not self.device_fits:
            return "device"
        if not self.host_fits:
            return "host"
        return None

    @property
    def tflops_per_gpu(self) -> float | None:
        """Predicted TFLOPS per GPU by PatrickStar's count (``8*N*B*s`` over the predicted step)."""
        if not self.seconds or self.seconds <= 0:
            return None
        return patrickstar_flops(self.n_params, self.batch, self.seq_len) / self.seconds / 1e12


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Hugging Face's warnings once per model build (a deprecated name, the loss type) are noise here."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(level)


def _model_func(spec: ModelSpec, checkpointing: bool) -> Callable[[], Any]:
    def build() -> Any:
        model = zoo.build_hf(spec)
        if checkpointing:
            # transformers 5 renamed it; gradient_checkpointing_enable still works there, with a FutureWarning
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        return model

    return build


def _first_sentence(text: str) -> str:
    head = text.strip().split("\n", 1)[0]
    cut = head.find(". ")
    return head if cut < 0 else head[: cut + 1]


@dataclass
class _Try:
    device_fits: bool = True
    failed: bool = False
    error: str = ""
    minimum_budget: int = 0
    chunk_elements: int | None = None
    host_chunks: list[int] = field(default_factory=list)
    predictions: list[Any] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)


DISK_PATH = "/nvme/chunkstar"
"""Where a dry run's disk tier says its files go on the target (it creates none: Note [dry run disk])."""


def _try(
    spec: ModelSpec, hardware: Hardware, gpus: int, batch: int, seq_len: int, chunk_size: int | None,
    ranks: Sequence[int], checkpointing: bool, steps: int, say: Progress, tag: str, disk: bool = False,
) -> _Try:  # fmt: skip
    import torch

    from chunkstar.dryrun import dry_run

    config: dict[str, Any] = {"bf16": {"enabled": True}}
    if chunk_size is not None:
        config["default_chunk_size"] = int(chunk_size)
    if disk:
        config["disk"] = {"path": DISK_PATH}
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    out = _Try()
    build = _model_func(spec, checkpointing)
    for r in ranks:  # one rank at a time: a rank that does not fit ends the try (the others are alike)
        t0 = time.perf_counter()
        say(f"{tag}: rank {r} of {gpus} ...")
        try:
            with _quiet_transformers():
                report = dry_run(build, config, {"input_ids": ids, "labels": ids}, world_size=gpus, hardware=hardware,
                                 steps=steps, ranks=[r])  # fmt: skip
        except Exception as err:  # any failure of the engine is a row saying so, not a crash of the table
            out.failed = True
            out.error = f"{type(err).__name__}: {_first_sentence(str(err))}"
            say(f"{tag}: rank {r}: the dry run failed: {out.error}")
            return out
        rank = report.ranks[0]
        out.ranks.append(r)
        out.minimum_budget = max(out.minimum_budget, int(rank.minimum_budget))
        if not rank.fits:
            out.device_fits = False
            out.error = _first_sentence(rank.error)
            say(f"{tag}: rank {r}: does not fit: needs {rank.minimum_budget / 2**30:.1f} GiB per GPU "
                f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
            return out
        stats = rank.stats
        out.chunk_elements = int(stats.get("chunk_size") or 0) or None
        out.host_chunks.append(int(stats.get("host_chunk_bytes_peak", 0)) + int(stats.get("disk_staging_budget_bytes", 0) or 0))
        if report.prediction is not None:
            out.predictions.append(report.prediction)
        say(f"{tag}: rank {r}: fits, minimum budget {rank.minimum_budget / 2**30:.1f} GiB"
            + (f", predicted step {report.prediction.seconds:.2f} s" if report.prediction else "")
            + f" ({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return out


def dry_run_point(
    spec: ModelSpec,
    hardware: str | Hardware,
    gpus: int,
    batch: int = 8,
    *,
    seq_len: int | None = None,
    chunk_size: int | None = None,
    ranks: str = "ends",
    checkpointing: bool = True,
    steps: int = 3,
    fallback: bool = True,
    progress: Progress | None = None,
    disk: bool | None = None,
) -> DryRunPoint:
    """Dry-run ``spec`` on ``gpus`` GPUs of ``hardware`` (a name in ``chunkstar.dryrun.HARDWARE`` or an alias
    of one, :func:`~chunkstar_bench.plan.nodes.node_named`, or a ``chunkstar.dryrun.Hardware``) with
    ``batch`` sequences per GPU (Note [the paper's workload in a dry run]).

    ``chunk_size`` None is the engine's ``"auto"``, and with ``fallback`` a device
    that ``"auto"`` does not fit gets a second try at :data:`PATRICKSTAR_CHUNK_ELEMENTS`.
    ``ranks`` is one of :data:`RANK_CHOICES`. ``disk``: the optimizer state on the node's
    disk (the disk tier, as LoHan/Ratel run); None: where the node has a disk. Never raises
    for a failed dry run: the point says it failed, and why."""
    hw = node_named(hardware) if isinstance(hardware, str) else hardware
    if disk is None:
        disk = hw.disk_read > 0
    if gpus < 1 or gpus > hw.gpus_per_node:
        raise ValueError(f"{hw.name} has {hw.gpus_per_node} GPU(s) per node; asked for {gpus}")
    seq = seq_len or spec.seq_len
    say = progress or (lambda _line: None)
    chosen = ranks_for(ranks, gpus)
    t0 = time.perf_counter()
    tries: list[str] = []
    name = hw.name

    def attempt(size: int | None) -> _Try:
        tag = f"{name} x{gpus} {spec.name} batch {batch}" + (f" chunk {size / 2**20:.0f}M" if size else "")
        tag += " disk tier" if disk else ""
        return _try(spec, hw, gpus, batch, seq, size, chosen, checkpointing, steps, say, tag, disk)

    used: int | None = chunk_size
    result = attempt(chunk_size)
    if chunk_size is None and fallback and not result.failed and not result.device_fits:
        second = attempt(PATRICKSTAR_CHUNK_ELEMENTS)
        if second.failed:  # e.g. chunks larger than the device: the verdict stays auto's
            tries.append(f"{PATRICKSTAR_CHUNK_ELEMENTS / 2**20:.0f}M: {second.error}")
        else:
            tries.append(f"auto: needs {result.minimum_budget / 2**30:.1f} GiB per GPU")
            result, used = second, PATRICKSTAR_CHUNK_ELEMENTS
    fits_device = result.device_fits and not result.failed
    host_need = 0
    if fits_device and result.host_chunks:
        missing = gpus - len(result.host_chunks)
        host_need = sum(result.host_chunks) + missing * max(result.host_chunks)
        host_need += HOST_RESERVED_BYTES + gpus * HOST_PER_PROCESS_BYTES
    slowest = max(result.predictions, key=lambda p: p.seconds, default=None) if fits_device else None
    return DryRunPoint(
        hardware=hw.name, gpus=gpus, model=spec.name, n_params=zoo.n_params(spec), batch=batch, seq_len=seq,
        device_fits=fits_device, host_fits=fits_device and host_need <= hw.host_memory,
        minimum_budget=result.minimum_budget, device_memory=int(hw.device_memory), host_need=host_need,
        host_memory=int(hw.host_memory), chunk_size=used, chunk_elements=result.chunk_elements,
        seconds=slowest.seconds if slowest else None, binding=slowest.binding if slowest else None,
        busy=dict(slowest.busy) if slowest else {}, ranks=tuple(result.ranks), wall_s=time.perf_counter() - t0,
        error=result.error, failed=result.failed, tries=tuple(tries), disk=bool(disk),
    )  # fmt: skip


@dataclass(frozen=True)
class LargestSearch:
    """The largest model of a ladder that fits a node, found by bisection on the ladder."""

    hardware: str
    gpus: int
    best: DryRunPoint | None
    """The largest model that fits (None: not even the smallest)."""
    blocked: DryRunPoint | None
    """The next larger model of the ladder, which does not fit (None: the largest of the ladder fits)."""
    tried: tuple[DryRunPoint, ...]
    """Every dry run the search looked at, in the order it did."""


def largest_fitting(
    models: Sequence[ModelSpec],
    run: Callable[[ModelSpec], DryRunPoint],
    hardware: str,
    gpus: int,
) -> LargestSearch:
    """Bisect ``models`` (sorted smallest first here) for the largest that ``run(spec).fits``.

    Bisection takes about ``log2(len(models)) + 1`` dry runs rather than one per model. It
    assumes fitting is monotone along the ladder (no model fits above one that does not),
    the formula planner's "first break" read the other way round; the answer is a pair of
    neighbours on the ladder, the one below fitting and the one above not, each dry-run.
    ``run`` may cache."""
    ladder = sorted(models, key=zoo.n_params)
    tried: list[DryRunPoint] = []

    def check(i: int) -> DryRunPoint:
        point = run(ladder[i])
        tried.append(point)
        return point

    lo, hi = -1, len(ladder)  # ladder[lo] fits (or lo == -1); ladder[hi] does not (or hi == len)
    results: dict[int, DryRunPoint] = {}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        results[mid] = check(mid)
        if results[mid].fits:
            lo = mid
        else:
            hi = mid
    best = results.get(lo) if lo >= 0 else None
    blocked = results.get(hi) if hi < len(ladder) else None
    return LargestSearch(hardware, gpus, best, blocked, tuple(tried))
