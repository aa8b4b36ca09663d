""""auto" picks chunks a few groups of which fit the device (issue 26, a scale bug the dry run found).

Bounded by the model's size alone, 175B parameters on 8 A100s got chunks of 1.4
billion elements: one gradient reduction needed 25 GiB of chunks and 49 GiB of
NCCL's flat buffers at once on an 80 GB device.
"""

from __future__ import annotations

import torch

import chunkstar
from chunkstar.config import parse_config
from chunkstar.runtime.start_checks import memory_chunk_cap


def test_a_group_and_its_collective_buffers_take_at_most_a_quarter_of_the_device() -> None:
    cfg = parse_config({"bf16": {"enabled": True}}, target_memory=80 * 2**30)
    capacity = 72 * 2**30
    # one process: a chunk in bf16, no collective
    assert memory_chunk_cap(cfg, capacity, 1, False) == capacity // 4 // 2
    # 8 ranks under NCCL: the group (8 x 2 bytes) and the fp32 reduction's 9 chunks (9 x 4 bytes)
    cap = memory_chunk_cap(cfg, capacity, 8, True)
    assert cap == capacity // 4 // (8 * 2 + 9 * 4)
    assert 8 * cap * 2 + 9 * cap * 4 <= capacity // 4
    # under gloo the collectives' buffers are host memory
    assert memory_chunk_cap(cfg, capacity, 8, False) == capacity // 4 // 16
    # a bf16 reduction halves the flat buffers' share
    half = parse_config({"bf16": {"enabled": True}, "reduce_dtype": "bf16"}, target_memory=80 * 2**30)
    assert memory_chunk_cap(half, capacity, 8, True) == capacity // 4 // (8 * 2 + 9 * 2)


def test_the_engine_takes_the_cap_when_it_binds() -> None:
    def build() -> torch.nn.Module:
        return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(32)])  # 2.1M parameters

    total = 32 * (256 * 256 + 256)
    engine, _ = chunkstar.initialize_engine(build, config={"device": "cpu", "device_memory_budget": "1MB", "bf16": {"enabled": True}})
    try:
        cap = memory_chunk_cap(engine.config, engine.mgr.capacity, 1, False)
        assert cap < total // 16  # the model's own bound would allow more
        assert engine.chunk_size <= cap
    finally:
        engine.close()
