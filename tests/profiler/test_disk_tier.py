"""The disk tier in a profile: its moves, samples, placements and stats, recorded from a real run,
then summarised and exported; and the same from hand-made columns (no engine)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import chunkstar_profiler
from chunkstar.events import MoveReason, Tier
from chunkstar_profiler.chrome import chrome_trace_events
from chunkstar_profiler.cli import main
from chunkstar_profiler.fileformat import write_profile
from chunkstar_profiler.profile import TABLES
from tests.profiler._hostile import SMALL_META

DISK_LISTS = {"master", "exp_avg", "exp_avg_sq"}


def test_the_profiles_vocabulary_is_the_cores() -> None:
    assert chunkstar_profiler.TIERS == tuple(t.value for t in Tier)
    assert chunkstar_profiler.MOVE_REASONS == tuple(r.value for r in MoveReason)


def test_stage_moves_add_up_to_the_engines_counters(recorded_disk: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(recorded_disk["path"])
    before, after = recorded_disk["before"], recorded_disk["after"]
    mv = p.moves
    stage_in, stage_out = mv[mv["reason"] == "stage_in"], mv[mv["reason"] == "stage_out"]
    assert len(stage_in) == after["moves_by_reason"]["stage_in"] - before["moves_by_reason"]["stage_in"] > 0
    assert len(stage_out) == after["moves_by_reason"]["stage_out"] - before["moves_by_reason"]["stage_out"]
    assert ((stage_in["src"] == "disk") & (stage_in["dst"] == "host")).all()
    assert ((stage_out["src"] == "host") & (stage_out["dst"] == "disk")).all()
    assert set(stage_in["chunk_list"]) == DISK_LISTS
    assert (stage_in["duration_s"] == 0).all(), "the I/O runs on I/O threads: a stage move is its issue time"
    # the engine's disk counters over the recording (drained at both ends) are exactly the staged bytes
    stats = p.meta["disk_stats"]
    assert stats["disk_bytes_read"] == stage_in["nbytes"].sum() == after["disk_bytes_read"] - before["disk_bytes_read"]
    assert stats["disk_bytes_written"] == stage_out["nbytes"].sum() == after["disk_bytes_written"] - before["disk_bytes_written"]
    assert stats["disk_read_s"] == pytest.approx(after["disk_read_s"] - before["disk_read_s"])
    assert stats["disk_file_bytes"] == after["disk_file_bytes"] > 0
    assert stats["disk_staging_budget_bytes"] == after["disk_staging_budget_bytes"]
    # moves between the device and the host are counted as before, without the stage moves
    dev_host = mv[(mv["src"] != "disk") & (mv["dst"] != "disk")]
    assert (dev_host["dst"] == "host").sum() == after["chunk_moves_to_host"] - before["chunk_moves_to_host"]


def test_disk_memory_samples_are_the_chunk_files(recorded_disk: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(recorded_disk["path"])
    assert p.meta["version"] == chunkstar_profiler.FORMAT_VERSION == 3
    assert p.meta["tiers"] == ["device", "host", "disk"]
    assert set(p.memory["tier"]) == {"device", "host", "disk"}
    disk = p.memory[p.memory["tier"] == "disk"]
    files = recorded_disk["after"]["disk_file_bytes"]
    assert len(disk) == (p.memory["tier"] == "device").sum()
    assert (disk["total_bytes"] == files).all() and (disk["chunk_bytes"] == files).all() and (disk["budget_bytes"] == files).all()
    assert (disk["non_model_bytes"] == 0).all()


def test_disk_and_host_stays_of_a_state_chunk_tile_the_recording(recorded_disk: dict[str, Any]) -> None:
    """A disk-list chunk is in its file only, or staged in (a host stay), never both, never neither."""
    p = chunkstar_profiler.load(recorded_disk["path"])
    pl = p.placements
    end = pl["t_end_s"].max()
    state = pl[pl["chunk_list"].isin(DISK_LISTS)]
    assert set(state["tier"]) == {"disk", "host"}
    assert not (pl[pl["tier"] == "disk"]["chunk_list"] == "param").any()
    n_in = p.moves.groupby(["chunk_list", "chunk_id"])["reason"].apply(lambda r: int((r == "stage_in").sum()))
    for (lst, cid), grp in state.groupby(["chunk_list", "chunk_id"]):
        grp = grp.sort_values("t_start_s")
        starts, ends = grp["t_start_s"].to_numpy(), grp["t_end_s"].to_numpy()
        assert starts[0] == 0.0 and ends[-1] == end, (lst, cid)
        np.testing.assert_array_equal(starts[1:], ends[:-1], err_msg=f"{lst}[{cid}]")
        tiers = list(grp["tier"])
        assert tiers[0] == "disk" and all(a != b for a, b in zip(tiers, tiers[1:])), (lst, cid, tiers)
        assert tiers.count("host") == n_in[(lst, cid)]


def test_round_trip_equals_the_in_memory_profile(recorded_disk: dict[str, Any]) -> None:
    live = recorded_disk["prof"].profile()
    disk = chunkstar_profiler.load(recorded_disk["path"])
    for table in ("moments", "moves", "memory", "stages", "placements"):
        pd.testing.assert_frame_equal(getattr(live, table), getattr(disk, table), check_exact=False, atol=1e-6, rtol=0, obj=table)
    assert disk.meta["disk_stats"] == live.meta["disk_stats"]


def test_a_run_without_the_disk_tier_has_none_in_its_profile(recorded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(recorded["path"])
    assert p.meta["tiers"] == ["device", "host"] and "disk_stats" not in p.meta
    assert "disk" not in set(p.memory["tier"]) | set(p.moves["src"]) | set(p.moves["dst"]) | set(p.placements["tier"])
    assert "disk tier" not in chunkstar_profiler.summarize(p)
    names = {e["args"]["name"] for e in chrome_trace_events(p) if e["name"] == "thread_name"}
    assert "disk stage in/out" not in names


def test_summary_shows_the_third_tier(recorded_disk: dict[str, Any], capsys: Any) -> None:
    assert main(["summary", str(recorded_disk["path"])]) == 0
    out = capsys.readouterr().out
    p = chunkstar_profiler.load(recorded_disk["path"])
    stats = p.meta["disk_stats"]
    mib = 2**20
    tiers = re.findall(r"^  (device|host|disk) +total", out, flags=re.M)
    assert tiers == ["device", "host", "disk"]
    disk_line = next(ln for ln in out.splitlines() if ln.startswith("  disk     total"))
    assert f"{stats['disk_file_bytes'] / mib:,.1f} MiB" in disk_line
    n_in = int((p.moves["reason"] == "stage_in").sum())
    in_bytes = p.moves.loc[p.moves["reason"] == "stage_in", "nbytes"].sum()
    assert re.search(rf"stage-in disk->host +{n_in} +{in_bytes / mib:,.1f} MiB", out)
    assert re.search(r"stage-out host->disk +\d+", out)
    # moves to host: device -> host only, the stage-ins are their own line
    to_host = p.moves[(p.moves["dst"] == "host") & (p.moves["src"] == "device")]
    assert re.search(rf"moves to host +{len(to_host)} ", out)
    read_rate = stats["disk_bytes_read"] / stats["disk_read_s"] / mib
    write_rate = stats["disk_bytes_written"] / stats["disk_write_s"] / mib
    assert re.search(rf"read +{stats['disk_bytes_read'] / mib:,.1f} MiB .* {read_rate:,.1f} MiB/s", out)
    assert re.search(rf"written +{stats['disk_bytes_written'] / mib:,.1f} MiB .* {write_rate:,.1f} MiB/s", out)
    assert "staging budget" in out


def test_chrome_export_has_a_disk_track_and_counter(recorded_disk: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert main(["export-chrome", str(recorded_disk["path"]), str(out)]) == 0
    ev = json.loads(out.read_text())["traceEvents"]
    tid = next(e["tid"] for e in ev if e["name"] == "thread_name" and e["args"]["name"] == "disk stage in/out")
    p = chunkstar_profiler.load(recorded_disk["path"])
    staged = p.moves[(p.moves["src"] == "disk") | (p.moves["dst"] == "disk")]
    on_track = [e for e in ev if e["ph"] == "X" and e["tid"] == tid]
    assert len(on_track) == len(staged) > 0
    assert {e["cat"] for e in on_track} == {"stage_in", "stage_out"}
    assert all(e["dur"] == 0 for e in on_track)
    assert sum(e["args"]["bytes"] for e in on_track) == staged["nbytes"].sum()
    assert any(e["ph"] == "f" and e["tid"] == tid for e in ev), "flows from the optimizer moment to its stage moves"
    # no stage move is on the host/device tracks
    host_tid = next(e["tid"] for e in ev if e["name"] == "thread_name" and e["args"]["name"] == "moves to host")
    assert not any(e["ph"] == "X" and e["tid"] == host_tid and e["cat"].startswith("stage") for e in ev)
    disk_counters = [e for e in ev if e["ph"] == "C" and e["name"] == "disk memory"]
    assert len(disk_counters) == (p.memory["tier"] == "disk").sum()
    assert {e["args"]["chunk files"] for e in disk_counters} == {p.meta["disk_stats"]["disk_file_bytes"]}


# --- hand-made files: no engine -----------------------------------------------------


def _columns(moves: list[tuple[str, str, str, int]], tiers: list[str]) -> dict[str, dict[str, list[Any]]]:
    """A profile's columns: ``moves`` as (src, dst, reason, nbytes), one memory sample per entry of ``tiers``."""
    cols: dict[str, dict[str, list[Any]]] = {t: {c: [] for c in schema} for t, schema in TABLES.items()}
    cols["moments"].update(iteration=[0], index=[-1], module=["optimizer"], stage=["optim"], t_start=[0], t_end=[10**7])
    for i, (src, dst, reason, nbytes) in enumerate(moves):
        for k, v in dict(t_start=i * 10**6, t_end=i * 10**6, chunk_id=i, chunk_list="master", nbytes=nbytes,
                         src=src, dst=dst, reason=reason, moment_row=0).items():  # fmt: skip
            cols["moves"][k].append(v)
    for i, tier in enumerate(tiers):
        for k, v in dict(t=i * 10**6, tier=tier, chunk_bytes=4096, non_model_bytes=0, budget_bytes=4096, moment_row=0).items():
            cols["memory"][k].append(v)
    return cols


