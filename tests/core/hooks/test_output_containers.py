"""Tensors inside any container a module returns or takes (Note [output containers] in
chunkstar/hooks/module_hooks.py).

A parameter-owning submodule that returns a plain dataclass used to get no backward
hook, and its backward read parameters that had moved (``setStorage: ... storage of
size 0``) at the first step after the warm-up. Each container kind trains under a
budget that forces eviction and is compared with plain PyTorch; the same runs again
in a fresh process without ``transformers`` imported, since what a walk by pytree
registrations finds depends on what the process imported. What no walk can open is
refused at the first forward, naming the module.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import chunkstar
from chunkstar.device.memory import METER_ENV
from chunkstar.hooks.module_hooks import output_tensors, substitute

from tests.core._budget import measured_budget  # the repository root is on the path: the check process puts it there


@dataclasses.dataclass
class PlainOut:
    h: torch.Tensor
    aux: torch.Tensor


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    h: torch.Tensor
    aux: torch.Tensor
    scale: float = 1.0
    doubled: torch.Tensor = dataclasses.field(init=False)  # set by __post_init__

    def __post_init__(self) -> None:
        object.__setattr__(self, "doubled", 2 * self.aux)


class TupleOut(NamedTuple):
    h: torch.Tensor
    aux: torch.Tensor


class Registered:
    """A class of the user's, made a pytree node (neither a dataclass nor a Mapping)."""

    def __init__(self, h: torch.Tensor, aux: torch.Tensor) -> None:
        self.h, self.aux = h, aux


pytree.register_pytree_node(
    Registered, lambda r: ([r.h, r.aux], None), lambda items, _ctx: Registered(*items),
    serialized_type_name="test_output_containers.Registered",
)  # fmt: skip


class Opaque:
    """Holds tensors, but is no container anything could know how to open."""

    def __init__(self, h: torch.Tensor, aux: torch.Tensor) -> None:
        self.h, self.aux = h, aux


def _wrap(kind: str, h: torch.Tensor, aux: torch.Tensor) -> Any:
    if kind == "dataclass":
        return PlainOut(h, aux)
    if kind == "frozen_dataclass":
        return FrozenOut(h, aux)
    if kind == "namedtuple":
        return TupleOut(h, aux)
    if kind == "nested":
        return {"out": [h, {"aux": [aux]}], "n": 1}
    if kind == "registered":
        return Registered(h, aux)
    assert kind == "opaque"
    return Opaque(h, aux)


def _unwrap(kind: str, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "nested":
        return out["out"][0], out["out"][1]["aux"][0]
    if kind == "frozen_dataclass":
        return out.h, out.doubled / 2
    return out.h, out.aux


class Block(nn.Module):
    """Owns a parameter directly (so it is hooked) and returns a container of ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.randn(32, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x)) @ self.w
        return _wrap(self.kind, h, h.square().mean())


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(Block(kind) for _ in range(4))
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for block in self.blocks:
            h, a = _unwrap(self.kind, block(x))
            x, aux = x + h, aux + a
        return (self.out(x).squeeze(-1), aux)


KINDS = ["dataclass", "frozen_dataclass", "namedtuple", "nested", "registered"]


def _build(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(kind)


def _config(budget: int) -> dict[str, Any]:
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "device": "cpu",
        "device_memory_budget": budget,
        "default_chunk_size": 1100,
    }


def _loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    pred, aux = out
    return (pred - y).square().mean() + 0.1 * aux


def train_and_compare(kind: str, steps: int = 5) -> None:
    """``steps`` steps of the engine under a budget that forces eviction, against PyTorch."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randn(16, generator=g)) for _ in range(steps)]
    ref = _build(kind)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    want = []
    for x, y in data:
        loss = _loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())

    budget = measured_budget(lambda: _build(kind), _config, lambda e, _o: e.backward(_loss(e(data[0][0]), data[0][1])))

    engine, optimizer = chunkstar.initialize_engine(lambda: _build(kind), 0, _config(budget))
    got = []
    for x, y in data:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    stats = engine.stats()
    assert stats["schedule"] == "frozen"  # the steps after the warm-up ran, where the crash was
    assert stats["chunk_moves_to_host"] > 0
    if os.environ.get(METER_ENV) == "1":  # the meter sees every step (else only the warm-up)
        assert stats["device_peak_bytes"] <= stats["device_budget_bytes"]
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_container_outputs_train_like_pytorch_under_eviction(kind: str) -> None:
    train_and_compare(kind)


