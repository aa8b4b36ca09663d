"""The collectives Comm issues under NCCL, with a faked backend (no GPU, no NCCL, no process group).

``torch.distributed``'s collectives are monkeypatched with recorders that do the
collective's effect for world size 2 on CPU (or meta) tensors: the other rank
holds known values (its gathered chunk is this rank's plus 100, its gradients
three times this rank's). The tests check which calls are issued, with which
buffers, that results equal the gloo path's, that the NCCL temporaries are
what ``Comm.gather_scratch_bytes`` / ``reduce_scratch_bytes`` say and are
counted in ``Comm.scratch_bytes_in_flight`` until their ``wait()``, and that
the backend is chosen per device type (``init_process_group()`` with no
backend: ``cpu:gloo,cuda:nccl``). Issue 17, findings 6 and 7.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
import torch.distributed as dist

from chunkstar.distributed import comm as comm_module
from chunkstar.distributed.comm import Comm, DistributedError

WORLD = 2
GPU_STAND_IN = torch.device("meta")  # a non-CPU device type that needs no accelerator


class FakeWork:
    def __init__(self, fail: str | None = None) -> None:
        self.waits = 0
        self.fail = fail

    def wait(self, timeout: Any = None) -> bool:
        self.waits += 1
        if self.fail:
            raise RuntimeError(self.fail)
        return True

    def is_completed(self) -> bool:
        return True


class FakeWorld:
    """Records the collectives and performs them for world size 2; ``rank`` is this process."""

    def __init__(self, rank: int, fail: str | None = None) -> None:
        self.rank = rank
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.works: list[FakeWork] = []
        self.fail = fail

    def _work(self, async_op: bool) -> FakeWork | None:
        w = FakeWork(self.fail)
        self.works.append(w)
        if async_op:
            return w
        w.wait()
        return None

    def _parts(self, own: torch.Tensor) -> list[torch.Tensor]:
        peer = own + 100  # the other rank's chunk
        return [own if r == self.rank else peer for r in range(WORLD)]

    def all_gather_flat(self, out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        self.calls.append(("all_gather_flat", {"out": (out.numel(), out.dtype, out.device), "in": inp.numel()}))
        if not out.is_meta:
            out.copy_(torch.cat(self._parts(inp.reshape(-1))))
        return self._work(async_op)

    def all_gather(self, outs: list[torch.Tensor], inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
        self.calls.append(("all_gather", {"outs": [o.numel() for o in outs]}))
        for o, p in zip(outs, self._parts(inp)):
            o.copy_(p)
        return self._work(async_op)

    def reduce_scatter_flat(
        self, out: torch.Tensor, inp: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False
    ) -> Any:
        shapes = {"out": (out.numel(), out.dtype, out.device), "in": (inp.numel(), inp.dtype)}
        self.calls.append(("reduce_scatter_flat", shapes))
        n = out.numel()
        if not out.is_meta:
            out.copy_((inp * 4)[self.rank * n : (self.rank + 1) * n])  # the other rank's gradients are 3x ours
        return self._work(async_op)

    def all_reduce(self, t: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        self.calls.append(("all_reduce", {"t": (t.numel(), t.dtype, t.device)}))
        if not t.is_meta:
            t.mul_(4)
        return self._work(async_op)

    def names(self) -> list[str]:
        return [c for c, _ in self.calls]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> FakeWorld:
    w = FakeWorld(getattr(request, "param", 0))
    for name in ("all_gather_single", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, w.all_gather_flat, raising=False)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, w.reduce_scatter_flat, raising=False)
    monkeypatch.setattr(dist, "all_gather", w.all_gather)
    monkeypatch.setattr(dist, "all_reduce", w.all_reduce)
    return w


def _chunk(seed: int, n: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ------------------------------------------------------------------ finding 6: flat gather buffers
@pytest.mark.parametrize("world", [0, 1], indirect=True)
def test_gather_under_nccl_writes_one_flat_buffer_then_the_chunks(world: FakeWorld) -> None:
    comm = Comm(world.rank, WORLD, "nccl")
    own = _chunk(0)
    outputs = [torch.full_like(own, -1.0) for _ in range(WORLD)]
    outputs[world.rank] = own  # the own chunk itself: left alone (no temporary for it)
    comm.all_gather_group(outputs, own, what="param chunks 0..1")
    assert world.names() == ["all_gather_flat"]  # not the list all_gather (a flat buffer plus copies inside NCCL)
    assert world.calls[0][1] == {"out": (WORLD * 6, torch.float32, torch.device("cpu")), "in": 6}
    peer = 1 - world.rank
    torch.testing.assert_close(outputs[peer], own + 100)
    assert comm.scratch_bytes_in_flight == 0
    assert comm.scratch_bytes_peak == comm.gather_scratch_bytes(6, torch.float32, own.device) == WORLD * 6 * 4


def test_gather_results_equal_the_gloo_path(world: FakeWorld) -> None:
    own = _chunk(1, n=10, dtype=torch.bfloat16)
    got = {}
    for backend in ("nccl", "gloo"):
        outputs = [torch.empty_like(own) for _ in range(WORLD)]  # as the chunk manager passes them today
        Comm(0, WORLD, backend).all_gather_group(outputs, own, what="x")
        got[backend] = outputs
    assert world.names() == ["all_gather_flat", "all_gather"]
    for a, b in zip(got["nccl"], got["gloo"]):
        assert torch.equal(a, b)
    assert Comm(0, WORLD, "gloo").gather_scratch_bytes(10, torch.bfloat16, torch.device("cpu")) == 0


def test_async_gather_copies_out_in_wait_and_counts_its_scratch_until_then(world: FakeWorld) -> None:
    comm = Comm(0, WORLD, "nccl")
    own = _chunk(2)
    remote = torch.full_like(own, -1.0)
    pending = comm.all_gather_group_async([None, remote], own, what="ahead")
    assert comm.scratch_bytes_in_flight == comm.gather_scratch_bytes(6, torch.float32, own.device) == 48
    assert torch.all(remote == -1.0)  # the chunk's storage is written by wait(), after the collective
    pending.wait()
    torch.testing.assert_close(remote, own + 100)
    assert comm.scratch_bytes_in_flight == 0
    remote.fill_(7.0)
    pending.wait()  # every chunk of the group waits on it: one copy out only
    assert torch.all(remote == 7.0) and world.works[0].waits == 1


# ------------------------------------------------------------------ finding 6: flat reduction buffers
@pytest.mark.parametrize("world", [0, 1], indirect=True)
def test_reduction_under_nccl_copies_into_one_flat_buffer_and_reduce_scatters(
    world: FakeWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    comm = Comm(world.rank, WORLD, "nccl")
    chunks = [_chunk(10 + r, n=8, dtype=torch.bfloat16) for r in range(WORLD)]
    real_cat = torch.cat
    cats: list[int] = []
    monkeypatch.setattr(torch, "cat", lambda ts, *a, **k: cats.append(len(ts)) or real_cat(ts, *a, **k))
    pending = comm.reduce_group_async(chunks, what="param chunks 0..1", dtype=torch.float32)
    assert cats == []  # no per-chunk .to() then cat: each chunk is copied (and converted) into its slice
    assert world.names() == ["reduce_scatter_flat"]
    assert world.calls[0][1] == {"out": (8, torch.float32, torch.device("cpu")), "in": (WORLD * 8, torch.float32)}
    want_scratch = comm.reduce_scratch_bytes(8, torch.float32, torch.device("cpu"))
    assert want_scratch == (WORLD + 1) * 8 * 4 == comm.scratch_bytes_in_flight
    got = pending.wait()
    assert comm.scratch_bytes_in_flight == 0 and comm.scratch_bytes_peak == want_scratch
    assert got.dtype == torch.float32 and got.numel() == 8
    torch.testing.assert_close(got, chunks[world.rank].float() * 4)


@pytest.mark.parametrize("world", [0, 1], indirect=True)
def test_reduction_results_equal_the_gloo_path(world: FakeWorld) -> None:
    chunks = [_chunk(20 + r, n=5, dtype=torch.bfloat16) for r in range(WORLD)]
    nccl = Comm(world.rank, WORLD, "nccl").reduce_group_async(chunks, what="g", dtype=torch.float32).wait()
    gloo_comm = Comm(world.rank, WORLD, "gloo")
    gloo = gloo_comm.reduce_group_async(chunks, what="g", dtype=torch.float32).wait()
    assert world.names() == ["reduce_scatter_flat", "all_reduce"]  # gloo has no reduce-scatter: all-reduce
    assert world.calls[1][1] == {"t": (WORLD * 5, torch.float32, torch.device("cpu"))}
    assert torch.equal(nccl, gloo)
    assert gloo_comm.scratch_bytes_peak == 0
    assert gloo_comm.reduce_scratch_bytes(5, torch.float32, torch.device("cpu")) == 0


def test_reduction_without_dtype_keeps_the_chunks_dtype(world: FakeWorld) -> None:
    chunks = [_chunk(30 + r, n=4, dtype=torch.bfloat16) for r in range(WORLD)]
    got = Comm(0, WORLD, "nccl").reduce_group_async(chunks, what="g").wait()
    assert got.dtype == torch.bfloat16 and world.calls[0][1]["in"] == (WORLD * 4, torch.bfloat16)


def test_a_dropped_pending_returns_its_scratch(world: FakeWorld) -> None:
    comm = Comm(0, WORLD, "nccl")
    chunks = [_chunk(40 + r) for r in range(WORLD)]
    pending = comm.reduce_group_async(chunks, what="g")
    assert comm.scratch_bytes_in_flight > 0
    del pending  # a failed backward drops its reductions unwaited
    gc.collect()
    assert comm.scratch_bytes_in_flight == 0


# ------------------------------------------------------------------ finding 7: the backend per device type
def test_backend_strings_are_read_per_device_type() -> None:
    parse_backends = comm_module.parse_backends
    assert parse_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert parse_backends("NCCL") == {"*": "nccl"}
    assert parse_backends("") == {}
    with pytest.raises(ValueError):
        parse_backends("cpu:gloo,cuda")
    gpu = torch.device("cuda", 1)
    mixed = Comm(0, WORLD, "cpu:gloo,cuda:nccl")
    assert mixed.exchange_device(gpu) == gpu and mixed.on_device(gpu)
    assert mixed.exchange_device(torch.device("cpu")) == torch.device("cpu") and not mixed.on_device(torch.device("cpu"))
    assert mixed.backend_for("cuda") == "nccl" and mixed.backend_for("cpu") == "gloo"
    assert Comm(0, WORLD, "cuda:gloo").exchange_device(gpu) == torch.device("cpu")
    assert mixed.gather_scratch_bytes(100, torch.bfloat16, gpu) == WORLD * 100 * 2
    assert mixed.reduce_scratch_bytes(100, torch.float32, gpu) == (WORLD + 1) * 100 * 4
    assert mixed.gather_scratch_bytes(100, torch.float32, torch.device("cpu")) == 0
    assert mixed.reduce_scratch_bytes(100, torch.float32, torch.device("cpu")) == 0
    assert Comm(0, 1, "nccl").gather_scratch_bytes(100, torch.float32, gpu) == 0  # one process: no collective


@pytest.mark.parametrize("backend_name", ["undefined", "cpu:gloo,cuda:nccl"])
def test_init_process_group_without_a_backend_puts_cuda_tensors_on_nccl(
    monkeypatch: pytest.MonkeyPatch, backend_name: str
) -> None:
    # init_process_group() with no backend: get_backend() says "undefined" (torch 2.13) or
    # "cpu:gloo,cuda:nccl" (older); get_backend_config() has the per-device map
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: WORLD)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend_name)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    comm = Comm.from_environment()
    gpu = torch.device("cuda", 1)
    assert (comm.rank, comm.world_size) == (1, WORLD)
    assert comm.exchange_device(gpu) == gpu  # the gradients stay on the GPU: NCCL
    assert comm.exchange_device(torch.device("cpu")) == torch.device("cpu")


def test_reduce_scatter_is_chosen_by_the_backend_of_the_chunks_device(world: FakeWorld) -> None:
    comm = Comm(0, WORLD, f"cpu:gloo,{GPU_STAND_IN.type}:nccl")  # meta stands in for cuda
    on_gpu = [torch.empty(16, dtype=torch.bfloat16, device=GPU_STAND_IN) for _ in range(WORLD)]
    comm.reduce_group_async(on_gpu, what="g", dtype=torch.float32).wait()
    comm.all_gather_group([None, torch.empty(16, device=GPU_STAND_IN)], torch.empty(16, device=GPU_STAND_IN), what="p")
    on_cpu = [_chunk(50 + r, n=16) for r in range(WORLD)]
    comm.reduce_group_async(on_cpu, what="g").wait()
    comm.all_gather_group([torch.empty(16), torch.empty(16)], on_cpu[0], what="p")
    assert world.names() == ["reduce_scatter_flat", "all_gather_flat", "all_reduce", "all_gather"]
    assert world.calls[0][1]["out"] == (16, torch.float32, GPU_STAND_IN)
    assert world.calls[1][1]["out"] == (WORLD * 16, torch.float32, GPU_STAND_IN)
    assert comm.scratch_bytes_peak == comm.reduce_scratch_bytes(16, torch.float32, GPU_STAND_IN)


# ------------------------------------------------------------------ finding 7: failures
def test_failed_collectives_raise_distributed_error_on_every_wait(world: FakeWorld) -> None:
    world.fail = "NCCL error: remote process exited or there was a network error"
    comm = Comm(0, WORLD, "nccl")
    own = _chunk(60)
    pending = comm.all_gather_group_async([None, torch.empty_like(own)], own, what="param chunks 2..3")
    for _ in range(2):  # each chunk of the group waits: each sees the failure
        with pytest.raises(DistributedError, match="all-gather of param chunks 2..3.*remote process exited"):
            pending.wait()
    assert comm.scratch_bytes_in_flight == 0
    reduce = comm.reduce_group_async([_chunk(61), _chunk(62)], what="param chunks 4..5")
    with pytest.raises(DistributedError, match="gradient reduction of param chunks 4..5"):
        reduce.wait()
    with pytest.raises(DistributedError, match="all-reduce of the gradient norm"):
        comm.all_reduce_sum(torch.ones(1), what="the gradient norm", device=torch.device("cpu"))
    assert comm.scratch_bytes_in_flight == 0


# ------------------------------------------------------------------ the flat path through a real backend
def test_flat_path_through_a_real_backend_equals_the_gloo_path(tmp_path: Any) -> None:
    from ._flat_worker import flat_against_gloo
    from ._spawn import run_ranks

    results = run_ranks(flat_against_gloo, tmp_path, timeout=120)
    assert len(results) == WORLD
    for r in results:
        assert "error" not in r, r
        assert r["gather_equal"] and r["gather_peer_ok"] and r["reduce_equal"], r
        # the largest of: a gather's flat buffer (2 x 37 bf16), a reduction's (2 x 53 + 53 fp32)
        assert r["scratch_peak"] == (WORLD + 1) * 53 * 4 and r["scratch_after"] == 0, r
        assert r["ints"] == [[0, 7, 0], [1, 7, -1]], r
