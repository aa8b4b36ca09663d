"""Activation moves (``chunkstar.events.ActivationMoved``: a block's saved activations offloaded to the host
and brought back, Note [activation offload]) in a profile: their own table, never among the chunk moves, through
the file (format version 3, older versions still read), the summary and the Perfetto export; first from events
built here and fed to the recorder as an engine would emit them, then from a real offloading run."""

from __future__ import annotations

import json
import re
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest
import torch

import chunkstar
import chunkstar_profiler
from chunkstar.activations.offload import MIN_OFFLOAD_BYTES
from chunkstar.events import ActivationMoved, ChunkMoved, Event, MomentBegin, MomentEnd, MoveReason, Stage, StageChanged, Tier
from chunkstar_profiler import ProfileFormatError
from chunkstar_profiler.chrome import chrome_trace_events
from chunkstar_profiler.fileformat import FORMAT_VERSION, write_profile
from chunkstar_profiler.profile import TABLES, build_profile
from chunkstar_profiler.recorder import Profiler
from chunkstar_profiler.summary import activation_table
from tests.profiler._hostile import SMALL_META, members

MS = 10**6
MIB = 2**20
D, H = Tier.DEVICE, Tier.HOST
FWD, BWD = Stage.FWD, Stage.BWD


def _act(block: str, mib: int, src: Tier, dst: Tier, prefetch: bool, moment: int, t0: float, t1: float) -> ActivationMoved:
    return ActivationMoved(block, mib * MIB, src, dst, prefetch, moment, int(t0 * MS), int(t1 * MS))


# Two micro-steps of a two-block model, times in ms. The core emits an activation move once its copy is found
# done, which may be in a later moment than the one that issued it: the event names the issuing one.
EVENTS: list[Event] = [
    StageChanged(FWD, 0),
    MomentBegin(0, "h.0", FWD, 1 * MS),
    _act("h.0", 2, D, H, False, 0, 2, 3),
    MomentEnd(0, "h.0", FWD, 4 * MS),
    MomentBegin(1, "h.1", FWD, 5 * MS),
    ChunkMoved(0, "param", 4096, H, D, MoveReason.ACCESS, 1, "h.1", 5 * MS, 5 * MS + 500_000),
    _act("h.0", 3, D, H, False, 0, 2.5, 6),  # h.0's copy, found done in h.1's moment: h.0's
    _act("h.1", 2, D, H, False, 1, 6, 7),
    MomentEnd(1, "h.1", FWD, 8 * MS),
    StageChanged(BWD, 9 * MS),
    MomentBegin(2, "h.1", BWD, 10 * MS),
    _act("h.1", 2, H, D, False, 2, 10, 11),  # the backward waited for it
    MomentBegin(3, "h.0", BWD, 13 * MS),
    _act("h.0", 2, H, D, True, 2, 10.5, 14),  # sent for ahead of h.0's backward, in h.1's
    _act("h.0", 3, H, D, True, 2, 10.6, 14.5),
    StageChanged(Stage.OPTIM, 16 * MS),
    ChunkMoved(0, "master", 8192, D, H, MoveReason.OPTIMIZER, -1, "", 16 * MS, 17 * MS),
    StageChanged(Stage.IDLE, 18 * MS),
    StageChanged(FWD, 20 * MS),
    MomentBegin(0, "h.0", FWD, 21 * MS),
    _act("h.0", 1, D, H, False, 0, 21.5, 22),
    MomentBegin(1, "h.1", FWD, 23 * MS),
    _act("h.1", 1, D, H, False, 1, 6.5, 24),  # issued in step 0's moment 1, found done in step 1's: no moment of this step
    _act("h.1", 1, D, H, False, -1, 24, 25),  # outside any moment
    MomentEnd(1, "h.1", FWD, 26 * MS),
    StageChanged(Stage.IDLE, 27 * MS),
]
ACTS = [e for e in EVENTS if isinstance(e, ActivationMoved)]
# the row of the moment each activation move was issued in (rows: h.0 fwd, h.1 fwd, h.1 bwd, h.0 bwd, optimizer, h.0, h.1)
ACT_ROWS = [0, 0, 1, 2, 2, 2, 5, -1, -1]


def _columns(events: list[Event], end: int = 30 * MS) -> dict[str, dict[str, list[Any]]]:
    """The recorder's columns after ``events``, fed in as an engine emits them (no engine: the way
    ``chunkstar_profiler.predicted`` feeds a dry run's events in)."""
    rec = Profiler.__new__(Profiler)
    rec._init_columns()
    for e in events:
        rec._on_event(e)
    rec.stop_at(end)
    return rec._columns(end)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    meta = {**SMALL_META, "iterations": 2}
    return Path(write_profile(tmp_path_factory.mktemp("act") / "act.csprof", _columns(EVENTS), meta))


