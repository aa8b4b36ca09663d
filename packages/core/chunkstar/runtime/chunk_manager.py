"""The chunk store: the one owner of the chunks, the tensor states and the byte counters,
and the one place that moves chunks to and from the device (residency, budgets, moves).

The manager owns the chunks of the four lists and the disk tier they may live in
(:class:`chunkstar.chunk.store.Chunks`, through which everyone reads them), every
tensor's state and the derived counts of those states
(:class:`chunkstar.runtime.tensor_states.TensorStates`, whose methods it binds as
its own: ``set_state`` also swaps each parameter's class when its tensor enters or
leaves COMPUTE, Note [parameter guard] in :mod:`chunkstar.hooks.param_guard`), and
the index of the chunks on the device. Its byte and move counters, and the events
of every move, are one :class:`chunkstar.chunk.counters.ChunkCounters` each move
path records into once; with several processes the all-gathers of chunk groups are
:class:`chunkstar.distributed.gather.GroupGathers`, which ``make_resident`` calls.
Others ask it for what they need (``make_resident``, ``set_state``, ``to_host``,
``offload``, ``prefetch``, ``make_room``); the optimizer and the checkpoint code
see only the :class:`chunkstar.chunk.store.ChunkStore` Protocol. It asks the pure
policies in :mod:`chunkstar.placement` and :mod:`chunkstar.memory.budget` what to
evict, prefetch and keep, and hands the copies to its copy engine
(:mod:`chunkstar.device`). It reads the iteration's
:class:`chunkstar.memory.cursor.Cursor` and never writes it.

Note [budget per moment]: the device holds chunks *and* non-model data
(activations, temporaries). The chunk budget of a moment is the capacity minus
the non-model bytes expected during that moment: measured live during warm-up,
read from the warm-up trace afterwards. Room is made when a moment begins,
i.e. before that moment's activations are allocated, so a moment never has to
evict while its own module is running.

Note [the last moment settles]: a moment's budget counts the frees still
pending as held, and settles only as many as it needs. The iteration's last
moment is the last time this engine polls its frees before the next step, but
not always the end of what the device runs: the rest of the same backward may
be another engine's (the DCGAN tutorial's ``errG.backward()`` runs the
discriminator's backward, then the generator's) or the user's hooks, none of
it in this engine's trace. Frees left pending there would hold their bytes, by
timing (a copy seen done is reaped, one still running is not), through
everything that runs after. So the last moment of a frozen iteration settles
every pending free (on CUDA a stream wait, no host sync).
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterable, Iterator, Sequence

import torch

from chunkstar.chunk.chunk import Chunk
from chunkstar.chunk.counters import ChunkCounters
from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.lists import CHUNK_LISTS, ChunkList
from chunkstar.chunk.state import ChunkLocation, TensorState
from chunkstar.chunk.store import Chunks
from chunkstar.config import PlacementConfig
from chunkstar.device.copy_engine import CopyEngine
from chunkstar.device.memory import DeviceMemory
from chunkstar.distributed.comm import Comm
from chunkstar.distributed.gather import GroupGathers
from chunkstar.errors import DeviceMemoryError
from chunkstar.events import EventBus, MoveReason, Stage, Tier
from chunkstar.memory.budget import chunk_budget, memory_error_advice, minimum_budget, out_of_memory_advice, room_target
from chunkstar.memory.cursor import Cursor
from chunkstar.memory.probes import MemoryProbe
from chunkstar.memory.tracer import ScheduleMode
from chunkstar.placement.eviction import ResidentChunk, choose_evictions
from chunkstar.placement.prefetch import PrefetchView, Upcoming, plan_prefetch
from chunkstar.runtime.tensor_states import TensorStates

__all__ = ["ChunkManager", "Key"]

_PARAM = ChunkList.PARAM

Key = tuple[ChunkList, int]


def _keys(name: ChunkList, ids: Iterable[int]) -> list[Key]:
    """``(name, id)`` for ``ids`` in ascending order."""
    return [(name, cid) for cid in sorted(ids)]


class ChunkManager:
    def __init__(
        self,
        layout: ChunkLayout,
        placement: PlacementConfig,
        capacity: int,
        compute_dtype: torch.dtype,
        *,
        probe: MemoryProbe,
        events: EventBus,
        comm: Comm,
        copies: CopyEngine,
        cursor: Cursor,
        let_through: Callable[[int], bool] = lambda _required: False,
        held_at_once: Callable[[int], None] = lambda _held: None,
    ) -> None:
        """``placement``: the config's section (Note [config sections]); ``capacity``: the
        device bytes the engine plans with, resolved once from it (the budget, the slack and
        what the GPU has: :func:`chunkstar.memory.budget.device_capacity`); the parts it calls:
        the memory probe, the event bus, the process group, the copy engine, the iteration's
        cursor (read here, written by the schedule only: memory/cursor.py), and
        ``let_through``, asked by :meth:`make_room` when a moment's chunks cannot fit, with the
        bytes it must hold at once, whether to let it through (the schedule's warm-up measures
        the smallest budget that fits instead of raising at once: runtime/schedule.py), and
        ``held_at_once``, told what a warm-up moment still holds after evicting all it could."""
        self.layout = layout
        self.comm = comm
        self.device = placement.device
        self.capacity = capacity
        # fraction of the device budget kept free (config device_memory_slack): capacity = budget * (1 - slack)
        self.slack = placement.slack
        self.policy = placement.eviction_policy
        self.probe = probe
        self.events = events
        self.cursor = cursor
        self.let_through = let_through
        self.held_at_once = held_at_once

        # the device: every device payload grows and shrinks through `memory`: the bytes the device
        # really holds for chunks, frees deferred until their copy is done (Note [deferred free]),
        # the meter. Payloads come from the allocator the activations use, so the bytes an eviction
        # frees can hold activations (a private pool would keep them for chunks only). When the
        # allocator refuses a payload even after the pending frees ran: the usual error, with
        # its advice (Note [out of memory with frees pending] in device/memory.py); under NCCL the
        # collectives' flat buffers are scratch, counted once: budgets count what is in flight,
        # the probe leaves it out of non-model memory (Note [scratch counted once] in
        # distributed/comm.py)
        cur = cursor
        self.memory = DeviceMemory(
            self.device, limit=capacity, where=lambda: f"moment {cur.moment} '{cur.module}' ({cur.stage.value})",
            scratch_in_flight=lambda: comm.scratch_bytes_in_flight, on_out_of_memory=self._out_of_memory,
        )  # fmt: skip
        # the two instruments that watch the device's bytes are attached here, once, by the
        # memory's owner: the collectives' scratch edge and the probe's windows
        self.comm.scratch_edge = self.memory.scratch_edge
        probe.attach(self.memory)
        # how chunk payloads travel (CUDA streams, the CPU copy thread, or serial): chunk.py's
        # Note [pending copy]; built by the engine from the config (overlap, device_link_bandwidth)
        self.copies = copies

        # what the store owns: the chunks and the disk tier they may live in (chunk/store.py); every
        # tensor's state, its derived counts per chunk and the parameter guard
        # (runtime/tensor_states.py), whose hot methods are the store's own, bound once; the byte
        # and move counters and the events of every move (chunk/counters.py)
        self.chunks = Chunks(layout, compute_dtype, self.device, self.memory, self.comm.rank)
        self.tensors = TensorStates(layout)
        self.slots: tuple[TensorSlot, ...] = layout.slots
        self.states: list[TensorState] = self.tensors.states
        self.set_state = self.tensors.set_state
        self.pinned = self.tensors.pinned
        self.settled = self.tensors.settled
        self.grads_in = self.tensors.grads_in
        self.slots_in_use = self.tensors.slots_in_use
        self.slots_of = self.tensors.slots_of
        self.install_guard = self.tensors.install_guard
        self.set_guarded = self.tensors.set_guarded
        self.remove_guard = self.tensors.remove_guard
        self.counters = ChunkCounters(events, self.cursor)

        # residency, derived from the chunks' locations and kept by index_resident only: ids of the
        # chunks on the device per list, the only ones make_room looks at (eviction candidates)
        self._on_device: dict[ChunkList, set[int]] = {name: set() for name in CHUNK_LISTS}
        self._own_param_chunks = sum(1 for i in range(layout.n_chunks) if self.chunks.own(i))
        self._clock = 0
        self._last_use: dict[Key, int] = {}
        # several processes: the all-gathers of chunk groups (distributed/gather.py)
        self.gathers = GroupGathers(self, self.chunks, self.comm, probe, self.counters)

    # ------------------------------------------------------------------ first placement
    def allocate_on_host(self, chunk_id: int) -> None:
        """Chunk ``chunk_id`` of every list starts on the host, if this rank owns it;
        other ranks' chunks have no payload here (param chunks are gathered when
        used, state chunks never exist)."""
        chunks = self.chunks
        if not chunks.own(chunk_id):
            return
        with self.probe.paused():
            for name in chunks.lists_of(chunk_id):
                c = chunks.chunk(name, chunk_id)
                if chunks.on_disk(name):  # its file slot is the payload (Note [disk tier])
                    c.place_on_disk()
                    tier = Tier.DISK
                else:
                    c.allocate(Tier.HOST)
                    tier = Tier.HOST
                self.counters.record(c.chunk_id, c.list_name, c.nbytes, src=None, dst=tier, t0=time.perf_counter_ns())

    # ------------------------------------------------------------------ residency and budgets
    def pinned_bytes(self) -> int:
        """Bytes of param chunks in use by a running moment (they cannot move)."""
        return self.chunks.bytes_of(_PARAM, (i for i in range(self.layout.n_chunks) if self.pinned(i)))

    def resident(self, key: Key) -> bool:
        return self.chunks.chunk(key[0], key[1]).location is ChunkLocation.DEVICE

    def chunk_budget(self) -> int:
        """Bytes chunks may occupy on the device during the current moment (Note [budget per moment])."""
        cur = self.cursor
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
        cur = self.cursor
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
        gathers = self.gathers
        chunks = self.chunks
        gather = gathers.missing(i for n, i in keys if n is _PARAM) if gather_groups else []
        want = list(keys)
        for g in gather:
            want += [(_PARAM, k) for k in self.layout.group(g) if (_PARAM, k) not in want]
        missing = [k for k in want if not self.resident(k)]
        need = sum(chunks.chunk(n, i).nbytes for n, i in missing)
        need += sum(gathers.scratch_bytes(g, self.device) for g in gather)
        self.make_room(need, protect=set(want), where=where, required=want, optional=ahead)
        for k in missing:
            if chunks.own(k[1]):
                self.move(k, Tier.DEVICE, reason)
        for g in gather:
            gathers.gather(g, ahead=ahead)
        for k in want:
            if not ahead:
                chunks.chunk(k[0], k[1]).wait_ready()
            self.touch(k)

    def make_room(
        self, need: int, protect: set[Key], where: str, required: Iterable[Key] = (), optional: bool = False
    ) -> None:
        """Evict until ``need`` more bytes fit this moment's chunk budget, or, during a
        warm-up pass, down to :func:`chunkstar.memory.budget.room_target`. ``optional``
        (a gather ahead, which every rank must issue alike): when evicting cannot make the
        room, evict nothing and go over the budget until the next access, rather than fail."""
        memory = self.memory
        memory.reap()  # copies out that are done give their bytes back first (Note [deferred free])
        cur = self.cursor
        if memory.pending_bytes and cur.mode is ScheduleMode.FOLLOWING and cur.moment == cur.trace.n_moments - 1:
            memory.settle()  # Note [the last moment settles]
        budget = self.chunk_budget()
        # with no trace to trust (warm-up, or an evaluation before the first step) nothing knows what
        # the moment will allocate: it keeps only what it needs (Note [budget per moment])
        target = room_target(budget, cur.mode, cur.stage is Stage.FWD or cur.stage is Stage.BWD)
        keeps_least = target == 0  # a warm-up moment: all that can move goes
        # the device holds the resident chunks and the frees still pending (both count), and under
        # NCCL the flat buffers of collectives in flight (a gather ahead, the gradient reductions),
        # which only this counts (Note [scratch counted once] in distributed/comm.py)
        target -= self.comm.scratch_bytes_in_flight
        if memory.held_bytes + need <= target:
            return
        excess = self.counters.device_chunk_bytes + need - target
        if excess <= 0:  # the pending frees alone are in the way: wait for the oldest of them
            memory.settle(memory.held_bytes + need - target)
            return
        candidates = self._eviction_candidates(protect)
        # what must go for the moment's budget (a warm-up target of 0 asks more): the state hybrid
        # Adam keeps on the device goes only for that (Note [state kept for the step])
        must = self.counters.device_chunk_bytes + need - (budget - self.comm.scratch_bytes_in_flight)
        victims = choose_evictions(candidates, excess, self.policy.value, must_bytes=must)
        if victims is None and optional:
            return
        if victims is None:
            freed = sum(c.nbytes for c in candidates)
            if self.counters.device_chunk_bytes - freed + need > budget:
                # what stays: the chunks required now, those in use, and (several processes) the
                # other ranks' chunks of gathered groups, freed on the schedule all ranks share
                shared = self.layout.world_size > 1
                req = set(required) | {(_PARAM, i) for i in range(self.layout.n_chunks) if self.pinned(i)}
                req |= {(_PARAM, i) for i in self._on_device[_PARAM] if shared and not self.chunks.own(i)}
                # warm-up: the schedule may let it go over the budget for now and measure, so the
                # error at the end of the iteration can name the smallest budget for all of it
                if not self.let_through(sum(self.chunks.chunk(n, i).nbytes for n, i in req)):
                    # the error names all that had to fit: besides the required chunks, the
                    # scratch asked for and what could not move (a gradient reduction's flat
                    # buffers were left out once, and it said "needs 25 GiB, 45 GiB free")
                    stuck = self.counters.device_chunk_bytes - freed + need
                    raise self.memory_error(where, sorted(req), budget, at_once=stuck)
            victims = [c.key for c in candidates]
        if keeps_least:
            # what stays beside the moment's own chunks (in use, other ranks'
            # gathered chunks, a group a reduction holds) is part of the smallest budget: measured
            # only when the room ran out, a roomy warm-up named a minimum that failed on two ranks
            chosen = set(victims)
            gone = sum(c.nbytes for c in candidates if c.key in chosen)
            self.held_at_once(self.counters.device_chunk_bytes - gone + need)
        for v in victims:
            assert isinstance(v, tuple)
            self.move(v, Tier.HOST, MoveReason.EVICTION)
        # the bytes are needed now: the evictions' frees run once their copies are done (on
        # CUDA the compute stream waits for them, the host does not)
        over = memory.held_bytes + need - max(target, self.counters.device_chunk_bytes + need)
        if over > 0:
            memory.settle(over)

    def _eviction_candidates(self, protect: set[Key], names: Sequence[ChunkList] = CHUNK_LISTS) -> list[ResidentChunk]:
        """The chunks on the device that may move now, by list then chunk id (the order the
        policy's ties keep). Read from the resident index, so an eviction costs in proportion
        to what the device holds, not to the size of the model."""
        after = self._next_use_after()
        next_use = self.cursor.trace.next_use
        last_use = self._last_use
        chunk = self.chunks.chunk
        out: list[ResidentChunk] = []
        for name in names:
            ids = self._on_device[name]
            if not ids:
                continue
            ids = ids - {cid for n, cid in protect if n == name}
            if name is not _PARAM:
                # state on the device is hybrid Adam's, kept for the step (Note [state kept for the
                # step] in placement/eviction.py); during the step itself it is fair game
                reserved = self.cursor.stage is not Stage.OPTIM
                out += [ResidentChunk(k, chunk(name, k[1]).nbytes, None, last_use.get(k, 0), reserved) for k in _keys(name, ids)]
                continue
            # not in use, and not a gathered remote copy (freed on a schedule all ranks share)
            count = self.tensors.compute_count
            if self.layout.world_size > 1:
                ids = {cid for cid in ids if self.chunks.own(cid)}
            movable = _keys(name, (cid for cid in ids if not count[cid]))
            if after is None:
                out += [ResidentChunk(k, chunk(name, k[1]).nbytes, None, last_use.get(k, 0)) for k in movable]
            else:
                out += [ResidentChunk(k, chunk(name, k[1]).nbytes, next_use(k[1], after), last_use.get(k, 0)) for k in movable]
        return out

    def index_resident(self, key: Key, on_device: bool) -> None:
        """Chunk ``key`` got its device payload (a move in, a gather) or lost it (a move out, a
        release): the index of the chunks on the device, which eviction reads."""
        if on_device:
            self._on_device[key[0]].add(key[1])
        else:
            self._on_device[key[0]].discard(key[1])

    def memory_error(
        self, where: str, required: Sequence[Key], free: int, non_model: int | None = None, at_once: int = 0
    ) -> DeviceMemoryError:
        """The error for chunks ``required`` at once that do not fit ``free`` chunk bytes,
        with the smallest budget that would hold them beside the measured non-model memory;
        ``at_once``: the device bytes that had to fit together, when more than the required
        chunks (a collective's scratch, chunks that could not move)."""
        needed = max(sum(self.chunks.chunk(n, i).nbytes for n, i in required), at_once)
        if non_model is None:
            non_model = self.capacity - free
        biggest = max((s for n, i in required for s in self.slots_of(i)), key=lambda s: s.numel, default=None)
        itemsize = self.chunks.compute_dtype.itemsize
        advice = memory_error_advice(free, None if biggest is None else (biggest.name, biggest.numel * itemsize))
        return DeviceMemoryError(
            device=str(self.device), needed=needed, free=max(free, 0), budget=self.capacity, where=where,
            minimum=minimum_budget(needed, max(non_model, 0), self.slack), advice=advice,
        )  # fmt: skip

    def _out_of_memory(self, nbytes: int, error: BaseException) -> DeviceMemoryError:
        """The error for a chunk payload of ``nbytes`` the device's allocator refused, ``error``,
        though the budget had room and every pending free ran (Note [out of memory with frees
        pending] in device/memory.py): the device gives less than the budget says."""
        memory = self.memory
        non_model = self.probe.non_model_now(memory.held_bytes)
        free = self.capacity - non_model - memory.held_bytes
        # its first sentence ("CUDA out of memory. Tried to allocate ..."); the whole is the cause
        first = str(error).strip().split(". ")[0][:200] or type(error).__name__
        return DeviceMemoryError(
            device=str(self.device), needed=nbytes, free=max(free, 0), budget=self.capacity,
            where=f"a chunk's payload at {memory.where()} (the allocator said: {first})",
            advice=out_of_memory_advice(free),
        )  # fmt: skip

    # ------------------------------------------------------------------ moves
    def _versions(self, chunk_id: int) -> int:
        """Sum of the version counters of the chunk's parameters: an in-place write to a
        parameter (even by its own module, unguarded in COMPUTE) bumps its counter."""
        return sum(p._version for p in self.tensors.chunk_params[chunk_id])

    @property
    def keeps_clean_copies(self) -> bool:
        """Whether param chunks brought to the device now keep their host copy: on the
        frozen schedule, where moves repeat every step (Note [clean host copy] in chunk/chunk.py)."""
        return self.cursor.follows_trace()

    def move(self, key: Key, tier: Tier, reason: MoveReason) -> None:
        self.memory.reap()
        chunk = self.chunks.chunk(key[0], key[1])
        if key[0] is _PARAM and self._params_on_disk:
            self._move_through_disk(key, chunk, tier, reason)
            return
        had_host = chunk.has_host_buffer
        keep = (
            tier is Tier.DEVICE and key[0] is _PARAM and self.keeps_clean_copies
            and (reason is MoveReason.ACCESS or reason is MoveReason.PREFETCH)
        )  # fmt: skip
        # a param chunk's parameters' version counters: an in-place write since it came makes the
        # clean host copy stale (Note [clean host copy]); only read for a copy that is kept or clean
        version = self._versions if key[0] is _PARAM else None
        t0 = time.perf_counter_ns()
        with self.probe.paused(), torch.profiler.record_function(f"chunkstar::{reason.value}_to_{tier.value}"):
            copied = chunk.move_to(tier, self.copies, prefetch=reason is MoveReason.PREFETCH, keep_host=keep, version=version)
        self.index_resident(key, tier is Tier.DEVICE)
        src = Tier.HOST if tier is Tier.DEVICE else Tier.DEVICE
        # a move allocates the payload in one tier and frees it in the other; a host buffer kept
        # beside the device copy (clean, or pinned for the next trip) stays allocated, and a move
        # to the host into such a buffer allocates none
        self.counters.record(
            key[1], chunk.list_name, chunk.nbytes, src=src, dst=tier, reason=reason,
            copied=chunk.nbytes if copied else 0, kept_src=tier is Tier.DEVICE and chunk.has_host_buffer,
            had_dst=tier is Tier.HOST and had_host, t0=t0, t1=time.perf_counter_ns(),
        )  # fmt: skip

    @property
    def _params_on_disk(self) -> bool:
        """Whether the param chunks' home is the disk tier (Note [param chunks on disk])."""
        disk = self.chunks.disk
        return disk is not None and disk.on_disk(_PARAM)

    def _move_through_disk(self, key: Key, chunk: Chunk, tier: Tier, reason: MoveReason) -> None:
        """Note [param chunks on disk]: a param chunk whose home is a file comes to the device
        through a staging buffer (read on the disk tier's read lane, copied in after the read
        on the copy engine, the buffer given back once the copy is done), and leaves it for its
        file: freed at once when the file holds its bytes (read and not written since), else
        copied into a staging buffer and written behind."""
        disk = self.chunks.disk
        assert disk is not None
        disk.wait_for(chunk)  # the step's thread may still be staging it (Note [the step issued behind])
        t0 = time.perf_counter_ns()
        version = self._versions
        with self.probe.paused(), torch.profiler.record_function(f"chunkstar::{reason.value}_to_{tier.value}"):
            if tier is Tier.DEVICE:
                if chunk.location is ChunkLocation.DISK:
                    disk.stage_in(chunk, for_device=True)  # recorded DISK -> HOST by the tier
                buf = chunk.host_buffer
                chunk.move_to(tier, self.copies, prefetch=reason is MoveReason.PREFETCH, version=version)
                disk.give_back_after(buf, chunk.pending_copy)
                self.index_resident(key, True)
                self.counters.record(
                    key[1], chunk.list_name, chunk.nbytes, src=Tier.HOST, dst=tier, reason=reason,
                    copied=chunk.nbytes, t0=t0, t1=time.perf_counter_ns(),
                )  # fmt: skip
                return
            if chunk.file_clean(version):
                chunk.drop_to_disk()
                self.index_resident(key, False)
                self.counters.record(
                    key[1], chunk.list_name, chunk.nbytes, src=Tier.DEVICE, dst=Tier.DISK, reason=reason,
                    had_dst=True, t0=t0, t1=time.perf_counter_ns(),
                )  # fmt: skip
                return
            chunk.move_to(Tier.HOST, self.copies, into=disk.take(chunk))
            self.index_resident(key, False)
            self.counters.record(
                key[1], chunk.list_name, chunk.nbytes, src=Tier.DEVICE, dst=Tier.HOST, reason=reason,
                copied=chunk.nbytes, t0=t0, t1=time.perf_counter_ns(),
            )  # fmt: skip
            disk.stage_out(chunk, write=True)  # written behind once the copy is done

    def prefetch(self, window_bytes: int, now: int | None = None) -> None:
        """Bring the chunks of the moments after ``now`` (default: the running moment) early,
        evicting chunks needed later, as :func:`chunkstar.placement.prefetch.plan_prefetch`
        plans. Never looks past the end of the iteration: the optimizer step in between
        changes the host copies."""
        if len(self._on_device[_PARAM]) >= self._own_param_chunks:
            return  # every chunk it could bring is here (no pressure): nothing to plan
        trace = self.cursor.trace
        start = self.cursor.moment if now is None else now
        chunks = self.chunks
        sharded = self.layout.world_size > 1
        capacity = self.capacity

        def upcoming() -> Iterator[Upcoming]:
            for j, peak, ids in trace.runs_after(start):
                # other ranks' chunks arrive by all-gather, on the schedule every rank shares
                keys = [(_PARAM, c) for c in ids if not sharded or chunks.own(c)]
                yield Upcoming(j, capacity - peak, keys)

        memory = self.memory
        memory.reap()
        budget_now = self.chunk_budget()
        view = PrefetchView(
            device_bytes=self.counters.device_chunk_bytes,
            budget_now=budget_now,
            nbytes=lambda k: chunks.chunk(k[0], k[1]).nbytes,
            resident=lambda k: chunks.chunk(k[0], k[1]).location is ChunkLocation.DEVICE,
            movable=lambda: [(c.key, c.next_use) for c in self._eviction_candidates(set(), names=(_PARAM,))],
        )
        for key, evict in plan_prefetch(view, upcoming(), start, window_bytes):
            for v in evict:
                self.move(v, Tier.HOST, MoveReason.EVICTION)
            nbytes = chunks.chunk(key[0], key[1]).nbytes
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

    # ------------------------------------------------------------------ writes the model makes
    def absorb_writes(self, indices: list[int]) -> None:
        """The model wrote parameters ``indices`` in place during a forward (Note [writes in a
        forward] in :mod:`chunkstar.runtime.hook_targets`): copy the elements that changed into
        their fp32 masters. Only what changed, so a master keeps its precision elsewhere (in bf16
        an unchanged element is exactly its master rounded). The chunks' clean host copies, if
        any, are stale now."""
        mgr = self
        by_chunk: dict[int, list[int]] = {}
        for i in indices:
            by_chunk.setdefault(mgr.slots[i].chunk_id, []).append(i)
        for cid, members in by_chunk.items():
            chunk = mgr.chunks.chunk(ChunkList.PARAM, cid)
            chunk.mark_dirty()
            if mgr.chunks.frozen(cid) or not mgr.chunks.own(cid):
                continue  # no master (the param slot is the value), or another rank's chunk
            with torch.no_grad(), mgr.chunks.staged([(ChunkList.MASTER, cid)], write=True):
                param = chunk.payload
                for i in members:
                    s = mgr.slots[i]
                    if mgr.states[i] is TensorState.HOLD_AFTER_BWD:
                        continue  # the slot holds a gradient
                    master = mgr.chunks.slot_view(ChunkList.MASTER, s)
                    value = param[s.offset : s.end].to(master.device)
                    changed = value != master.to(value.dtype)
                    if bool(changed.any()):
                        master[changed] = value[changed].to(master.dtype)

    # ------------------------------------------------------------------ the probe and memory samples
    def paused_probe(self) -> contextlib.AbstractContextManager[None]:
        """The non-model memory probe paused: the store's own work is model memory."""
        return self.probe.paused()

    def memory_sample(self) -> None:
        """Samples of the device, host and disk tiers now, for the profiler (when events are on)."""
        if self.events.active:
            disk = self.chunks.disk
            files = disk.file_bytes if disk is not None else None
            self.counters.sample(self.probe.non_model_now(self.memory.held_bytes), self.capacity, files)
