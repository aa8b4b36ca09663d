"""Pinned host buffers (device/pinned.py) against a faked CUDA runtime (issue 17, finding 8).

``torch.cuda.cudart()`` is replaced by a recorder of ``cudaHostRegister`` /
``cudaHostUnregister`` calls, ``torch.cuda.synchronize`` by one that records
its call, and the ``cudaGetLastError`` the module found on the loaded
``libcudart`` by one that records that the error was consumed. They check that
registrations cover whole pages of their own (page-aligned, page-multiple,
never overlapping), that the view handed out has exactly the elements asked
for, that a failed registration is followed by consuming the runtime's last
error before anything else (then PyTorch's pinned allocator serves the
buffer), and that buffers are unregistered only after a device sync.
"""

from __future__ import annotations

import gc
import mmap
from typing import Any

import pytest
import torch

from chunkstar.device import pinned

PAGE = mmap.PAGESIZE


class FakeRuntime:
    def __init__(self, refuse: set[int] | None = None) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.registered: dict[int, int] = {}  # address -> bytes
        self.refuse = refuse or set()  # the indices (0-based) of the registrations to refuse
        self.last_error = 0
        self._n = 0

    # torch.cuda.cudart()'s functions
    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        i, self._n = self._n, self._n + 1
        self.log.append(("register", address, size, flags))
        if i in self.refuse:
            self.last_error = 2  # cudaErrorMemoryAllocation, kept as the thread's last error
            return 2
        for a, s in self.registered.items():
            if address < a + s and a < address + size:
                self.last_error = 712  # cudaErrorHostMemoryAlreadyRegistered
                return 712
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.log.append(("unregister", address))
        if self.registered.pop(address, None) is None:
            self.last_error = 713  # cudaErrorHostMemoryNotRegistered
            return 713
        return 0

    # the libcudart function the module consumes errors with
    def get_last_error(self) -> int:
        self.log.append(("get_last_error",))
        err, self.last_error = self.last_error, 0
        return err

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize", device))


@pytest.fixture
def rt(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(pinned, "_get_last_error_fn", lambda: fake.get_last_error, raising=False)
    # PyTorch's pinned allocator needs a GPU: stand in for it with a marked tensor
    monkeypatch.setattr(pinned, "_torch_pinned", lambda n, dt: _Fallback(n, dt), raising=False)
    return fake


class _Fallback:
    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel, self.dtype = numel, dtype


def _registers(rt: FakeRuntime) -> list[tuple[int, int]]:
    return [(e[1], e[2]) for e in rt.log if e[0] == "register"]


def test_registrations_cover_whole_pages_of_their_own(rt: FakeRuntime) -> None:
    pool = pinned.PinnedBuffers()
    sizes = [(1000, torch.float32), (3, torch.bfloat16), (PAGE // 4, torch.float32), (PAGE + 1, torch.uint8), (7, torch.int64)]
    bufs = [pool.take(n, dt) for n, dt in sizes]
    regs = _registers(rt)
    assert len(regs) == len(sizes)
    assert all(e[3] == 1 for e in rt.log)  # cudaHostRegisterPortable
    for (address, size), t, (n, dt) in zip(regs, bufs, sizes):
        assert address % PAGE == 0 and size % PAGE == 0 and size >= n * dt.itemsize
        assert isinstance(t, torch.Tensor) and t.shape == (n,) and t.dtype == dt and t.is_contiguous()
        assert t.data_ptr() == address  # the exact view starts the registered range
        assert address + n * dt.itemsize <= address + size
    spans = sorted(regs)
    for (a, s), (b, _) in zip(spans, spans[1:]):
        assert a + s <= b  # no page shared by two registrations
    assert len(rt.registered) == len(sizes)  # the driver took every one (no overlap refused)
    assert pool.pinned_bytes == sum(s for _, s in regs)
    for t in bufs:  # ordinary host memory to read and write
        t.fill_(1)
        assert int(t.sum()) == t.numel()
    pool.close()


def test_a_failed_registration_consumes_the_error_then_falls_back(rt: FakeRuntime) -> None:
    rt.refuse = {1}
    pool = pinned.PinnedBuffers()
    a = pool.take(100, torch.float32)
    b = pool.take(200, torch.bfloat16)
    c = pool.take(300, torch.float32)
    kinds = [e[0] for e in rt.log]
    assert kinds == ["register", "register", "get_last_error", "register"]  # consumed at once, on this thread
    assert rt.last_error == 0  # nothing left for a later kernel launch check to report
    assert isinstance(b, _Fallback) and (b.numel, b.dtype) == (200, torch.bfloat16)
    assert isinstance(a, torch.Tensor) and isinstance(c, torch.Tensor)
    assert pool.pinned_bytes == 2 * PAGE
    pool.close()


def test_no_registration_when_the_error_could_not_be_consumed(rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pinned, "_get_last_error_fn", lambda: None)  # no loaded libcudart found
    pool = pinned.PinnedBuffers()
    t = pool.take(64, torch.float32)
    assert isinstance(t, _Fallback) and rt.log == [] and pool.pinned_bytes == 0


def test_close_synchronizes_before_unregistering(rt: FakeRuntime) -> None:
    pool = pinned.PinnedBuffers(torch.device("cuda", 1))
    bufs = [pool.take(n, torch.float32) for n in (10, 5000, 3)]
    addresses = [a for a, _ in _registers(rt)]
    rt.log.clear()
    pool.close()
    assert rt.log[0] == ("synchronize", torch.device("cuda", 1))  # no copy still reads a buffer
    assert sorted(e[1] for e in rt.log[1:]) == sorted(addresses) and all(e[0] == "unregister" for e in rt.log[1:])
    assert rt.registered == {} and pool.pinned_bytes == 0
    rt.log.clear()
    pool.close()  # once only
    assert rt.log == []
    bufs[1].fill_(2.0)  # still referenced: valid pageable memory after close
    assert float(bufs[1].sum()) == 2.0 * 5000


def test_a_collected_pool_synchronizes_then_unregisters(rt: FakeRuntime) -> None:
    pool = pinned.PinnedBuffers()
    pool.take(10, torch.float32)
    rt.log.clear()
    del pool
    gc.collect()
    assert [e[0] for e in rt.log] == ["synchronize", "unregister"] and rt.log[0][1] is None


def test_a_failed_sync_keeps_the_buffers_registered_and_alive(rt: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = pinned.PinnedBuffers()
    t = pool.take(10, torch.float32)

    def broken(device: Any = None) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", broken)
    rt.log.clear()
    pool.close()
    assert rt.log == []  # not unregistered while a copy might still use it
    assert any(k.data_ptr() == t.data_ptr() for k in pinned._KEPT)
    pinned._KEPT.clear()


def test_a_failed_unregister_consumes_its_error(rt: FakeRuntime) -> None:
    pool = pinned.PinnedBuffers()
    pool.take(10, torch.float32)
    rt.registered.clear()  # the driver no longer knows it (say, the context was torn down)
    rt.log.clear()
    pool.close()
    assert [e[0] for e in rt.log] == ["synchronize", "unregister", "get_last_error"] and rt.last_error == 0


def test_page_aligned_memory_without_a_fake() -> None:
    for n, dt in [(1, torch.uint8), (1000, torch.float32), (PAGE, torch.bfloat16)]:
        t, address, size = pinned._page_aligned(n, dt)
        assert address % PAGE == 0 and size % PAGE == 0 and size >= n * dt.itemsize
        assert t.shape == (n,) and t.dtype == dt and t.data_ptr() == address
        assert int(t.count_nonzero()) == 0  # fresh anonymous pages are zero
