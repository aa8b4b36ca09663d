"""chunkstar-bench: reproducible throughput and max-scale benchmarks of chunkstar against DeepSpeed, FSDP2 and PyTorch.

The pieces, one concept per module:

* what is run: :mod:`~chunkstar_bench.zoo` (model configs by name),
  :mod:`~chunkstar_bench.published` (the published figures and the one table of
  system names), :mod:`~chunkstar_bench.suites` (named lists of runs);
* one run = one subprocess: :mod:`~chunkstar_bench.runner` (the parent side:
  spec, record, memory watch), :mod:`~chunkstar_bench.child` (the entry inside
  the subprocess), :mod:`~chunkstar_bench.harness` (what every training loop
  shares: context, batches, clock) and :mod:`~chunkstar_bench.systems` (one
  module per system under test);
* what comes out: :mod:`~chunkstar_bench.flops` (the only FLOP counting),
  :mod:`~chunkstar_bench.results` (SQLite), :mod:`~chunkstar_bench.report`;
* searches, tables and plans on top: :mod:`~chunkstar_bench.maxscale`,
  :mod:`~chunkstar_bench.comparisons` (``step-time``, ``overlap``),
  :mod:`~chunkstar_bench.plan` (a prediction), and the CLI
  (:mod:`~chunkstar_bench.cli`, ``chunkstar-bench``);
* shared by all of them: :mod:`~chunkstar_bench.units` (byte units, the size
  parser) and :mod:`~chunkstar_bench.tables` (the text-table formatter).

Importing this package does not import torch.
"""

from __future__ import annotations

from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.zoo import ZOO, ModelSpec, build_hf, get, n_params

__all__ = ["ZOO", "ModelSpec", "RunRecord", "RunSpec", "build_hf", "get", "n_params", "run"]
