"""Host memory as a budget: what a run's chunks need of it, and what the machine gives.

Note [host memory plan]: the engine plans host memory as it plans the device's,
before it builds anything. What it will hold in host memory follows from the
layout and the config alone:

* the chunks of every list whose home is host memory (this rank's own: the param
  chunks unless the param list is on disk, the fp32 master and Adam state unless
  those are);
* with the disk tier, the staging pool, its whole budget (a pool keeps the
  buffers it lent, up to the budget, for the next chunks of the same size);
* with gradient accumulation, an fp32 accumulator per trainable param chunk
  (Note [accumulator buffers] in :mod:`chunkstar.runtime.gradients`);
* on the CPU virtual device, the device itself: its budget is host memory too
  (or, if fewer, the bytes of the chunks it could ever hold: a budget far above
  the model is not memory the run takes; the activations beside the chunks are
  then not planned).

Less what the start gives back: the model's real (non-meta) parameters on the
host are freed as their values move into the chunks. What the process holds
besides (torch itself, the batch, activations on the CPU virtual device beyond
its budget, a framework's own buffers) is not the engine's and is not planned;
the budget leaves room for it by being a share of what is available, not all.

The budget (config ``host_memory_budget``) is bytes, or "auto": 90% of what the
machine has available now (``MemAvailable``; inside a cgroup with a memory limit,
the limit less the group's usage, if lower; ``CHUNKSTAR_HOST_MEMORY``, when set,
stands for the machine's memory, less this process's resident set: a benchmark
emulates a smaller machine with it), shared by the processes of this node
(``LOCAL_WORLD_SIZE``, or what the launcher says: ``processes_on_node`` in
:mod:`chunkstar.device.threads`). A plan above its budget is refused before anything is
built (:class:`chunkstar.errors.HostMemoryError`, with the plan's parts and what
to change), never killed halfway; with the disk tier and no ``lists`` given, the
param list goes on disk when that is what makes the plan fit (Note [param chunks
on disk] in :mod:`chunkstar.runtime.disk_tier`).

Pure arithmetic here, apart from :func:`available_host_memory`, which reads the
machine; the engine (:mod:`chunkstar.runtime.start_checks`) acts on the answers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from chunkstar.errors import _fmt as _size

__all__ = ["AUTO_SHARE", "HOST_MEMORY_ENV", "HostPlan", "available_host_memory", "host_budget"]

AUTO_SHARE = 0.9
"""The share of the available host memory "auto" plans with: the rest is the process's own
(torch, the batch, the activations a CPU virtual device holds, the allocator's slack)."""

HOST_MEMORY_ENV = "CHUNKSTAR_HOST_MEMORY"
"""When set (bytes, or a size like "8GiB"), the machine's memory as "auto" sees it."""


@dataclass(frozen=True)
class HostPlan:
    """The host bytes a run's plan holds at most, by part (the module docstring)."""

    parts: dict[str, int] = field(default_factory=dict)
    """What holds host memory, in bytes, by name ("param chunks", "staging", ...)."""
    credit: int = 0
    """Bytes the start gives back (the model's real parameters, freed into the chunks)."""

    @property
    def total(self) -> int:
        return max(0, sum(self.parts.values()) - self.credit)

    def describe(self) -> str:
        """``param chunks 4.20 GB + staging 1.44 GB - 0 B freed``: the parts, largest first."""
        text = " + ".join(f"{name} {_size(n)}" for name, n in sorted(self.parts.items(), key=lambda kv: -kv[1]) if n)
        if self.credit:
            text += f" - {_size(self.credit)} of real parameters freed into the chunks"
        return text or "nothing"


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room() -> int | None:
    """A cgroup v2 memory limit less the group's usage, or None (no limit, or not Linux)."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            rel = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
    except OSError:
        return None
    if rel is None:
        return None
    base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
    try:
        with open(os.path.join(base, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current"), encoding="ascii") as f:
            used = int(f.read().strip())
        return max(0, int(limit) - used)
    except (OSError, ValueError):
        return None


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0


def available_host_memory(machine: int | None = None) -> tuple[int | None, str]:
    """Host bytes available to this process now, and where the figure came from: the lowest of
    ``MemAvailable`` and a cgroup's room; ``machine`` (the value of :data:`HOST_MEMORY_ENV`)
    stands for the machine's memory instead, less this process's resident set."""
    if machine is not None:
        rss = _resident_bytes()
        return max(0, machine - rss), f"{HOST_MEMORY_ENV}={_size(machine)} less this process's {_size(rss)} resident"
    found = [(n, what) for n, what in ((_meminfo_available(), "MemAvailable"), (_cgroup_room(), "the cgroup's memory.max less its usage")) if n is not None]
    if not found:
        return None, "unknown (no /proc/meminfo)"
    n, what = min(found)
    return n, f"{what} ({_size(n)})"


def host_budget(configured: int | None, local_world_size: int = 1, machine: int | None = None) -> tuple[int | None, str]:
    """The host bytes a rank's plan may hold: ``configured`` (config ``host_memory_budget``), or
    for "auto" (None) :data:`AUTO_SHARE` of what is available, split over the node's
    ``local_world_size`` processes; None when the machine cannot say (nothing is refused)."""
    if configured is not None:
        return configured, f"host_memory_budget {_size(configured)}"
    avail, what = available_host_memory(machine)
    if avail is None:
        return None, what
    n = max(1, local_world_size)
    share = int(avail * AUTO_SHARE) // n
    per = f" / {n} processes on this node" if n > 1 else ""
    return share, f"host_memory_budget \"auto\": {AUTO_SHARE:.0%} of {what}{per} = {_size(share)}"
