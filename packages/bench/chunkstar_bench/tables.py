"""Plain-text tables for the command line: one formatter for every table the bench prints."""

from __future__ import annotations

from typing import Sequence

__all__ = ["text_table"]


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned, a rule under the headers."""
    widths = [max(len(headers[i]), *(len(r[i]) for r in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])
