"""How wide torch's CPU ops run on chunkstar's own threads.

Mechanism only: one call a thread makes on itself before its first job.

Note [one OpenMP team]: torch's CPU build runs every large op (a copy, an
elementwise op, a matmul) on an OpenMP team of ``torch.get_num_threads()``
threads, and GNU OpenMP (libgomp, the runtime of PyTorch's Linux wheels) keeps
one such team per thread that ever ran a multi-threaded op, for that thread's
whole life. Between two ops a team's threads spin for about 300,000 iterations
(a few ms) before they sleep, so the next op starts at once; but as soon as the
process holds more OpenMP threads than CPUs, libgomp cuts that spin to 100
iterations, and from then on every op of every thread starts by waking its
team's threads from a futex. A copy lane or the host worker that ran one
multi-threaded copy, or an autograd device thread that ran one backward, is
enough. Measured on a 2-core VM (a 49M GPT-2, bf16, 4 x 128, every chunk
resident; each phase timed in wall and process CPU seconds, as
``benchmarks/resident_phases.py --cpu-time`` does): with the copy lanes, the
host worker and the virtual device's autograd thread each holding a team, the
process kept 1.6 of its 2 cores busy and a step took 0.45-0.48 s; with only the
compute thread's team, 2.0 cores and 0.40-0.44 s, PyTorch's own step time (its
one thread never loses the spin).

So chunkstar's helper threads (the copy lanes and the host worker of the CPU
virtual device, the disk tier's I/O lanes) run torch's ops on themselves alone:
their work is meant to run beside the compute thread's, on what it leaves
free, not to compete with it for every core. One exception: once the frozen
schedule gives the host worker optimizer updates (hybrid Adam left chunks on
the host, or the disk tier keeps every chunk's state there), their throughput
matters more than the compute thread's spin, and the worker widens to torch's
width (measured with a 124M GPT-2 on the disk tier, 2 x 128: 2.36 s/step wide
against 2.65-2.71 narrow); when every update runs on the device it never holds
a team. On CUDA the host worker keeps torch's width throughout: there the CPU's
cores are the host Adam's, and the compute is the GPU's. And the CPU virtual device runs the backward on the caller's thread,
as autograd does for CPU tensors, unless the strict device asks for a device
thread of its own (``CHUNKSTAR_STRICT_DEVICE=1``: the test suite's setting;
:mod:`chunkstar.device.virtual`), which costs that thread's team.

Note [the rank's share of the cores]: torch's width is the process's, and under
``torchrun`` with several processes per node it is 1: torchrun sets
``OMP_NUM_THREADS=1`` for every rank unless the user set it, so that N ranks do
not each start an OpenMP team as wide as the node. For the compute thread of a
GPU rank that is right (the GPU computes); for the host worker it is not: host
Adam is the one CPU-bound part of a step, and on one core per rank it leaves
the node's other cores idle and takes seconds for a 1B model. So with several
processes per node (:func:`processes_on_node`: ``LOCAL_WORLD_SIZE``, which torchrun sets, above 1) the host
worker's width is the rank's share of the CPUs this process may run on
(``os.sched_getaffinity``, which a container's cpuset narrows), divided evenly
among the node's processes; alone on its node the worker keeps torch's width.
``engine.stats()["host_worker_threads"]`` says the width it runs at.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable, Mapping

import torch

__all__ = ["host_worker_width", "ops_on_this_thread_only", "processes_on_node", "rank_share_of_cores", "set_ops_width"]


def _find_omp_set_num_threads() -> Callable[[int], None] | None:
    """OpenMP's ``omp_set_num_threads`` as loaded with torch (it sets the calling thread's
    width only); None where torch runs without OpenMP or the symbol is not global."""
    try:
        fn = getattr(ctypes.CDLL(None), "omp_set_num_threads", None)
    except (OSError, TypeError):  # no dlopen(NULL) (Windows)
        return None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return fn  # type: ignore[no-any-return]


_OMP_SET_NUM_THREADS = _find_omp_set_num_threads()


def set_ops_width(width: int) -> bool:
    """Run torch's CPU ops called from this thread on ``width`` threads (OpenMP's width is the
    calling thread's own; other threads keep theirs). Whether it could (False where torch
    does not use OpenMP: nothing to do there)."""
    if _OMP_SET_NUM_THREADS is None:
        return False
    # torch sets each thread's OpenMP width lazily, on the thread's first question: ask first,
    # so that first question cannot undo the width set below
    torch.get_num_threads()
    _OMP_SET_NUM_THREADS(max(1, width))
    return torch.get_num_threads() == max(1, width)


def ops_on_this_thread_only() -> bool:
    """Make torch's CPU ops called from this thread run on it alone, with no OpenMP team
    of their own (Note [one OpenMP team])."""
    return set_ops_width(1)


# the processes on this node, as each launcher says it: torchrun (and accelerate launch, which
# runs it), Open MPI, MPICH / Intel MPI, SLURM with --ntasks-per-node; the first one set counts
_PROCESSES_ON_NODE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def processes_on_node(environ: Mapping[str, str] | None = None) -> int:
    """The processes on this node (``LOCAL_WORLD_SIZE`` as torchrun sets it, or what an MPI
    launcher or SLURM says, :data:`_PROCESSES_ON_NODE`); 1 when none says (a launcher that
    does not say runs one process per node as far as we know) or the value is not a
    positive integer. The engine splits the node's cores and host memory budget by it."""
    env = os.environ if environ is None else environ
    for name in _PROCESSES_ON_NODE:
        value = env.get(name)
        if value:
            try:
                return max(1, int(value))
            except ValueError:
                return 1
    return 1


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset or a binding narrows it)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return max(1, len(getaffinity(0)))
        except OSError:
            pass
    return max(1, os.cpu_count() or 1)


def rank_share_of_cores(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """This process's share of the CPUs it may run on, among the ``LOCAL_WORLD_SIZE`` processes
    of its node (Note [the rank's share of the cores]); at least 1. ``environ`` and ``cpus``
    default to the process's own."""
    local = processes_on_node(environ)
    return max(1, (_usable_cpus() if cpus is None else cpus) // local)


def host_worker_width(environ: Mapping[str, str] | None = None, cpus: int | None = None) -> int:
    """How wide the host worker runs torch's ops (Note [the rank's share of the cores]): torch's
    width for a process alone on its node, the rank's share of the cores with several."""
    if processes_on_node(environ) <= 1:
        return torch.get_num_threads()
    return rank_share_of_cores(environ, cpus)
