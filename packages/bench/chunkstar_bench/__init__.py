"""chunkstar-bench: reproducible throughput and max-scale benchmarks of chunkstar against DeepSpeed, FSDP2 and PyTorch.

The pieces, one concept per module: :mod:`~chunkstar_bench.zoo` (model configs),
:mod:`~chunkstar_bench.flops` (the only FLOP counting), :mod:`~chunkstar_bench.runner`
(one run = one subprocess), :mod:`~chunkstar_bench.child` (the training loop inside it),
:mod:`~chunkstar_bench.results` (SQLite), :mod:`~chunkstar_bench.suites`,
:mod:`~chunkstar_bench.maxscale`, :mod:`~chunkstar_bench.report` and the CLI.
Importing this package does not import torch.
"""

from __future__ import annotations

from chunkstar_bench.runner import RunRecord, RunSpec, run
from chunkstar_bench.zoo import ZOO, ModelSpec, build_hf, get, n_params

__all__ = ["ZOO", "ModelSpec", "RunRecord", "RunSpec", "build_hf", "get", "n_params", "run"]
