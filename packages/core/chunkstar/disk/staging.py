"""The host staging buffers of the disk tier: a bounded, reusing pool for chunks between disk and optimizer.

Mechanism only. With the optimizer state on disk, host memory holds only the
chunks on their way: read ahead and waiting for the optimizer, being updated,
or waiting for their write-behind. :class:`StagingBuffers` bounds those bytes:
:meth:`~StagingBuffers.take` blocks until the budget has room, so a read-ahead
can never run host memory out, and :meth:`~StagingBuffers.give_back` (the
write-behind's ``then``, typically) makes the room again. How far ahead to read
is the runtime's policy; this pool only says "not yet".

Freed buffers are kept and handed out again to a request of the same size: a
fresh 64 MiB buffer page-faults on first touch (about as long as reading it
from a fast disk), a reused one does not. Kept buffers count against the
budget too, so what the pool holds, lent or kept, never exceeds it; a request
that fits only once kept buffers of other sizes are dropped drops them.
Requests are served in the order they arrive, so a large one is not starved
by a stream of small ones. ``aligned=True`` makes every buffer start at a
multiple of 4096 bytes, as ``O_DIRECT`` needs (each then costs up to 4 KiB
more than its size, not counted in the budget). ``device="meta"`` lends
buffers with no bytes (a dry run: Note [dry run disk] in
:mod:`chunkstar.dryrun.disk`), budgeted and waited for exactly as real ones.
Thread-safe.

Note [all or nothing]: a taker that needs several buffers at once (an update
stages a chunk's, or a slice's, lists together) takes them in one
:meth:`~StagingBuffers.take_all`, never one by one. Two takers each holding
part of what they need and waiting for the rest is a deadlock: the tier's step
thread holding a slice's param buffer and waiting for its moment's, while the
forward waits for room for a whole param chunk, stopped a run with a budget of
the least that works; neither could give back what the other waited for.

A taker waits for buffers that transfers give back; once a transfer has
failed, :meth:`~StagingBuffers.fail` makes every waiting and later
:meth:`~StagingBuffers.take` raise that failure instead of waiting (the run
is failing: the step must hear of it, not wait for room that may never come).
"""

from __future__ import annotations

import collections
import threading
import time

import torch

from chunkstar.device.copy_engine import relayed
from chunkstar.disk.blockio import aligned_empty
from chunkstar.errors import _fmt as _fmt_bytes

__all__ = ["StagingBuffers"]


