"""``chunkstar-profile``: summarize a profile, export it for Perfetto, or open it in the dashboard."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chunkstar-profile", description="Inspect chunkstar profiles.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary", help="top operators by bytes moved and by stall time, peak memory per tier, totals")
    s.add_argument("path")
    s.add_argument("--top", type=int, default=10)
    e = sub.add_parser("export-chrome", help="write Chrome trace JSON (open it in ui.perfetto.dev)")
    e.add_argument("path")
    e.add_argument("out")
    v = sub.add_parser(
        "view", help="open the profile in the dashboard: memory timeline, chunk map, moves per operator (chunkstar[dashboard])"
    )
    v.add_argument("path")
    v.add_argument("--compare", metavar="OTHER", help="a second profile, for the Compare page")
    v.add_argument("--bench-db", "--db", dest="bench_db", metavar="SQLITE", help="a chunkstar-bench results database, for the Benchmarks page")
    v.add_argument("--port", type=int, default=None, help="port to serve on (default: Streamlit's, 8501)")
    v.add_argument("--address", default="127.0.0.1", help="interface to listen on (default: 127.0.0.1, this machine only)")
    v.add_argument("--no-browser", action="store_true", help="do not open a browser tab")
    args = ap.parse_args(argv)
    if args.cmd == "view":
        if args.port is not None and not 1 <= args.port <= 65535:
            ap.error(f"--port {args.port}: a port is 1..65535")
        return _view(args)

    from chunkstar_profiler import ProfileFormatError, export_chrome_trace, load, summarize

    try:
        profile = load(args.path)
    except (ProfileFormatError, FileNotFoundError) as err:
        print(f"chunkstar-profile: {err}", file=sys.stderr)
        return 2
    if args.cmd == "summary":
        print(summarize(profile, top=args.top))
    else:
        out = export_chrome_trace(profile, args.out)
        print(f"wrote {out}: open it at https://ui.perfetto.dev (Open trace file)")
    return 0


def _view(args: argparse.Namespace) -> int:
    # The dashboard is an optional extra that depends on this package, so it is imported only here.
    try:
        import chunkstar_dashboard
    except ImportError as err:
        print(f"chunkstar-profile view: the dashboard is not installed ({err}): pip install 'chunkstar[dashboard]'", file=sys.stderr)
        return 2
    try:
        return chunkstar_dashboard.serve(
            args.path, compare=args.compare, bench_db=args.bench_db, port=args.port, address=args.address,
            open_browser=not args.no_browser,
        )  # fmt: skip
    except chunkstar_dashboard.LaunchError as err:
        print(f"chunkstar-profile view: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
