"""What each rank runs in the checkpoint and start-up agreement tests (spawned, gloo on CPU)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import chunkstar
from chunkstar.checkpoint import CheckpointError
from chunkstar.distributed.comm import DistributedError
from tests.core._faults import file_size_limit
from tests.core._models import CASES, build_gpt2, engine_config

from ._loop import train_slices
from ._worker import CHUNK, full_batch

SAVE_AFTER = 3
STEPS = 5
OTHER_SEED = 7
STARTUP_STEPS = 2


def _init(rank: int, world: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20))


def _train(engine: chunkstar.ChunkEngine, optimizer: chunkstar.ChunkAdam, steps: range) -> list[float]:
    """Each rank its slice of the global batch; returns the mean loss over ranks per step."""
    return train_slices(engine, optimizer, lambda step: full_batch("gpt2", step), steps)


def _finish(out: str, rank: int, result: dict[str, Any]) -> None:
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if "error" not in result:
        dist.destroy_process_group()


def resume(rank: int, world: int, port: int, out: str, budget: int) -> None:
    """Train 5 steps saving after 3 and 5; a new engine of other weights loads the step-3
    shards and trains steps 3-4; then a directory of mixed steps must be refused."""
    _init(rank, world, port)
    result: dict[str, Any] = {"rank": rank}
    try:
        config = engine_config("fp32", budget=budget, chunk_size=CHUNK)
        engine, optimizer = chunkstar.initialize_engine(CASES["gpt2"].build, rank, config)
        result["run_id"] = engine.run_id
        losses = _train(engine, optimizer, range(SAVE_AFTER))
        step3 = Path(engine.save_checkpoint(str(Path(out) / "ckpt3"))).parent  # the save's step directory
        losses += _train(engine, optimizer, range(SAVE_AFTER, STEPS))
        step5 = Path(engine.save_checkpoint(str(Path(out) / "ckpt5"))).parent
        result.update(uninterrupted=losses, moves_to_host=engine.stats()["chunk_moves_to_host"])

        engine, optimizer = chunkstar.initialize_engine(lambda: build_gpt2(seed=OTHER_SEED), rank, config)
        engine.load_checkpoint(str(Path(out) / "ckpt3"))
        result["resumed"] = _train(engine, optimizer, range(SAVE_AFTER, STEPS))

        mixed = Path(out) / "mixed"
        if rank == 0:  # rank 0's shard of step 3 next to rank 1's of step 5
            mixed.mkdir()
            shutil.copy(step3 / f"rank0-of-{world}.safetensors", mixed)
            shutil.copy(step5 / f"rank1-of-{world}.safetensors", mixed)
        dist.barrier()
        try:
            engine.load_checkpoint(str(mixed))
            result["mixed"] = "loaded"
        except CheckpointError as e:
            result["mixed"] = str(e)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    _finish(out, rank, result)


KILL_STEPS = 6  # the save after step 3 is published; the one after step 6 is killed


def killed_save(rank: int, world: int, port: int, out: str, when: str) -> None:
    """Publish the save after step 3; after step 6 let rank 1's write fail (every rank must
    raise, nothing is published), then rank 0 dies ``when`` ("before-write": rank 1 saves
    alone; "before-publish": both shards are written, rank 0 dies publishing them)."""
    _init(rank, world, port)
    result: dict[str, Any] = {"rank": rank}
    ckpt = Path(out) / "ckpt"
    try:
        param_bytes = sum(p.numel() * 4 for p in build_gpt2().parameters())
        config = engine_config("fp32", budget=4 * param_bytes, chunk_size=CHUNK)
        engine, optimizer = chunkstar.initialize_engine(CASES["gpt2"].build, rank, config)
        _train(engine, optimizer, range(SAVE_AFTER))
        engine.save_checkpoint(str(ckpt))
        sd = engine.state_dict()  # a collective: every rank takes part
        if rank == 0:
            torch.save(sd, Path(out) / "step3.pt")
        _train(engine, optimizer, range(SAVE_AFTER, KILL_STEPS))
        try:
            with file_size_limit(4096) if rank == 1 else contextlib.nullcontext():
                engine.save_checkpoint(str(ckpt))  # rank 1's shard does not fit
            result["failed_write"] = "saved"
        except CheckpointError as e:
            result["failed_write"] = str(e)
        if rank == 0:  # what it learnt, before it dies
            Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        if rank == 0 and when == "before-write":
            os._exit(3)  # dies without a word; rank 1 goes on to save alone
        if rank == 0 and when == "before-publish":
            replace = os.replace

            def die_publishing(src: Any, dst: Any) -> None:
                if Path(dst).parent == ckpt:  # the pointer: the shards are in their step directory
                    os._exit(3)
                replace(src, dst)

            os.replace = die_publishing  # type: ignore[assignment]
        engine.save_checkpoint(str(ckpt))
        result["killed_save"] = "saved"
    except (CheckpointError, DistributedError) as e:
        result["killed_save"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    os._exit(0)  # the process group is broken (its peer died): no teardown


def load_after_kill(rank: int, world: int, port: int, out: str, *directories: str) -> None:
    """Load each directory into an engine of other weights: its step and weights; then a
    save after one more step must publish and leave nothing else behind."""
    _init(rank, world, port)
    result: dict[str, Any] = {"rank": rank}
    try:
        param_bytes = sum(p.numel() * 4 for p in build_gpt2().parameters())
        config = engine_config("fp32", budget=4 * param_bytes, chunk_size=CHUNK)
        for d in directories:
            engine, optimizer = chunkstar.initialize_engine(lambda: build_gpt2(seed=OTHER_SEED), rank, config)
            try:
                engine.load_checkpoint(d)
            except CheckpointError as e:
                result[d] = {"load": str(e)}
                continue
            sd = engine.state_dict()
            if rank == 0:
                torch.save(sd, Path(d).with_suffix(".loaded.pt"))
            entry: dict[str, Any] = {"load": "loaded", "step": optimizer.step_count}
            _train(engine, optimizer, range(SAVE_AFTER, SAVE_AFTER + 1))
            engine.save_checkpoint(d)
            engine.load_checkpoint(d)
            entry["step_after_save"] = optimizer.step_count
            result[d] = entry
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    _finish(out, rank, result)


def startup(rank: int, world: int, port: int, out: str) -> None:
    """Engines whose ranks disagree (seeds, chunk size) must fail on every rank; ranks
    that agree (device budgets may differ) train."""
    _init(rank, world, port)
    result: dict[str, Any] = {"rank": rank}
    param_bytes = sum(p.numel() * 4 for p in build_gpt2().parameters())
    same = engine_config("fp32", budget=4 * param_bytes, chunk_size=CHUNK)
    cases: dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]] = {
        "seeds": (lambda: build_gpt2(seed=1234 + rank), same),
        "chunk_size": (build_gpt2, engine_config("fp32", budget=4 * param_bytes, chunk_size=CHUNK // (1 + rank))),
        "same": (build_gpt2, engine_config("fp32", budget=(4 + rank) * param_bytes, chunk_size=CHUNK)),
    }
    try:
        for name, (build, config) in cases.items():
            try:
                engine, optimizer = chunkstar.initialize_engine(build, rank, config)
            except DistributedError as e:
                result[name] = {"error": str(e)}
                continue
            result[name] = {"run_id": engine.run_id, "losses": _train(engine, optimizer, range(STARTUP_STEPS))}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    _finish(out, rank, result)


def unshared_save(rank: int, world: int, port: int, out: str) -> None:
    """Each rank saves into a folder of its own at the same step: a folder local to each node
    (Note [one folder for every rank]). The save must fail on every rank, saying so; a save
    into one folder then works."""
    _init(rank, world, port)
    result: dict[str, Any] = {"rank": rank}
    try:
        engine, optimizer = chunkstar.initialize_engine(build_gpt2, rank, engine_config("fp32", budget="64MB", chunk_size=CHUNK))
        _train(engine, optimizer, range(1))
        try:
            engine.save_checkpoint(str(Path(out) / f"node{rank}"))
            result["unshared"] = "saved"
        except CheckpointError as e:
            result["unshared"] = str(e)
        result["shared"] = engine.save_checkpoint(str(Path(out) / "shared"))
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    _finish(out, rank, result)