class StagingBuffers:
    """At most ``budget_bytes`` of host buffers (lent and kept together); see the module docstring."""

    def __init__(self, budget_bytes: int, *, aligned: bool = False, device: str = "cpu") -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes}: expected > 0")
        if device not in ("cpu", "meta"):
            raise ValueError(f"device={device!r}: staging buffers are host memory ('cpu'), or 'meta' for a dry run")
        self.budget_bytes = budget_bytes
        self.aligned = aligned and device == "cpu"
        self.device = device
        self._cond = threading.Condition()
        # nbytes -> kept buffers (1-D uint8, host), the sizes given back longest ago first
        self._kept: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._lent: dict[int, tuple[int, torch.Tensor]] = {}  # _key -> (nbytes, the uint8 buffer under the view)
        self._queue: collections.deque[object] = collections.deque()  # waiting takers, first come first served
        self._in_use = 0
        self._kept_bytes = 0
        self._failure: BaseException | None = None  # what take raises once the pool has failed
        self.peak_in_use_bytes = 0
        self.allocations = 0
        """Buffers allocated so far (a take served by a kept buffer allocates none)."""

    @property
    def in_use_bytes(self) -> int:
        """Bytes lent out now."""
        with self._cond:
            return self._in_use

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds now, lent or kept for reuse (never more than the budget)."""
        with self._cond:
            return self._in_use + self._kept_bytes

    def take(self, nbytes: int, dtype: torch.dtype = torch.uint8, *, timeout: float | None = None) -> torch.Tensor:
        """A 1-D host tensor of ``nbytes`` bytes of ``dtype`` (uninitialised, or a previous
        chunk's bytes), once the budget has room for it; ``TimeoutError`` after ``timeout`` s,
        and the failure given to :meth:`fail` (relayed: its type kept) once there is one."""
        return self.take_all([(nbytes, dtype)], timeout=timeout)[0]

    def take_all(self, wanted: list[tuple[int, torch.dtype]], *, timeout: float | None = None) -> list[torch.Tensor]:
        """One buffer for each ``(nbytes, dtype)`` of ``wanted``, all at once, once the budget has
        room for all of them (Note [all or nothing]); otherwise as :meth:`take`."""
        for nbytes, dtype in wanted:
            itemsize = torch.empty((), dtype=dtype).element_size()
            if nbytes <= 0 or nbytes % itemsize:
                raise ValueError(f"take: {nbytes} bytes is not a positive whole number of {dtype} elements")
        total = sum(n for n, _ in wanted)
        if total > self.budget_bytes:
            raise ValueError(
                f"take: staging buffers of {_fmt_bytes(total)} ({total} bytes) at once cannot fit the staging budget of "
                f"{_fmt_bytes(self.budget_bytes)} ({self.budget_bytes} bytes): raise the budget to at least one chunk "
                f"(several, for read-ahead to overlap), or use smaller chunks"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        token = object()
        with self._cond:
            self._queue.append(token)
            try:
                while True:
                    if self._failure is not None:
                        raise relayed(self._failure)
                    if self._queue[0] is token and self._in_use + total <= self.budget_bytes:
                        break
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"take: waited {timeout} s for {total} bytes of staging; {self._in_use} of "
                            f"{self.budget_bytes} bytes are lent out and not given back"
                        )
                    self._cond.wait(left)
                # the room for all of them is there: each reuses a kept buffer of its size, or drops
                # kept ones until a new one fits (it can: the whole request fits beside what is lent)
                found: list[torch.Tensor | None] = []
                for nbytes, _ in wanted:
                    found.append(self._reuse(nbytes))
                    self._in_use += nbytes
                self.peak_in_use_bytes = max(self.peak_in_use_bytes, self._in_use)
            finally:
                self._queue.remove(token)
                self._cond.notify_all()  # the next in line may fit now
        out = []
        for (nbytes, dtype), buf in zip(wanted, found):
            if buf is None:
                # Outside the lock: allocating maps memory (no page is touched yet). The room is
                # already reserved, so nothing else can overrun the budget meanwhile.
                buf = aligned_empty(nbytes) if self.aligned else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                with self._cond:
                    self.allocations += 1
            with self._cond:
                self._lent[_key(buf)] = (nbytes, buf)
            out.append(buf.view(dtype))
        return out

    def _reuse(self, nbytes: int) -> torch.Tensor | None:
        """A kept buffer of exactly ``nbytes``, or None after dropping kept buffers of other
        sizes (oldest sizes first) until a new one fits the budget. Called holding the lock."""
        same = self._kept.get(nbytes)
        if same:
            self._kept_bytes -= nbytes
            buf = same.pop()
            if not same:
                del self._kept[nbytes]
            return buf
        while self._in_use + self._kept_bytes + nbytes > self.budget_bytes:
            size, bufs = next(iter(self._kept.items()))
            bufs.pop()
            self._kept_bytes -= size
            if not bufs:
                del self._kept[size]
        return None

    def give_back(self, t: torch.Tensor) -> None:
        """Return a buffer :meth:`take` lent (any view of the same first byte), to be reused."""
        with self._cond:
            entry = self._lent.pop(_key(t), None)
            if entry is None:
                raise ValueError("give_back: this tensor was not lent by this staging pool, or was given back already")
            nbytes, buf = entry
            self._in_use -= nbytes
            self._kept.setdefault(nbytes, []).append(buf)
            self._kept.move_to_end(nbytes)  # the sizes in use now are dropped last
            self._kept_bytes += nbytes
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Make every :meth:`take`, waiting now or later, raise ``error`` (the first one given
        is kept). Buffers still come back by :meth:`give_back`."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    @property
    def failure(self) -> BaseException | None:
        """The error given to :meth:`fail`, None while the pool works."""
        with self._cond:
            return self._failure

    def release_kept(self) -> None:
        """Free the kept buffers (lent ones stay lent)."""
        with self._cond:
            self._kept.clear()
            self._kept_bytes = 0

    def __repr__(self) -> str:
        return (
            f"StagingBuffers(budget={self.budget_bytes}, in_use={self._in_use}, kept={self._kept_bytes}, "
            f"aligned={self.aligned})"
        )


def _key(t: torch.Tensor) -> int:
    """What names a lent buffer, given it or a view of it: its first byte's address; on meta,
    where every address is 0 (and a view of another dtype has no ``_base``), the storage
    under it, which the buffer keeps alive while lent."""
    if t.device.type != "meta":
        return t.data_ptr()
    return int(t.untyped_storage()._cdata)
