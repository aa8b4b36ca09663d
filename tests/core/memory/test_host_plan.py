"""Host memory as a budget (Note [host memory plan]): planned before anything is built.

The plan's parts are the layout's own bytes; a plan over its budget is refused
with a HostMemoryError naming the parts and what to change, before any chunk,
file or thread exists; with the disk tier and no lists given, the param list
goes on disk exactly when that is what fits, and the run is then bit-identical
to the same run without the tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import chunkstar
from chunkstar.chunk.lists import ChunkList
from chunkstar.memory.host import AUTO_SHARE, HOST_MEMORY_ENV, HostPlan, available_host_memory, host_budget
from chunkstar.runtime.start_checks import host_plan
from tests.core._models import CASES, engine_config, eviction_budget, train_engine

CASE = CASES["gpt2"]


def test_a_plan_adds_its_parts_and_says_them_largest_first() -> None:
    plan = HostPlan({"param chunks": 3 << 30, "disk staging": 1 << 30, "gradient accumulators": 0}, credit=1 << 29)
    assert plan.total == (4 << 30) - (1 << 29)
    text = plan.describe()
    assert text.index("param chunks 3.00 GiB") < text.index("disk staging 1.00 GiB")
    assert "accumulators" not in text and "512.00 MiB of real parameters freed" in text
    assert HostPlan({"x": 10}, credit=20).total == 0


def test_auto_is_a_share_of_what_the_machine_has(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_budget(123, 4) == (123, "host_memory_budget 123 B")  # a configured budget is the budget
    avail, what = available_host_memory()
    assert avail is not None and avail > 0 and "MemAvailable" in what or "cgroup" in what
    budget, text = host_budget(None, 2, machine=8 << 30)  # the machine as a benchmark emulates it
    room, _ = available_host_memory(8 << 30)
    assert room is not None and room < 8 << 30  # less this process's resident set
    assert budget == int(room * AUTO_SHARE) // 2 and "2 processes" in text and HOST_MEMORY_ENV in text


def _build() -> nn.Module:
    with torch.device("meta"):
        return CASE.build()


def _param_bytes(dtype: torch.dtype = torch.bfloat16) -> int:
    return sum(p.numel() for p in CASE.build().parameters()) * dtype.itemsize


def test_a_plan_over_its_budget_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    budget = eviction_budget(CASE.build(), torch.bfloat16)
    cfg = engine_config("bf16", budget=budget, host_memory_budget=budget + 1000)  # the cpu device alone fills it
    with pytest.raises(chunkstar.HostMemoryError, match=r"put the optimizer state .* on disk") as info:
        chunkstar.initialize_engine(_build, 0, cfg)
    e = info.value
    assert e.budget == budget + 1000 and e.needed > e.budget
    assert "param chunks" in str(e) and "the cpu virtual device" in str(e) and "host_memory_budget" in str(e)
    # with the state on disk but the param list named out, the advice is the param list
    d = tmp_path / "disk"
    cfg = engine_config(
        "bf16", budget=budget, host_memory_budget=budget + _param_bytes() // 2,
        disk={"path": str(d), "lists": ["master", "exp_avg", "exp_avg_sq"]},
    )  # fmt: skip
    with pytest.raises(chunkstar.HostMemoryError, match=r'put the param chunks on disk too: "disk": \{"lists": \["param"'):
        chunkstar.initialize_engine(_build, 0, cfg)
    assert not d.exists() or not list(d.iterdir())  # nothing was created


def test_left_to_the_engine_the_param_list_goes_on_disk_when_that_is_what_fits(tmp_path: Path) -> None:
    budget = eviction_budget(CASE.build(), torch.bfloat16)
    roomy = budget + 10 * _param_bytes()
    cfg = engine_config("bf16", budget=budget, host_memory_budget=roomy, disk={"path": str(tmp_path / "first")})
    engine, _ = chunkstar.initialize_engine(_build, 0, cfg)
    lists = tuple(ChunkList)
    with_params = host_plan(engine.config, engine.mgr.layout, 0, lists, 0).total
    without = host_plan(engine.config, engine.mgr.layout, 0, lists[1:], 0).total
    engine.close()
    assert with_params < without == engine.stats()["host_memory_planned_bytes"]
    tight = (with_params + without) // 2
    on_disk = {}
    for name, host in (("roomy", roomy), ("tight", tight)):
        cfg = engine_config("bf16", budget=budget, host_memory_budget=host, disk={"path": str(tmp_path / name)})
        engine, _ = chunkstar.initialize_engine(_build, 0, cfg)
        s = engine.stats()
        on_disk[name] = s["params_on_disk"]
        assert s["host_memory_planned_bytes"] <= host == s["host_memory_budget_bytes"]
        assert ("param chunks" in s["host_memory_plan"]) != s["params_on_disk"]
        engine.close()
    assert on_disk == {"roomy": False, "tight": True}
    # and the run it chose trains as the same run without the tier
    torch.manual_seed(5)
    plain = chunkstar.initialize_engine(_build, 0, engine_config("bf16", budget=budget))
    torch.manual_seed(5)
    cfg = engine_config("bf16", budget=budget, host_memory_budget=tight, disk={"path": str(tmp_path / "again")})
    chosen = chunkstar.initialize_engine(_build, 0, cfg)
    assert train_engine(*chosen, CASE, 3, dtype="bf16") == train_engine(*plain, CASE, 3, dtype="bf16")
    chosen[0].close()


def test_bad_budgets_are_config_errors() -> None:
    for bad in ("lots", -5, 0, "1EB"):
        with pytest.raises(chunkstar.ConfigError, match="host_memory_budget"):
            chunkstar.initialize_engine(lambda: nn.Linear(4, 4), 0, engine_config(budget="1MB", host_memory_budget=bad))
