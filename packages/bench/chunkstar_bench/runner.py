"""One benchmark run = one subprocess: what to run (``RunSpec``), how, and what came out (``RunRecord``).

:func:`run` starts ``python -m chunkstar_bench.child`` (or ``torchrun
--standalone --nproc_per_node N -m chunkstar_bench.child`` for several
processes) in a fresh process group, echoes its progress, watches its memory
from outside, and turns the per-rank JSON lines it prints into one
:class:`RunRecord` with the derived metrics (tokens/s, TFLOPS under both FLOP
counts, MFU). A crash, an out-of-memory or a hang in one run therefore cannot
poison the next (docs/design.md, 'Benchmarks').

Note [the host-memory cap]: one rule for every system.
    ``RLIMIT_AS`` is not usable: torch and DeepSpeed reserve far more virtual
    address space than they touch, so a cap on it fails runs that would fit.
    Instead the parent samples the resident set size of every process in the
    child's process group (``/proc``, every 50 ms) and kills the group when the
    sum passes the cap; the run's status is then ``oom``. A short spike between
    two samples could slip past the sampler, so a run that finishes is also
    checked against its ranks' own ``ru_maxrss`` (summed over ranks): over the
    cap means ``oom`` too. The cap is the same rule for every system, which is
    what a max-scale comparison needs.

Note [a disk run's swap folder]: made and removed by the parent.
    A system in :data:`DISK_SYSTEMS` swaps to files. For each such run the
    parent makes a fresh folder under ``RunSpec.disk_dir`` (the system temp
    folder when None), hands it to the child in ``CHUNKSTAR_BENCH_DISK_DIR``,
    and removes it when the child has exited, whatever happened (a child killed
    by the watchdog cannot clean up after itself). Just before removing it, it
    sums the bytes the files there occupy (swap files only grow, so this is the
    run's peak) into ``details["disk_bytes"]``, beside ``details["disk_dir"]``.

This module imports only the standard library and the torch-free parts of this
package (the parent stays light; the child pays for torch).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from chunkstar_bench import flops
from chunkstar_bench.published import DISK_SYSTEMS, RUN_SYSTEMS
from chunkstar_bench.watch import watch

CHUNKSTAR_HOST_MEMORY_ENV = "CHUNKSTAR_HOST_MEMORY"
"""chunkstar.memory.host.HOST_MEMORY_ENV (named here: the runner does not import torch)."""
from chunkstar_bench.zoo import get, n_params

__all__ = [
    "ACTIVATION_POLICIES", "CHUNKSTAR_SYSTEMS", "DEVICES", "DISK_DIR_ENV", "PRECISIONS", "RESULT_PREFIX", "STATUSES",
    "RunRecord", "RunSpec", "git_commit", "run", "versions",
]  # fmt: skip

CHUNKSTAR_SYSTEMS: tuple[str, ...] = tuple(s for s in RUN_SYSTEMS if s.startswith("chunkstar"))
"""The systems whose spec may set the ``chunkstar_*`` engine options."""
DEVICES: tuple[str, ...] = ("cpu", "cuda")
ACTIVATION_POLICIES: tuple[str, ...] = ("keep", "checkpoint", "offload", "auto")
"""The engine's ``activations.policy`` values (:attr:`RunSpec.chunkstar_activations`)."""
PRECISIONS: tuple[str, ...] = ("bf16", "fp32")
"""What :attr:`RunSpec.chunkstar_precision` may say."""
STATUSES: tuple[str, ...] = ("ok", "oom", "error")

RESULT_PREFIX = "CHUNKSTAR_BENCH_RESULT "
RESULT_DIR_ENV = "CHUNKSTAR_BENCH_RESULT_DIR"  # children write rank<r>.json there (stdout line as fallback)
"""A child's stdout line that starts with this carries one rank's JSON result."""
DISK_DIR_ENV = "CHUNKSTAR_BENCH_DISK_DIR"
"""The run's own swap folder, made and removed by the parent (Note [a disk run's swap folder])."""

Device = Literal["cpu", "cuda"]
Status = Literal["ok", "oom", "error"]