def test_activation_moves_are_a_table_of_their_own(synthetic: Path) -> None:
    p = chunkstar_profiler.load(synthetic)
    am = p.activation_moves
    assert list(am["block"]) == [e.block for e in ACTS]
    assert list(am["nbytes"]) == [e.nbytes for e in ACTS]
    assert list(am["src"]) == [e.src.value for e in ACTS] and list(am["dst"]) == [e.dst.value for e in ACTS]
    assert list(am["prefetch"]) == [e.prefetch for e in ACTS] and am["prefetch"].dtype == bool
    assert list(am["t_start_s"]) == pytest.approx([e.t_start_ns / 1e9 for e in ACTS])
    assert list(am["duration_s"]) == pytest.approx([(e.t_end_ns - e.t_start_ns) / 1e9 for e in ACTS])
    # the chunk moves are the two chunk events, nothing of the activations' among them
    assert list(p.moves["chunk_list"]) == ["param", "master"] and list(p.moves["nbytes"]) == [4096, 8192]
    assert not set(p.moves.columns) & {"block", "prefetch"} and not set(am.columns) & {"chunk_id", "reason"}


def test_an_activation_move_belongs_to_the_moment_that_issued_it(synthetic: Path) -> None:
    p = chunkstar_profiler.load(synthetic)
    am = p.activation_moves
    assert list(am["moment_row"]) == ACT_ROWS
    assert list(am["module"]) == ["h.0", "h.0", "h.1", "h.1", "h.1", "h.1", "h.0", "", ""]
    assert list(am["stage"]) == ["fwd", "fwd", "fwd", "bwd", "bwd", "bwd", "fwd", "", ""]
    assert list(am["iteration"]) == [0, 0, 0, 0, 0, 0, 1, -1, -1]


def test_the_round_trip_keeps_every_activation_move(synthetic: Path) -> None:
    columns = _columns(EVENTS)
    live = build_profile(columns, {})
    disk = chunkstar_profiler.load(synthetic)
    assert len(disk.activation_moves) == len(ACTS)
    for table in ("activation_moves", "moves", "moments"):
        pd.testing.assert_frame_equal(getattr(live, table), getattr(disk, table), check_exact=False, atol=1e-6, rtol=0, obj=table)
    with zipfile.ZipFile(synthetic) as zf:
        manifest = json.loads(zf.read("manifest.json"))
    assert manifest["version"] == FORMAT_VERSION == 3
    table = manifest["tables"]["activation_moves"]
    assert table["rows"] == len(ACTS) and set(table["columns"]) == set(TABLES["activation_moves"])


def _older(src: Path, dst: Path, version: int, keep_table: bool = False) -> Path:
    """``src`` as a writer of format ``version`` (before the activation_moves table) wrote it: the same layout
    without that table (with ``keep_table``, a file that says ``version`` yet still holds it)."""
    parts = members(src)
    manifest = json.loads(parts.pop("manifest.json"))
    manifest["version"] = version
    if not keep_table:
        manifest["tables"].pop("activation_moves")
        manifest["dictionaries"] = {k: v for k, v in manifest["dictionaries"].items() if not k.startswith("activation_moves.")}
        parts = {name: data for name, data in parts.items() if not name.startswith("tables/activation_moves/")}
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("manifest.json", json.dumps(manifest))
        for name, data in parts.items():
            zf.writestr(name, data)
    return dst


@pytest.mark.parametrize("version", [1, 2])
def test_a_file_from_before_activation_moves_still_loads(version: int, synthetic: Path, tmp_path: Path) -> None:
    now = chunkstar_profiler.load(synthetic)
    old = chunkstar_profiler.load(_older(synthetic, tmp_path / f"v{version}.csprof", version))
    assert old.meta["version"] == version
    assert old.activation_moves.empty and list(old.activation_moves.columns) == list(now.activation_moves.columns)
    for table in ("moments", "moves", "memory", "stages", "placements"):
        pd.testing.assert_frame_equal(getattr(old, table), getattr(now, table), obj=table)
    assert "activation moves" not in chunkstar_profiler.summarize(old)
    assert not any(e["name"] == "thread_name" and e["args"]["name"].startswith("activations") for e in chrome_trace_events(old))
    # a table the version did not have is not read, even where a member of its name is there
    assert chunkstar_profiler.load(_older(synthetic, tmp_path / "odd.csprof", version, keep_table=True)).activation_moves.empty


def test_a_version_3_file_without_the_table_is_refused(synthetic: Path, tmp_path: Path) -> None:
    with pytest.raises(ProfileFormatError, match="table 'activation_moves' is missing"):
        chunkstar_profiler.load(_older(synthetic, tmp_path / "damaged.csprof", 3))


