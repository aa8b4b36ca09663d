"""Two gloo ranks: the reducer's per-group gradient counters reduce each group exactly
when the scan of its slots would (Note [pending gradients] in distributed/grad_reduce.py),
also after a parameter stops requiring grad between steps; the manager's resident index
(gathered copies of other ranks' chunks included) gives the candidates the full scan gave."""

from __future__ import annotations

from pathlib import Path

from ._reduce_worker import reduce_counters
from ._spawn import run_ranks


def test_counters_reduce_when_the_scan_would(tmp_path: Path) -> None:
    results = run_ranks(reduce_counters, tmp_path)
    assert len(results) == 2 and all("error" not in r for r in results), results
    for r in results:
        assert r["mismatches"] == [], r
        assert r["reduced_early"] > 0  # groups were reduced during the backward, not only at its end
        assert r["moves"] > 0 and r["evictions"] > 0  # under eviction
    assert results[0]["losses"] == results[1]["losses"]
