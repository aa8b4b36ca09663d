"""chunkstar under test: ``chunkstar`` (chunks moving between the device and host tiers) and
``chunkstar-disk`` (the same, with master and Adam state in chunk files and the model built on
the meta device).

On the CPU virtual device the budget comes from :func:`chunkstar_budget_bytes`
(by default one that forces chunk moves every step); on a GPU the device's own
size is the budget unless the spec names one. Several processes (torchrun)
shard the chunks' master and Adam state over ranks. The spec's
``chunkstar_overlap`` and ``chunkstar_link`` set the engine's ``overlap`` and
``device_link_bandwidth`` (an emulated link on the CPU virtual device), its
``chunkstar_activations`` the blocks' ``activations.policy``, and its
``chunkstar_precision`` ``"fp32"`` leaves ``bf16`` off.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from chunkstar_bench.harness import ADAMW, Context, hf_checkpointing, init_process_group, progress, timed_record
from chunkstar_bench.runner import DISK_DIR_ENV
from chunkstar_bench.zoo import ModelSpec, build_hf, n_params

__all__ = ["DISK_PARAM_ROOM", "PRESSURE_FRACTION", "chunkstar_budget_bytes", "engine_config", "run"]

PRESSURE_FRACTION = 0.6
"""Default chunkstar budget on the CPU virtual device: this share of the bf16 parameter
bytes beside the estimated activations (0.6, not 0.5: the tied embedding and one
block's chunk must fit together; see docs/benchmarks.md)."""

DISK_PARAM_ROOM = 1 << 30
"""``chunkstar-disk``'s default on the CPU virtual device: at most this many bytes of param
chunks beside the activations (the 60% of :data:`PRESSURE_FRACTION` while that is less). The
disk tier's user has a GPU small against the model, and on the CPU virtual device the
device's bytes come out of the host memory the cap measures: a device that grew with the
model would make a max-scale search measure the emulated GPU, not the engine (the 4.06B
GPT-2 under an 8 GiB cap was refused for its 6.08 GiB device)."""

_MOVE_COUNTERS = (
    "chunk_moves_to_device", "chunk_moves_to_host", "bytes_to_device", "bytes_to_host", "disk_bytes_read",
    "disk_bytes_written",
)  # fmt: skip
"""``engine.stats()`` counters reported per timed step."""


def chunkstar_budget_bytes(model: ModelSpec, batch: int, seq: int, budget: str | int | None, *, disk: bool = False) -> int:
    """The chunkstar device budget for a run, from the spec's ``chunkstar_budget``.

    * an int, or a size string (``"2GiB"``): that many bytes;
    * ``"params:F"``: estimated activations + ``F`` x the bf16 parameter bytes;
    * None or ``"auto"``: ``"params:0.6"`` -- on the CPU virtual device, only
      60% of the parameters fit beside the activations, so chunks move every
      step (the pressure chunkstar exists for); with ``disk`` (``chunkstar-disk``)
      at most :data:`DISK_PARAM_ROOM` of them.

    The activation estimate is ``B*s*(16*V + 34*h*L)`` bytes: bf16 logits, their
    fp32 upcast and gradients (16 bytes per logit) plus Korthikanti et al.'s
    ``34*s*b*h`` per layer (flash/SDPA attention, no score matrices), times
    1.25 (the estimate is slack enough to hold the few chunks one module needs at once).
    """
    from chunkstar import parse_bytes

    if isinstance(budget, int):
        return budget
    if budget is not None and budget != "auto" and not budget.startswith("params:"):
        return int(parse_bytes(budget))
    fraction = PRESSURE_FRACTION if budget in (None, "auto") else float(budget.split(":", 1)[1])
    h, layers, vocab = model.hidden, model.layers, model.vocab
    activations = int(1.25 * batch * seq * (16 * vocab + 34 * h * layers))
    param_room = int(fraction * 2 * n_params(model))
    if disk and budget in (None, "auto"):
        param_room = min(param_room, DISK_PARAM_ROOM)
    return activations + param_room


def engine_config(ctx: Context, budget: int | None) -> dict[str, Any]:
    """The engine config of a run: AdamW (:data:`~chunkstar_bench.harness.ADAMW`), bf16, the spec's clipping,
    chunk size searched, ``budget`` bytes of device tier (None: the device's own size), and the
    spec's overlap, link, activation policy and precision (fp32: no ``bf16`` section). The disk
    tier is :func:`run`'s to add."""
    config: dict[str, Any] = {
        "optimizer": {"type": "AdamW", "params": ADAMW},
        "bf16": {"enabled": True},
        "gradient_clipping": ctx.spec.clip,
        "device": "cpu" if ctx.device == "cpu" else f"cuda:{ctx.local_rank}",
        "default_chunk_size": "auto",
    }
    if ctx.spec.chunkstar_precision == "fp32":
        del config["bf16"]  # the engine's default: fp32 chunks and compute
    if budget is not None:
        config["device_memory_budget"] = budget
    if ctx.spec.chunkstar_overlap is not None:
        config["overlap"] = ctx.spec.chunkstar_overlap
    if ctx.spec.chunkstar_link is not None:
        config["device_link_bandwidth"] = ctx.spec.chunkstar_link
    if ctx.spec.chunkstar_activations is not None:
        config["activations"] = {"policy": ctx.spec.chunkstar_activations}
    return config


def run(ctx: Context) -> dict[str, Any]:
    """Train ``ctx``'s run with chunkstar (or chunkstar-disk); the per-rank record with the
    engine's stats and its chunk moves (and disk traffic) per timed step."""
    if ctx.world > 1:
        init_process_group(ctx)  # the engine finds the process group and shards over it
    import chunkstar

    budget: int | None = chunkstar_budget_bytes(
        ctx.model, ctx.spec.batch, ctx.seq, ctx.spec.chunkstar_budget, disk=ctx.spec.system == "chunkstar-disk"
    )
    if ctx.device == "cuda" and ctx.spec.chunkstar_budget in (None, "auto"):
        budget = None  # on a real GPU the device's own size is the budget
    config = engine_config(ctx, budget)
    build = ctx.build
    if ctx.spec.system == "chunkstar-disk":
        # the disk tier (master and Adam state in files), and the model built on the meta
        # device straight into the chunks: its fp32 weights never exist whole in host memory.
        # The runner makes (and removes) the run's own folder; run without it, a temporary one.
        folder = os.environ.get(DISK_DIR_ENV) or tempfile.mkdtemp(prefix="chunkstar-disk-", dir=ctx.spec.disk_dir)
        config["disk"] = {"path": folder}
        if ctx.spec.nvme_params:  # else the engine decides (Note [host memory plan] in chunkstar.memory.host)
            config["disk"]["lists"] = ["param", "master", "exp_avg", "exp_avg_sq"]
        if ctx.spec.chunkstar_staging is not None:
            config["disk"]["staging_budget"] = ctx.spec.chunkstar_staging

        def build() -> Any:
            import torch

            torch.manual_seed(ctx.spec.seed)
            with torch.device("meta"):
                model = build_hf(ctx.model)
            if ctx.spec.hf_checkpointing:
                hf_checkpointing(model)
            return model

    engine, optimizer = chunkstar.initialize_engine(model_func=build, local_rank=ctx.local_rank, config=config)
    progress(ctx, f"engine built: {engine.construction.meta_params} parameters from the meta device, {engine.stats()['n_chunks']} chunks")

    def step(ids: Any) -> float:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.item())

    # counters snapshotted after the warm-up: the per-step figures describe steady-state steps
    before: dict[str, Any] = {}
    record = timed_record(ctx, step, "chunkstar ChunkAdam (AdamW)", before_timed=lambda: before.update(engine.stats()))
    stats = dict(engine.stats())
    moves = {
        key: (stats[key] - before.get(key, 0)) / max(ctx.spec.steps, 1)
        for key in _MOVE_COUNTERS
        if isinstance(stats.get(key), (int, float))
    }
    if "disk_bytes_read" in moves:  # the disk tier's traffic per timed step, and its rate
        step_s = statistics.median(record["step_times_s"]) if record["step_times_s"] else 0.0
        disk = moves["disk_bytes_read"] + moves["disk_bytes_written"]
        record["disk_bytes_per_step"] = disk
        record["disk_bytes_per_s"] = disk / step_s if step_s > 0 else None
        record["disk_file_bytes"] = int(stats["disk_file_bytes"])
        # the chunk files stay until the runner measures and removes the run's folder
    if record["peak_device_bytes"] is None:  # no CUDA: the virtual device's peak (Note [peak memory] in chunkstar_bench.child)
        record["peak_device_bytes"] = int(stats["device_chunk_bytes_peak"]) + int(stats["warmup_non_model_peak_bytes"] or 0)
        record["peak_device_kind"] = "chunkstar virtual device: device_chunk_bytes_peak + warmup_non_model_peak_bytes"
    return {**record, "device_budget_bytes": budget, "chunkstar_stats": stats, "chunk_moves_per_timed_step": moves}