def test_summary_counts_activation_moves_each_way_per_iteration(synthetic: Path) -> None:
    p = chunkstar_profiler.load(synthetic)
    text = chunkstar_profiler.summarize(p)
    to_host = [e for e in ACTS if e.dst is H]
    to_device = [e for e in ACTS if e.dst is D]
    section = text[text.index("activation moves") :]
    assert "2 block(s)" in section.splitlines()[0]
    assert re.search(rf"^  to host +{len(to_host)} +{sum(e.nbytes for e in to_host) / MIB:.1f} MiB", section, re.M)
    to_device_mib = sum(e.nbytes for e in to_device) / MIB
    assert re.search(rf"^  to device +{len(to_device)} +{to_device_mib:.1f} MiB .*\(2 prefetched", section, re.M)
    # the chunk moves' totals are the chunk moves' alone
    assert re.search(r"^  moves to device +1 ", text, re.M) and re.search(r"^  moves to host +1 ", text, re.M)
    table = activation_table(p).set_index("iteration")
    assert list(table.index) == [-1, 0, 1]
    assert table.loc[0, ["to_host", "bytes_to_host", "to_device", "bytes_to_device", "prefetched"]].tolist() == [
        3, 7 * MIB, 3, 7 * MIB, 2,
    ]  # fmt: skip
    assert table.loc[1, ["to_host", "bytes_to_host", "to_device"]].tolist() == [1, MIB, 0]
    assert table.loc[-1, ["to_host", "bytes_to_host"]].tolist() == [2, 2 * MIB]
    assert table["bytes_to_host"].sum() == sum(e.nbytes for e in to_host)
    assert re.search(r"^  to host per iteration +2\.0 +4\.0 MiB +\(mean of 2 iterations\)", section, re.M)
    assert re.search(r"^    iteration 1 +to host +1 +1\.0 MiB", section, re.M)
    assert re.search(r"^    outside moments +to host +2 +2\.0 MiB", section, re.M)


def _tracks(ev: list[dict[str, Any]]) -> dict[str, int]:
    return {e["args"]["name"]: e["tid"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}


def test_the_perfetto_export_puts_activation_moves_on_their_own_tracks(synthetic: Path) -> None:
    p = chunkstar_profiler.load(synthetic)
    ev = chrome_trace_events(p)
    tracks = _tracks(ev)
    # copies found done late overlap partly: a second (third) lane, never a misdrawn stack on one track
    act_tracks = {n: t for n, t in tracks.items() if n.startswith("activations")}
    assert set(act_tracks) == {
        "activations to host", "activations to host (2)", "activations to device", "activations to device (2)",
        "activations to device (3)",
    }  # fmt: skip
    assert len(set(act_tracks.values())) == 5 and not set(act_tracks.values()) & {tracks["moves to host"], tracks["moves to device"]}
    xs = [e for e in ev if e["ph"] == "X"]
    acts = [e for e in xs if e["cat"] == "activation"]
    assert [(e["name"], e["args"]["bytes"], e["args"]["prefetch"]) for e in acts] == [
        (f"{a.block} -> {a.dst.value}", a.nbytes, a.prefetch) for a in ACTS
    ]
    for e, a in zip(acts, ACTS):
        name = next(n for n, t in act_tracks.items() if t == e["tid"])
        assert name.startswith(f"activations to {a.dst.value}") and e["args"]["block"] == a.block
    assert not any(e["cat"] != "activation" and e["tid"] in act_tracks.values() for e in xs)
    assert sum(e["args"]["bytes"] for e in xs if e["cat"] in {r.value for r in MoveReason}) == int(p.moves["nbytes"].sum())
    # on one track, two slices are disjoint or nested (Perfetto's rule for X events)
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in xs:
        spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for tid, sl in spans.items():
        sl.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float]] = []
        for a, b in sl:
            while stack and stack[-1][1] <= a + 0.002:
                stack.pop()
            assert not stack or b <= stack[-1][1] + 0.002, (tid, (a, b), stack[-1])
            stack.append((a, b))
    # a flow from the issuing moment to each activation move that has one
    ends = [e for e in ev if e["ph"] == "f" and e["tid"] in act_tracks.values()]
    assert len(ends) == sum(r >= 0 for r in ACT_ROWS)
    starts = {e["id"] for e in ev if e["ph"] == "s"}
    assert {e["id"] for e in ends} <= starts and len(starts) == len({e["id"] for e in ev if e["ph"] == "f"})


