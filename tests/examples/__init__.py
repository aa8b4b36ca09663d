"""The examples, run as a user runs them (each in a process of its own)."""

HANG_GUARD_S = 1800
"""Seconds an example's process may take before the test calls it hung. A guard against a
hang, never a speed check: the whole suite beside two busy loops on 2 cores (issue 30's
load check) took one demo run past the 600 s the guard used to be, so the verdict changed
with the load. The examples take a few minutes on a quiet machine; speed is the benchmarks'."""
