"""The Chrome/Perfetto export, checked by parsing it, and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import chunkstar_profiler
from chunkstar.events import MoveReason
from chunkstar_profiler.cli import main


def _export(recorded: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "trace.json"
    assert main(["export-chrome", str(recorded["path"]), str(out)]) == 0
    return json.loads(out.read_text())


def test_phases_tracks_and_counters(recorded: dict[str, Any], tmp_path: Path) -> None:
    doc = _export(recorded, tmp_path)
    ev = doc["traceEvents"]
    phases = {e["ph"] for e in ev}
    assert {"M", "X", "C", "s", "f"} <= phases
    names = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"stages", "moments (modules)", "moves to device", "moves to host"} <= names
    p = chunkstar_profiler.load(str(recorded["path"]))
    xs = [e for e in ev if e["ph"] == "X"]
    reasons = {r.value for r in MoveReason}
    assert sum(1 for e in xs if e["cat"] in reasons) == len(p.moves)
    assert sum(e["args"]["bytes"] for e in xs if "bytes" in e["args"]) == int(p.moves["nbytes"].sum())
    counters = [e for e in ev if e["ph"] == "C"]
    assert {"device memory", "host memory", "device budget"} <= {e["name"] for e in counters}
    for e in counters:
        assert all(isinstance(v, (int, float)) for v in e["args"].values())
    for e in xs:
        assert e["dur"] >= 0 and e["ts"] >= 0


def test_complete_events_nest_per_track(recorded: dict[str, Any], tmp_path: Path) -> None:
    """On one track, two slices are either disjoint or one contains the other (no partial overlap)."""
    ev = _export(recorded, tmp_path)["traceEvents"]
    by_track: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            by_track[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    eps = 0.002  # microsecond rounding
    for tid, spans in by_track.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float]] = []
        for a, b in spans:
            while stack and stack[-1][1] <= a + eps:
                stack.pop()
            if stack:
                assert b <= stack[-1][1] + eps, f"track {tid}: ({a}, {b}) overlaps {stack[-1]} partially"
            stack.append((a, b))


def test_flows_link_moments_to_their_moves(recorded: dict[str, Any], tmp_path: Path) -> None:
    ev = _export(recorded, tmp_path)["traceEvents"]
    starts = {e["id"]: e for e in ev if e["ph"] == "s"}
    ends = {e["id"]: e for e in ev if e["ph"] == "f"}
    assert starts and starts.keys() == ends.keys()
    moments = [e for e in ev if e["ph"] == "X" and e["tid"] == 2]
    for fid, s in list(starts.items())[:200]:
        assert s["ts"] <= ends[fid]["ts"] + 1e-3
        # the flow starts inside a moment slice on the moments track
        assert any(m["ts"] - 1e-3 <= s["ts"] <= m["ts"] + m["dur"] + 1e-3 for m in moments)


def test_summary_cli(recorded: dict[str, Any]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "chunkstar_profiler.cli", "summary", str(recorded["path"])],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for needle in ("top 10 operators by bytes moved", "stall time", "peak memory per tier", "moves to host", "eviction"):
        assert needle in out.stdout


def test_cli_on_a_bad_file_says_why(tmp_path: Path, capsys: Any) -> None:
    bad = tmp_path / "x.csprof"
    bad.write_text("nope")
    assert main(["summary", str(bad)]) == 2
    assert "not a chunkstar profile" in capsys.readouterr().err


def test_cli_on_a_directory_says_why(tmp_path: Path, capsys: Any) -> None:
    assert main(["summary", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"chunkstar-profile: {tmp_path}: a directory, not a profile file\n"
