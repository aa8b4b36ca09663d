"""The disk tier in the engine (Note [disk tier]): optimizer state chunks in files.

Every result is compared bit for bit with the same run without the disk tier:
training under eviction (with random I/O and worker delays), a staging budget
of the minimum two chunks, checkpoints and resumes, the between-step habits
that read or write masters, meta-device construction in waves and pretrained=.
The files are a cache: deleted at close, a dead run's refused or wiped, and a
failed start's deleted at once. Faults (issue 19): a chunk file truncated or
changed between steps, or a write-behind that fails, stops training with a
DiskTierError naming the file and the chunk (its original the __cause__),
and no step waits forever (each runs on a thread that must end in time).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.disk import DiskTierError
from tests.core._faults import file_size_limit
from tests.core._models import CASES, engine_config, eviction_budget, gpt2_batch, train_engine

CASE = CASES["gpt2"]
STEPS = 4
LARGEST_STATE_CHUNK = 4 * 512 * 128
"""The test GPT-2's largest fp32 state chunk: its tied embedding (512 x 128), alone in its chunk."""
ONE_CHUNK = {"staging_budget": LARGEST_STATE_CHUNK}
"""The smallest staging budget, the largest chunk's master (a between-step access stages it
whole): the masters are filled in many waves, and the step updates that chunk in slices
(Note [the step in slices])."""


def _pair(
    tmp_path: Path, dtype: str = "bf16", build: Callable[[], nn.Module] = CASE.build, disk: dict[str, Any] | None = None, **kw: Any
) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
    """The same engine twice from the same seed: without and with the disk tier."""
    budget = eviction_budget(CASE.build(), torch.bfloat16 if dtype == "bf16" else torch.float32)
    torch.manual_seed(5)
    plain = chunkstar.initialize_engine(build, 0, engine_config(dtype, budget=budget), **kw)
    torch.manual_seed(5)
    with_disk = chunkstar.initialize_engine(
        build, 0, engine_config(dtype, budget=budget, disk={"path": str(tmp_path / "disk"), **(disk or {})}), **kw
    )
    return plain, with_disk


