"""Every tensor's state, its derived counts per chunk, and the parameter guard.

One entry per tensor slot (:class:`chunkstar.chunk.state.TensorState`), moved
only by :meth:`TensorStates.set_state`, which checks the transition and keeps
per-chunk counts of the tensors in COMPUTE (the chunk is pinned: in use by a
running moment), in HOLD_AFTER_FWD (awaiting their backward) and in
HOLD_AFTER_BWD (holding a gradient), so per-step work visits the chunks that
have such tensors instead of every slot. It also swaps each parameter's class
when its tensor enters or leaves COMPUTE (Note [parameter guard] in
:mod:`chunkstar.hooks.param_guard`). The chunk store owns one and exposes its
methods as its own; nothing here moves bytes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.state import TensorState, check_tensor_transition
from chunkstar.errors import ChunkStateError

__all__ = ["TensorStates"]

_COMPUTE, _HOLD_AFTER_FWD, _HOLD_AFTER_BWD = TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD


def _legal(old: TensorState, new: TensorState) -> bool:
    try:
        check_tensor_transition("", old, new)
    except ChunkStateError:
        return False
    return True


# (id(old), id(new)) of every transition check_tensor_transition allows (the one definition
# stays in chunk/state.py): set_state's fast test, with the check itself for the error
_LEGAL_TRANSITIONS = frozenset((id(a), id(b)) for a in TensorState for b in TensorState if _legal(a, b))


class TensorStates:
    def __init__(self, layout: ChunkLayout) -> None:
        self.slots: tuple[TensorSlot, ...] = layout.slots
        self.states: list[TensorState] = [TensorState.FREE] * len(layout.slots)
        # derived caches of the states, kept by set_state only, per param chunk: tensors in
        # COMPUTE (the chunk is pinned), in HOLD_AFTER_FWD and in HOLD_AFTER_BWD (gradients)
        self.compute_count: list[int] = [0] * layout.n_chunks
        self._fwd_count: list[int] = [0] * layout.n_chunks
        self._grad_count: list[int] = [0] * layout.n_chunks
        self._chunk_of: list[int] = [s.chunk_id for s in layout.slots]  # by slot index
        self._slots_by_chunk: list[list[TensorSlot]] = [[] for _ in range(layout.n_chunks)]
        for s in layout.slots:
            self._slots_by_chunk[s.chunk_id].append(s)
        # parameter objects by slot, with their plain, watched (in COMPUTE: Note [data aliases])
        # and guarded classes (Note [parameter guard]); set_state swaps the class when a tensor
        # enters or leaves COMPUTE
        self._guard: list[tuple[torch.Tensor, type, type, type]] = []
        self.chunk_params: list[list[torch.Tensor]] = [[] for _ in range(layout.n_chunks)]
        """Each chunk's parameter objects (once the guard is installed): their version counters
        tell an in-place write (Note [clean host copy])."""

    def set_state(self, index: int, new: TensorState) -> None:
        # hot: about five calls per parameter per step, so enum members are compared by
        # identity and legal transitions looked up by id (Enum.__hash__ is Python code)
        old = self.states[index]
        if old is new:
            return
        if (id(old), id(new)) not in _LEGAL_TRANSITIONS:
            check_tensor_transition(self.slots[index].name, old, new)  # raises, naming the parameter
        cid = self._chunk_of[index]
        if old is _COMPUTE:
            self.compute_count[cid] -= 1
            if self._guard:
                p, _, _, guarded = self._guard[index]
                p.__class__ = guarded
        elif old is _HOLD_AFTER_FWD:
            self._fwd_count[cid] -= 1
        elif old is _HOLD_AFTER_BWD:
            self._grad_count[cid] -= 1
        if new is _COMPUTE:
            self.compute_count[cid] += 1
            if self._guard:
                p, _, watched, _ = self._guard[index]
                p.__class__ = watched
        elif new is _HOLD_AFTER_FWD:
            self._fwd_count[cid] += 1
        elif new is _HOLD_AFTER_BWD:
            self._grad_count[cid] += 1
        self.states[index] = new

    def settled(self, chunk_id: int) -> bool:
        """No tensor of the chunk is in COMPUTE or HOLD_AFTER_FWD (none awaits its backward)."""
        return not self.compute_count[chunk_id] and not self._fwd_count[chunk_id]

    def grads_in(self, chunk_id: int) -> int:
        """Tensors of the chunk holding their gradient (HOLD_AFTER_BWD)."""
        return self._grad_count[chunk_id]

    def slots_in_use(self) -> list[int]:
        """Indices of the tensors in COMPUTE or HOLD_AFTER_FWD (used since the last
        backward ended), in chunk order; visits only the chunks that hold such tensors."""
        states = self.states
        return [
            s.index
            for cid, (c, f) in enumerate(zip(self.compute_count, self._fwd_count))
            if c or f
            for s in self._slots_by_chunk[cid]
            if states[s.index] is _COMPUTE or states[s.index] is _HOLD_AFTER_FWD
        ]

    def install_guard(self, params: Sequence[torch.Tensor], watched: Sequence[type], guarded: Sequence[type]) -> None:
        """Guard every parameter not in COMPUTE and watch those in it (Note [parameter guard]
        and Note [data aliases] in hooks/param_guard.py)."""
        self._guard = [(p, type(p), w, g) for p, w, g in zip(params, watched, guarded)]
        self.chunk_params = [[params[s.index] for s in slots] for slots in self._slots_by_chunk]
        for i, (p, _, w, g) in enumerate(self._guard):
            p.__class__ = w if self.states[i] is TensorState.COMPUTE else g

    def set_guarded(self, index: int, on: bool) -> None:
        """Guard one parameter outside COMPUTE, or give it its plain class (gathered_parameters()
        unguards: its .data is an fp32 copy of its own there)."""
        if self._guard:
            p, base, _, guarded = self._guard[index]
            p.__class__ = guarded if on else base

    def remove_guard(self) -> None:
        for p, base, _, _ in self._guard:
            p.__class__ = base
        self._guard = []

    def pinned(self, chunk_id: int) -> bool:
        return self.compute_count[chunk_id] > 0

    def slots_of(self, chunk_id: int) -> list[TensorSlot]:
        return self._slots_by_chunk[chunk_id]