_PACKAGE_PARENT = Path(__file__).resolve().parent.parent  # .../packages/bench
_REPO_ROOT = _PACKAGE_PARENT.parent.parent


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """Everything that defines one run; two equal specs are the same experiment."""

    system: str
    """A canonical name of :data:`chunkstar_bench.published.RUN_SYSTEMS`: ``chunkstar``,
    ``chunkstar-disk`` (with the disk tier), ``deepspeed`` (ZeRO-3, params + optimizer
    offloaded to CPU), ``deepspeed-nvme`` (ZeRO-Infinity: optimizer state, and with
    ``nvme_params`` the params, offloaded to files under ``disk_dir``; ``nvme_params``
    puts chunkstar-disk's param list on disk too), ``fsdp2`` (CPU
    offload) or ``pytorch`` (plain, DDP when several processes)."""
    model: str
    """A zoo name (:data:`chunkstar_bench.zoo.ZOO`)."""
    batch: int
    """Sequences per step *per process* (per GPU)."""
    steps: int
    """Timed steps; the reported step time is their median."""
    warmup: int
    """Untimed steps before the timed ones."""
    nprocs: int = 1
    """Processes (GPUs); more than one runs under torchrun."""
    seq_len: int | None = None
    """Tokens per sequence; None: the model's own."""
    seed: int = 0
    """Seeds the weights (same for every system) and the token batches."""
    device: Device = "cpu"
    host_mem_cap_bytes: int | None = None
    """Kill the run (status ``oom``) when its processes' resident memory passes this."""
    chunkstar_budget: str | int | None = None
    """chunkstar's device budget: bytes, ``"2GiB"``, ``"params:0.6"`` or None/``"auto"``
    (see :func:`chunkstar_bench.systems.chunkstar.chunkstar_budget_bytes`)."""
    hardware: str = "cpu"
    """A label for the machine (``v100x8_240gb``, ``a100x8_1tb``, ``cpu-2core``); picks the MFU peak."""
    threads: int | None = None
    """torch threads per process on CPU; None: the cores shared evenly among the processes."""
    disk_dir: str | None = None
    """Only for :data:`DISK_SYSTEMS`: the folder under which each run gets (and loses) its own
    swap folder; None: the system temp folder. It should be on the disk under test: files
    on a tmpfs live in RAM, outside the resident set the host-memory cap watches."""
    chunkstar_staging: str | int | None = None
    """Only for ``chunkstar-disk``: the disk tier's host staging budget (bytes or ``"1GB"``;
    None: the engine's "auto", two chunks of master and moments)."""
    nvme_params: bool = False
    """Only for ``deepspeed-nvme``: swap the bf16 parameters to disk too (``offload_param``
    to ``nvme``), not only the optimizer state and gradients. Measured here: a larger
    model under the same cap, 1.2-1.4x the step time (docs/benchmarks.md)."""
    chunkstar_overlap: bool | None = None
    """Only for the chunkstar systems: the engine's ``overlap`` (False: the serial reference
    path); None: the engine's default (True)."""
    chunkstar_link: str | None = None
    """Only for the chunkstar systems on the CPU virtual device: the engine's
    ``device_link_bandwidth`` (``"1GB/s"``), an emulated link whose copies take at least
    bytes / bandwidth; None: no emulated link."""
    clip: float = 1.0
    """Global-norm gradient clipping in every system's step (Note [what one step is] in
    :mod:`chunkstar_bench.harness`); 0: none."""
    chunkstar_activations: str | None = None
    """Only for the chunkstar systems: the engine's ``activations.policy`` (``"keep"``,
    ``"checkpoint"``, ``"offload"`` or ``"auto"``, Note [activation policies] in
    :mod:`chunkstar.activations`); None: the engine's default (keep)."""
    chunkstar_precision: str | None = None
    """Only for the chunkstar systems: ``"bf16"`` (None, the default: bf16 chunks and compute,
    fp32 masters) or ``"fp32"`` (no ``bf16`` section: fp32 chunks and compute), for a CPU
    without fast bf16 matmuls."""
    hf_checkpointing: bool = False
    """The model checkpoints its own blocks: the builder calls Hugging Face's
    ``gradient_checkpointing_enable()`` (every block recomputed in the backward; chunkstar's
    block wrapper then steps aside)."""

    def __post_init__(self) -> None:
        if self.system not in RUN_SYSTEMS:
            raise ValueError(f"system {self.system!r} is not one of {', '.join(RUN_SYSTEMS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        get(self.model)  # a KeyError listing the zoo
        for name in ("batch", "steps", "nprocs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.clip < 0:
            raise ValueError(f"clip must be >= 0 (0: no clipping), got {self.clip}")
        if self.seq_len is not None and self.seq_len > get(self.model).seq_len:
            raise ValueError(f"seq_len {self.seq_len} exceeds {self.model}'s {get(self.model).seq_len} positions")
        if self.disk_dir is not None and self.system not in DISK_SYSTEMS:
            raise ValueError(f"disk_dir is only used by {', '.join(DISK_SYSTEMS)}, not by {self.system}")
        if self.chunkstar_staging is not None and self.system != "chunkstar-disk":
            raise ValueError(f"chunkstar_staging is only used by chunkstar-disk, not by {self.system}")
        if self.nvme_params and self.system not in DISK_SYSTEMS:
            raise ValueError(f"nvme_params is only used by {', '.join(DISK_SYSTEMS)}, not by {self.system}")
        for name in ("chunkstar_overlap", "chunkstar_link"):
            if getattr(self, name) is not None and self.system not in CHUNKSTAR_SYSTEMS:
                raise ValueError(f"{name} is only used by {', '.join(CHUNKSTAR_SYSTEMS)}, not by {self.system}")
        if self.chunkstar_link is not None and self.device != "cpu":
            raise ValueError("chunkstar_link emulates a link on the CPU virtual device; a GPU has its own")
        for name in ("chunkstar_activations", "chunkstar_precision"):
            if getattr(self, name) is not None and self.system not in CHUNKSTAR_SYSTEMS:
                raise ValueError(f"{name} is only used by {', '.join(CHUNKSTAR_SYSTEMS)}, not by {self.system}")
        if self.chunkstar_activations not in (None, *ACTIVATION_POLICIES):
            raise ValueError(
                f"chunkstar_activations {self.chunkstar_activations!r} is not one of {', '.join(ACTIVATION_POLICIES)}"
            )
        if self.chunkstar_precision not in (None, *PRECISIONS):
            raise ValueError(f"chunkstar_precision {self.chunkstar_precision!r} is not one of {', '.join(PRECISIONS)}")

    @property
    def seq(self) -> int:
        """The sequence length this run uses."""
        return self.seq_len or get(self.model).seq_len

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


@dataclasses.dataclass
class RunRecord:
    """What one run produced: its status, metrics, and where and with what it ran."""

    spec: RunSpec
    status: Status
    message: str = ""
    """Empty when ok; the error (or why it counts as out of memory) otherwise."""
    step_time_s: float | None = None
    """Median timed step, slowest rank."""
    tokens_per_s: float | None = None
    """All processes together."""
    tflops_per_gpu_patrickstar: float | None = None
    tflops_per_gpu_megatron: float | None = None
    flops_formulas: dict[str, str] = dataclasses.field(default_factory=dict)
    """Which formula each TFLOPS/MFU figure used (names from :mod:`chunkstar_bench.flops`)."""
    mfu: float | None = None
    peak_device_bytes: int | None = None
    peak_device_kind: str | None = None
    """How ``peak_device_bytes`` was measured (CUDA allocator, or chunkstar's virtual device)."""
    peak_host_bytes: int | None = None
    """Peak RSS, the maximum over ranks (``ru_maxrss``; the sampler's when no rank reported)."""
    n_params: int | None = None
    wall_s: float | None = None
    created_utc: str = ""
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    git_commit: str = ""
    host: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per-system detail from rank 0 (losses, step times, chunkstar stats, DeepSpeed config ...)."""

    def config(self) -> dict[str, Any]:
        """The full configuration of the run: the spec plus the system's own settings."""
        return {"spec": dataclasses.asdict(self.spec), "details": self.details, "flops_formulas": self.flops_formulas}


def versions() -> dict[str, str]:
    """Installed versions of everything that shapes a result (``importlib.metadata``)."""
    found = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "deepspeed", "chunkstar"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return found


def git_commit() -> str:
    """HEAD of the checkout this package runs from, ``+dirty`` with local changes; "" outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


def _command(spec: RunSpec) -> list[str]:
    child = ["-m", "chunkstar_bench.child", "--spec", spec.to_json()]
    if spec.nprocs == 1:
        return [sys.executable, *child]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(spec.nprocs), *child]


def _is_progress(line: str) -> bool:
    return line.startswith("[") and "] step " in line


def run(spec: RunSpec, timeout_s: float = 1800.0, *, echo: bool = True) -> RunRecord:
    """Run ``spec`` in a fresh subprocess and return its record; never raises for a failed run.

    ``echo`` forwards the child's per-step progress lines to this process's stderr.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PACKAGE_PARENT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    created = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        disk_dir = _make_disk_dir(spec)
    except OSError as exc:
        record = _new_record(spec, created, 0.0)
        record.message = f"cannot make a swap folder under {spec.disk_dir or tempfile.gettempdir()}: {exc}"
        return record
    if disk_dir is not None:
        env[DISK_DIR_ENV] = disk_dir
    if spec.host_mem_cap_bytes is not None:
        # the machine the run is capped to, as chunkstar's host memory plan sees it (a container
        # would say so through its cgroup; the watchdog's cap says nothing to the process)
        env[CHUNKSTAR_HOST_MEMORY_ENV] = str(spec.host_mem_cap_bytes)
    result_dir = tempfile.mkdtemp(prefix="chunkstar-bench-")
    env[RESULT_DIR_ENV] = result_dir
    results: list[dict[str, Any]] = []
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def on_line(line: str) -> None:
        if line.startswith(RESULT_PREFIX):
            try:
                results.append(json.loads(line[len(RESULT_PREFIX) :]))
            except json.JSONDecodeError:
                tail.append(line)
            return
        if echo and _is_progress(line):
            print(f"  {line}", file=sys.stderr, flush=True)
        tail.append(line)

    try:
        done = watch(_command(spec), env, on_line, timeout_s, spec.host_mem_cap_bytes)
    finally:
        disk_bytes = _remove_disk_dir(disk_dir)
    killed_for, returncode, sampled_peak, wall = done.killed_for, done.returncode, done.sampled_peak_rss_bytes, done.wall_s
    record = _new_record(spec, created, wall)
    record.details["sampled_peak_group_rss_bytes"] = sampled_peak
    if disk_dir is not None:
        record.details.update(disk_dir=disk_dir, disk_bytes=disk_bytes)
    for f in sorted(Path(result_dir).glob("rank*.json")):
        try:
            results.append(json.loads(f.read_text(encoding="utf-8")))
        except (OSError, json.JSONDecodeError) as e:
            tail.append(f"unreadable result file {f.name}: {e}")
    shutil.rmtree(result_dir, ignore_errors=True)
    return _finish(record, results, killed_for, returncode, list(tail), timeout_s)


def _new_record(spec: RunSpec, created: str, wall: float) -> RunRecord:
    """An ``error`` record of ``spec`` with where and with what it ran; the caller fills in the rest."""
    return RunRecord(
        spec=spec, status="error", n_params=n_params(get(spec.model)), wall_s=wall, created_utc=created,
        versions=versions(), git_commit=git_commit(), host=socket.gethostname(),
    )


def _make_disk_dir(spec: RunSpec) -> str | None:
    """A fresh swap folder for a run of a disk system (Note [a disk run's swap folder]); None for the others."""
    if spec.system not in DISK_SYSTEMS:
        return None
    parent = Path(spec.disk_dir) if spec.disk_dir is not None else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkdtemp(prefix="chunkstar-bench-disk-", dir=parent.resolve())


def _remove_disk_dir(disk_dir: str | None) -> int | None:
    """Remove a run's swap folder; the bytes its files occupied on disk (allocated blocks)."""
    if disk_dir is None:
        return None
    used = 0
    for root, _dirs, files in os.walk(disk_dir):
        for name in files:
            try:
                used += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    shutil.rmtree(disk_dir, ignore_errors=True)
    return used


def _finish(
    record: RunRecord, results: list[dict[str, Any]], killed_for: str | None, returncode: int,
    tail: list[str], timeout_s: float,
) -> RunRecord:
    """Fill ``record`` from the ranks' results, or explain why there are none."""
    spec = record.spec
    sampled = record.details["sampled_peak_group_rss_bytes"]
    rank_peaks = [int(r["peak_host_bytes"]) for r in results if r.get("peak_host_bytes")]
    record.peak_host_bytes = max(rank_peaks) if rank_peaks else (sampled or None)
    if killed_for == "timeout":
        record.status, record.message = "error", f"timeout after {timeout_s:.0f} s"
        return record
    if killed_for is not None:
        record.status, record.message = "oom", f"{killed_for} (killed by the runner's watchdog)"
        return record
    results.sort(key=lambda r: r.get("rank", 0))
    if len(results) < spec.nprocs:
        # No (or not every) rank reported: a crash outside the child's own handler.
        last = next((line for line in reversed(tail) if line.strip()), "")
        if returncode == -signal.SIGKILL:
            record.status = "oom"
            record.message = f"killed by SIGKILL (most likely the kernel's OOM killer); last output: {last}"[:500]
        else:
            record.status = "error"
            record.message = f"exit status {returncode}, {len(results)}/{spec.nprocs} ranks reported; last output: {last}"[:500]
        if not results:
            return record
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        worst = next((r for r in failed if r["status"] == "oom"), failed[0])
        record.status, record.message = worst["status"], f"rank {worst.get('rank', 0)}: {worst.get('message', '')}"
        if worst.get("device_memory_error") is not None:  # the figures of a DeviceMemoryError (chunkstar_bench.child)
            record.details["device_memory_error"] = worst["device_memory_error"]
        return record
    if len(results) < spec.nprocs:
        return record
    cap = spec.host_mem_cap_bytes
    if cap is not None and sum(rank_peaks) > cap:
        record.status = "oom"
        record.message = (
            f"peak RSS {sum(rank_peaks) / 2**30:.2f} GiB (ru_maxrss, summed over ranks) passed the cap of "
            f"{cap / 2**30:.2f} GiB between two samples"
        )
        return record

    first = results[0]
    record.status, record.message = "ok", ""
    step = max(float(r["step_time_s"]) for r in results)
    n = record.n_params or 0
    model = get(spec.model)
    record.step_time_s = step
    record.tokens_per_s = spec.nprocs * spec.batch * spec.seq / step
    record.tflops_per_gpu_patrickstar = flops.tflops(flops.patrickstar_flops(n, spec.batch, spec.seq), step)
    record.tflops_per_gpu_megatron = flops.tflops(flops.megatron_flops(model, spec.batch, False, seq=spec.seq), step)
    record.mfu = None if spec.device == "cpu" else flops.mfu(record.tflops_per_gpu_megatron, spec.hardware)
    record.flops_formulas = {
        "tflops_per_gpu_patrickstar": flops.FORMULA_PATRICKSTAR,
        "tflops_per_gpu_megatron": flops.FORMULA_MEGATRON,
        "mfu": flops.FORMULA_MFU,
    }
    peaks = [int(r["peak_device_bytes"]) for r in results if r.get("peak_device_bytes") is not None]
    record.peak_device_bytes = max(peaks) if peaks else None
    record.peak_device_kind = first.get("peak_device_kind")
    skip = {"rank", "status", "message", "peak_device_bytes", "peak_device_kind", "peak_host_bytes", "n_params", "step_time_s"}
    record.details.update({k: v for k, v in first.items() if k not in skip})
    record.details["per_rank_peak_host_bytes"] = rank_peaks
    return record