def _same_state(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _same_optimizer(a: Any, b: Any) -> None:
    oa, ob = a.state_dict()["state"], b.state_dict()["state"]
    assert oa.keys() == ob.keys() and oa
    for i in oa:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa[i][k], ob[i][k]), (i, k)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_training_is_bit_identical_with_the_state_on_disk(
    tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKSTAR_DEBUG_COPY_DELAY_MS", "0-3")  # a missing wait would show
    (e0, o0), (e1, o1) = _pair(tmp_path, dtype)
    assert train_engine(e1, o1, CASE, STEPS, dtype=dtype) == train_engine(e0, o0, CASE, STEPS, dtype=dtype)
    _same_state(e0, e1)
    _same_optimizer(o0, o1)
    s = e1.stats()
    # the state lives on disk: the host holds param chunks only; every step reads and writes it
    assert e1.mgr.counters.host_chunk_bytes == e1.mgr.chunks.bytes_of(ChunkList.PARAM)
    assert s["disk_bytes_written"] >= STEPS * s["master_and_adam_bytes"]
    assert s["disk_bytes_read"] >= (STEPS - 1) * s["master_and_adam_bytes"]
    assert s["disk_staging_peak_bytes"] <= s["disk_staging_budget_bytes"]
    # the default staging is no longer set by the largest chunk's state (the tied embedding's, 12
    # bytes per element): it is updated in slices (Note [the step in slices]), and the budget is
    # what a between-step access stages at once (its master) or two usual chunks' state
    masters = sorted((c.nbytes for c in e1.mgr.chunks.chunks_of(ChunkList.MASTER)), reverse=True)
    assert masters[0] == LARGEST_STATE_CHUNK and s["disk_staging_budget_bytes"] < 3 * masters[0]
    big = max(e1.mgr.chunks.chunks_of(ChunkList.MASTER), key=lambda c: c.numel)
    assert len(e1.mgr.chunks.disk.slices(big)) > 1  # type: ignore[union-attr]
    assert s["chunk_moves_to_host"] > 0 and s["device_adam_chunks"] == 0
    # staging buffers are model memory: the warm-up measured the same activations
    assert s["warmup_non_model_peak_bytes"] == e0.stats()["warmup_non_model_peak_bytes"]
    e1.close()
    assert not list((tmp_path / "disk").glob("*.chunks"))  # a cache: gone at a clean end


def test_the_staging_shape_no_parameter_sets_it() -> None:
    """Note [the step in slices]: one huge chunk (an embedding) among usual ones is updated in
    slices; the budget is two usual chunks' state, or what a between-step access stages whole
    (the master and param of the largest chunk), whichever is more."""
    from chunkstar.runtime.disk_tier import SLICE_ALIGN, staging_shape

    state = (ChunkList.MASTER, ChunkList.EXP_AVG, ChunkList.EXP_AVG_SQ)
    usual, huge = 200_000, 3_000_000
    sizes = {name: {0: (huge, 4), **{c: (usual, 4) for c in range(1, 10)}} for name in state}
    shape = staging_shape(sizes, None)
    usual_slices = -(-usual // SLICE_ALIGN) * SLICE_ALIGN
    assert shape.least == 4 * huge  # a master alone, between steps
    assert shape.budget == max(4 * huge, 2 * 12 * usual_slices) < 12 * huge  # not the huge chunk's state
    e = shape.slice_elements
    assert e % SLICE_ALIGN == 0 and 2 * 12 * e <= shape.budget  # two slices' state: one read ahead, one updated
    cuts = shape.slices(huge)
    assert len(cuts) > 1 and cuts[0][0] == 0 and cuts[-1][1] == huge and all(b == c for (_, b), (c, _) in zip(cuts, cuts[1:]))
    assert shape.slices(usual) == [(0, usual)]
    assert shape.piece_nbytes == {name.value: 4 * e for name in state}
    # with the param list on disk (bf16), a write through stages a chunk's master and param together
    with_params = {**sizes, ChunkList.PARAM: {c: (n, 2) for c, (n, _) in sizes[ChunkList.MASTER].items()}}
    assert staging_shape(with_params, None).least == 6 * huge
    # a budget given is kept: large enough, nothing is sliced; below the least, refused before any file
    assert staging_shape(sizes, 2 * 12 * huge).slices(huge) == [(0, huge)]
    with pytest.raises(chunkstar.ChunkStateError, match="least that works"):
        staging_shape(sizes, 4 * huge - 1)
    assert staging_shape({}, None).budget == 0


def test_a_staging_budget_of_one_chunk_is_enough_and_less_is_refused(tmp_path: Path) -> None:
    (e0, o0), (e1, o1) = _pair(tmp_path, disk=ONE_CHUNK)
    assert e1.stats()["disk_staging_budget_bytes"] == ONE_CHUNK["staging_budget"]
    assert train_engine(e1, o1, CASE, 3, dtype="bf16") == train_engine(e0, o0, CASE, 3, dtype="bf16")
    _same_state(e0, e1)
    e1.close()
    with pytest.raises(chunkstar.ChunkStateError, match="staging_budget"):
        chunkstar.initialize_engine(
            CASE.build, 0, engine_config("bf16", budget="64MB", disk={"path": str(tmp_path / "d2"), "staging_budget": ONE_CHUNK["staging_budget"] - 1})
        )


def test_checkpoints_and_between_step_habits_match(tmp_path: Path) -> None:
    (e0, o0), (e1, o1) = _pair(tmp_path)
    for e, o in ((e0, o0), (e1, o1)):
        train_engine(e, o, CASE, 2, dtype="bf16")
        e.save_checkpoint(str(tmp_path / f"ck{e is e1}"))
        w = e.module.transformer.h[1].mlp.c_fc.weight
        with torch.no_grad():
            w.mul_(0.5)  # written through to the master (staged from disk and back)
        with e.gathered_parameters([e.module.transformer.h[0].attn.c_attn.weight]) as (p,):
            p.data.add_(0.01)
        engine_sd = e.state_dict()
        e.load_state_dict(engine_sd)
        e.backward(CASE.loss(e, gpt2_batch(9), torch.bfloat16))
        o.zero_grad()  # drops the gradients: params restored from the masters
    _same_state(e0, e1)
    assert train_engine(e1, o1, CASE, range(2, 4), dtype="bf16") == train_engine(e0, o0, CASE, range(2, 4), dtype="bf16")
    _same_optimizer(o0, o1)
    # a checkpoint of the disk run resumes bit for bit, into a disk engine and into a plain one
    torch.manual_seed(5)
    budget = eviction_budget(CASE.build(), torch.bfloat16)
    back = chunkstar.initialize_engine(
        CASE.build, 0, engine_config("bf16", budget=budget, disk={"path": str(tmp_path / "disk3")})
    )
    back[0].load_checkpoint(str(tmp_path / "ckTrue"))
    plain = chunkstar.initialize_engine(CASE.build, 0, engine_config("bf16", budget=budget))
    plain[0].load_checkpoint(str(tmp_path / "ckTrue"))
    assert train_engine(*back, CASE, range(2, 4), dtype="bf16") == train_engine(*plain, CASE, range(2, 4), dtype="bf16")
    for e in (e1, back[0]):
        e.close()


def _meta_gpt2() -> nn.Module:
    with torch.device("meta"):
        return CASE.build()


def test_meta_construction_in_waves_gives_the_same_values_and_rng(tmp_path: Path) -> None:
    # a staging budget of a few chunks: the masters are filled in many waves
    (e0, o0), (e1, o1) = _pair(tmp_path, build=_meta_gpt2, disk=ONE_CHUNK)
    assert e1.construction.initialised
    _same_state(e0, e1)
    assert train_engine(e1, o1, CASE, 2, dtype="bf16") == train_engine(e0, o0, CASE, 2, dtype="bf16")
    e1.close()


def test_rng_after_waves_equals_one_pass(tmp_path: Path) -> None:
    budget = eviction_budget(CASE.build(), torch.bfloat16)
    torch.manual_seed(5)
    chunkstar.initialize_engine(_meta_gpt2, 0, engine_config("bf16", budget=budget))
    one_pass = torch.random.get_rng_state()
    torch.manual_seed(5)
    e = chunkstar.initialize_engine(
        _meta_gpt2, 0, engine_config("bf16", budget=budget, disk={"path": str(tmp_path / "d"), **ONE_CHUNK})
    )[0]
    assert torch.equal(torch.random.get_rng_state(), one_pass)
    e.close()


def test_pretrained_into_the_disk_tier_is_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(3)
    saved = CASE.build()
    saved.save_pretrained(tmp_path / "ck")  # type: ignore[operator]
    (e0, _), (e1, _) = _pair(tmp_path, dtype="fp32", build=_meta_gpt2, pretrained=tmp_path / "ck")
    want = saved.state_dict()
    got = e1.state_dict()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    _same_state(e0, e1)
    e1.close()


_CRASH = textwrap.dedent(
    """
    import os, sys, torch, chunkstar
    from torch import nn
    cfg = {"device": "cpu", "device_memory_budget": "16MB", "disk": {"path": sys.argv[1]}}
    engine, _ = chunkstar.initialize_engine(lambda: nn.Linear(64, 64), 0, cfg)
    os._exit(0)  # dies without closing: its chunk files stay behind
    """
)


def test_files_a_dead_run_left_are_refused_then_wiped(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    subprocess.run([sys.executable, "-c", _CRASH, str(d)], check=True, timeout=120)
    left = sorted(p.name for p in d.iterdir())
    assert any(n.endswith(".chunks") for n in left), left
    (d / "notes.txt").write_text("not chunkstar's")
    cfg = {"device": "cpu", "device_memory_budget": "16MB", "disk": {"path": str(d)}}
    with pytest.raises(DiskTierError, match="on_stale"):
        chunkstar.initialize_engine(lambda: nn.Linear(64, 64), 0, cfg)
    cfg["disk"]["on_stale"] = "wipe"  # type: ignore[index]
    engine, opt = chunkstar.initialize_engine(lambda: nn.Linear(64, 64), 0, cfg)
    engine.backward(engine(torch.ones(2, 64)).sum())
    opt.step()
    engine.close()
    assert (d / "notes.txt").read_text() == "not chunkstar's"  # never deletes what it did not write


def test_auto_chunk_size_fits_two_chunks_state_in_the_staging_budget(tmp_path: Path) -> None:
    """"auto" with the disk tier caps the chunk size so that two chunks' master and moments
    fit the staging budget; and glibc stops keeping large freed blocks (Note [host heap])."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(64, 64) for _ in range(64)))

    free, _ = chunkstar.initialize_engine(build, 0, engine_config("bf16", budget="64MB", chunk_size="auto"))
    assert free.stats()["heap_retention_bounded"] is False
    staging = 2 * 12 * (free.chunk_size // 3)  # two chunks' state at a third of the free choice
    engine, opt = chunkstar.initialize_engine(
        build, 0,
        engine_config("bf16", budget="64MB", chunk_size="auto", disk={"path": str(tmp_path / "d"), "staging_budget": staging}),
    )  # fmt: skip
    assert engine.chunk_size <= staging // 24 < free.chunk_size
    assert engine.stats()["disk_staging_budget_bytes"] == staging
    if sys.platform.startswith("linux"):
        assert engine.stats()["heap_retention_bounded"] is True
    x = torch.randn(4, 64)
    engine.backward(engine(x.bfloat16()).float().square().mean())
    opt.step()  # and it trains: each update stages within the budget
    engine.close()


# ---------------------------------------------------------------------------- faults (issue 19)

LAYER = 64 * 64 + 64
"""Elements of one Linear(64, 64): one chunk each, so the small model has four state chunks per list."""


def _layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))


def _disk_config(d: Path, **disk: Any) -> dict[str, Any]:
    return engine_config("fp32", budget="16MB", chunk_size=LAYER, disk={"path": str(d), **disk})


def _step(engine: Any, optimizer: Any) -> None:
    engine.backward(engine(torch.ones(2, 64)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def _within(seconds: float, fn: Callable[[], None]) -> None:
    """``fn()`` on a thread that must end within ``seconds`` (a hang fails the test, not the
    suite); its exception is raised here."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            failed.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        pytest.fail(f"still running after {seconds} s: a wait that never ends")
    if failed:
        raise failed[0]


def _trained_engine(d: Path) -> tuple[Any, Any]:
    engine, optimizer = chunkstar.initialize_engine(_layers, 0, _disk_config(d))
    _step(engine, optimizer)
    engine.mgr.chunks.disk.drain()  # every write-behind is on disk
    return engine, optimizer


def _slot_offset(d: Path, list_name: str, chunk: int) -> int:
    manifest = json.loads((d / "chunkstar-r0.manifest.json").read_text())
    return int(manifest["lists"][list_name]["chunks"][str(chunk)]["offset"])


def _first_failure(step: Callable[[], None], tries: int = 3) -> DiskTierError:
    """Run ``step`` (each on a thread that must end in time) until it raises a DiskTierError.
    The step's staging is issued behind it (Note [the step issued behind]), so a transfer it
    queued fails whoever waits for it next: the step's own end, or the next forward."""
    for _ in range(tries):
        try:
            _within(60, step)
        except DiskTierError as e:
            return e
    pytest.fail(f"training went on for {tries} steps after a transfer failed")


def test_a_truncated_chunk_file_fails_the_step_and_every_later_one(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    engine, optimizer = _trained_engine(d)
    master = d / "chunkstar-r0-master.chunks"
    os.truncate(master, 4096)  # under the engine: chunk 0 is cut short, the others are gone
    for tries in (2, 1):  # the step that reads it (or the forward that waits for its update), then every step
        error = _first_failure(lambda: _step(engine, optimizer), tries)
        assert re.search(r"reading chunk 0 of list 'master' .*shorter than its manifest", str(error)), error
        assert str(master) in str(error)
        assert isinstance(error.__cause__, DiskTierError)  # the original, raised on the I/O thread
    _within(60, engine.close)
    assert not list(d.glob("chunkstar*"))


def test_a_failed_write_behind_fails_the_step(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    engine, optimizer = _trained_engine(d)

    def step_and_write() -> None:  # the writes behind land under the limit (its buffers come back: no hang)
        _step(engine, optimizer)
        engine.mgr.chunks.disk.drain()

    # writes past 32 KiB fail (EFBIG): chunk 0 of each list is written, chunk 1 (from 20 KiB) is not
    with file_size_limit(32 << 10):
        error = _first_failure(step_and_write, 2)
    assert re.search(r"writing chunk 1 of list '\w+' .*too large", str(error)), error
    assert isinstance(error.__cause__, DiskTierError)
    # the chunks whose write failed are lost: the files hold the previous step's state
    _first_failure(lambda: _step(engine, optimizer), 1)
    _within(60, engine.close)
    assert not list(d.glob("chunkstar*"))


@pytest.mark.parametrize(
    "list_name, how, chunk",
    [
        ("master", "0xff", 0),
        ("master", "0xff", 3),  # the last chunk of the update: the step has returned when its read fails
        ("exp_avg_sq", "zeros", 1),
        ("exp_avg", "truncated", 0),  # truncated, then regrown (as a pending write past the end does): zeros
    ],
)
def test_a_chunk_file_changed_between_steps_stops_training(tmp_path: Path, list_name: str, how: str, chunk: int) -> None:
    d = tmp_path / "disk"
    engine, optimizer = _trained_engine(d)
    path = d / f"chunkstar-r0-{list_name}.chunks"
    offset = _slot_offset(d, list_name, chunk)
    if how == "truncated":
        size = path.stat().st_size
        os.truncate(path, 0)
        os.truncate(path, size)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write((b"\xff" if how == "0xff" else b"\0") * (4 * LAYER))
    failure: DiskTierError | None = None
    for _ in range(2):
        try:
            _within(60, lambda: _step(engine, optimizer))
        except DiskTierError as e:
            failure = e
            break
    assert failure is not None, "training went on from a changed chunk file"
    assert f"chunk {chunk} of list '{list_name}'" in str(failure) and str(path) in str(failure)
    assert "not the ones written there" in str(failure)
    assert isinstance(failure.__cause__, DiskTierError), "the original is the cause, its type kept"
    _within(60, engine.close)


def test_without_verify_the_checks_are_left_out(tmp_path: Path) -> None:
    """disk.verify=false trades the check's CPU (Note [chunk checks]) for the protection: the
    same change of a file goes unseen, and training goes on from it."""
    d = tmp_path / "disk"
    engine, optimizer = chunkstar.initialize_engine(_layers, 0, _disk_config(d, verify=False))
    _step(engine, optimizer)
    engine.mgr.chunks.disk.drain()
    with open(d / "chunkstar-r0-exp_avg_sq.chunks", "r+b") as f:
        f.seek(_slot_offset(d, "exp_avg_sq", 1))
        f.write(b"\0" * (4 * LAYER))
    for _ in range(2):
        _within(60, lambda: _step(engine, optimizer))
    _within(60, engine.close)


def _pretrained_of_another_shape(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "other.safetensors"
    save_file({"0.weight": torch.zeros(32, 64), "0.bias": torch.zeros(32)}, str(path))
    return path


_CORRECTED = textwrap.dedent(
    """
    import sys, torch, chunkstar
    from torch import nn
    cfg = {"device": "cpu", "device_memory_budget": "16MB", "default_chunk_size": %d, "disk": {"path": sys.argv[1]}}
    engine, opt = chunkstar.initialize_engine(lambda: nn.Sequential(*(nn.Linear(64, 64) for _ in range(4))), 0, cfg)
    engine.backward(engine(torch.ones(2, 64)).sum())
    opt.step()
    engine.close()
    """
    % LAYER
)


@pytest.mark.parametrize("failure", ["staging_budget", "pretrained", "param_groups"])
def test_a_failed_start_leaves_nothing_behind_so_the_corrected_call_starts(tmp_path: Path, failure: str) -> None:
    """Where the start fails: in the disk tier, in the engine once the tier exists, after the engine."""
    d = tmp_path / "disk"
    kw: dict[str, Any] = {}
    if failure == "staging_budget":
        kw["config"] = _disk_config(d, staging_budget=100)
        raises: tuple[type[BaseException], str] = (chunkstar.ChunkStateError, "staging_budget")
    elif failure == "pretrained":
        kw["config"] = _disk_config(d)
        kw["pretrained"] = _pretrained_of_another_shape(tmp_path)
        raises = (Exception, r"'0\.weight' is \[32, 64\]")
    else:
        kw["config"] = _disk_config(d)
        kw["param_groups_fn"] = lambda m: [{"params": list(m.parameters())[:2]}]
        raises = (ValueError, "left out")
    with pytest.raises(raises[0], match=raises[1]) as info:
        chunkstar.initialize_engine(_layers, 0, **kw)
    assert not d.exists() or not os.listdir(d), sorted(os.listdir(d))
    # a new process, and this one (the failure still referenced, as a notebook keeps it), start
    subprocess.run([sys.executable, "-c", _CORRECTED, str(d)], check=True, timeout=300)
    engine, optimizer = chunkstar.initialize_engine(_layers, 0, _disk_config(d))
    _step(engine, optimizer)
    engine.close()
    assert info.value is not None and not list(d.glob("chunkstar*"))
