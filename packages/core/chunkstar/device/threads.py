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
"""

from __future__ import annotations

import ctypes
from typing import Callable

import torch

__all__ = ["ops_on_this_thread_only", "set_ops_width"]


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
