"""``chunkstar-profile``: summarize a profile or export it for Perfetto."""

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
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
