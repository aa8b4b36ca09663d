"""Byte sizes on the command line: one parser, in a module the commands share and that imports none of them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chunkstar_bench.units import parse_size


def test_parse_size() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("2G") == 2 * 10**9  # chunkstar.parse_bytes' units, the engine's own
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


def test_a_subcommand_takes_sizes_without_importing_the_cli() -> None:
    """``plan`` and ``chunkstar-bench`` share the size parser through :mod:`chunkstar_bench.units`, a leaf:
    the subcommand does not import the entry point that imports it."""
    code = (
        "import sys, chunkstar_bench.plan.command, chunkstar_bench.units; "
        "print(sorted(m for m in sys.modules if m == 'chunkstar_bench.cli'))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
