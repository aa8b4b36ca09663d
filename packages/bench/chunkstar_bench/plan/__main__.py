"""``python -m chunkstar_bench.plan plan ...`` (the same as ``chunkstar-bench plan ...``)."""

from chunkstar_bench.plan.command import main

raise SystemExit(main())
