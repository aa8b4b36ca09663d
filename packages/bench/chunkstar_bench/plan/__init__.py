"""Capacity planning: the largest zoo model each system should fit on a machine. A PREDICTION.

``chunkstar-bench plan --hardware v100x8_240gb`` answers "how big a model can
chunkstar, DeepSpeed ZeRO-3 offload and plain PyTorch (DDP, FSDP) train on this
node?" (and, given ``--disk 2TB``, chunkstar with its optimizer state on disk)
from bytes-per-parameter accounting, without running anything, and prints it
beside the paper's published maximum scales and, given a results database, the
largest model each system actually trained. It is arithmetic on parameter
shapes, not a measurement; every figure it prints says so.

* :mod:`~chunkstar_bench.plan.nodes` -- the nodes ``--hardware`` names, for the
  formula and the dry run alike: ``chunkstar.dryrun.HARDWARE``'s entries, the one
  table of hardware facts, and older names kept as aliases of them;
* :mod:`~chunkstar_bench.plan.model` -- the memory model (Note [the memory
  model]): footprints and the predicted maximum per system;
* :mod:`~chunkstar_bench.plan.rows` -- each prediction beside the published and
  the measured maximum;
* :mod:`~chunkstar_bench.plan.format` -- the text table;
* :mod:`~chunkstar_bench.plan.command` -- ``chunkstar-bench plan``;
* :mod:`~chunkstar_bench.plan.dryrun` -- ``plan --dry-run``: chunkstar's real
  engine on the meta device for one model on one node, and the largest model
  of a ladder that fits;
* :mod:`~chunkstar_bench.plan.deepspeed` -- DeepSpeed's own ZeRO-3 memory
  estimator, re-implemented (DeepSpeed's verdict beside chunkstar's);
* :mod:`~chunkstar_bench.plan.paper` -- the paper's published points and the
  largest model per node, with both verdicts;
* :mod:`~chunkstar_bench.plan.gate` -- those figures in a results database, and
  the nightly regression gate against the last run's.

What this is not: a throughput model, or a check that a run will succeed (a
run can also fail on pinned-memory limits, allocator fragmentation beyond the
margin, or bugs). ``chunkstar-bench max-scale`` measures; this predicts. It
needs ``chunkstar`` itself (the real chunk layout), unlike the rest of the bench
package's parent side.
"""

from __future__ import annotations

from chunkstar_bench.plan.command import add_plan_command, main, run_dry_run, run_plan
from chunkstar_bench.plan.deepspeed import DeepSpeedVerdict, deepspeed_verdict, model_to_params, zero3_model_states_mem_needs
from chunkstar_bench.plan.dryrun import DryRunPoint, DryRunSettings, LargestSearch, dry_run_point, largest_fitting
from chunkstar_bench.plan.format import format_largest, format_paper_table, format_plan
from chunkstar_bench.plan.gate import Regression, gate, store
from chunkstar_bench.plan.model import (
    DEVICE_FRAGMENTATION,
    DEVICE_RESERVED_BYTES,
    DISK_SYSTEMS,
    GIB,
    HARDWARE,
    HOST_PER_PROCESS_BYTES,
    HOST_RESERVED_BYTES,
    SYSTEMS,
    Footprint,
    Hardware,
    Prediction,
    Workload,
    activation_bytes,
    chunk_layout,
    default_systems,
    footprint,
    gpt2_param_shapes,
    model_data_bytes_per_param,
    models_named,
    predict_max,
)
from chunkstar_bench.plan.paper import LargestRow, PaperPoint, PaperRow, largest_rows, paper_points, paper_rows
from chunkstar_bench.plan.rows import MeasuredMax, PlanRow, measured_max, plan

__all__ = [
    "DEVICE_FRAGMENTATION",
    "DeepSpeedVerdict",
    "DryRunPoint",
    "DryRunSettings",
    "LargestRow",
    "LargestSearch",
    "PaperPoint",
    "PaperRow",
    "Regression",
    "deepspeed_verdict",
    "dry_run_point",
    "format_largest",
    "format_paper_table",
    "gate",
    "largest_fitting",
    "largest_rows",
    "model_to_params",
    "paper_points",
    "paper_rows",
    "run_dry_run",
    "store",
    "zero3_model_states_mem_needs",
    "DEVICE_RESERVED_BYTES",
    "DISK_SYSTEMS",
    "GIB",
    "HARDWARE",
    "HOST_PER_PROCESS_BYTES",
    "HOST_RESERVED_BYTES",
    "SYSTEMS",
    "Footprint",
    "Hardware",
    "MeasuredMax",
    "PlanRow",
    "Prediction",
    "Workload",
    "activation_bytes",
    "add_plan_command",
    "chunk_layout",
    "default_systems",
    "footprint",
    "format_plan",
    "gpt2_param_shapes",
    "main",
    "measured_max",
    "model_data_bytes_per_param",
    "models_named",
    "plan",
    "predict_max",
    "run_plan",
]
