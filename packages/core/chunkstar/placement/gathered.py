"""When to drop gathered copies of other ranks' param chunks: pure policy (several processes).

After a module's forward, the groups its parameters live in hold this rank's
copies of the other ranks' chunks. They are dropped unless the next moment
(per the frozen trace) needs the group again, or a chunk of the group is still
in use (pinned). The decision reads only tensor states and the trace's chunk
ids, the same on every rank, never a memory measurement, so every rank drops
the same groups (Note [collective schedule] in
:mod:`chunkstar.distributed.grad_reduce`). The reducer acts on the answer.
"""

from __future__ import annotations

from typing import Callable, Iterable

__all__ = ["groups_to_release"]


def groups_to_release(used: Iterable[int], needed_next: Iterable[int], pinned: Callable[[int], bool]) -> list[int]:
    """First chunk ids of the groups in ``used`` to drop, ascending: those the next moment
    does not need (``needed_next``: its groups' first chunk ids, empty without a frozen
    trace) and with no pinned chunk (``pinned(group start)``)."""
    keep = set(needed_next)
    return [g for g in sorted(set(used) - keep) if not pinned(g)]
