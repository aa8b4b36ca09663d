"""Micro-benchmarks of chunkstar's hot paths against plain-torch baselines (pytest-benchmark).

Run with ``python -m pytest benchmarks/micro --benchmark-json out.json`` (these
files live outside ``tests/`` so the regular test run never times anything).

Each comparison is a *group* of two benchmarks, chunkstar's and its baseline's,
run in the same process one after the other; the ``ratio`` fixture records
each median, and at the end of the session every group's ratio
(chunkstar / baseline, and derived figures such as overhead per moment) is
printed and written into the benchmark JSON under ``"chunkstar_ratios"``. On a
shared 2-core machine absolute times are noisy: compare ratios from one run.
"""

from __future__ import annotations

from typing import Any

import pytest

_MEANS: dict[str, dict[str, float]] = {}
"""group -> role ("chunkstar", "baseline", ...) -> median seconds, filled as the benchmarks run.
(Medians, not means: on a shared machine one descheduled round skews a mean.)"""
_DERIVED: dict[str, dict[str, float]] = {}
"""group -> extra figures computed by the benchmarks themselves (bandwidth, per-moment overhead)."""


class Recorder:
    def __init__(self, benchmark: Any) -> None:
        self._benchmark = benchmark

    def median(self, group: str, role: str) -> float | None:
        """Store this test's median (seconds) under ``group``/``role``; None when benchmarking is disabled."""
        stats = getattr(self._benchmark, "stats", None)
        if stats is None:
            return None
        median = float(stats.stats.median)
        _MEANS.setdefault(group, {})[role] = median
        self._benchmark.extra_info[f"{role}_median_s"] = median
        return median

    def other(self, group: str, role: str) -> float | None:
        """The median another benchmark of ``group`` stored (it ran earlier in this session)."""
        return _MEANS.get(group, {}).get(role)

    def derived(self, group: str, name: str, value: float) -> None:
        _DERIVED.setdefault(group, {})[name] = value
        self._benchmark.extra_info[name] = value


@pytest.fixture
def ratio(benchmark: Any) -> Recorder:
    return Recorder(benchmark)


def ratios() -> dict[str, dict[str, float]]:
    """Every group's chunkstar/baseline ratio and derived figures."""
    out: dict[str, dict[str, float]] = {}
    for group, means in _MEANS.items():
        row = dict(_DERIVED.get(group, {}))
        if "chunkstar" in means and "baseline" in means and means["baseline"] > 0:
            row["ratio_chunkstar_over_baseline"] = means["chunkstar"] / means["baseline"]
        row.update({f"{k}_median_s": v for k, v in means.items()})
        out[group] = row
    for group, extra in _DERIVED.items():
        out.setdefault(group, dict(extra))
    return out


def pytest_benchmark_update_json(config: Any, benchmarks: Any, output_json: dict[str, Any]) -> None:
    output_json["chunkstar_ratios"] = ratios()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    found = ratios()
    if not found:
        return
    terminalreporter.section("chunkstar ratios (chunkstar / baseline; < 1 is faster)")
    for group, row in sorted(found.items()):
        parts = [f"{k}={v:.4g}" for k, v in sorted(row.items()) if not k.endswith("_median_s")]
        terminalreporter.write_line(f"{group}: " + ", ".join(parts))
