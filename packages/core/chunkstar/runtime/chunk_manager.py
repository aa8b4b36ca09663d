"""The chunk store: the one owner of the chunks, the tensor states and the byte counters,
and the one place that acts on placement (residency, budgets, moves).

The manager owns the four chunk lists (:class:`chunkstar.chunk.lists.ChunkList`),
every tensor's state and the derived counts of those states, the index of the
chunks on the device, and the byte counters (each kept in one place: ``move``,
``_gather``, ``release_group``, ``allocate_on_host``). Others reach the chunks
through a narrow door (``chunk``, ``chunks_of``, ``slot_view``; the optimizer
and the checkpoint code see only the :class:`chunkstar.chunk.store.ChunkStore`
Protocol) and ask for what they need (``make_resident``, ``set_state``,
``to_host``, ``offload``, ``prefetch``, ``make_room``). It asks the pure
policies in :mod:`chunkstar.placement` what to evict and prefetch, hands the
copies to its copy engine (:mod:`chunkstar.device`) and emits events. It also
swaps each parameter's class when its tensor enters or leaves COMPUTE (Note
[parameter guard] in :mod:`chunkstar.hooks.param_guard`). It reads the
iteration's :class:`chunkstar.runtime.cursor.Cursor` and never writes it.

Note [budget per moment]: the device holds chunks *and* non-model data
(activations, temporaries). The chunk budget of a moment is the capacity minus
the non-model bytes expected during that moment: measured live during warm-up,
read from the warm-up trace afterwards. Room is made when a moment begins,
i.e. before that moment's activations are allocated, so a moment never has to
evict while its own module is running.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Iterator, Sequence

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.lists import CHUNK_LISTS, STATE_LISTS, ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState, check_tensor_transition
from chunkstar.config import EvictionPolicyName
from chunkstar.device.copy_engine import CopyEngine, SerialCopies
from chunkstar.device.memory import DeviceMemory
from chunkstar.device.pinned import PinnedBuffers
from chunkstar.distributed.comm import Comm
from chunkstar.errors import ChunkStateError, DeviceMemoryError
from chunkstar.events import ChunkAllocated, ChunkFreed, ChunkMoved, EventBus, MemorySample, MoveReason, Stage, Tier
from chunkstar.memory.budget import chunk_budget, minimum_budget, room_target
from chunkstar.memory.probes import MemoryProbe
from chunkstar.memory.tracer import MemoryTrace, ScheduleMode
from chunkstar.placement.eviction import ResidentChunk, choose_evictions
from chunkstar.placement.prefetch import PrefetchView, Upcoming, plan_prefetch
from chunkstar.runtime.cursor import Cursor
from chunkstar.runtime.disk_tier import DiskTier

__all__ = ["ChunkManager", "Key"]

_PARAM = ChunkList.PARAM

Key = tuple[ChunkList, int]

_COMPUTE, _HOLD_AFTER_FWD, _HOLD_AFTER_BWD = TensorState.COMPUTE, TensorState.HOLD_AFTER_FWD, TensorState.HOLD_AFTER_BWD


def _legal(old: TensorState, new: TensorState) -> bool:
    try:
        check_tensor_transition("", old, new)
    except ChunkStateError:
        return False
    return True


# (id(old), id(new)) of every transition check_tensor_transition allows (the one definition
# stays in chunk/state.py): set_state's fast test, with the check itself for the error
_LEGAL_TRANSITIONS = frozenset((id(a), id(b)) for a in TensorState for b in TensorState if _legal(a, b))


def _keys(name: ChunkList, ids: Iterable[int]) -> list[Key]:
    """``(name, id)`` for ``ids`` in ascending order."""
    return [(name, cid) for cid in sorted(ids)]


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        compute_dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        policy: EvictionPolicyName,
        probe: MemoryProbe,
        events: EventBus,
        comm: Comm | None = None,
        copies: CopyEngine | None = None,
        cursor: Cursor | None = None,
        slack: float = 0.0,
    ) -> None:
        self.layout = layout
        self.comm = comm or Comm()
        self.device = device
        self.capacity = capacity
        self.policy = policy
        self.probe = probe
        self.events = events
        # param chunks travel every step on a CUDA device: their host buffers are pinned, exactly
        # sized (device/pinned.py); state chunks travel once at most and stay in plain memory
        self.pinned_buffers = PinnedBuffers(device) if device.type == "cuda" else None
        # every device payload grows and shrinks through it: the bytes the device really holds
        # for chunks, frees deferred until their copy is done (Note [deferred free]), the meter.
        # Payloads come from the allocator the activations use, so the bytes an eviction frees
        # can hold activations (a private pool would keep them for chunks only).
        self.memory = DeviceMemory(device)
        self.memory.limit = capacity
        self.memory.where = lambda: f"moment {self._cur.moment} '{self._cur.module}' ({self._cur.stage.value})"
        probe.attach(self.memory)
        self.compute_dtype = compute_dtype
        # the chunks of the four lists (chunk/lists.py), by list then chunk id: the store's own,
        # reached from outside through chunk(), chunks_of() and slot_view() only. A frozen
        # chunk has its param chunk only (Note [frozen chunks] in chunk/layout.py).
        self._chunks: dict[ChunkList, dict[int, Chunk]] = {
            name: {
                i: Chunk(i, name.value, n, compute_dtype if name is _PARAM else torch.float32, device,
                         self.pinned_buffers if name is _PARAM else None, self.memory)  # fmt: skip
                for i, n in enumerate(layout.chunk_sizes)
                if name is _PARAM or i not in layout.frozen
            }
            for name in CHUNK_LISTS
        }
        self._param_chunks = list(self._chunks[_PARAM].values())  # by chunk id: the list hot paths read
        self.slots: tuple[TensorSlot, ...] = layout.slots
        self.states: list[TensorState] = [TensorState.FREE] * len(layout.slots)
        # derived caches of the states, kept by set_state only, per param chunk: tensors in
        # COMPUTE (the chunk is pinned), in HOLD_AFTER_FWD and in HOLD_AFTER_BWD (gradients),
        # so per-step work visits the chunks that have such tensors, not every slot
        self._compute_count: list[int] = [0] * layout.n_chunks
        self._fwd_count: list[int] = [0] * layout.n_chunks
        self._grad_count: list[int] = [0] * layout.n_chunks
        self._chunk_of: list[int] = [s.chunk_id for s in layout.slots]  # by slot index
        self._slots_by_chunk: list[list[TensorSlot]] = [[] for _ in range(layout.n_chunks)]
        for s in layout.slots:
            self._slots_by_chunk[s.chunk_id].append(s)
        # derived from the chunks' locations, kept by _on_resident/_on_left_device only: ids of
        # the chunks on the device per list, the only ones make_room looks at (eviction candidates)
        self._on_device: dict[ChunkList, set[int]] = {name: set() for name in CHUNK_LISTS}
        self._own_param_chunks = sum(1 for i in range(layout.n_chunks) if layout.owner(i) == self.comm.rank)

        # how chunk payloads travel (CUDA streams, the CPU copy thread, or serial): chunk.py's
        # Note [pending copy]; set by the engine from the config (overlap, device_link_bandwidth)
        self.copies: CopyEngine = SerialCopies() if copies is None else copies
        # the iteration's cursor (stage, moment, trace, ...): read here, written by the schedule only
        self._cur = Cursor() if cursor is None else cursor
        # fraction of the device budget kept free (config device_memory_slack): capacity = budget * (1 - slack)
        self.slack = slack
        # Set by the schedule during warm-up: a moment that does not fit is let through and
        # its chunk bytes (with everything pinned) kept here, instead of raising at once.
        self.measuring_shortfall = False
        self.required_peak = 0
        # Parameter objects by slot, with their plain and guarded classes (Note [parameter guard]);
        # set_state swaps the class when a tensor enters or leaves COMPUTE.
        self._guard: list[tuple[torch.Tensor, type, type]] = []
        self._clock = 0
        self._last_use: dict[Key, int] = {}

        self.device_chunk_bytes = 0
        self.device_chunk_bytes_peak = 0
        self.host_chunk_bytes = 0
        self.moves_to_device = 0
        self.moves_to_host = 0
        self.bytes_to_device = 0
        self.bytes_to_host = 0
        self.moves_by_reason: dict[str, int] = {r.value: 0 for r in MoveReason}
        self.clean_evictions = 0  # evictions of clean param chunks: no bytes copied (Note [clean host copy])
        # sum of the parameters' version counters of each clean param chunk when it was loaded
        self._clean_versions: dict[int, int] = {}
        self._chunk_params: list[list[torch.Tensor]] = [[] for _ in range(layout.n_chunks)]
        self.disk: DiskTier | None = None  # the disk tier, when the config has one (attach_disk)
        self.gathers = 0  # all-gathers of a chunk group (several processes only)
        self.gathers_ahead = 0  # of them started a moment early (Note [gather ahead])
        self.gathered_groups: set[int] = set()  # first chunk ids of groups whose remote copies are here
        self.bytes_gathered = 0  # remote bytes received by them

    # ------------------------------------------------------------------ the chunks: the narrow door
    def chunk(self, which: ChunkList, chunk_id: int) -> Chunk:
        """Chunk ``chunk_id`` of list ``which`` (its payload, buffers and pending copies)."""
        try:
            return self._chunks[which][chunk_id]
        except KeyError:
            if chunk_id in self.layout.frozen:
                raise ChunkStateError(
                    f"chunk {chunk_id} holds frozen parameters (requires_grad=False): it has a param chunk only, "
                    f"no {which.value} chunk"
                ) from None
            raise

    def lists_of(self, chunk_id: int) -> tuple[ChunkList, ...]:
        """The lists chunk ``chunk_id`` has: all four, or the param list of a frozen chunk."""
        return (_PARAM,) if chunk_id in self.layout.frozen else CHUNK_LISTS

    def frozen(self, chunk_id: int) -> bool:
        """Chunk ``chunk_id`` holds frozen parameters: no master, no Adam state, no gradients."""
        return chunk_id in self.layout.frozen

    def value_view(self, slot: TensorSlot) -> torch.Tensor:
        """1-D view of ``slot``'s authoritative value: its fp32 master, or for a frozen
        parameter its param slot (in the compute dtype; it has no master)."""
        which = _PARAM if slot.chunk_id in self.layout.frozen else ChunkList.MASTER
        return self._chunks[which][slot.chunk_id].payload[slot.offset : slot.end]

    def chunks_of(self, which: ChunkList) -> Sequence[Chunk]:
        """Every chunk of list ``which``, by chunk id (read-only); a state list has none for frozen chunks."""
        return tuple(self._chunks[which].values())

    def slot_view(self, which: ChunkList, slot: TensorSlot) -> torch.Tensor:
        """1-D view of ``slot``'s elements in its chunk of list ``which`` (where the payload is now)."""
        return self._chunks[which][slot.chunk_id].payload[slot.offset : slot.end]

    def param_slot_view(self, slot: TensorSlot) -> torch.Tensor:
        """``slot_view(ChunkList.PARAM, slot)`` for the per-gradient path (one lookup fewer)."""
        return self._param_chunks[slot.chunk_id].payload[slot.offset : slot.end]

    def nbytes(self, which: ChunkList, chunk_id: int) -> int:
        return self._chunks[which][chunk_id].nbytes

    def paused_probe(self) -> contextlib.AbstractContextManager[None]:
        """The non-model memory probe paused: the store's own work is model memory."""
        return self.probe.paused()

    # ------------------------------------------------------------------ the cursor, read-only
    @property
    def trace(self) -> MemoryTrace:
        return self._cur.trace

    @property
    def stage(self) -> Stage:
        return self._cur.stage

    @property
    def moment(self) -> int:
        return self._cur.moment

    @property
    def module(self) -> str:
        return self._cur.module

    @property
    def mode(self) -> ScheduleMode:
        return self._cur.mode

    # ------------------------------------------------------------------ states
    def set_state(self, index: int, new: TensorState) -> None:
        # hot: about five calls per parameter per step, so enum members are compared by
        # identity and legal transitions looked up by id (Enum.__hash__ is Python code)
        old = self.states[index]
        if old is new:
            return
        if (id(old), id(new)) not in _LEGAL_TRANSITIONS:
            check_tensor_transition(self.slots[index].name, old, new)  # raises, naming the parameter
        cid = self._chunk_of[index]
        if old is _COMPUTE:
            self._compute_count[cid] -= 1
            if self._guard:
                p, _, guarded = self._guard[index]
                p.__class__ = guarded
        elif old is _HOLD_AFTER_FWD:
            self._fwd_count[cid] -= 1
        elif old is _HOLD_AFTER_BWD:
            self._grad_count[cid] -= 1
        if new is _COMPUTE:
            self._compute_count[cid] += 1
            if self._guard:
                p, base, _ = self._guard[index]
                p.__class__ = base
        elif new is _HOLD_AFTER_FWD:
            self._fwd_count[cid] += 1
        elif new is _HOLD_AFTER_BWD:
            self._grad_count[cid] += 1
        self.states[index] = new

    def settled(self, chunk_id: int) -> bool:
        """No tensor of the chunk is in COMPUTE or HOLD_AFTER_FWD (none awaits its backward)."""
        return not self._compute_count[chunk_id] and not self._fwd_count[chunk_id]

    def grads_in(self, chunk_id: int) -> int:
        """Tensors of the chunk holding their gradient (HOLD_AFTER_BWD)."""
        return self._grad_count[chunk_id]

    def slots_in_use(self) -> list[int]:
        """Indices of the tensors in COMPUTE or HOLD_AFTER_FWD (used since the last
        backward ended), in chunk order; visits only the chunks that hold such tensors."""
        states = self.states
        return [
            s.index
            for cid, (c, f) in enumerate(zip(self._compute_count, self._fwd_count))
            if c or f
            for s in self._slots_by_chunk[cid]
            if states[s.index] is _COMPUTE or states[s.index] is _HOLD_AFTER_FWD
        ]

    def install_guard(self, params: Sequence[torch.Tensor], guarded: Sequence[type]) -> None:
        """Guard every parameter not in COMPUTE (Note [parameter guard] in hooks/param_guard.py)."""
        self._guard = [(p, type(p), g) for p, g in zip(params, guarded)]
        self._chunk_params = [[params[s.index] for s in slots] for slots in self._slots_by_chunk]
        for i, (p, _, g) in enumerate(self._guard):
            if self.states[i] is not TensorState.COMPUTE:
                p.__class__ = g

    def set_guarded(self, index: int, on: bool) -> None:
        """Guard or unguard one parameter outside COMPUTE (gathered_parameters() unguards)."""
        if self._guard:
            p, base, guarded = self._guard[index]
            p.__class__ = guarded if on else base

    def remove_guard(self) -> None:
        for p, base, _ in self._guard:
            p.__class__ = base
        self._guard = []

    def pinned_bytes(self) -> int:
        """Bytes of param chunks in use by a running moment (they cannot move)."""
        return sum(self._chunks[_PARAM][i].nbytes for i in range(self.layout.n_chunks) if self.pinned(i))

    def pinned(self, chunk_id: int) -> bool:
        return self._compute_count[chunk_id] > 0

    def slots_of(self, chunk_id: int) -> list[TensorSlot]:
        return self._slots_by_chunk[chunk_id]

    # ------------------------------------------------------------------ placement
    def own(self, chunk_id: int) -> bool:
        """Whether this rank owns the chunk (always, in a single process)."""
        return self.layout.owner(chunk_id) == self.comm.rank

    def allocate_on_host(self, chunk_id: int) -> None:
        """Chunk ``chunk_id`` of every list starts on the host, if this rank owns it;
        other ranks' chunks have no payload here (param chunks are gathered when
        used, state chunks never exist)."""
        if not self.own(chunk_id):
            return
        with self.probe.paused():
            for name in self.lists_of(chunk_id):
                c = self._chunks[name][chunk_id]
                if self.on_disk(name):  # its file slot is the payload (Note [disk tier])
                    c.place_on_disk()
                    tier = Tier.DISK
                else:
                    c.allocate(Tier.HOST)
                    self.host_chunk_bytes += c.nbytes
                    tier = Tier.HOST
                if self.events.active:
                    self.events.emit(ChunkAllocated(c.chunk_id, c.list_name, tier, c.nbytes, time.perf_counter_ns()))

    # ------------------------------------------------------------------ the disk tier
    def attach_disk(self, tier: DiskTier) -> None:
        """From now on the chunks of ``tier.lists`` live on disk (before any chunk is allocated)."""
        self.disk = tier

    def on_disk_move(self, chunk: Chunk, to_disk: bool, nbytes: int, t_ns: int) -> None:
        """A chunk was staged in from disk or out to it (the disk tier calls this): events and counters."""
        self.host_chunk_bytes += -chunk.nbytes if to_disk else chunk.nbytes
        self.moves_by_reason[(MoveReason.STAGE_OUT if to_disk else MoveReason.STAGE_IN).value] += 1
        if not self.events.active:
            return
        cur = self._cur
        src, dst = (Tier.HOST, Tier.DISK) if to_disk else (Tier.DISK, Tier.HOST)
        reason = MoveReason.STAGE_OUT if to_disk else MoveReason.STAGE_IN
        if not to_disk:
            self.events.emit(ChunkAllocated(chunk.chunk_id, chunk.list_name, Tier.HOST, chunk.nbytes, t_ns))
        # issued now; the bytes travel on the disk tier's I/O lanes (t_end is the issue time too)
        self.events.emit(ChunkMoved(chunk.chunk_id, chunk.list_name, nbytes, src, dst, reason, cur.moment, cur.module, t_ns, t_ns))
        if to_disk:
            self.events.emit(ChunkFreed(chunk.chunk_id, chunk.list_name, Tier.HOST, chunk.nbytes, t_ns))

    def on_disk(self, name: ChunkList) -> bool:
        """Whether list ``name``'s chunks live on disk (Note [disk tier])."""
        return self.disk is not None and self.disk.on_disk(name)

    def disk_chunks(self, names: Sequence[ChunkList]) -> dict[ChunkList, dict[int, Chunk]]:
        """This rank's chunks of lists ``names`` by chunk id (what a disk tier stores)."""
        return {n: {cid: c for cid, c in self._chunks[n].items() if self.own(cid)} for n in names}

    @contextlib.contextmanager
    def staged(self, keys: Iterable[Key], *, write: bool) -> Iterator[None]:
        """Inside the block, the chunks ``keys`` that live on disk are staged into host buffers
        (their payloads readable and writable as usual); at its end they go back to disk,
        written back with ``write``. Nothing happens for chunks in memory. One chunk at a
        time is the rule: the keys' bytes must fit the staging budget."""
        tier = self.disk
        if tier is None:
            yield
            return
        keys = list(dict.fromkeys(keys))
        chunks = [self._chunks[n][i] for n, i in keys if self._chunks[n][i].location is ChunkLocation.DISK]
        need = sum(c.nbytes for c in chunks)
        if need > tier.budget:
            raise ChunkStateError(
                f"staging {len(chunks)} chunks from disk at once needs {need} bytes, more than disk.staging_budget "
                f"({tier.budget} bytes)"
            )
        done: list[Chunk] = []
        try:
            with self.probe.paused():
                for c in chunks:
                    tier.stage_in(c)
                    done.append(c)
            yield
        finally:
            with self.probe.paused():
                for c in done:
                    tier.stage_out(c, write=write)

    def resident(self, key: Key) -> bool:
        return self._chunks[key[0]][key[1]].location is ChunkLocation.DEVICE

    def chunk_budget(self) -> int:
        """Bytes chunks may occupy on the device during the current moment (Note [budget per moment])."""
        cur = self._cur
        trace = cur.trace
        return chunk_budget(
            self.capacity, self.probe.non_model_now(self.memory.held_bytes), cur.mode,
            cur.stage is Stage.FWD or cur.stage is Stage.BWD, lambda: trace.non_model_at(cur.moment),
            trace.max_non_model if cur.mode is ScheduleMode.EVALUATING_OFF else 0,
        )  # fmt: skip

    def touch(self, key: Key) -> None:
        self._clock += 1
        self._last_use[key] = self._clock

    def _next_use_after(self) -> int | None:
        """The moment the param chunks' next uses count from now (None: no schedule to read)."""
        cur = self._cur
        if not cur.follows_trace():
            return None
        if cur.stage is Stage.OPTIM or cur.stage is Stage.IDLE:
            return -1
        return cur.moment

    def make_resident(
        self, keys: Sequence[Key], reason: MoveReason, where: str, *, gather_groups: bool = False, ahead: bool = False
    ) -> None:
        """Bring ``keys`` to the device, evicting others as the policy says.

        With ``gather_groups`` (a module's access, on every rank alike) the groups of
        the param chunks are all-gathered unless already gathered. A group's gathered
        state is the same on every rank (Note [collective schedule] in
        distributed/grad_reduce.py), so the ranks agree on which groups to gather, even the
        rank that owns the very chunk a module needs. Without it only this rank's
        own chunks move (the optimizer's placement). ``ahead`` (Note [gather ahead]):
        return once the moves and gathers have started, and never fail for lack of room."""
        gather = []
        if gather_groups and self.comm.distributed:
            gather = sorted({self.layout.group(i).start for n, i in keys if n is _PARAM} - self.gathered_groups)
        want = list(keys)
        for g in gather:
            want += [(_PARAM, k) for k in self.layout.group(g) if (_PARAM, k) not in want]
        missing = [k for k in want if not self.resident(k)]
        need = sum(self._chunks[n][i].nbytes for n, i in missing)
        for g in gather:  # NCCL gathers into a flat temporary of the whole group first (distributed/comm.py)
            c = self._chunks[_PARAM][g]
            need += self.comm.gather_scratch_bytes(c.numel, c.dtype, self.device)
        self.make_room(need, protect=set(want), where=where, required=want, optional=ahead)
        for k in missing:
            if self.own(k[1]):
                self.move(k, Tier.DEVICE, reason)
        for g in gather:
            self._gather(g, ahead=ahead)
        for k in want:
            if not ahead:
                self._chunks[k[0]][k[1]].wait_ready()
            self.touch(k)

    def gather_ahead(self, chunk_ids: Iterable[int]) -> None:
        """Note [gather ahead]: start the all-gathers of the groups holding ``chunk_ids`` (the
        next moment's, per the frozen trace) that are not gathered yet, without waiting: the
        remote chunks' payloads and this rank's own chunk wait on the collective, so the
        next moment's access finds the group gathered and waits only for what has not
        landed. Called on every rank alike, from the trace and the gathered groups only
        (both the same on every rank: Note [collective schedule])."""
        if not self.comm.distributed:
            return
        keys = [(_PARAM, c) for c in chunk_ids if self.layout.group(c).start not in self.gathered_groups]
        if keys:
            self.make_resident(keys, MoveReason.PREFETCH, where="the all-gather ahead", gather_groups=True, ahead=True)

    def _gather(self, start: int, ahead: bool = False) -> None:
        """All-gather the param chunks of the group starting at ``start`` (own chunk resident);
        ``ahead``: return once it has started (Note [gather ahead])."""
        group = list(self.layout.group(start))
        own = self._chunks[_PARAM][group[self.comm.rank]]
        own.wait_ready()  # its load may still be in flight: the collective reads it
        outputs: list[torch.Tensor | None] = []
        t0 = time.perf_counter_ns()
        with self.probe.paused(), torch.profiler.record_function("chunkstar::all_gather"):
            for k in group:
                c = self._chunks[_PARAM][k]
                if k == own.chunk_id:
                    outputs.append(None)  # it holds this rank's part already (the collective leaves it alone)
                else:
                    outputs.append(c.materialize_on_device())
                    self._on_resident((_PARAM, k))
                    self.device_chunk_bytes += c.nbytes
                    self.bytes_gathered += c.nbytes
            self.device_chunk_bytes_peak = max(self.device_chunk_bytes_peak, self.device_chunk_bytes)
            what = f"param chunks {group[0]}..{group[-1]}"
            if ahead:
                pending = self.comm.all_gather_group_async(outputs, own.device_view, what=what)
                for k in group:  # the remote copies are written, the own chunk read, until it lands
                    self._chunks[_PARAM][k].set_pending(pending)
            else:
                self.comm.all_gather_group(outputs, own.device_view, what=what)
        self.gathers += 1
        self.gathers_ahead += ahead
        self.gathered_groups.add(start)
        if self.events.active:
            t1 = time.perf_counter_ns()
            for k in group:
                if k != own.chunk_id:
                    self.events.emit(ChunkAllocated(k, _PARAM.value, Tier.DEVICE, self._chunks[_PARAM][k].nbytes, t0))
                    self.events.emit(ChunkMoved(k, _PARAM.value, self._chunks[_PARAM][k].nbytes, Tier.HOST, Tier.DEVICE,
                                                MoveReason.PREFETCH if ahead else MoveReason.ACCESS, self._cur.moment,
                                                self._cur.module, t0, t1))  # fmt: skip

    def release_group(self, start: int) -> None:
        """Drop this rank's copies of the other ranks' param chunks of a gathered group."""
        if start not in self.gathered_groups:
            return
        self.gathered_groups.discard(start)
        for k in self.layout.group(start):
            c = self._chunks[_PARAM][k]
            if self.own(k) or c.location is not ChunkLocation.DEVICE:
                continue
            with self.probe.paused():
                c.release()
            self._on_left_device((_PARAM, k))
            self.device_chunk_bytes -= c.nbytes
            if self.events.active:
                self.events.emit(ChunkFreed(k, c.list_name, Tier.DEVICE, c.nbytes, time.perf_counter_ns()))

    def make_room(
        self, need: int, protect: set[Key], where: str, required: Iterable[Key] = (), optional: bool = False
    ) -> None:
        """Evict until ``need`` more bytes fit this moment's chunk budget, or, during a
        warm-up pass, down to :func:`chunkstar.memory.budget.room_target`. ``optional``
        (a gather ahead, which every rank must issue alike): when evicting cannot make the
        room, evict nothing and go over the budget until the next access, rather than fail."""
        memory = self.memory
        memory.reap()  # copies out that are done give their bytes back first (Note [deferred free])
        budget = self.chunk_budget()
        cur = self._cur
        # with no trace to trust (warm-up, or an evaluation before the first step) nothing knows what
        # the moment will allocate: it keeps only what it needs (Note [budget per moment])
        target = room_target(budget, cur.mode, cur.stage is Stage.FWD or cur.stage is Stage.BWD)
        # the device holds the resident chunks and the frees still pending (both count), and under
        # NCCL the flat buffers of collectives in flight (a gather ahead, the gradient reductions)
        target -= self.comm.scratch_bytes_in_flight
        if memory.held_bytes + need <= target:
            return
        excess = self.device_chunk_bytes + need - target
        if excess <= 0:  # the pending frees alone are in the way: wait for the oldest of them
            memory.settle(memory.held_bytes + need - target)
            return
        candidates = self._eviction_candidates(protect)
        victims = choose_evictions(candidates, excess, self.policy.value)
        if victims is None and optional:
            return
        if victims is None:
            freed = sum(c.nbytes for c in candidates)
            if self.device_chunk_bytes - freed + need > budget:
                # what stays: the chunks required now, those in use, and (several processes) the
                # other ranks' chunks of gathered groups, freed on the schedule all ranks share
                shared = self.layout.world_size > 1
                req = set(required) | {(_PARAM, i) for i in range(self.layout.n_chunks) if self.pinned(i)}
                req |= {(_PARAM, i) for i in self._on_device[_PARAM] if shared and not self.own(i)}
                if not self.measuring_shortfall:
                    raise self.memory_error(where, sorted(req), budget)
                # warm-up: go over the budget for now and measure, so the error at the end of
                # the iteration can name the smallest budget for all of it (runtime/schedule.py)
                self.required_peak = max(self.required_peak, sum(self._chunks[n][i].nbytes for n, i in req))
            victims = [c.key for c in candidates]
        for v in victims:
            assert isinstance(v, tuple)
            self.move(v, Tier.HOST, MoveReason.EVICTION)
        # the bytes are needed now: the evictions' frees run once their copies are done (on
        # CUDA the compute stream waits for them, the host does not)
        over = memory.held_bytes + need - max(target, self.device_chunk_bytes + need)
        if over > 0:
            memory.settle(over)

    def _eviction_candidates(self, protect: set[Key], names: Sequence[ChunkList] = CHUNK_LISTS) -> list[ResidentChunk]:
        """The chunks on the device that may move now, by list then chunk id (the order the
        policy's ties keep). Read from the resident index, so an eviction costs in proportion
        to what the device holds, not to the size of the model."""
        after = self._next_use_after()
        next_use = self._cur.trace.next_use
        last_use = self._last_use
        out: list[ResidentChunk] = []
        for name in names:
            ids = self._on_device[name]
            if not ids:
                continue
            ids = ids - {cid for n, cid in protect if n == name}
            chunks = self._chunks[name]
            if name is not _PARAM:
                out += [ResidentChunk(k, chunks[k[1]].nbytes, None, last_use.get(k, 0)) for k in _keys(name, ids)]
                continue
            # not in use, and not a gathered remote copy (freed on a schedule all ranks share)
            count = self._compute_count
            if self.layout.world_size > 1:
                ids = {cid for cid in ids if self.own(cid)}
            movable = _keys(name, (cid for cid in ids if not count[cid]))
            if after is None:
                out += [ResidentChunk(k, chunks[k[1]].nbytes, None, last_use.get(k, 0)) for k in movable]
            else:
                out += [ResidentChunk(k, chunks[k[1]].nbytes, next_use(k[1], after), last_use.get(k, 0)) for k in movable]
        return out

    def _on_resident(self, key: Key) -> None:
        """Chunk ``key`` got its device payload (a move in, a gather)."""
        self._on_device[key[0]].add(key[1])

    def _on_left_device(self, key: Key) -> None:
        """Chunk ``key`` lost its device payload (a move out, a release)."""
        self._on_device[key[0]].discard(key[1])

    def memory_error(self, where: str, required: Sequence[Key], free: int, non_model: int | None = None) -> DeviceMemoryError:
        """The error for chunks ``required`` at once that do not fit ``free`` chunk bytes,
        with the smallest budget that would hold them beside the measured non-model memory."""
        needed = sum(self._chunks[n][i].nbytes for n, i in required)
        if non_model is None:
            non_model = self.capacity - free
        biggest = max((s for n, i in required for s in self.slots_of(i)), key=lambda s: s.numel, default=None)
        itemsize = self._chunks[_PARAM][0].dtype.itemsize
        big_tensor = biggest is not None and biggest.numel * itemsize > max(free, 0)
        if big_tensor:
            assert biggest is not None
            advice = (
                f"one parameter alone, '{biggest.name}' ({biggest.numel * itemsize} bytes), is larger than the free "
                "chunk memory, so smaller chunks cannot help: raise 'device_memory_budget', or lower the batch size "
                "or sequence length (or enable activation checkpointing) to shrink the non-model memory"
            )
        else:
            advice = (
                "raise 'device_memory_budget'; or lower the batch size or sequence length, or enable activation "
                "checkpointing, to shrink the non-model memory; or lower 'default_chunk_size' so this moment's "
                "working set needs fewer whole chunks"
            )
        return DeviceMemoryError(
            device=str(self.device), needed=needed, free=max(free, 0), budget=self.capacity, where=where,
            minimum=minimum_budget(needed, max(non_model, 0), self.slack), advice=advice,
        )  # fmt: skip

    def _versions(self, chunk_id: int) -> int:
        """Sum of the version counters of the chunk's parameters: an in-place write to a
        parameter (even by its own module, unguarded in COMPUTE) bumps its counter."""
        return sum(p._version for p in self._chunk_params[chunk_id])

    @property
    def keeps_clean_copies(self) -> bool:
        """Whether param chunks brought to the device now keep their host copy: on the
        frozen schedule, where moves repeat every step (Note [clean host copy] in chunk/chunk.py)."""
        return self._cur.follows_trace()

    def move(self, key: Key, tier: Tier, reason: MoveReason) -> None:
        self.memory.reap()
        chunk = self._chunks[key[0]][key[1]]
        had_host = chunk.has_host_buffer
        if tier is Tier.HOST and chunk.clean and self._clean_versions.get(key[1]) != self._versions(key[1]):
            chunk.mark_dirty()  # written in place since it came: the host copy is stale
        keep = (
            tier is Tier.DEVICE and key[0] is _PARAM and self.keeps_clean_copies
            and (reason is MoveReason.ACCESS or reason is MoveReason.PREFETCH)
        )  # fmt: skip
        t0 = time.perf_counter_ns()
        with self.probe.paused(), torch.profiler.record_function(f"chunkstar::{reason.value}_to_{tier.value}"):
            copied = chunk.move_to(tier, self.copies, prefetch=reason is MoveReason.PREFETCH, keep_host=keep)
        self._on_resident(key) if tier is Tier.DEVICE else self._on_left_device(key)
        t1 = time.perf_counter_ns()
        # host bytes are the host buffers allocated (a buffer kept beside the device copy counts)
        self.host_chunk_bytes += (chunk.has_host_buffer - had_host) * chunk.nbytes
        if tier is Tier.DEVICE:
            self.device_chunk_bytes += chunk.nbytes
            if keep:
                self._clean_versions[key[1]] = self._versions(key[1])
            self.device_chunk_bytes_peak = max(self.device_chunk_bytes_peak, self.device_chunk_bytes)
            self.moves_to_device += 1
            self.bytes_to_device += chunk.nbytes
        else:
            self.device_chunk_bytes -= chunk.nbytes
            self.moves_to_host += 1
            if copied:
                self.bytes_to_host += chunk.nbytes
            else:
                self.clean_evictions += 1
        self.moves_by_reason[reason.value] += 1
        if self.events.active:
            src = Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE
            # a move allocates the payload in one tier and frees it in the other (a host
            # buffer kept beside the device copy stays allocated)
            if tier is Tier.DEVICE or not had_host:
                self.events.emit(ChunkAllocated(key[1], chunk.list_name, tier, chunk.nbytes, t0))
            nbytes = chunk.nbytes if copied else 0
            cur = self._cur
            self.events.emit(ChunkMoved(key[1], chunk.list_name, nbytes, src, tier, reason, cur.moment, cur.module, t0, t1))
            if tier is Tier.HOST or not chunk.has_host_buffer:
                self.events.emit(ChunkFreed(key[1], chunk.list_name, src, chunk.nbytes, t1))

    def prefetch(self, window_bytes: int, now: int | None = None) -> None:
        """Bring the chunks of the moments after ``now`` (default: the running moment) early,
        evicting chunks needed later, as :func:`chunkstar.placement.prefetch.plan_prefetch`
        plans. Never looks past the end of the iteration: the optimizer step in between
        changes the host copies."""
        if len(self._on_device[_PARAM]) >= self._own_param_chunks:
            return  # every chunk it could bring is here (no pressure): nothing to plan
        trace = self._cur.trace
        start = self._cur.moment if now is None else now
        chunks = self._chunks
        sharded = self.layout.world_size > 1
        capacity = self.capacity

        def upcoming() -> Iterator[Upcoming]:
            for j, peak, ids in trace.runs_after(start):
                # other ranks' chunks arrive by all-gather, on the schedule every rank shares
                keys = [(_PARAM, c) for c in ids if not sharded or self.own(c)]
                yield Upcoming(j, capacity - peak, keys)

        memory = self.memory
        memory.reap()
        budget_now = self.chunk_budget()
        view = PrefetchView(
            device_bytes=self.device_chunk_bytes,
            budget_now=budget_now,
            nbytes=lambda k: chunks[k[0]][k[1]].nbytes,
            resident=lambda k: chunks[k[0]][k[1]].location is ChunkLocation.DEVICE,
            movable=lambda: [(c.key, c.next_use) for c in self._eviction_candidates(set(), names=(_PARAM,))],
        )
        for key, evict in plan_prefetch(view, upcoming(), start, window_bytes):
            for v in evict:
                self.move(v, Tier.HOST, MoveReason.EVICTION)
            nbytes = chunks[key[0]][key[1]].nbytes
            if memory.held_bytes + nbytes > budget_now:
                memory.reap()
                if memory.held_bytes + nbytes > budget_now:
                    # the evictions' bytes are still on their way out (Note [deferred free]): a
                    # prefetch never waits for them; the next moment's prefetch goes on from here
                    break
            self.move(key, Tier.DEVICE, MoveReason.PREFETCH)
            self.touch(key)

    def offload(self, chunk_id: int) -> None:
        """Send param chunk ``chunk_id``, whose gradients are complete, to the host where its
        Adam update runs; its copy overlaps the rest of the backward."""
        key = (_PARAM, chunk_id)
        if self.resident(key) and not self.pinned(chunk_id):
            self.move(key, Tier.HOST, MoveReason.OFFLOAD)

    def to_host(self, key: Key, reason: MoveReason) -> None:
        if self.resident(key):
            self.move(key, Tier.HOST, reason)

    # ------------------------------------------------------------------ accounting
    def memory_sample(self) -> None:
        if not self.events.active:
            return
        non_model = self.probe.non_model_now(self.memory.held_bytes)
        self.events.emit(
            MemorySample(
                Tier.DEVICE,
                self.device_chunk_bytes + non_model,
                self.device_chunk_bytes,
                non_model,
                self.capacity,
                self._cur.moment,
                time.perf_counter_ns(),
            )
        )
        host = self.host_chunk_bytes
        self.events.emit(MemorySample(Tier.HOST, host, host, 0, 0, self._cur.moment, time.perf_counter_ns()))
        if self.disk is not None:  # the chunk files: this rank's state, whatever is staged
            files = self.disk.files.file_bytes
            self.events.emit(MemorySample(Tier.DISK, files, files, 0, files, self._cur.moment, time.perf_counter_ns()))

    def model_data_bytes(self) -> int:
        """Param chunks (all: each is gathered when used) plus this rank's state chunks."""
        return self.bytes_of(_PARAM) + self.state_bytes()

    def state_bytes(self) -> int:
        """fp32 master + Adam moments this rank keeps (1/world_size of them)."""
        return sum(c.nbytes for name in STATE_LISTS for c in self._chunks[name].values() if self.own(c.chunk_id))

    def bytes_of(self, list_name: ChunkList, chunk_ids: Iterable[int] | None = None) -> int:
        chunks = self._chunks[list_name]
        ids = range(self.layout.n_chunks) if chunk_ids is None else chunk_ids
        return sum(chunks[i].nbytes for i in ids if i in chunks)
