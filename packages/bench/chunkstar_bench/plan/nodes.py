"""The nodes ``chunkstar-bench plan`` knows, the formula's and the dry run's alike.

:data:`chunkstar.dryrun.HARDWARE` is the one table of hardware facts: GPUs per node,
device and host memory, the dense bf16/fp16 peak, the links, the disk, each entry with
its source. The bench keeps no copy of them: the formula's presets
(:data:`chunkstar_bench.plan.model.HARDWARE`) are built from its entries, and so are the
peaks MFU divides by (:mod:`chunkstar_bench.flops`). What this module adds are the names
scripts may still use for an entry (:data:`ALIASES`), and the one lookup
(:func:`node_named`) the formula, the dry run and the paper tables all go through, so
``--hardware`` means the same node whichever of them answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chunkstar.dryrun import HARDWARE as CORE_HARDWARE
from chunkstar.dryrun import Hardware as Node
from chunkstar.dryrun import hardware_named

from chunkstar_bench.units import GIB

__all__ = ["ALIASES", "NODE_NAMES", "Alias", "Node", "aliases_help", "node_named"]


@dataclass(frozen=True)
class Alias:
    """Another name for an entry of :data:`chunkstar.dryrun.HARDWARE`."""

    node: str
    """The entry it maps to: every figure is that entry's unless a field below says otherwise."""
    host_memory: int | None = None
    """Host bytes per node where the named machine has other than the entry's (None: the entry's)."""
    why: str = ""


ALIASES: dict[str, Alias] = {
    # The formula's own preset before it read chunkstar.dryrun.HARDWARE ("1 x H200, 128 GiB host"): the
    # core's single-H200 node is MegaTrain's, with 1.5 TB of host, so the name keeps its 128 GiB; the GPU,
    # its memory and the links are the core entry's.
    "h200x1_128gb": Alias("h200_1.5tb", host_memory=128 * GIB, why="the formula's former preset, kept for scripts"),
}
"""Older ``--hardware`` names, each an entry of :data:`chunkstar.dryrun.HARDWARE`."""

NODE_NAMES: tuple[str, ...] = (*CORE_HARDWARE, *ALIASES)
"""Every name :func:`node_named` takes (besides the core's ``"this-machine"``): the core's entries, then the aliases."""


def node_named(name: str) -> Node:
    """The :data:`chunkstar.dryrun.HARDWARE` entry called ``name``, an alias's entry (named as the alias,
    with its own host memory where it has one), or ``"this-machine"`` (measured now); a ValueError naming
    the choices otherwise."""
    alias = ALIASES.get(name)
    if alias is None:
        try:
            return hardware_named(name)
        except ValueError:
            raise ValueError(f"unknown hardware {name!r}; known: {', '.join([*NODE_NAMES, 'this-machine'])}") from None
    node = CORE_HARDWARE[alias.node]
    if alias.host_memory is None:
        return dataclasses.replace(node, name=name, description=f"alias of {alias.node}: {node.description}")
    return dataclasses.replace(
        node, name=name, host_memory=alias.host_memory,
        description=f"alias of {alias.node} ({node.description}), but {alias.host_memory / GIB:g} GiB of host",
    )  # fmt: skip


def aliases_help() -> str:
    """One phrase per alias, for ``--help``: ``"h200x1_128gb = h200_1.5tb with 128 GiB of host"``."""
    parts = []
    for name, alias in ALIASES.items():
        host = f" with {alias.host_memory / GIB:g} GiB of host" if alias.host_memory is not None else ""
        parts.append(f"{name} = {alias.node}{host}" + (f" ({alias.why})" if alias.why else ""))
    return "; ".join(parts)
