"""``chunkstar``: command-line tools of the core (``merge-checkpoint``)."""

from __future__ import annotations

import sys

__all__ = ["main"]

_USAGE = "usage: chunkstar merge-checkpoint DIR OUT.safetensors [--force]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    if args[0] == "merge-checkpoint":
        from chunkstar.checkpoint import main_merge  # here, so `chunkstar --help` does not import torch

        return main_merge(args[1:])
    print(f"chunkstar: unknown command {args[0]!r}\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
