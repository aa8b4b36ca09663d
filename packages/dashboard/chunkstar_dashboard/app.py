"""chunkstar profile dashboard: the Streamlit entry point.

    streamlit run dashboards/app.py -- --profile run.prof [--compare other.prof] [--bench-db results.sqlite]

Without ``--profile`` the sidebar asks for a path or an upload; the Benchmarks
page reads the results database of ``--bench-db`` (or its own sidebar box). This script
only parses the arguments, picks the profile and builds the navigation; the
pages in ``views/`` render, from the pure functions in ``chunkstar_dashboard``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # `streamlit run` adds it; AppTest and other runners may not
    sys.path.insert(0, str(_HERE))

import streamlit as st  # noqa: E402

from chunkstar_dashboard import loading  # noqa: E402
from chunkstar_dashboard.data import ProfileData, format_bytes, has_disk_tier, peak_bytes  # noqa: E402
from chunkstar_dashboard.text import escape_markdown  # noqa: E402


def _cli_args() -> argparse.Namespace:
    """``--profile`` / ``--compare`` / ``--bench-db`` after ``--`` on the streamlit command line; none under other runners."""
    ap = argparse.ArgumentParser(prog="dashboards/app.py", add_help=False)
    ap.add_argument("--profile", default="")
    ap.add_argument("--compare", default="")
    ap.add_argument("--bench-db", default="")
    own = Path(sys.argv[0]).resolve() == Path(__file__).resolve() if sys.argv and sys.argv[0] else False
    return ap.parse_known_args(sys.argv[1:] if own else [])[0]


def _sidebar_summary(p: ProfileData) -> None:
    # Every string from the file is escaped: a model name of `**x**` or `[x](url)` shows as typed.
    m = p.meta
    chunk_size = m.get("chunk_size")
    lines = [
        f"**{escape_markdown(p.name)}**",
        f"model {escape_markdown(m.get('model_name', '?'))}, {m.get('n_params', 0) / 1e6:,.2f}M params"
        + (f", {escape_markdown(m['precision'])}" if m.get("precision") else ""),
        f"{escape_markdown(m.get('n_chunks', '?'))} chunks" + (f" of {chunk_size:,} elements" if isinstance(chunk_size, int) else ""),
        f"device {escape_markdown(m.get('device', '?'))}, budget " + (format_bytes(m["budget_bytes"]) if m.get("budget_bytes") else "unbounded"),
        f"{escape_markdown(m.get('iterations', '?'))} iterations, {p.duration_s:.3f} s recorded",
    ]
    if has_disk_tier(p):
        lines.insert(4, f"disk tier: {format_bytes(peak_bytes(p.memory, 'disk'))} of chunk files")
    created = m.get("created_unix")
    if isinstance(created, (int, float)) and created > 0:
        try:
            lines.append(f"recorded {datetime.datetime.fromtimestamp(created):%Y-%m-%d %H:%M}")
        except (OverflowError, OSError, ValueError):  # a time no calendar holds: leave the line out
            pass
    st.sidebar.caption("  \n".join(lines))


def main() -> None:
    st.set_page_config(page_title="chunkstar profile", layout="wide")
    args = _cli_args()
    st.session_state.setdefault("profile_path", args.profile)
    st.session_state.setdefault("compare_path", args.compare)
    st.session_state.setdefault("bench_db_path", args.bench_db)
    pages = [
        st.Page("views/memory.py", title="Memory timeline", default=True),
        st.Page("views/chunks.py", title="Chunk locations"),
        st.Page("views/operators.py", title="Operator movements"),
        st.Page("views/compare.py", title="Compare profiles"),
        st.Page("views/benchmarks.py", title="Benchmarks"),
    ]
    nav = st.navigation(pages)
    with st.sidebar:
        st.header("Profile")
        loaded = loading.profile_picker("profile", "Profile")
    loading.set_current(loaded)
    if loaded.profile is not None:
        _sidebar_summary(loaded.profile)
    nav.run()


main()
