"""The param list on disk (Note [param chunks on disk]): param chunks whose home is a file.

Every result is compared bit for bit with the same run without the disk tier,
as the optimizer lists' tests do (tests/core/runtime/test_disk_tier.py): under
eviction with random copy, I/O and worker delays, with the param list alone or
with the optimizer's, in bf16 and fp32; gradient accumulation and the habits
that read or write parameters between steps; checkpoints both ways; frozen
(LoRA) chunks; meta construction in waves and pretrained=; a changed param
file stops training. Host memory holds no param chunk between uses: what the
host holds for chunks is staging, within its budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.state import ChunkLocation
from chunkstar.disk import DiskTierError
from tests.core._models import CASES, engine_config, eviction_budget, gpt2_batch, train_engine

CASE = CASES["gpt2"]
ALL = ["param", "master", "exp_avg", "exp_avg_sq"]


def _pair(
    tmp_path: Path, dtype: str = "bf16", lists: list[str] = ALL, build: Callable[[], nn.Module] = CASE.build,
    disk: dict[str, Any] | None = None, **kw: Any,
) -> tuple[tuple[Any, Any], tuple[Any, Any]]:  # fmt: skip
    """The same engine twice from the same seed: without the disk tier, and with ``lists`` on disk."""
    budget = eviction_budget(CASE.build(), torch.bfloat16 if dtype == "bf16" else torch.float32)
    extra = {k: kw.pop(k) for k in ("accum",) if k in kw}
    torch.manual_seed(5)
    plain = chunkstar.initialize_engine(build, 0, engine_config(dtype, budget=budget, **extra), **kw)
    torch.manual_seed(5)
    cfg = engine_config(dtype, budget=budget, disk={"path": str(tmp_path / "disk"), "lists": lists, **(disk or {})}, **extra)
    return plain, chunkstar.initialize_engine(build, 0, cfg, **kw)


def _same_state(a: Any, b: Any) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _params_at_home(engine: Any) -> None:
    """Between uses no param chunk is in host memory: each is on the device or in its file."""
    engine.mgr.chunks.disk.drain()
    for c in engine.mgr.chunks.chunks_of(ChunkList.PARAM):
        assert c.location in (ChunkLocation.DEVICE, ChunkLocation.DISK), c
        assert not c.has_host_buffer, c


@pytest.mark.parametrize("dtype, lists", [("bf16", ALL), ("fp32", ALL), ("bf16", ["param"]), ("fp32", ["param", "exp_avg"])])
def test_training_is_bit_identical_with_the_params_on_disk(
    tmp_path: Path, dtype: str, lists: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHUNKSTAR_DEBUG_COPY_DELAY_MS", "0-3")  # a missing wait would show
    (e0, o0), (e1, o1) = _pair(tmp_path, dtype, lists)
    assert train_engine(e1, o1, CASE, 4, dtype=dtype) == train_engine(e0, o0, CASE, 4, dtype=dtype)
    _same_state(e0, e1)
    oa, ob = o0.state_dict()["state"], o1.state_dict()["state"]
    assert oa.keys() == ob.keys() and all(torch.equal(oa[i][k], ob[i][k]) for i in oa for k in ("exp_avg", "exp_avg_sq"))
    _params_at_home(e1)
    s = e1.stats()
    param_bytes = e1.mgr.chunks.bytes_of(ChunkList.PARAM)
    # every forward reads the param chunks from their files: 4 steps read them at least 4 times;
    # a file holds the elements its parameters use, not a chunk's padding (Note [a file holds
    # what a chunk uses])
    used = sum(p.numel() for p in e1.module.parameters()) * (2 if dtype == "bf16" else 4)
    assert s["disk_bytes_read"] >= 4 * used and s["disk_file_bytes"] >= used
    if lists == ["param"]:
        assert s["disk_file_bytes"] < param_bytes  # the layout pads (the next parameter did not fit)
    # what the host held for chunks: staging (and, with the state in memory, the state)
    in_memory = sum(e1.mgr.chunks.bytes_of(ChunkList(n)) for n in ("master", "exp_avg", "exp_avg_sq") if n not in lists)
    assert s["host_chunk_bytes_peak"] <= s["disk_staging_budget_bytes"] + in_memory
    assert s["disk_staging_peak_bytes"] <= s["disk_staging_budget_bytes"]
    assert s["clean_evictions"] > 0  # a chunk read and not written goes back to its file for free
    # the last iteration's disk figures (Note [disk busy time]): its reads are at least the
    # forward's param chunks and the state, its busy time a part of its wall time
    last = s["disk_last_step"]
    assert last["bytes_read"] >= s["master_and_adam_bytes"] * sum(n != "param" for n in lists) // 3
    assert 0 < last["busy_s"] <= last["seconds"] and 0 < last["busy_fraction"] <= 1
    assert last["read_bytes_per_s"] > 0 and last["write_bytes_per_s"] > 0
    e1.close()
    assert not list((tmp_path / "disk").glob("*.chunks"))


def test_accumulation_and_the_habits_between_steps_match(tmp_path: Path) -> None:
    (e0, o0), (e1, o1) = _pair(tmp_path, accum=2)
    assert train_engine(e1, o1, CASE, 2, dtype="bf16", accum=2) == train_engine(e0, o0, CASE, 2, dtype="bf16", accum=2)
    for e, o in ((e0, o0), (e1, o1)):
        e.backward(CASE.loss(e, gpt2_batch(7), torch.bfloat16))
        w = e.module.transformer.h[0].mlp.c_proj.weight
        grad = w.grad.clone()  # a gradient read from its slot (staged from its file)
        with torch.no_grad():
            e.eval()
            CASE.loss(e, gpt2_batch(8), torch.bfloat16)  # a forward keeps the waiting gradients
            e.train()
        assert torch.equal(w.grad, grad)
        e.backward(CASE.loss(e, gpt2_batch(9), torch.bfloat16))
        o.step()
        o.zero_grad()
        with torch.no_grad():
            e.module.transformer.h[1].mlp.c_fc.weight.mul_(0.5)  # written through to the master and the slot
        with e.gathered_parameters([e.module.transformer.h[0].attn.c_attn.weight]) as (p,):
            p.data.add_(0.01)
        e.load_state_dict(e.state_dict())
        e.backward(CASE.loss(e, gpt2_batch(10), torch.bfloat16))
        e.module.transformer.h[0].attn.c_proj.zero_grad()  # drops those gradients: values back from the masters
        e.backward(CASE.loss(e, gpt2_batch(11), torch.bfloat16))
        o.step()
        o.zero_grad()
    _same_state(e0, e1)
    assert train_engine(e1, o1, CASE, range(2, 4), dtype="bf16", accum=2) == train_engine(
        e0, o0, CASE, range(2, 4), dtype="bf16", accum=2
    )
    _params_at_home(e1)
    e1.close()


def test_checkpoints_resume_both_ways(tmp_path: Path) -> None:
    (e0, o0), (e1, o1) = _pair(tmp_path)
    train_engine(e1, o1, CASE, 2, dtype="bf16")
    e1.save_checkpoint(str(tmp_path / "ck"))
    budget = eviction_budget(CASE.build(), torch.bfloat16)
    cfg = engine_config("bf16", budget=budget, disk={"path": str(tmp_path / "d2"), "lists": ALL})
    back = chunkstar.initialize_engine(CASE.build, 0, cfg)
    back[0].load_checkpoint(str(tmp_path / "ck"))
    e0.load_checkpoint(str(tmp_path / "ck"))  # into an engine without the tier
    want = train_engine(e1, o1, CASE, range(2, 4), dtype="bf16")
    assert train_engine(*back, CASE, range(2, 4), dtype="bf16") == want
    assert train_engine(e0, o0, CASE, range(2, 4), dtype="bf16") == want
    e0.save_checkpoint(str(tmp_path / "ck2"))  # and a plain engine's checkpoint into the tier
    back[0].load_checkpoint(str(tmp_path / "ck2"))
    _same_state(e0, back[0])
    for e in (e1, back[0]):
        e.close()


def _meta_gpt2() -> nn.Module:
    with torch.device("meta"):
        return CASE.build()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_meta_construction_in_waves_and_pretrained(tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the smallest staging budget: the param and master of the largest chunk (the tied
    # embedding's), which a wave and a write through stage together; the step updates that
    # chunk in slices (Note [the step in slices]), with a slice's buffers taken at once: taken
    # one by one, the step thread held a slice's param buffer while the forward waited for the
    # whole budget, for good (Note [all or nothing]).
    # In fp32 a param chunk's staging buffer has a master's size, so the pool hands the buffers
    # the waves built masters in to param chunks copied back mid-backward: a parameter that
    # still shared such a buffer's version counter failed the backward (Note [a parameter's
    # version counter])
    monkeypatch.setenv("CHUNKSTAR_DEBUG_COPY_DELAY_MS", "0-2")  # a missing wait would show
    largest = 512 * 128
    one = ((2 if dtype == "bf16" else 4) + 4) * largest
    (e0, o0), (e1, o1) = _pair(tmp_path, dtype, build=_meta_gpt2, disk={"staging_budget": one})
    assert e1.construction.initialised and e1.stats()["disk_staging_budget_bytes"] == one
    big = max(e1.mgr.chunks.chunks_of(ChunkList.PARAM), key=lambda c: c.numel)
    assert big.numel == largest and len(e1.mgr.chunks.disk.slices(big)) > 1  # type: ignore[union-attr]
    _same_state(e0, e1)
    assert train_engine(e1, o1, CASE, 3, dtype=dtype) == train_engine(e0, o0, CASE, 3, dtype=dtype)
    s = e1.stats()
    assert s["disk_staging_peak_bytes"] <= one and s["host_chunk_bytes_peak"] <= one
    e1.close()
    if dtype == "bf16":
        return
    torch.manual_seed(3)
    saved = CASE.build()
    saved.save_pretrained(tmp_path / "ck")  # type: ignore[operator]
    (_, _), (e2, _) = _pair(tmp_path / "p", dtype="fp32", build=_meta_gpt2, pretrained=tmp_path / "ck")
    got = e2.state_dict()
    for k, v in saved.state_dict().items():
        assert torch.equal(got[k], v), k
    e2.close()


def test_frozen_lora_chunks_live_on_disk_too(tmp_path: Path) -> None:
    from tests.core.runtime.test_frozen import LORA

    budget = eviction_budget(LORA.build(), torch.bfloat16)
    runs = []
    for disk in (None, {"path": str(tmp_path / "d"), "lists": ALL}):
        torch.manual_seed(5)
        cfg = engine_config("bf16", budget=budget, **({"disk": disk} if disk else {}))
        e, o = chunkstar.initialize_engine(LORA.build, 0, cfg)
        runs.append((e, train_engine(e, o, LORA, 3, dtype="bf16")))
        if disk:
            e.save_checkpoint(str(tmp_path / "ck"))
    (e0, l0), (e1, l1) = runs
    assert l0 == l1
    _same_state(e0, e1)
    frozen = e1.mgr.layout.frozen
    assert frozen and all(e1.mgr.chunks.chunk(ChunkList.PARAM, c).location is not ChunkLocation.HOST for c in frozen)
    e0.load_checkpoint(str(tmp_path / "ck"))  # the frozen values came out of their files
    _same_state(e0, e1)
    e1.close()


def test_a_param_file_changed_between_steps_stops_training(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layers = lambda: nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))  # noqa: E731
    cfg = engine_config("fp32", budget="16MB", chunk_size=64 * 64 + 64, disk={"path": str(tmp_path / "d"), "lists": ALL})
    engine, optimizer = chunkstar.initialize_engine(layers, 0, cfg)

    def step() -> None:
        engine.backward(engine(torch.ones(2, 64)).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    step()
    engine.mgr.chunks.disk.drain()
    path = tmp_path / "d" / "chunkstar-r0-param.chunks"
    with open(path, "r+b") as f:
        f.write(b"\xff" * 4096)  # chunk 0's first bytes
    with pytest.raises(DiskTierError, match=r"chunk 0 of list 'param'.*not the ones written there"):
        for _ in range(2):
            step()
    engine.close()
