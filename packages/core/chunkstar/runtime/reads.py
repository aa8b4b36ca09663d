"""What reads of parameters through their guard leave behind, for the hooks and the iteration.

A read of a parameter outside the module hooks (Note [parameter guard] in
:mod:`chunkstar.hooks.param_guard`) can leave state that outlives the read:
``.data`` aliases a forward took, each with its own version counter (Note
[data aliases]); parameters a forward read outside every module, held in
COMPUTE until the next module boundary; the parameters inside an open
``engine.gathered_parameters()`` block; the values one ``module.state_dict()``
call hands out. The parameter access (:mod:`chunkstar.runtime.param_access`)
makes this state, the hook targets settle the aliases and holds at module
boundaries, and the iteration settles them when a forward or an iteration ends
or aborts. All three are built with this one object, before any of them, so
none has to hand another a callback after construction.
"""

from __future__ import annotations

import torch

from chunkstar.chunk.state import TensorState
from chunkstar.runtime.chunk_manager import ChunkManager

__all__ = ["ReadState", "alias_written"]


def alias_written(taken: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether any of these .data aliases was written since it was noted (its own counter)."""
    return any(a._version != v for a, v in taken)


class ReadState:
    def __init__(self, mgr: ChunkManager) -> None:
        self._mgr = mgr
        self.aliases: dict[int, list[tuple[torch.Tensor, int]]] = {}
        """Slot index -> the .data aliases a forward took of it, each with its own counter
        then (Note [data aliases]); the hook targets check them where they check versions."""
        self.loose: dict[int, TensorState] = {}
        """Slot index -> its state before: parameters whose .data a forward took outside every
        module, held in COMPUTE until the next module boundary (:meth:`flush_loose`)."""
        self.gathered: set[int] = set()
        """Slot indices inside an open ``engine.gathered_parameters()`` block."""
        self.sd_depth = 0
        """Nesting of ``module.state_dict()`` calls in progress."""
        self.sd_memo: dict[int, torch.Tensor] = {}
        """Slot index -> the fp32 value handed out in this ``state_dict()``."""
        self.sd_masters: dict[int, torch.Tensor] | None = None
        """Gathered master chunks for this ``state_dict()`` (several processes)."""
        self.sd_chunk: tuple[int, torch.Tensor] | None = None
        """The last master chunk staged from disk for this ``state_dict()``, a copy."""

    def gathered_active(self) -> bool:
        return bool(self.gathered)

    def note_alias(self, index: int, alias: torch.Tensor) -> None:
        """A forward took ``p.data`` of slot ``index`` (Note [data aliases])."""
        self.aliases.setdefault(index, []).append((alias, alias._version))

    def hold_loose(self, indices: list[int], prior: dict[int, TensorState]) -> None:
        """A forward took ``.data`` of these parameters outside every module: they stay in
        COMPUTE until the next module boundary (:meth:`flush_loose`)."""
        for i in indices:
            self.loose.setdefault(i, prior[i])

    def flush_loose(self) -> None:
        """Absorb what was written through the loose aliases and release their parameters."""
        if not self.loose:
            return
        loose = dict(self.loose)
        self.loose.clear()
        written = [i for i in loose if alias_written(self.aliases.pop(i, []))]
        mgr = self._mgr
        states = mgr.states
        if written:
            mgr.absorb_writes([i for i in written if states[i] is TensorState.COMPUTE])
        for i, prior in loose.items():
            if states[i] is TensorState.COMPUTE:
                mgr.set_state(i, TensorState.HOLD if prior is TensorState.COMPUTE else prior)

    def reset_state_dict(self) -> None:
        """Forget what a ``module.state_dict()`` call memoised."""
        self.sd_memo = {}
        self.sd_masters = None
        self.sd_chunk = None

    def reset(self) -> None:
        """An iteration begins or aborts: settle the loose holds, forget the aliases, and
        forget a ``state_dict()`` an exception left half-done."""
        self.flush_loose()
        self.aliases.clear()
        self.loose.clear()
        self.sd_depth = 0
        self.reset_state_dict()
