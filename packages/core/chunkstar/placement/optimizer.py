"""Where each chunk's Adam update runs (hybrid Adam): pure policy.

After warm-up the device's non-model peak is known. If every param chunk fits
on the device together with that peak, the margin left over can hold the
fp32 master and Adam state of some chunks permanently; those chunks run Adam
on the device (no traffic at all), the rest on the host. If the param chunks
alone do not fit, every chunk runs Adam on the host: keeping optimizer state on
the device would only shrink the budget that forward and backward need.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["plan_device_adam"]


def plan_device_adam(
    param_chunk_bytes: Sequence[int], state_chunk_bytes: Sequence[int], capacity: int, non_model_peak: int
) -> set[int]:
    """Chunk ids whose master/exp_avg/exp_avg_sq live on the device.

    ``state_chunk_bytes[i]`` is the bytes of chunk i's three fp32 state chunks.
    Chunks are taken in id order until the margin is used up.
    """
    margin = capacity - non_model_peak - sum(param_chunk_bytes)
    chosen: set[int] = set()
    if margin <= 0:
        return chosen
    for i, b in enumerate(state_chunk_bytes):
        if b > margin:
            break
        chosen.add(i)
        margin -= b
    return chosen
