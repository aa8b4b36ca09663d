"""Collectives over torch.distributed for chunk groups (docs/design.md, 'Many processes').

A chunk *group* is ``world_size`` consecutive chunks of equal size; rank r
owns chunk ``group_start + r``. Before a group is used its param chunks are
all-gathered (every rank contributes its own chunk); after its backward the
gradients are reduced and each rank keeps its own chunk's share.

Note [backend per device type]: a process group may serve each device type
with another backend: ``init_process_group("nccl")`` serves CUDA tensors with
NCCL, ``"gloo"`` CPU (and CUDA) tensors with gloo, and an
``init_process_group()`` without a backend gives ``"cpu:gloo,cuda:nccl"``
(older torch) or ``"cuda:nccl"`` (newer, on a CUDA machine).
:meth:`Comm.from_environment` reads the per-device map
(``dist.get_backend_config()``), and every choice below is made for the
backend that serves the tensors' device type: a collective runs where the
tensors are when NCCL serves their type (:meth:`Comm.exchange_device`), on the
CPU otherwise.

Note [flat group buffers]: under NCCL a group's all-gather writes one flat
temporary of ``world_size`` chunks (``all_gather_single``, before torch 2.13
``all_gather_into_tensor``: NCCL's native layout, no copies inside the
backend), and its slices are copied into the chunks' own device storages once
the collective is done; a reduction copies every chunk into its slice of one
flat buffer in the reduce dtype (the copy converts: no per-chunk ``.to()``
then ``cat``), and the reduce-scatter (``reduce_scatter_single`` /
``reduce_scatter_tensor``) leaves this rank's chunk of the sum in one
chunk-sized output. The chunks' storages are separate tensors (each owns one
persistent storage resized to 0 when it leaves the device), so the temporary
cannot be the chunks themselves. Everything is ordered on the streams (no
host sync): the collective waits on the current stream, ``wait()`` orders the
current stream after the collective, and the copy out of a gather is issued on
the current stream right after, in the pending object's
:meth:`PendingCollective.wait` for an asynchronous gather. The temporaries
stay referenced until then. Their device bytes are what
:meth:`Comm.gather_scratch_bytes` and :meth:`Comm.reduce_scratch_bytes` say
(for budgeting), and :attr:`Comm.scratch_bytes_in_flight` counts those held
by collectives started and not yet waited for. When the exchange device is the
CPU (gloo) the temporaries are host memory and count 0 device bytes.

Note [scratch counted once]: the temporaries are device memory the caching
allocator reports like activations, and budgets count them as scratch (a
gather's joins the room its moment makes, a reduction makes room for its own,
and what is in flight lowers every moment's chunk budget). Counted as non-model
memory too, they were counted twice, and worse, by timing: how many reductions
are still in flight when a moment begins depends on how fast NCCL ran, so the
frozen schedule's check of the live non-model memory against the trace could
find it grown and re-trace on timing alone. So they are counted as scratch
only: the CUDA probe subtracts :attr:`Comm.scratch_bytes_in_flight` as it
subtracts the chunk bytes, and each allocation of a temporary, and its release,
happens inside :attr:`Comm.scratch_edge` (the device memory's window edge, set
by the chunk manager), so no measured peak is set against the scratch of
another instant.

Under gloo (on the CPU) nothing changes: a group's reduction is an all-reduce
of the flat buffer and each rank keeps its own part (twice the traffic, same
result; gloo's reduce-scatter is missing from older torch builds), and a
gather writes the chunks' tensors directly (list ``all_gather``).

Note [failures under NCCL]: under gloo every collective runs under the process
group's timeout and raises when a peer dies (its connection closes) or hangs
past it; that becomes a :class:`DistributedError`. Under NCCL ``wait()`` only
orders the current stream after the collective and returns at once, so a dead
or hung peer is seen by NCCL's watchdog thread, not by the caller: after the
process group's timeout (at once when NCCL reports a remote error) the
watchdog, by default (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), takes the whole
process down, logging the collective that failed; the launcher (torchrun) then
stops the other ranks. No Python exception is raised, and nothing here can turn
that into one without a host sync per collective (which would end the overlap
of gathers and reductions with compute). What this module does: every
collective, the blocking ones too, is waited for through its work object, and
whatever ``wait()`` raises becomes a :class:`DistributedError`; torch's
``WorkNCCL.wait`` raises an error the work already recorded (one the watchdog
found without ending the process, or a blocking wait's timeout). So
``TORCH_NCCL_BLOCKING_WAIT=1`` (every ``wait()`` blocks the host until the
collective is done or the timeout runs out, then raises; no watchdog) gives a
:class:`DistributedError` on every surviving rank, at the cost of that overlap;
``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` makes the watchdog abort the communicators
without ending the process, and the next collective or ``wait()`` raises.
(``Work.exception()`` is not called: it is deprecated, and ``wait()`` already
raises what it holds.) The timeout runs on the host clock from the moment a
collective is queued, so a collective queued behind long device work (a step
under heavy eviction) counts that time too.

This module is mechanism only: *when* to gather or reduce is decided by the
runtime, identically on every rank (from the module order and the warm-up
trace, never from per-rank measurements), so the ranks always agree.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "DistributedError", "PendingCollective", "PendingReduce", "parse_backends"]

_NCCL = "nccl"
_ANY = "*"  # a backend named without device types serves every type it is handed


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the group broke."""