def test_in_a_fresh_process_without_transformers_or_the_meter() -> None:
    """The same runs in a fresh process that never imports transformers, with the device
    meter off: the meter's dispatch mode, active through every backward, hid the crash
    (the suite runs with it on), as an import can change what a pytree walk finds."""
    script = (
        "import sys\n"
        "import test_output_containers as t\n"
        "for kind in t.KINDS:\n"
        "    t.train_and_compare(kind)\n"
        "assert 'transformers' not in sys.modules, 'the check needs a process without transformers'\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != METER_ENV}
    here = Path(__file__)
    env["PYTHONPATH"] = os.pathsep.join([str(here.parent), str(here.parents[3]), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]


def test_an_output_nothing_can_open_is_refused_naming_the_module() -> None:
    engine, _ = chunkstar.initialize_engine(lambda: _build("opaque"), 0, _config(1 << 30))
    with pytest.raises(TypeError, match=r"module 'blocks\.0' returned an object of type .*Opaque.*register_pytree_node"):
        engine(torch.randn(4, 32))


# ---------------------------------------------------------------------------- the walk itself


def test_walk_finds_every_tensor_and_rebuilds_each_container_as_its_type() -> None:
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    a2, b2, c2 = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    subs = {id(a): a2, id(b): b2, id(c): c2}
    cases: list[Any] = [
        PlainOut(a, b),
        TupleOut(a, b),
        Registered(a, b),
        {"x": [a, (b, {"y": c})], "n": None},
        collections.OrderedDict(x=a, y=[b]),
        collections.defaultdict(list, x=[a]),
        torch.max(torch.stack([a, a]), 0),  # torch.return_types.max: a pytree-registered tuple
        collections.deque([a, b]),
        [PlainOut(a, TupleOut(b, c))],
    ]
    for obj in cases:
        found = list(output_tensors(obj, refuse="m"))
        assert found and all(t is not None for t in found)
        new = substitute(obj, subs)
        assert type(new) is type(obj)
        assert all(id(t) not in subs for t in output_tensors(new)), obj  # every tensor replaced
        assert len(list(output_tensors(new))) == len(found)
    frozen = FrozenOut(a, b)
    new = substitute(frozen, subs)
    assert type(new) is FrozenOut and new.h is a2 and new.aux is b2
    assert list(output_tensors(frozen)) == [a, b, frozen.doubled]
    assert substitute(defaultdict_case := collections.defaultdict(list, x=[a]), subs).default_factory is list
    assert defaultdict_case["x"][0] is a  # the original is left alone
    dc = PlainOut(torch.ones(1), b)
    assert substitute(dc, {}) is dc  # nothing replaced: the same object


def test_walk_refuses_unknown_objects_only_where_told() -> None:
    t = torch.ones(1)
    assert list(output_tensors((Opaque(t, t), t))) == [t]  # inputs: opaque objects are skipped
    assert list(output_tensors((None, 1, 2.0, "s", torch.float32, torch.device("cpu"), t), refuse="m")) == [t]
    with pytest.raises(TypeError, match="module 'm' returned"):
        list(output_tensors({"o": Opaque(t, t)}, refuse="m"))


def test_a_model_output_is_rebuilt_as_itself() -> None:
    """Hugging Face's ``ModelOutput`` is a dict and a dataclass; imported here only, so the
    fresh-process test above runs without it."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    a, a2 = torch.ones(1), torch.zeros(1)
    out = modeling_outputs.BaseModelOutput(last_hidden_state=a, hidden_states=(a,))
    assert list(output_tensors(out, refuse="m")) == [a, a]
    new = substitute(out, {id(a): a2})
    assert type(new) is type(out) and new.last_hidden_state is a2 and new["hidden_states"][0] is a2
    assert out.last_hidden_state is a
