"""Reading benchmark results for the app: the results SQLite, the published figures, the planner.

All three go through ``chunkstar_bench`` (the same distribution; its heavier
modules imported only when a page asks) and are cached by ``st.cache_data``:
a results file by (path, mtime, size), so a database a nightly job appended
to is read again.
A file that is missing or not a results database becomes a ``BenchLoadError``
whose text the page shows; rows whose values are not of their column's type
(``chunkstar_bench.results.BadRowsError``) are left out, and the sentence
naming them comes back beside the other runs for the page to show.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from .bench_data import published_frame

__all__ = ["BenchLoadError", "load_published", "load_runs", "planned_max"]

class BenchLoadError(Exception):
    """A results database could not be read; the message is meant for the user."""


@st.cache_data(show_spinner="Reading results...", max_entries=8)
def _runs(path: str, mtime_ns: int, size: int) -> tuple[pd.DataFrame, str | None]:
    del mtime_ns, size  # part of the cache key only
    from chunkstar_bench.results import BadRowsError, ResultsDB

    db = ResultsDB(path, read_only=True)  # the dashboard never creates or changes a results file
    try:
        return db.runs(), None
    except BadRowsError as err:
        return err.good, str(err)


def load_runs(path: str) -> tuple[pd.DataFrame, str | None]:
    """Every readable run in the results SQLite at ``path`` (cached), and a sentence naming the rows left out
    (None when there are none); raises ``BenchLoadError`` with a readable message when the file cannot be read."""
    p = Path(path).expanduser()
    try:
        stat = p.stat()
    except OSError as err:
        raise BenchLoadError(f"Cannot open {path!r}: {err.strerror or err}") from None
    if not p.is_file():
        raise BenchLoadError(f"{path!r} is not a file.")
    try:
        from chunkstar_bench.results import ResultsFileError
    except ImportError as err:
        raise BenchLoadError(f"Reading results needs the chunkstar_bench package ({err}).") from None
    try:
        return _runs(str(p.resolve()), stat.st_mtime_ns, stat.st_size)
    except ResultsFileError as err:  # the sentence names the file and what is wrong with it
        raise BenchLoadError(f"{p.name} is not a readable chunkstar-bench results database: {err}") from None


@st.cache_data(show_spinner=False)
def load_published() -> pd.DataFrame:
    """The paper's published figures (``chunkstar_bench.published``, exact zoo sizes where known), as a frame."""
    from chunkstar_bench import published

    return published_frame(published.load_published())


@st.cache_data(show_spinner="Planning...")
def planned_max(hardware: tuple[str, ...]) -> pd.DataFrame:
    """The capacity planner's largest model per system on each preset node in ``hardware`` (others skipped).

    Default workload: micro-batch 8 per GPU, activation checkpointing, all the
    node's GPUs, chunkstar's auto chunk size.
    """
    from chunkstar_bench import plan
    from chunkstar_bench.published import canonical_system

    rows = []
    for name in hardware:
        hw = plan.HARDWARE.get(name)
        if hw is None:
            continue
        for system in plan.SYSTEMS:
            best = plan.predict_max(system, hw).best
            if best is not None:
                rows.append({"hardware": name, "system": canonical_system(system), "model": best.model, "n_params": best.n_params})
    return pd.DataFrame(rows, columns=["hardware", "system", "model", "n_params"])
