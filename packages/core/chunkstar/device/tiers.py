"""Which device each tier of a compute device lives on.

Note [the meta device]: the engine runs on three kinds of compute device. A CUDA
GPU; the CPU virtual device (host memory held under ``device_memory_budget``);
and the meta device, where no tensor has bytes. The meta device is for the dry
run: the real engine (layout, warm-up trace, budgets, eviction, prefetch,
hybrid Adam) deciding on a model built on the meta device, its forward and
backward running on meta tensors. There, the host tier is on the meta device
too: no chunk, staging buffer or optimizer scratch has bytes anywhere. It is
measured as the virtual device is, by the dispatch-mode probe
(:mod:`chunkstar.memory.probes`), counting the storages its tensors would
have. Nothing on it has values: construction initialises nothing, and autocast
(which torch has no meta backend for) is left out, as on any device torch
cannot autocast on. Every other decision is the virtual device's. This module
is the one place that says where a device's host tier is; the rest ask it or
ask torch what the device can do.
"""

from __future__ import annotations

import torch

__all__ = ["holds_values", "host_device"]

_META = torch.device("meta")
_CPU = torch.device("cpu")


def host_device(device: torch.device) -> torch.device:
    """Where the host tier of compute device ``device`` keeps chunks and buffers: the CPU,
    or the meta device for the meta device (Note [the meta device])."""
    return _META if device.type == "meta" else _CPU


def holds_values(device: torch.device) -> bool:
    """Whether tensors on ``device`` have values (all but the meta device)."""
    return device.type != "meta"
