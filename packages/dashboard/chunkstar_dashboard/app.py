"""chunkstar profile dashboard: the Streamlit script.

    chunkstar-profile view run.csprof [--compare other.csprof] [--bench-db results.sqlite]
    streamlit run dashboards/app.py -- --profile run.csprof [--compare other.csprof] [--bench-db results.sqlite]

The first form starts this script (``chunkstar_dashboard.launch``); the second
runs the checkout's thin entry, which calls :func:`main`. Without
``--profile`` the sidebar asks for a path or an upload; the Benchmarks page
reads the results database of ``--bench-db`` (or its own sidebar box). This
script only parses the arguments, picks the profile and builds the navigation;
the pages in ``views/`` render, from the pure functions of the package.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path

import streamlit as st
from chunkstar_profiler import Profile

from chunkstar_dashboard import loading
from chunkstar_dashboard.data import (
    activation_totals, display_name, duration_s, format_bytes, format_duration, has_activation_moves, has_disk_tier, peak_bytes,
)  # fmt: skip
from chunkstar_dashboard.text import escape_markdown

__all__ = ["PAGES", "main", "script_args"]

VIEWS = Path(__file__).resolve().with_name("views")
PAGES = (
    ("memory.py", "Memory timeline"),
    ("chunks.py", "Chunk locations"),
    ("operators.py", "Operator movements"),
    ("compare.py", "Compare profiles"),
    ("benchmarks.py", "Benchmarks"),
)
"""The page scripts in ``views/`` and their titles, in navigation order; the first is the default."""


def script_args(script: str) -> list[str]:
    """The arguments after ``--`` when ``script`` is what ``streamlit run`` runs; none under other runners
    (``AppTest`` and pytest leave their own ``sys.argv``, which is not ours to parse)."""
    if sys.argv and sys.argv[0] and Path(sys.argv[0]).resolve() == Path(script).resolve():
        return sys.argv[1:]
    return []


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chunkstar_dashboard/app.py", add_help=False, allow_abbrev=False)
    ap.add_argument("--profile", default="")
    ap.add_argument("--compare", default="")
    ap.add_argument("--bench-db", default="")
    return ap.parse_known_args(list(argv))[0]


def _sidebar_summary(p: Profile) -> None:
    # Every string from the file is escaped: a model name of `**x**` or `[x](url)` shows as typed.
    m = p.meta
    predicted = p.prediction is not None
    chunk_size = m.get("chunk_size")
    lines = [
        f"**{escape_markdown(display_name(p))}**",
        f"model {escape_markdown(m.get('model_name', '?'))}, {m.get('n_params', 0) / 1e6:,.2f}M params"
        + (f", {escape_markdown(m['precision'])}" if m.get("precision") else ""),
        f"{escape_markdown(m.get('n_chunks', '?'))} chunks" + (f" of {chunk_size:,} elements" if isinstance(chunk_size, int) else ""),
        f"device {escape_markdown(m.get('device', '?'))}, budget " + (format_bytes(m["budget_bytes"]) if m.get("budget_bytes") else "unbounded"),
        f"{escape_markdown(m.get('iterations', '?'))} iterations, {format_duration(duration_s(p))} "
        + ("predicted" if predicted else "recorded"),
    ]
    if predicted:  # a dry run's step on the time model's clock: said before any figure
        lines.insert(1, "**predicted** by a dry run, not measured")
    if has_disk_tier(p):
        lines.insert(4, f"disk tier: {format_bytes(peak_bytes(p.memory, 'disk'))} of chunk files")
    if has_activation_moves(p):
        act = activation_totals(p.activation_moves)
        lines.insert(-1, f"activations offloaded: {format_bytes(act['bytes_to_host'])} to the host, {act['moves']:,} moves")
    created = m.get("created_unix")
    if isinstance(created, (int, float)) and created > 0:
        try:
            lines.append(f"{'written' if predicted else 'recorded'} {datetime.datetime.fromtimestamp(created):%Y-%m-%d %H:%M}")
        except (OverflowError, OSError, ValueError):  # a time no calendar holds: leave the line out
            pass
    st.sidebar.caption("  \n".join(lines))


def main(argv: Sequence[str] = ()) -> None:
    """One run of the app; ``argv``: ``--profile`` / ``--compare`` / ``--bench-db`` (see :func:`script_args`)."""
    st.set_page_config(page_title="chunkstar profile", layout="wide")
    args = _parse(argv)
    st.session_state.setdefault("profile_path", args.profile)
    st.session_state.setdefault("compare_path", args.compare)
    st.session_state.setdefault("bench_db_path", args.bench_db)
    pages = [st.Page(VIEWS / file, title=title, default=i == 0) for i, (file, title) in enumerate(PAGES)]
    nav = st.navigation(pages)
    with st.sidebar:
        st.header("Profile")
        loaded = loading.profile_picker("profile", "Profile")
    loading.set_current(loaded)
    if loaded.profile is not None:
        _sidebar_summary(loaded.profile)
    nav.run()


if __name__ == "__main__":  # `streamlit run` runs this file as __main__ (chunkstar-profile view does)
    main(script_args(__file__))
