"""The four aligned chunk lists (docs/design.md, 'Chunks'): chunk *i* of each holds the same tensors at the same offsets.

Only the name of each list lives here; the chunks themselves are the chunk
store's (:class:`chunkstar.chunk.store.Chunks`). The values are
what events, profiles and checkpoints store, so they never change.
"""

from __future__ import annotations

import enum

__all__ = ["ChunkList", "CHUNK_LISTS", "STATE_LISTS"]


class ChunkList(str, enum.Enum):
    PARAM = "param"
    """Parameters in the compute dtype; a slot holds its parameter's gradient after backward."""
    MASTER = "master"
    """fp32 master copy of each parameter."""
    EXP_AVG = "exp_avg"
    """Adam's first moment, fp32."""
    EXP_AVG_SQ = "exp_avg_sq"
    """Adam's second moment, fp32."""

    # A member is its value everywhere a string is: it hashes and compares like it (a
    # profile's "param" finds ChunkList.PARAM in a dict), and prints as it (Enum's own
    # __hash__ is Python code and its __str__ would print "ChunkList.PARAM").
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


CHUNK_LISTS = tuple(ChunkList)
STATE_LISTS = (ChunkList.MASTER, ChunkList.EXP_AVG, ChunkList.EXP_AVG_SQ)
"""The lists the optimizer keeps (this rank's share only, with several processes)."""
