"""Tensor states and chunk locations, each an enum with one checked transition.

A tensor's state says what its slot in the param chunk holds and whether a
module is using it; a chunk's location says which tier holds its payload. The
chunk's *movability* is derived from its tensors (any COMPUTE pins it), never
stored beside them.
"""

from __future__ import annotations

import enum

from chunkstar.errors import ChunkStateError

__all__ = ["TensorState", "ChunkLocation", "check_tensor_transition", "check_location_transition"]


class TensorState(enum.Enum):
    FREE = "free"
    """No valid data in the slot (before initialisation)."""
    COMPUTE = "compute"
    """A running module reads the slot; the chunk is pinned on the device."""
    HOLD = "hold"
    """The slot holds the parameter value; nobody is using it."""
    HOLD_AFTER_FWD = "hold_after_fwd"
    """The slot holds the parameter value, used in this forward, awaiting backward."""
    HOLD_AFTER_BWD = "hold_after_bwd"
    """The slot holds the parameter's gradient (the value lives on in the fp32 master)."""


class ChunkLocation(enum.Enum):
    RELEASED = "released"
    """No payload anywhere: before first placement, or a remote chunk (owned by another
    rank) between uses."""
    HOST = "host"
    """The payload is a host-memory buffer; the device storage is resized to 0 bytes."""
    DEVICE = "device"
    """The payload is in the device storage; no host copy is kept."""
    DISK = "disk"
    """The payload is the chunk's slot in its file on disk (Note [disk tier]); no host or
    device bytes. A write of it may still be in flight (the chunk's pending event)."""


_T = TensorState
_TENSOR_EDGES: dict[TensorState, frozenset[TensorState]] = {
    _T.FREE: frozenset({_T.HOLD}),
    _T.HOLD: frozenset({_T.COMPUTE, _T.HOLD}),
    _T.HOLD_AFTER_FWD: frozenset({_T.COMPUTE, _T.HOLD, _T.HOLD_AFTER_FWD}),
    # a gradient is in the slot: only the optimizer (or zero_grad) turns it back into a value
    _T.HOLD_AFTER_BWD: frozenset({_T.HOLD, _T.HOLD_AFTER_BWD}),
    _T.COMPUTE: frozenset({_T.COMPUTE, _T.HOLD, _T.HOLD_AFTER_FWD, _T.HOLD_AFTER_BWD}),
}

_L = ChunkLocation
_LOCATION_EDGES: dict[ChunkLocation, frozenset[ChunkLocation]] = {
    _L.RELEASED: frozenset({_L.HOST, _L.DEVICE, _L.DISK}),
    _L.HOST: frozenset({_L.DEVICE, _L.DISK}),
    _L.DISK: frozenset({_L.HOST}),  # staged in through a host buffer
    # RELEASED: a gathered remote copy is dropped; DISK: a param chunk whose file holds its bytes
    _L.DEVICE: frozenset({_L.HOST, _L.RELEASED, _L.DISK}),
}


def check_tensor_transition(name: str, old: TensorState, new: TensorState) -> None:
    if new not in _TENSOR_EDGES[old]:
        if old is _T.HOLD_AFTER_BWD and new is _T.COMPUTE:
            raise ChunkStateError(
                f"parameter '{name}' holds its gradient, not its value: call optimizer.step() on the optimizer "
                "initialize_engine returned (or its zero_grad() to drop the gradients) before running the model "
                "again; an optimizer of your own over engine.parameters() cannot update chunkstar's parameters"
            )
        raise ChunkStateError(f"parameter '{name}': illegal state change {old.name} -> {new.name}")


def check_location_transition(chunk: str, old: ChunkLocation, new: ChunkLocation) -> None:
    if new not in _LOCATION_EDGES[old]:
        raise ChunkStateError(f"chunk {chunk}: illegal move {old.name} -> {new.name}")
