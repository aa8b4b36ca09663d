"""Where each chunk's Adam update runs (hybrid Adam): pure policy.

After warm-up the device's non-model peak is known. If the param chunks the
forward and backward hold fit on the device together with that peak, the
margin left over can hold the fp32 master and Adam state of some chunks
permanently; those chunks run Adam on the device (no traffic at all), the rest
on the host. If the param chunks alone do not fit, every chunk runs Adam on the
host: keeping optimizer state on the device would only shrink the budget that
forward and backward need.

Note [resident footprint with several ranks]: what "the param chunks fit" means
depends on the world size. One process holds every param chunk, so the
footprint is all of them beside the largest non-model peak. With several ranks
a rank holds its own chunks for good and the other ranks' chunks of a group
only while a moment uses the group (they are dropped after it, gathered again
later; placement/gathered.py), and a moment's gather can start during the one
before (Note [gather ahead] in distributed/gather.py). So the footprint is the
rank's own chunks plus, at the worst moment, that moment's non-model peak
beside the other ranks' chunks of its groups and of the next moment's. Counted
as one process counts it (all chunks of the model), 68B parameters on 8 A100s
needed 136 GB of fp16 chunks on an 80 GB device, and hybrid Adam never placed a
chunk on any rank while each had tens of GiB to spare. Only a rank's own
chunks have optimizer state, so only they are candidates.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

__all__ = ["moment_footprints", "plan_device_adam", "resident_footprint"]


def resident_footprint(
    param_bytes: Sequence[int],
    own: Callable[[int], bool],
    group: Callable[[int], Sequence[int]],
    moments: Sequence[tuple[int, ...]],
    non_model: Sequence[int],
    scratch: int = 0,
) -> int:
    """Device bytes the forward and backward hold when no chunk is ever evicted (Note
    [resident footprint with several ranks]): the chunks ``own`` says are this rank's, plus
    the worst moment's non-model peak (``non_model[m]``) beside the other ranks' chunks of
    the groups (``group(c)``: the chunk ids of ``c``'s group) that moment ``m`` and moment
    ``m + 1`` use (``moments[m]``: its chunk ids), and a collective's ``scratch`` beside them."""
    owned = sum(b for c, b in enumerate(param_bytes) if own(c))
    return owned + max(moment_footprints(param_bytes, own, group, moments, non_model, scratch), default=0)


def moment_footprints(
    param_bytes: Sequence[int],
    own: Callable[[int], bool],
    group: Callable[[int], Sequence[int]],
    moments: Sequence[tuple[int, ...]],
    non_model: Sequence[int],
    scratch: int = 0,
) -> list[int]:
    """Per moment, what it holds beside this rank's own chunks with nothing evicted: its
    non-model peak, and the other ranks' chunks it and the next moment gather with a
    collective's scratch (:func:`resident_footprint` is the worst of them)."""

    def remote(chunk_ids: tuple[int, ...]) -> set[int]:
        return {k for c in chunk_ids for k in group(c) if not own(k)}

    out = []
    for m, chunk_ids in enumerate(moments):
        gathered = remote(chunk_ids) | (remote(moments[m + 1]) if m + 1 < len(moments) else set())
        out.append(non_model[m] + (sum(param_bytes[k] for k in gathered) + scratch if gathered else 0))
    return out


def plan_device_adam(state_bytes: Mapping[int, int], capacity: int, footprint: int) -> set[int]:
    """Chunk ids whose master/exp_avg/exp_avg_sq live on the device.

    ``state_bytes``: the candidates (this rank's chunks with optimizer state) in the order
    they are taken, each with the bytes of its three fp32 state chunks; ``footprint``: what
    the forward and backward hold with nothing evicted (:func:`resident_footprint`).
    Candidates are taken in order until the margin is used up.
    """
    margin = capacity - footprint
    chosen: set[int] = set()
    if margin <= 0:
        return chosen
    for i, b in state_bytes.items():
        if b > margin:
            break
        chosen.add(i)
        margin -= b
    return chosen
