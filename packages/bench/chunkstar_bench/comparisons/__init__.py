"""Side-by-side comparison tables: labelled runs over rounds, pooled, checked against ratio targets.

* :mod:`~chunkstar_bench.comparisons.rounds` -- rows, round-robin running through
  the runner, pooling, targets and verdicts;
* :mod:`~chunkstar_bench.comparisons.step_time` -- ``chunkstar-bench step-time``:
  PyTorch, chunkstar with and without pressure, DeepSpeed;
* :mod:`~chunkstar_bench.comparisons.overlap` -- ``chunkstar-bench overlap``:
  overlapped vs serial copies under an emulated device link;
* :mod:`~chunkstar_bench.comparisons.activations` -- ``chunkstar-bench activations``:
  keep, HF checkpointing, offload and auto activation policies under a pressured
  budget, and the longest sequence each trains (issue 27);
* :mod:`~chunkstar_bench.comparisons.command` -- their subcommands.

A suite (:mod:`chunkstar_bench.suites`) is a fixed list of runs for the results
database; a comparison is a table whose rows may depend on each other (the
pressure budget is sized on the unpressured run's measurement) and whose point
is the ratios between them.
"""

from __future__ import annotations

from chunkstar_bench.comparisons.rounds import Pooled, Row, Target, Verdict, judge, run_rows

__all__ = ["Pooled", "Row", "Target", "Verdict", "judge", "run_rows"]