def test_a_hand_made_disk_profile_summarises_and_exports(tmp_path: Path) -> None:
    moves = [("disk", "host", "stage_in", 4096), ("host", "disk", "stage_out", 4096), ("host", "disk", "stage_out", 0),
             ("device", "host", "eviction", 512)]  # fmt: skip
    meta = {**SMALL_META, "disk_stats": {"disk_bytes_read": 4 * 2**20, "disk_read_s": 2.0, "disk_bytes_written": 2**20, "disk_write_s": 0.0}}
    path = write_profile(tmp_path / "d.csprof", _columns(moves, ["device", "host", "disk"]), meta)
    p = chunkstar_profiler.load(path)
    text = chunkstar_profiler.summarize(p)
    assert re.search(r"stage-out host->disk +2 .*\(1 dropped unchanged, 0 bytes\)", text)
    assert re.search(r"moves to host +1 ", text)
    assert "2.0 MiB/s" in text and "n/a" in text  # 4 MiB in 2 s; no write time: no rate
    ev = chrome_trace_events(p)
    assert "disk stage in/out" in {e["args"]["name"] for e in ev if e["name"] == "thread_name"}


def test_moves_to_an_unknown_tier_go_to_a_track_of_their_own(tmp_path: Path) -> None:
    """A newer core's tier must not break the export (it used to be a KeyError)."""
    path = write_profile(tmp_path / "u.csprof", _columns([("host", "moon", "access", 8)], ["device"]), SMALL_META)
    ev = chrome_trace_events(chunkstar_profiler.load(path))
    tid = next(e["tid"] for e in ev if e["name"] == "thread_name" and e["args"]["name"] == "moves (other)")
    assert [e["name"] for e in ev if e["ph"] == "X" and e["tid"] == tid] == ["master[0] -> moon"]
