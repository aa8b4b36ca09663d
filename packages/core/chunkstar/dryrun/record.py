"""One training step as the engine ran it: moments, FLOPs, chunk moves, collectives, Adam.

:class:`StepRecorder` watches an engine (real or on the meta device) through its
event bus and counts the FLOPs of every op in a dispatch mode, with
``torch.utils.flop_counter``'s formulas (the ones the bench's TFLOPS use). What it
keeps is a :class:`StepRecord`, everything the time model
(:mod:`chunkstar.dryrun.timing`) replays: in the order they ran, the moments of
the forward and backward with their FLOPs, the chunk moves each issued (bytes,
direction, reason), the bytes the collectives carried, and the optimizer step's
moves and Adam work. The events are kept too, for a predicted profile.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from chunkstar.dryrun.comm import CollectiveBytes, SimulatedComm
from chunkstar.events import ActivationMoved, ChunkMoved, Event, MomentBegin, Stage, StageChanged, Tier

__all__ = ["Move", "MomentRecord", "StepRecord", "StepRecorder"]


@dataclass(frozen=True)
class Move:
    """A chunk move: ``nbytes`` from tier ``src`` to ``dst`` ("device", "host", "disk")."""

    chunk_id: int
    chunk_list: str
    nbytes: int
    src: str
    dst: str
    reason: str
    """A :class:`chunkstar.events.MoveReason` value: access, eviction, prefetch, optimizer, offload, stage_in,
    stage_out; or ``activation`` (a block's saved tensors going to the host, ``chunk_list`` "activation")."""
    seq: int = 0
    """Its place among the step's moves, in the order they were issued (the events' order)."""
    gathered: bool = False
    """Another rank's chunk arriving by an all-gather: its bytes travel the interconnect (the
    moment's :attr:`MomentRecord.gather_bytes`), not the host link."""


@dataclass
class MomentRecord:
    """One moment of the forward or backward (a module's pre-hook to the next moment)."""

    index: int
    module: str
    stage: str
    """"fwd" or "bwd"."""
    flops: int = 0
    moves: list[Move] = field(default_factory=list)
    gather_bytes: int = 0
    """Bytes this rank received in all-gathers issued in the moment."""
    reduce_bytes: int = 0
    """Bytes this rank sent in gradient reductions issued in the moment."""


@dataclass
class StepRecord:
    """One training iteration (all its micro-steps) of one rank."""

    moments: list[MomentRecord] = field(default_factory=list)
    optimizer_moves: list[Move] = field(default_factory=list)
    """Moves of the optimizer step and between steps (outside any moment)."""
    optimizer_flops: int = 0
    host_adam_params: int = 0
    """Parameters this rank's Adam updates on the host (CPU Adam)."""
    device_adam_params: int = 0
    """Parameters this rank's Adam updates on the device (hybrid Adam's chunks)."""
    gather_bytes: int = 0
    reduce_bytes: int = 0
    """All of this rank's collectives in the iteration (the moments' and the rest)."""
    world_size: int = 1
    rank: int = 0
    dtype_bytes: int = 2
    events: list[Event] = field(default_factory=list)
    """Every event of the step, in order (for a predicted profile)."""
    placements_at_start: list[tuple[str, int, str]] = field(default_factory=list)
    """(list, chunk id, tier) of every chunk payload that had a tier when the step began."""

    @property
    def flops(self) -> int:
        return sum(m.flops for m in self.moments) + self.optimizer_flops

    def moves(self) -> list[Move]:
        """Every move of the step, in the order they were issued."""
        return sorted([mv for m in self.moments for mv in m.moves] + self.optimizer_moves, key=lambda mv: mv.seq)

    def moved(self, src: str, dst: str) -> int:
        """Bytes this rank moved from tier ``src`` to ``dst`` in the whole iteration (gathered
        chunks came from other ranks: not counted, as ``engine.stats()`` counts them apart)."""
        every = [mv for m in self.moments for mv in m.moves] + self.optimizer_moves
        return sum(mv.nbytes for mv in every if mv.src == src and mv.dst == dst and not mv.gathered)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (no events): for JSON."""
        d = dataclasses.asdict(self)
        d.pop("events")
        d.pop("placements_at_start")
        return d


def _flash_cpu_flops(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(tuple(query.shape), tuple(key.shape), tuple(value.shape)))


def _flash_cpu_backward_flops(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(tuple(grad_out.shape), tuple(query.shape), tuple(key.shape), tuple(value.shape)))


_FORMULAS: dict[Any, Callable[..., int]] = dict(flop_registry)
# the CPU flash kernel (the one the meta device's attention takes, chunkstar/dryrun/meta_ops.py):
# the same FLOPs as the CUDA fused kernels, which torch's table has
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _flash_cpu_flops),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _flash_cpu_backward_flops),
):
    _op = getattr(torch.ops.aten, _name, None)
    if _op is not None:
        _FORMULAS[_op] = _fn


class _FlopCount(TorchDispatchMode):
    """Adds up the FLOPs of every op with a formula (matrix products, convolutions, attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _FORMULAS.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


class StepRecorder:
    """``with StepRecorder(engine) as rec: <one training iteration>``; then ``rec.record``.

    FLOPs are counted on the thread that enters it (where the meta device runs the
    backward too); the moves come from the engine's events, from whichever thread."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.record = StepRecord(
            world_size=engine.comm.world_size, rank=engine.comm.rank, dtype_bytes=engine.config.precision.dtype.itemsize
        )
        self._flops = _FlopCount()
        self._moment: MomentRecord | None = None
        self._flops_at = 0
        comm = engine.comm
        self._coll: CollectiveBytes | None = comm.bytes if isinstance(comm, SimulatedComm) else None
        self._coll_at = (0, 0)
        self._unsubscribe: Callable[[], None] | None = None
        self._seq = 0

    def __enter__(self) -> StepRecorder:
        from chunkstar.chunk.lists import ChunkList

        chunks = self.engine.mgr.chunks
        self.record.placements_at_start = [
            (which.value, c.chunk_id, c.tier.value) for which in ChunkList for c in chunks.chunks_of(which) if c.tier is not None
        ]
        self._coll_at = self._collectives()
        self._start = self._coll_at
        self._unsubscribe = self.engine.events.subscribe(self._on_event)
        self._flops.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        disk = self.engine.mgr.chunks.disk
        if disk is not None and exc[0] is None:
            # the step's staging runs on the disk tier's own thread, and its moves are the
            # step's: a record closed before that thread is done leaves them out (Note [the
            # step issued behind])
            disk.settle()
        self._flops.__exit__(*exc)
        if self._unsubscribe is not None:
            self._unsubscribe()
        self._close_moment()
        rec = self.record
        rec.optimizer_flops += self._flops.total - self._flops_at
        now = self._collectives()
        rec.gather_bytes, rec.reduce_bytes = now[0] - self._start[0], now[1] - self._start[1]
        self._adam_work()

    def _collectives(self) -> tuple[int, int]:
        c = self._coll
        return (c.gather_bytes, c.reduce_bytes) if c is not None else (0, 0)

    def _close_moment(self) -> None:
        m = self._moment
        total = self._flops.total
        now = self._collectives()
        if m is not None:
            m.flops += total - self._flops_at
            m.gather_bytes += now[0] - self._coll_at[0]
            m.reduce_bytes += now[1] - self._coll_at[1]
        else:
            self.record.optimizer_flops += total - self._flops_at
        self._flops_at, self._coll_at = total, now
        self._moment = None

    def _on_event(self, e: Event) -> None:
        self.record.events.append(e)
        if isinstance(e, MomentBegin):
            self._close_moment()
            self._moment = MomentRecord(e.index, e.module, e.stage.value)
            self.record.moments.append(self._moment)
        elif isinstance(e, StageChanged) and e.stage in (Stage.OPTIM, Stage.IDLE):
            self._close_moment()
        elif isinstance(e, ChunkMoved):
            self._seq += 1
            mv = Move(e.chunk_id, e.chunk_list, e.nbytes, _tier(e.src), _tier(e.dst), e.reason.value, self._seq - 1, e.gathered)
            (self._moment.moves if self._moment is not None else self.record.optimizer_moves).append(mv)
        elif isinstance(e, ActivationMoved):
            # a block's saved tensors over the host link (chunk_list "activation", no chunk): charged
            # to the moment that issued the copy, an offload as an eviction is (beside the compute),
            # a copy back sent for ahead as a prefetch, one the backward waited for as an access
            self._seq += 1
            reason = "activation" if e.dst is Tier.HOST else "prefetch" if e.prefetch else "access"
            mv = Move(-1, "activation", e.nbytes, _tier(e.src), _tier(e.dst), reason, self._seq - 1)
            issued = next((m for m in reversed(self.record.moments) if m.index == e.moment), self._moment)
            (issued.moves if issued is not None else self.record.optimizer_moves).append(mv)

    def _adam_work(self) -> None:
        """Parameters this rank's Adam updates, on the host and on the device."""
        mgr = self.engine.mgr
        on_device = set(self.engine.device_adam_chunks)
        host = device = 0
        layout = mgr.layout
        for cid, n in enumerate(layout.chunk_sizes):
            if layout.is_frozen(cid) or not mgr.chunks.own(cid):
                continue
            if cid in on_device:
                device += n
            else:
                host += n
        self.record.host_adam_params, self.record.device_adam_params = host, device


def _tier(t: Tier) -> str:
    return t.value