def test_a_profile_without_activation_moves_has_no_activation_track(recorded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(recorded["path"])
    assert p.activation_moves.empty
    assert not any(n.startswith("activations") for n in _tracks(chrome_trace_events(p)))
    assert "activation moves" not in chunkstar_profiler.summarize(p)


# --- a real run that offloads its blocks' activations -------------------------------------


def _gpt2() -> torch.nn.Module:
    """Two blocks whose saved activations (batch 2 x 256 tokens x 256 wide, fp32) are storages of 1.5-2 MiB,
    past ``MIN_OFFLOAD_BYTES``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=512, n_positions=256, n_embd=256, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from tests.core._models import engine_config, gpt2_batch, hf_loss

    # a budget under the run's needs, so chunks move too and the two kinds are seen side by side
    cfg = engine_config("fp32", budget="40MB", chunk_size=1 << 16, activations={"policy": "offload"})
    engine, optimizer = chunkstar.initialize_engine(_gpt2, 0, cfg)

    def step(i: int) -> None:
        engine.backward(hf_loss(engine, gpt2_batch(i, batch=2, seq=256), torch.float32))
        optimizer.step()
        optimizer.zero_grad()

    try:
        step(0)  # warm-up outside the recording
        before = engine.stats()
        with Profiler(engine) as prof:
            for i in range(1, 3):
                step(i)
        after = engine.stats()
        path = Path(prof.save(tmp_path_factory.mktemp("act") / "offload.csprof"))
        yield {"prof": prof, "path": path, "before": before, "after": after}
    finally:
        engine.close()


def test_an_offloading_run_records_its_activation_moves(offloaded: dict[str, Any]) -> None:
    p = chunkstar_profiler.load(offloaded["path"])
    before, after = offloaded["before"], offloaded["after"]
    am = p.activation_moves
    to_host, to_device = am[am["dst"] == "host"], am[am["dst"] == "device"]
    assert len(to_host) > 0 and len(to_device) > 0 and len(to_host) + len(to_device) == len(am)
    # every byte the engine offloaded and brought back over the recording, and no other
    assert to_host["nbytes"].sum() == after["activation_bytes_to_host"] - before["activation_bytes_to_host"]
    assert to_device["nbytes"].sum() == after["activation_bytes_to_device"] - before["activation_bytes_to_device"]
    assert (to_host["src"] == "device").all() and (to_device["src"] == "host").all()
    assert set(am["block"]) == {"transformer.h.0", "transformer.h.1"} and (am["nbytes"] >= MIN_OFFLOAD_BYTES).all()
    assert (to_host["stage"] == "fwd").all() and (to_device["stage"] == "bwd").all(), "issued by the blocks' moments"
    assert to_device["prefetch"].any(), "the next block's storages are sent for ahead of its backward"
    assert activation_table(p).set_index("iteration").loc[[0, 1], "bytes_to_host"].sum() == to_host["nbytes"].sum()
    # the chunk moves are the engine's chunk moves: no activation bytes among them
    mv = p.moves
    assert len(mv) > 0
    assert (mv["dst"] == "host").sum() == after["chunk_moves_to_host"] - before["chunk_moves_to_host"]
    assert mv.loc[mv["dst"] == "host", "nbytes"].sum() == after["bytes_to_host"] - before["bytes_to_host"]
    assert mv.loc[mv["dst"] == "device", "nbytes"].sum() == after["bytes_to_device"] - before["bytes_to_device"]
    # saved and loaded as recorded
    live = offloaded["prof"].profile()
    pd.testing.assert_frame_equal(live.activation_moves, am, check_exact=False, atol=1e-6, rtol=0)
    assert f"{len(to_host)} " in chunkstar_profiler.summarize(p).split("activation moves", 1)[1].splitlines()[1]


def test_a_dry_runs_activation_moves_are_on_the_predicted_clock(tmp_path: Path) -> None:
    """A dry run of an offloading model records its activation moves too; the predicted profile replays them
    (its clock places them as it places samples: the time model has no activation copies)."""
    from chunkstar_profiler.predicted import predicted_profile, write_predicted_profile

    ids = torch.zeros(2, 256, dtype=torch.long)
    cfg = {
        "device_memory_budget": "64MB", "default_chunk_size": 1 << 16, "bf16": {"enabled": True}, "activations": {"policy": "offload"},
    }  # fmt: skip
    report = chunkstar.dry_run(_gpt2, cfg, {"input_ids": ids, "labels": ids}, hardware="a100x8_1tb")
    record = report.ranks[0].record
    assert record is not None
    emitted = [e for e in record.events if isinstance(e, ActivationMoved)]
    assert emitted
    p = predicted_profile(report)
    am = p.activation_moves
    assert list(am["nbytes"]) == [e.nbytes for e in emitted] and list(am["block"]) == [e.block for e in emitted]
    seconds = p.meta["predicted"]["seconds_per_step"]
    assert am["t_start_s"].min() >= 0 and am["t_end_s"].max() <= seconds * 1.0001
    assert (am["t_end_s"] >= am["t_start_s"]).all()
    loaded = chunkstar_profiler.load(write_predicted_profile(report, tmp_path / "predicted.csprof"))
    assert len(loaded.activation_moves) == len(emitted)
