"""What each rank runs in test_comm_nccl_calls' real two-rank check (spawned, gloo on CPU).

torch's gloo backend also runs the flat collectives (``all_gather_single`` /
``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``)
on CPU tensors, so a ``Comm`` told that NCCL serves the CPU takes its NCCL path
(flat group buffers) through a real backend: its results must equal the gloo
path's, bit for bit."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from chunkstar.distributed.comm import Comm


def flat_against_gloo(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict[str, Any] = {"rank": rank}
    try:
        flat, gloo = Comm(rank, world, "cpu:nccl"), Comm(rank, world, "gloo")
        assert flat.on_device(torch.device("cpu")) and not gloo.on_device(torch.device("cpu"))
        g = torch.Generator().manual_seed(rank)
        own = torch.randn(37, generator=g).bfloat16()
        gathered = {}
        for name, comm in (("flat", flat), ("gloo", gloo)):
            outs: list[torch.Tensor | None] = [torch.full_like(own, float("nan")) for _ in range(world)]
            outs[rank] = None  # the own chunk is left alone
            comm.all_gather_group_async(outs, own, what="param chunks").wait()
            outs[rank] = own
            gathered[name] = outs
        pairs = zip(gathered["flat"], gathered["gloo"])
        result["gather_equal"] = all(torch.equal(a, b) for a, b in pairs)  # type: ignore[arg-type]
        peer = torch.randn(37, generator=torch.Generator().manual_seed(1 - rank)).bfloat16()
        result["gather_peer_ok"] = bool(torch.equal(gathered["flat"][1 - rank], peer))  # type: ignore[arg-type]
        chunks = [torch.randn(53, generator=g).bfloat16() for _ in range(world)]
        a = flat.reduce_group_async(chunks, what="grads", dtype=torch.float32).wait()
        b = gloo.reduce_group_async(chunks, what="grads", dtype=torch.float32).wait()
        result["reduce_equal"] = bool(torch.equal(a, b)) and a.dtype == b.dtype == torch.float32 and a.numel() == 53
        result["scratch_peak"] = flat.scratch_bytes_peak
        result["scratch_after"] = flat.scratch_bytes_in_flight
        result["ints"] = flat.all_gather_ints([rank, 7, -rank], "ints", torch.device("cpu"))
    except Exception as e:  # reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.destroy_process_group()
