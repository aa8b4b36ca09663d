"""chunkstar_profiler: see every chunk move and every byte, per operator.

    with chunkstar_profiler.Profiler(engine) as prof:
        ...train...
    prof.save("run.csprof")
    p = chunkstar_profiler.load("run.csprof")   # p.moments, p.moves, p.memory, p.stages, p.placements, p.meta
    p.activation_moves                           # saved activations across the host link: not chunk moves

The recorder subscribes to the engine's typed events (the core never imports
this package). Files are a versioned ZIP of NPY columns plus a JSON manifest
(:mod:`chunkstar_profiler.fileformat`); loading needs no engine. The CLI
``chunkstar-profile`` prints summaries, exports Chrome/Perfetto traces and
opens a profile in the viewer (``chunkstar-profile view``, with the
``dashboard`` extra: the ``chunkstar_dashboard`` package).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from chunkstar_profiler._version import __version__
from chunkstar_profiler.chrome import export_chrome_trace
from chunkstar_profiler.fileformat import FORMAT_VERSION, ProfileFormatError, read_profile
from chunkstar_profiler.profile import MOVE_REASONS, TIERS, Profile
from chunkstar_profiler.summary import summarize

if TYPE_CHECKING:
    from chunkstar_profiler.recorder import Profiler

__all__ = [
    "FORMAT_VERSION",
    "MOVE_REASONS",
    "Profile",
    "ProfileFormatError",
    "Profiler",
    "TIERS",
    "export_chrome_trace",
    "load",
    "summarize",
]


def __getattr__(name: str) -> Any:
    # The recorder needs the engine (and torch); reading, summarising and exporting
    # files must not, so it is imported only when asked for.
    if name == "Profiler":
        from chunkstar_profiler.recorder import Profiler

        return Profiler
    raise AttributeError(f"module 'chunkstar_profiler' has no attribute {name!r}")


def load(source: str | os.PathLike[str] | bytes, name: str | None = None) -> Profile:
    """Load a profile written by :meth:`Profiler.save`, from its path or its bytes."""
    return read_profile(source, name)