def parse_backends(backend: str) -> dict[str, str]:
    """``{device type: backend}`` from a backend string: ``"cpu:gloo,cuda:nccl"`` (the
    format of ``dist.get_backend_config()``), or a single name (``"nccl"``, ``"gloo"``),
    which serves every device type (key ``"*"``). ``""`` (one process): empty."""
    s = backend.strip().lower()
    if not s:
        return {}
    if ":" not in s:
        return {_ANY: s}
    out: dict[str, str] = {}
    for pair in s.split(","):
        device, sep, name = pair.strip().partition(":")
        if not sep or not device or not name:
            raise ValueError(f"cannot read the backend string {backend!r} (expected 'cpu:gloo,cuda:nccl')")
        out[device.strip()] = name.strip()
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_memory(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.device == b.device and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


class _Pending:
    """A collective in flight: its work object, the buffers it reads and writes (kept
    referenced until :meth:`wait` has run), what :meth:`wait` still has to do once the
    collective is done (``finish``), and its device scratch bytes (counted by its
    :class:`Comm` until :meth:`wait` has run, or until the object is dropped unwaited)."""

    def __init__(
        self,
        work: Any,
        keep: tuple[torch.Tensor, ...],
        comm: Comm,
        what: str,
        scratch: int = 0,
        finish: Callable[[], None] | None = None,
    ) -> None:
        self._work = work
        self._keep = keep
        self._comm = comm
        self._what = what
        self._scratch = scratch
        self._finish = finish
        self._waited = False
        self._error: DistributedError | None = None
        self._lock = threading.Lock()  # one wait() runs the copy out, whichever thread it is on
        if scratch:
            comm._scratch_track(self)

    def done(self) -> bool:
        """The collective itself is done (:meth:`wait` would not block the host). The
        outputs of a gather hold the gathered values only once :meth:`wait` has run."""
        return self._waited or self._error is not None or bool(self._work.is_completed())

    def _wait(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error  # every waiter of a failed collective sees its failure
            if self._waited:
                return
            try:
                self._comm._wait_work(self._work, self._what)
                if self._finish is not None:
                    self._finish()  # stream-ordered after the collective (Note [flat group buffers])
            except DistributedError as e:
                self._error = e
                raise
            except Exception as e:  # the copy out failed (the device is in trouble)
                self._error = self._comm._fail(self._what, e)
                raise self._error from e
            finally:
                # the temporaries go back to the allocator, stream-ordered, as they stop counting
                # as scratch (Note [scratch counted once])
                with self._comm.scratch_edge() if self._scratch else contextlib.nullcontext():
                    self._finish = None
                    self._keep = ()
                    self._release()
            self._waited = True

    def _release(self) -> None:
        if self._scratch:
            self._comm._scratch_untrack(self)
            self._scratch = 0


class PendingCollective(_Pending):
    """A collective in flight (``async_op``), as a chunk's pending event (chunk/chunk.py's
    Note [pending copy]): :meth:`wait` returns once it is done (under NCCL: orders the
    current stream after it, then copies a gather's flat temporary into the outputs,
    Note [flat group buffers]); the buffers it reads and writes stay referenced until then.
    :meth:`wait` may be called any number of times (every chunk of a group waits on it)."""

    def wait(self) -> None:
        self._wait()

    def order(self) -> None:
        """As a copy event's ``order`` (device/copy_engine.py): :meth:`wait`, which under NCCL
        is a stream wait plus the copy out on the current stream (no host sync); under gloo
        the calling thread waits (the CPU is where the collective ran)."""
        self._wait()


class PendingReduce(_Pending):
    """A gradient reduction in flight (``async_op``): :meth:`wait` returns this rank's
    own chunk of the sum; the buffers it reads and writes stay referenced until then."""

    def __init__(
        self, work: Any, result: torch.Tensor, keep: tuple[torch.Tensor, ...], comm: Comm, what: str, scratch: int = 0
    ) -> None:
        super().__init__(work, keep, comm, f"gradient reduction of {what}", scratch)
        self._result = result

    def wait(self) -> torch.Tensor:
        self._wait()
        return self._result


class Comm:
    """The process group as the engine sees it; a single process is world size 1.

    ``backend`` is the process group's backend string: one name (``"nccl"``,
    ``"gloo"``) or a per-device-type map (``"cpu:gloo,cuda:nccl"``, Note [backend
    per device type])."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.backends = parse_backends(backend)
        # the collectives started and not yet waited for that hold device temporaries (Note [flat
        # group buffers]); weak: one dropped unwaited (a failed backward) stops counting by itself
        self._scratch_live: weakref.WeakSet[_Pending] = weakref.WeakSet()
        self._scratch_lock = threading.Lock()
        self.scratch_bytes_peak = 0  # the most scratch_bytes_in_flight was, since reset_scratch_peak()
        self.scratch_edge: Callable[[], ContextManager[None]] = contextlib.nullcontext
        """Entered around each allocation and release of a device temporary (Note [scratch
        counted once]): the chunk manager sets the device memory's window edge."""

    @classmethod
    def from_environment(cls) -> Comm:
        """World size 1 unless torch.distributed is initialised (e.g. under torchrun)."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        backend = ""
        get_config = getattr(dist, "get_backend_config", None)
        if get_config is not None:
            try:
                backend = str(get_config())
            except Exception:  # a process group type that keeps no config
                backend = ""
        try:
            known = bool(parse_backends(backend))
        except ValueError:
            known = False
        if not known:
            backend = str(dist.get_backend())
        return cls(dist.get_rank(), dist.get_world_size(), backend)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    # ------------------------------------------------------------------ the backend per device type
    def backend_for(self, device_type: str) -> str:
        """The backend that serves tensors of ``device_type`` ("" if none does)."""
        b = self.backends
        return b.get(device_type) or b.get(_ANY, "")

    def on_device(self, device: torch.device) -> bool:
        """Collectives take tensors of ``device`` where they are: NCCL serves its type
        (else they go through the CPU)."""
        return self.backend_for(torch.device(device).type) == _NCCL

    def exchange_device(self, device: torch.device) -> torch.device:
        """Where a tensor must be to take part in a collective: ``device`` when NCCL serves
        its device type, else the CPU."""
        return torch.device(device) if self.on_device(device) else torch.device("cpu")

    # ------------------------------------------------------------------ scratch bytes (for budgeting)
    def gather_scratch_bytes(self, numel: int, dtype: torch.dtype, device: torch.device) -> int:
        """Device bytes a group all-gather (:meth:`all_gather_group`, sync or async) holds
        beyond the group's chunks, whose chunks have ``numel`` elements of ``dtype`` on
        ``device``: the flat temporary of ``world_size`` chunks under NCCL, from the start
        of the collective until its ``wait()`` has run (Note [flat group buffers]); 0 when
        the exchange device is the CPU (gloo writes the chunks directly) or with one process."""
        if not self.distributed or not self.on_device(device):
            return 0
        return self.world_size * numel * _elsize(dtype)

    def reduce_scratch_bytes(self, numel: int, dtype: torch.dtype, device: torch.device) -> int:
        """Device bytes a group reduction (:meth:`reduce_group_async`) holds beyond the
        group's chunks, whose chunks have ``numel`` elements, reduced in ``dtype`` (the
        reduce dtype), with this rank's own chunk on ``device``: the flat buffer of
        ``world_size`` chunks and the chunk-sized output under NCCL, from the start until
        its ``wait()`` has run (the output, returned by ``wait()``, lives on until the caller
        drops it); 0 when the exchange device is the CPU (gloo) or with one process."""
        if not self.distributed or not self.on_device(device):
            return 0
        return (self.world_size + 1) * numel * _elsize(dtype)

    @property
    def scratch_bytes_in_flight(self) -> int:
        """Device bytes of the temporaries held by collectives started and not yet waited for
        (:meth:`gather_scratch_bytes` / :meth:`reduce_scratch_bytes` of each): each stops
        counting once its ``wait()`` has run (or it was dropped unwaited). 0 under gloo."""
        if not self._scratch_live:  # one process (asked at every moment): nothing was ever started
            return 0
        with self._scratch_lock:
            return sum(p._scratch for p in list(self._scratch_live))

    def reset_scratch_peak(self) -> None:
        """Start a new :attr:`scratch_bytes_peak` from what is in flight now."""
        now = self.scratch_bytes_in_flight
        with self._scratch_lock:
            self.scratch_bytes_peak = now

    def _scratch_track(self, pending: _Pending) -> None:
        with self._scratch_lock:
            self._scratch_live.add(pending)
            now = sum(p._scratch for p in list(self._scratch_live))
            self.scratch_bytes_peak = max(self.scratch_bytes_peak, now)

    def _scratch_untrack(self, pending: _Pending) -> None:
        with self._scratch_lock:
            self._scratch_live.discard(pending)

    # ------------------------------------------------------------------ failures
    def _fail(self, what: str, err: BaseException) -> DistributedError:
        return DistributedError(
            f"rank {self.rank}/{self.world_size}: {what} failed: a peer rank probably died or hangs "
            f"({type(err).__name__}: {err}). Stopping this rank too; see the other ranks' logs for the first error."
        )

    def _wait_work(self, work: Any, what: str) -> None:
        """``work.wait()``, its failure as a :class:`DistributedError` (Note [failures under
        NCCL]: under NCCL it raises only for an error the work object already recorded)."""
        try:
            if work is not None:
                work.wait()
        except Exception as e:  # gloo/NCCL raise RuntimeError subclasses of their own
            raise self._fail(what, e) from e

    # ------------------------------------------------------------------ group collectives
    def all_gather_group(self, outputs: Sequence[torch.Tensor | None], own: torch.Tensor, what: str) -> None:
        """``outputs[r]`` receives rank r's ``own`` (all the same size). ``outputs[rank]``
        may be ``own`` itself or ``None`` (left alone: it already holds this rank's part)."""
        self.all_gather_group_async(outputs, own, what).wait()

    def all_gather_group_async(
        self, outputs: Sequence[torch.Tensor | None], own: torch.Tensor, what: str
    ) -> PendingCollective:
        """Start :meth:`all_gather_group` and return at once; readers of ``outputs`` (and
        writers of ``own``) wait on the result first. Under NCCL the collective writes a
        flat temporary of ``world_size`` chunks (:meth:`gather_scratch_bytes`), copied into
        ``outputs`` in the result's ``wait()`` (Note [flat group buffers])."""
        label = f"all-gather of {what}"
        n = own.numel()
        try:
            if self.distributed and self.on_device(own.device):
                with self.scratch_edge():  # Note [scratch counted once]
                    flat = torch.empty(self.world_size * n, dtype=own.dtype, device=own.device)
                    scratch = _nbytes(flat)
                    work = _all_gather_flat(flat, own.reshape(-1))
                    keep = (*(o for o in outputs if o is not None), own, flat)
                    return PendingCollective(work, keep, self, label, scratch, lambda: self._copy_out(flat, outputs, own))
            outs = [torch.empty_like(own) if (o is None or _same_memory(o, own)) else o for o in outputs]
            work = dist.all_gather(outs, own, async_op=True)
            return PendingCollective(work, (*outs, own), self, label)
        except DistributedError:
            raise
        except Exception as e:
            raise self._fail(label, e) from e

    def _copy_out(self, flat: torch.Tensor, outputs: Sequence[torch.Tensor | None], own: torch.Tensor) -> None:
        n = own.numel()
        for r, o in enumerate(outputs):
            if o is None or _same_memory(o, own):
                continue
            o.view(-1).copy_(flat[r * n : (r + 1) * n])

    def reduce_group_async(
        self, chunks: Sequence[torch.Tensor], what: str, dtype: torch.dtype | None = None
    ) -> PendingReduce:
        """Start summing ``chunks`` (this rank's copy of every chunk of a group) over ranks
        and return at once; the pending result's ``wait()`` gives this rank's own chunk of
        the sum, in ``dtype`` (default: the chunks'), on ``exchange_device`` of the own
        chunk's device (a copy that is not on it, say an evicted chunk, is moved there).
        The chunks are copied into their slices of one flat buffer first (the copy converts
        to ``dtype``), so they may change or go away while the collective runs. Under NCCL
        it is a reduce-scatter (its device bytes: :meth:`reduce_scratch_bytes`),
        elsewhere an all-reduce of the flat buffer on the CPU."""
        own = chunks[self.rank]
        where = self.exchange_device(own.device)
        dtype = own.dtype if dtype is None else dtype
        n = own.numel()
        try:
            if self.on_device(where):
                with self.scratch_edge():  # Note [scratch counted once]
                    flat = torch.empty(len(chunks) * n, dtype=dtype, device=where)
                    for r, c in enumerate(chunks):
                        flat[r * n : (r + 1) * n].copy_(c.reshape(-1))
                    out = torch.empty(n, dtype=dtype, device=where)
                    scratch = _nbytes(flat) + _nbytes(out)
                    work = _reduce_scatter_flat(out, flat)
                    return PendingReduce(work, out, (flat,), self, what, scratch)
            flat = torch.empty(len(chunks) * n, dtype=dtype, device=where)
            for r, c in enumerate(chunks):
                flat[r * n : (r + 1) * n].copy_(c.reshape(-1))
            work = dist.all_reduce(flat, async_op=True)
            return PendingReduce(work, flat[self.rank * n : (self.rank + 1) * n], (flat,), self, what)
        except Exception as e:
            raise self._fail(f"gradient reduction of {what}", e) from e

    # ------------------------------------------------------------------ small agreements
    def all_gather_ints(self, values: Sequence[int], what: str, device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` (int64s, the same count on every rank), indexed by rank.

        For small agreements (start-up fingerprints, checkpoint identities): one
        all-gather of an int64 tensor, on ``device`` under NCCL (it only moves CUDA
        tensors), on the CPU under gloo. World size 1 returns ``[values]``."""
        if not self.distributed:
            return [list(values)]
        own = torch.tensor(list(values), dtype=torch.int64, device=self.exchange_device(device))
        outs = [torch.empty_like(own) for _ in range(self.world_size)]
        self.all_gather_group(outs, own, what)
        return [[int(v) for v in t.tolist()] for t in outs]

    def all_reduce_sum(self, t: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
        """Sum ``t`` over ranks; the sum lies on ``exchange_device(device)`` (``device``
        is the engine's: NCCL reduces CUDA tensors only, gloo here CPU ones)."""
        return self._all_reduce(t, what, device, None)

    def all_reduce_max(self, t: torch.Tensor, what: str, device: torch.device) -> torch.Tensor:
        """Element-wise maximum of ``t`` over ranks (flags and figures every rank must agree on)."""
        return self._all_reduce(t, what, device, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, what: str, device: torch.device, op: Any) -> torch.Tensor:
        if not self.distributed:
            return t
        t = t.to(self.exchange_device(device))
        label = f"all-reduce of {what}"
        try:
            work = dist.all_reduce(t, async_op=True) if op is None else dist.all_reduce(t, op=op, async_op=True)
        except Exception as e:
            raise self._fail(label, e) from e
        self._wait_work(work, label)
        return t


def _elsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor) -> Any:
    """The flat-output all-gather, asynchronous: ``all_gather_single`` where torch has it
    (2.13 deprecates ``all_gather_into_tensor`` in its favour), else ``all_gather_into_tensor``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, async_op=True)


def _reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor) -> Any:
    """The flat-input reduce-scatter (sum), asynchronous: ``reduce_scatter_single`` where torch
    has it, else ``reduce_scatter_tensor``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, async_op=True)
