"""Chunk move bandwidth: ``Chunk.move_to`` host <-> device (CPU virtual device) against ``Tensor.copy_``.

Both sides move the same bytes both ways per round: 16M fp32 elements (64 MiB)
to the device and back. chunkstar's move also allocates the destination
(storage resize on the device, a fresh host buffer on the way back) and frees
the source, as it does in training; the baseline copies between two
preallocated buffers, the floor of what any move can cost here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.device.copy_engine import SerialCopies
from chunkstar.events import Tier

NUMEL = 16 * 2**20
NBYTES = NUMEL * 4
GROUP = "chunk-move-64MiB"
PEDANTIC = dict(rounds=15, iterations=1, warmup_rounds=2)


@pytest.mark.benchmark(group=GROUP)
def test_chunk_move_roundtrip(benchmark: Any, ratio: Any) -> None:
    chunk = Chunk(0, "param", NUMEL, torch.float32, torch.device("cpu"))
    chunk.allocate(Tier.HOST)
    chunk.payload.fill_(1.5)
    copies = SerialCopies()

    def roundtrip() -> None:
        chunk.move_to(Tier.DEVICE, copies)
        chunk.move_to(Tier.HOST, copies)
        chunk.wait_ready()

    benchmark.pedantic(roundtrip, **PEDANTIC)
    assert chunk.tier is Tier.HOST and float(chunk.payload[NUMEL - 1]) == 1.5
    mean = ratio.median(GROUP, "chunkstar")
    if mean:
        ratio.derived(GROUP, "chunkstar_GBps", 2 * NBYTES / mean / 1e9)


@pytest.mark.benchmark(group=GROUP)
def test_copy_roundtrip(benchmark: Any, ratio: Any) -> None:
    host = torch.full((NUMEL,), 1.5)
    device = torch.empty(NUMEL)

    def roundtrip() -> None:
        device.copy_(host)
        host.copy_(device)

    benchmark.pedantic(roundtrip, **PEDANTIC)
    mean = ratio.median(GROUP, "baseline")
    if mean:
        ratio.derived(GROUP, "copy_GBps", 2 * NBYTES / mean / 1e9)
