"""What each rank runs in test_habits_two_ranks (spawned, gloo on CPU)."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import chunkstar
from tests.core._models import CASES, engine_config, eviction_budget, gpt2_batch
from tests.core.runtime.test_param_access import _encoder_loss, _seq_batch, build_encoder
from tests.distributed._loop import train_slices

STEPS = 3
COMPILED_STEPS = 4
ACCUM = 2
ACCUM_STEPS = 3
AUTO_STEPS = 8  # two measured, two traced under the plan, one frozen and timed, then (re-planned or not) on it


def _checkpointed_gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=16, n_positions=32, n_embd=256, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _arithmetic_batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(step))  # 4 rows per rank
    return {"input_ids": ids, "labels": ids}


class Branchy(torch.nn.Module):
    """A side branch that only some micro-batches use."""

    def __init__(self) -> None:
        super().__init__()
        self.main = torch.nn.Linear(8, 8)
        self.side = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.main(x)
        return h + self.side(x) if use_side else h


def habits(rank: int, world: int, port: int, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    result: dict[str, Any] = {"rank": rank}
    try:
        # 1. nn.TransformerEncoder (MultiheadAttention reads out_proj.weight) on two ranks
        budget = eviction_budget(build_encoder(), torch.float32, 0.75)
        engine, optimizer = chunkstar.initialize_engine(build_encoder, rank, engine_config("fp32", budget=budget))
        result["encoder_losses"] = train_slices(  # one sequence per rank
            engine, optimizer, _seq_batch, range(STEPS), loss_of=lambda model, batch: _encoder_loss(model, batch, torch.float32)
        )
        result["encoder_moves"] = engine.stats()["chunk_moves_to_host"]

        # 2. GPT-2: module.state_dict() is a collective; reads of another rank's parameter
        # name gathered_parameters(); gathered_parameters() writes back on every rank
        case = CASES["gpt2"]
        engine, optimizer = chunkstar.initialize_engine(
            case.build, rank, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32))
        )
        train_slices(engine, optimizer, gpt2_batch, range(2))  # one sequence per rank
        sd = engine.module.state_dict()
        full = engine.state_dict()
        result["module_sd_equals_engine_sd"] = sd.keys() == full.keys() and all(torch.equal(sd[k], full[k]) for k in sd)
        names = dict(engine.module.named_parameters())
        foreign = next(n for n, p in names.items() if not engine.mgr.chunks.own(engine.mgr.slots[engine.index_of(p)].chunk_id))
        try:
            with torch.no_grad():
                names[foreign].sum()
            result["foreign_read"] = "no error"
        except chunkstar.ChunkStateError as e:
            result["foreign_read"] = str(e)
        w = names["transformer.h.1.mlp.c_fc.weight"]
        with engine.gathered_parameters([w]):
            result["gathered_equal"] = bool(torch.equal(w.data, full["transformer.h.1.mlp.c_fc.weight"]))
            w.data.mul_(0.5)
        after = engine.state_dict()
        result["written_back"] = bool(
            torch.equal(after["transformer.h.1.mlp.c_fc.weight"], 0.5 * full["transformer.h.1.mlp.c_fc.weight"])
        )
        if rank == 0:
            torch.save(sd, Path(out) / "module_sd.pt")

        # 3. GPT-2 with its blocks compiled (block.compile(), Note [compiled units]) on two ranks
        def compiled() -> torch.nn.Module:
            model = case.build()
            for block in model.transformer.h:
                block.compile(backend="aot_eager")
            return model

        # a block's moment holds all its chunks' gathered groups (two ranks' chunks each): more room
        budget = eviction_budget(case.build(), torch.float32, 1.1)  # a compiled backward holds more than eager
        engine, optimizer = chunkstar.initialize_engine(compiled, rank, engine_config("fp32", budget=budget))
        result["compiled_losses"] = train_slices(engine, optimizer, gpt2_batch, range(COMPILED_STEPS))
        result["compiled_calls"] = engine.stats()["compiled_calls"]
        result["compiled_moves"] = engine.stats()["chunk_moves_to_host"]

        # 4. gradient accumulation over two ranks (Note [accumulation across ranks]): each rank
        # its slice of every micro-batch, one reduction per step
        engine, optimizer = chunkstar.initialize_engine(
            case.build, rank, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32), accum=ACCUM)
        )
        result["accum_losses"] = train_slices(engine, optimizer, gpt2_batch, range(ACCUM_STEPS), accum=ACCUM)
        result["accum_moves"] = engine.stats()["chunk_moves_to_host"]

        # 5. several backwards before one step, written by hand (no gradient_accumulation_steps):
        # the second forward keeps the first backward's reduced gradients (Note [gradients kept
        # across a forward]); each loss halved, so the sum is the accumulation's mean
        engine, optimizer = chunkstar.initialize_engine(
            case.build, rank, engine_config("fp32", budget=eviction_budget(case.build(), torch.float32))
        )
        result["kept_losses"] = train_slices(
            engine, optimizer, gpt2_batch, range(ACCUM_STEPS), accum=ACCUM, loss_of=lambda m, b: m(**b).loss / ACCUM
        )
        result["kept_forwards"] = engine.stats()["kept_gradient_forwards"]
        result["kept_moves"] = engine.stats()["chunk_moves_to_host"]

        # 6. the smallest budget a too-small one's error names trains on two ranks: the other
        # ranks' gathered chunks a moment finds on the device are counted (the 3.2M GPT-2 of
        # examples/train_trainer.py, auto chunks, activation checkpointing; uncounted, the
        # named 8.90 MiB failed in the third step)
        minimum = None
        for budget in (8_000_000, None):
            engine, optimizer = chunkstar.initialize_engine(
                _checkpointed_gpt2, rank,
                engine_config("fp32", budget=budget if budget is not None else minimum, chunk_size="auto"),
            )  # fmt: skip
            try:
                train_slices(engine, optimizer, _arithmetic_batch, range(4))
                result["named_minimum_trains"] = budget is None
                break
            except chunkstar.DeviceMemoryError as e:
                if budget is None:
                    result["named_minimum_trains"] = f"the named minimum failed: {e}"
                    break
                minimum = e.minimum
                dist.barrier()

        # 7. activation policies (Note [activation policies]) on two ranks: a recomputed block's
        # moment gathers its groups again; an offloaded block's saved tensors go to the host and back
        import chunkstar.activations.offload as offload_mod

        offload_mod.MIN_OFFLOAD_BYTES = 1  # the test model's saved tensors are kilobytes
        for policy in ("checkpoint", "offload"):
            config = engine_config("fp32", budget=eviction_budget(case.build(), torch.float32), activations={"policy": policy})
            engine, optimizer = chunkstar.initialize_engine(case.build, rank, config)
            result[f"{policy}_losses"] = train_slices(engine, optimizer, gpt2_batch, range(STEPS))
            stats = engine.stats()
            result[f"{policy}_calls"] = stats["activation_recomputed_calls"] + stats["activation_offloaded_calls"]
            result[f"{policy}_moves"] = stats["chunk_moves_to_host"]
            if policy == "offload":
                offload_minimum = stats["minimum_budget_bytes"]
        # auto: each rank measures its own blocks; the figures are agreed, so every rank plans alike
        # (a budget a little above offloading every block's least: the plan has to choose)
        config = engine_config("fp32", budget=int(offload_minimum * 1.2), activations={"policy": "auto"})
        engine, optimizer = chunkstar.initialize_engine(case.build, rank, config)
        result["auto_losses"] = train_slices(engine, optimizer, gpt2_batch, range(AUTO_STEPS))
        stats = engine.stats()
        result["auto_plan"] = stats["activation_plan"]["blocks"]
        result["auto_measuring"] = stats["activation_measuring"]
        result["auto_timed"] = stats["activation_plan"]["timed_on_frozen_step"]

        # 5. a parameter that gets gradients in an earlier micro-batch only: refused on every rank alike
        torch.manual_seed(0)
        branchy = Branchy()
        engine, optimizer = chunkstar.initialize_engine(lambda: branchy, rank, engine_config("fp32", budget="1MB", accum=2, chunk_size=64))
        try:
            for use_side in (True, False):
                engine.backward(engine(torch.ones(2, 8), use_side).square().mean())
            result["branch_error"] = "no error"
        except chunkstar.ChunkStateError as e:
            result["branch_error"] = str(e)
    except Exception as e:  # noqa: BLE001 - the test reads the message
        result["error"] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    if "error" not in result:
        dist.destroy_process_group()
