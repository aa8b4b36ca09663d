""""auto" picks chunks a few groups of which fit the GPU (issue 26, a scale bug the dry run found).

Bounded by the model's size alone, 175B parameters on 8 A100s got chunks of 1.4
billion elements: one gradient reduction needed 25 GiB of chunks and 46 GiB of
NCCL's flat buffers at once on an 80 GB device. The bound is the GPU's own size,
never the budget (Note [chunks sized to the device]).
"""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from chunkstar.config import parse_config
from chunkstar.dryrun.comm import SimulatedComm
from chunkstar.runtime.engine import ChunkEngine
from chunkstar.runtime.start_checks import memory_chunk_cap


def test_a_group_and_its_collective_buffers_take_at_most_a_quarter_of_the_gpu() -> None:
    cfg = parse_config({"bf16": {"enabled": True}, "device_memory_slack": 0.1}, target_memory=80 * 2**30)
    usable = int(80 * 2**30 * 0.9)
    # one process: a chunk in bf16, no collective
    assert memory_chunk_cap(cfg, 1, False) == usable // 4 // 2
    # 8 ranks under NCCL: the group (8 x 2 bytes) and the fp32 reduction's 9 chunks (9 x 4 bytes)
    cap = memory_chunk_cap(cfg, 8, True)
    assert cap == usable // 4 // (8 * 2 + 9 * 4)
    assert cap is not None and 8 * cap * 2 + 9 * cap * 4 <= usable // 4
    # under gloo the collectives' buffers are host memory
    assert memory_chunk_cap(cfg, 8, False) == usable // 4 // 16
    # a bf16 reduction halves the flat buffers' share
    half = parse_config({"bf16": {"enabled": True}, "reduce_dtype": "bf16", "device_memory_slack": 0.1}, target_memory=80 * 2**30)
    assert memory_chunk_cap(half, 8, True) == usable // 4 // (8 * 2 + 9 * 2)
    # the CPU virtual device: its budget is its size, and gloo holds no device scratch
    assert memory_chunk_cap(parse_config({"device": "cpu", "device_memory_budget": "1MB"}), 2, False) is None
    # a budget below the GPU's size does not move the bound
    budgeted = parse_config({"bf16": {"enabled": True}, "device_memory_budget": "10GB", "device_memory_slack": 0.1},
                            target_memory=80 * 2**30)  # fmt: skip
    assert memory_chunk_cap(budgeted, 8, True) == cap


def _gpt2() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_embd=1024, n_layer=8, n_head=16, n_positions=128))


def _chunk_size(config: dict[str, object], gpu_bytes: int) -> int:
    """The chunk size rank 0 of 8 NCCL ranks builds on a GPU of ``gpu_bytes`` (on meta, as a dry run)."""
    cfg = parse_config(config, target_memory=gpu_bytes)
    with torch.device("meta"):
        model = _gpt2()
    engine = ChunkEngine(model, cfg, model_func=_gpt2, comm=SimulatedComm(0, 8, "nccl"))
    try:
        return engine.chunk_size
    finally:
        engine.close()


def test_the_engine_takes_the_bound_and_the_budget_does_not_change_the_layout() -> None:
    """On a small GPU of 8 ranks the bound binds: the chunks are smaller than the model's own
    range allows. Any budget on that GPU gives the same chunks, so the minimum a too-small
    budget's error names holds for the layout that minimum gives."""
    gpu = 256 * 2**20
    cap = memory_chunk_cap(parse_config({"bf16": {"enabled": True}}, target_memory=gpu), 8, True)
    total = 8 * (12 * 1024 * 1024 + 13 * 1024) + 50257 * 1024 + 128 * 1024 + 2 * 1024
    assert cap is not None and cap < total / (16 * 8)  # the model's own range would allow more
    free = _chunk_size({"bf16": {"enabled": True}}, gpu)
    assert free <= cap
    assert _chunk_size({"bf16": {"enabled": True}, "device_memory_budget": "100MB"}, gpu) == free
    # on a GPU large enough the model's own range decides
    assert _chunk_size({"bf16": {"enabled": True}}, 80 * 2**30) > cap
