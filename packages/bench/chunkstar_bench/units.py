"""Byte units for the bench's command lines and tables: the binary multiples and the size parser.

A leaf: it imports nothing of this package, so the entry point (:mod:`~chunkstar_bench.cli`)
and the subcommands it registers (``plan``) both take their sizes from here without
importing one another. The units themselves are chunkstar's (:func:`chunkstar.parse_bytes`).
"""

from __future__ import annotations

import argparse

__all__ = ["GIB", "MIB", "parse_size"]

GIB = 2**30
MIB = 2**20


def parse_size(text: str) -> int:
    """An argparse type: ``"8GiB"`` -> bytes, by chunkstar's own :func:`chunkstar.parse_bytes`
    (KB/MB/GB decimal, KiB/MiB/GiB binary, or a plain number)."""
    from chunkstar import parse_bytes  # imports torch: only the commands that take a size pay for it

    try:
        return parse_bytes(text.strip(), "size")
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 8GiB, 6000MiB or 8589934592)") from None
