"""``"activations": {"policy": "auto"}``: from the frozen warm-up trace to a plan for the blocks.

The policy is :func:`chunkstar.activations.plan.plan_activations` (Note
[activation plan]); this module gathers what it reads from the running engine:
the blocks' measurements (:class:`~chunkstar.activations.BlockActivations`),
where each block's forward and backward fall among the trace's moments, each
moment's headroom (the capacity less its chunks, the collectives' scratch and
its measured non-model peak), the warm-up's chunk traffic by pass and direction
and the chunks' uses for predicting each plan's loads,
and the host link's speed, timed once through the engine's own copy engines (so
an emulated link on the CPU device is timed as it runs, and a GPU's PCIe as it
is). With several processes every figure is agreed over the ranks (the largest
bytes and times, the least headroom and link speed), so every rank plans the
same blocks and their collectives stay in step.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from chunkstar.activations import BlockActivations
from chunkstar.activations.plan import ActivationPlan, BlockCost, LinkLoad, StateRoom, plan_activations
from chunkstar.config import ActivationPolicy
from chunkstar.device.copy_engine import CopyEngine
from chunkstar.device.tiers import host_device
from chunkstar.distributed.comm import Comm
from chunkstar.events import Stage
from chunkstar.memory.tracer import MemoryTrace
from chunkstar.placement.chunk_traffic import CacheModel

__all__ = [
    "LINK_PROBE_BYTES", "REFINE_TOLERANCE", "PlanInputs", "PlanReport", "Span", "block_spans", "costs", "measure_link",
    "plan_blocks", "refine", "unread_bytes",
]

LINK_PROBE_BYTES = 32 << 20
"""Bytes timed each way to measure the host link (large enough that a copy's fixed cost is noise)."""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is searched on beside the blocks (agreed over the ranks): kept so a plan can be
    searched again with the blocks' forward times of a frozen step (:func:`refine`)."""

    headroom: Sequence[int]
    traffic: LinkLoad
    room_value: float
    state: StateRoom | None
    cache: CacheModel | None


@dataclass(frozen=True)
class PlanReport:
    """A plan and what it was planned from (engine.stats() reports it)."""

    plan: ActivationPlan
    blocks: tuple[BlockCost, ...]
    link: float
    least_headroom: int
    inputs: PlanInputs | None = None
    timed_on_frozen_step: bool = False
    """The blocks' forward times are a frozen step's (:func:`refine`), not the measuring run's."""


def measure_link(device: torch.device, copies: CopyEngine) -> float:
    """The host link's bytes per second, the slower way of a timed round trip of
    :data:`LINK_PROBE_BYTES` through ``copies`` (best of two). The meta device has no link: 0."""
    if device.type == "meta":
        return 0.0
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=host_device(device), pin_memory=device.type == "cuda")
    dev = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    best = 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        copies.to_device(dev, host).order()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        copies.to_host(host, dev).wait()
        t2 = time.perf_counter()
        best = max(best, LINK_PROBE_BYTES / max(t1 - t0, t2 - t1, 1e-9))
    return best


@dataclass(frozen=True)
class Span:
    """Where one block falls in the trace: the moments of its first forward call (the first, and the
    one after its last), its first backward moment and the one after its last."""

    first_fwd: int
    after_fwd: int
    first_bwd: int
    after_bwd: int = -1

    @property
    def found(self) -> bool:
        return 0 <= self.first_fwd < self.after_fwd <= self.first_bwd


def block_spans(trace: MemoryTrace, names: Sequence[str]) -> list[Span]:
    """Per block, its :class:`Span` in the trace (-1s for a block with no moment of its own)."""
    first_fwd: dict[str, int] = {}
    after_fwd: dict[str, int] = {}  # the moment after the first call's last (its moments run in a row)
    first_bwd: dict[str, int] = {}
    after_bwd: dict[str, int] = {}  # the moment after its last backward one
    owner: dict[str, str] = {}

    def block_of(label: str) -> str | None:
        if label not in owner:
            owner[label] = next((n for n in names if label == n or label.startswith(n + ".")), "")
        return owner[label] or None

    running: str | None = None  # the block whose first forward call is running
    for m, rec in enumerate(trace.records):
        b = block_of(rec.module)
        fwd = rec.stage == Stage.FWD.value
        if running is not None and (b != running or not fwd):
            after_fwd[running] = m
            running = None
        if b is None:
            continue
        if fwd and b not in first_fwd:
            first_fwd[b] = m
            running = b
        elif rec.stage == Stage.BWD.value:
            first_bwd.setdefault(b, m)
            after_bwd[b] = m + 1
    return [
        Span(first_fwd[n], after_fwd.get(n, first_bwd[n]), first_bwd[n], after_bwd[n])
        if n in first_fwd and n in first_bwd else Span(-1, -1, -1)
        for n in names
    ]  # fmt: skip


def unread_bytes(span: Span, saved: int, back: Mapping[int, int]) -> list[int]:
    """Per moment of the block's backward, the bytes of its ``saved`` the measuring run had not
    brought back by the end of that moment (``back``: moment -> bytes it brought back then)."""
    if not span.found:
        return []
    out, read = [], sum(b for m, b in back.items() if m < span.first_bwd)  # any read before (a prefetch)
    for m in range(span.first_bwd, max(span.after_bwd, span.first_bwd)):
        read += back.get(m, 0)
        out.append(max(saved - read, 0))
    return out


def costs(spans: Sequence[Span], names: Sequence[str], saved: Sequence[float], inputs: Sequence[float],
          forward_s: Sequence[float], backward_begins: int,
          unread: Sequence[Sequence[int]] | None = None) -> tuple[BlockCost, ...]:  # fmt: skip
    """The planner's view of each block (Note [activation plan]): beyond the measuring run, keeping
    holds its bytes from the end of its first forward call through its backward; offloading,
    until the next block's forward call is over (or the backward begins, ``backward_begins``),
    and again from its copy back (one offloaded block ahead: the plan places it) through its
    backward (beyond the measuring run there: ``unread``, per block, :func:`unread_bytes`;
    None: all it saved). Within its own forward the measuring run holds them too (a call's
    storages live until it ends, Note [activation offload])."""
    found = sorted((sp.first_fwd, i) for i, sp in enumerate(spans) if sp.found)
    next_in_forward = {i: found[k + 1][1] for k, (_, i) in enumerate(found[:-1])}
    out = []
    for i, (name, sp) in enumerate(zip(names, spans)):
        if not sp.found:
            out.append(BlockCost(name, int(saved[i]), int(inputs[i]), forward_s[i], 0, 0))
            continue
        nxt = next_in_forward.get(i)
        let_go = spans[nxt].after_fwd if nxt is not None else backward_begins
        out.append(BlockCost(
            name, int(saved[i]), int(inputs[i]), forward_s[i], sp.after_fwd, sp.first_bwd,
            min(max(let_go, sp.after_fwd), sp.first_bwd), sp.after_bwd,
            tuple(int(x) for x in unread[i]) if unread is not None else None,
        ))  # fmt: skip
    return tuple(out)


def plan_blocks(
    act: BlockActivations,
    trace: MemoryTrace,
    capacity: int,
    moment_chunk_bytes: Callable[[int], int],
    scratch: int,
    chunk_traffic: LinkLoad,
    link: float,
    comm: Comm,
    device: torch.device,
    room: tuple[float, StateRoom | None] = (0.0, None),
    chunks: tuple[Sequence[int], Callable[[int], bool]] | None = None,
) -> PlanReport:
    """The plan for ``act``'s blocks on the frozen ``trace`` (module docstring). ``chunks``: the
    param chunks' bytes and which are this rank's, for the plan to predict each plan's chunk
    loads (:class:`~chunkstar.placement.chunk_traffic.CacheModel`)."""
    spans = block_spans(trace, act.names)
    n, m = len(act.blocks), trace.n_moments
    headroom = [capacity - moment_chunk_bytes(i) - scratch - trace.records[i].non_model_peak for i in range(m)]
    figures = (
        [float(x.saved) for x in act.measures] + [float(x.inputs) for x in act.measures]
        + [float(x.forward_s or 0.0) for x in act.measures] + [-float(h) for h in headroom]
        + [-link, room[0], float(room[1].over if room[1] is not None else 0), float(chunk_traffic.forward_to_device), float(chunk_traffic.forward_to_host),
           float(chunk_traffic.backward_to_device), float(chunk_traffic.backward_to_host)]
        # per moment what hybrid Adam counts beside this rank's chunks (zeros where room has no price)
        + [float(x) for x in (list(room[1].base) if room[1] is not None else [0] * m)]
    )  # fmt: skip
    # per block and moment of its backward, what the measuring run had not read back (the spans
    # are the trace's, alike on every rank)
    unread = [unread_bytes(sp, x.saved, x.back) for sp, x in zip(spans, act.measures)]
    figures += [float(u) for us in unread for u in us]
    if comm.distributed:
        t = torch.tensor(figures, dtype=torch.float64)
        figures = comm.all_reduce_max(t, what="the activation plan's measurements", device=device).tolist()
    saved, inputs, fwd = figures[:n], figures[n : 2 * n], figures[2 * n : 3 * n]
    headroom = [int(-h) for h in figures[3 * n : 3 * n + m]]
    tail = figures[3 * n + m :]
    link, room_value, over = -tail[0], tail[1], int(tail[2])
    traffic = LinkLoad(*(int(x) for x in tail[3:7]))
    # (each rank places its own state chunks; their sizes are alike, so rank 0's stand for all)
    state = StateRoom([int(x) for x in tail[7 : 7 + m]], over, list(room[1].state_chunks)) if room[1] is not None else None
    flat, lengths, unread = tail[7 + m :], [len(u) for u in unread], []
    for k in lengths:
        unread.append([int(x) for x in flat[:k]])
        flat = flat[k:]
    backward_begins = next((i for i, r in enumerate(trace.records) if r.stage == Stage.BWD.value), m)
    blocks = costs(spans, act.names, saved, inputs, fwd, backward_begins, unread)
    cache = None
    if chunks is not None:
        sizes, own = chunks
        uses = [tuple(c for c in trace.records[i].chunks if own(c)) for i in range(m)]
        # a moment's headroom is what its chunks leave: this rank's own chunks may stay in it
        cache = CacheModel(uses, sizes, [h + sum(sizes[c] for c in u) for h, u in zip(headroom, uses)], backward_begins)
    agreed = PlanInputs(headroom, traffic, room_value, state, cache)
    return PlanReport(_decide(blocks, link, agreed, comm, device), blocks, link, min(headroom, default=0), agreed)


def _decide(blocks: Sequence[BlockCost], link: float, inputs: PlanInputs, comm: Comm, device: torch.device) -> ActivationPlan:
    """The plan for ``blocks`` on agreed figures, agreed block by block over the ranks."""
    plan = plan_activations(blocks, inputs.headroom, link, inputs.traffic, inputs.room_value, inputs.state, inputs.cache)
    if comm.distributed:
        # the figures are agreed, but each rank prices its own state chunks and predicts its own
        # chunk loads: should the plans still differ, every rank takes, block by block, the one
        # that holds least (and copies waited for if any rank waits), so the ranks' collectives
        # stay in step
        n = len(blocks)
        rank_of = {ActivationPolicy.KEEP: 0.0, ActivationPolicy.OFFLOAD: 1.0, ActivationPolicy.CHECKPOINT: 2.0}
        mine = torch.tensor([rank_of[p] for p in plan.policies] + [0.0 if plan.overlap else 1.0], dtype=torch.float64)
        agreed = comm.all_reduce_max(mine, what="the activation plan", device=device).tolist()
        back = {v: k for k, v in rank_of.items()}
        policies = tuple(back[x] for x in agreed[:n])
        if policies != plan.policies or (agreed[n] > 0) == plan.overlap:
            plan = dataclasses.replace(plan, policies=policies, overlap=agreed[n] == 0)
    return plan


REFINE_TOLERANCE = 0.10
"""How far (relative) a frozen step's forward times may stray from the measured ones before the
plan is searched again on them: closer, the plan stands (a new plan is traced afresh, which costs
two warm-up iterations)."""


def refine(report: PlanReport, forward_s: Sequence[float | None], comm: Comm, device: torch.device) -> PlanReport:
    """``report`` with the blocks' forward times of a frozen step under its plan (None: a block
    not called; it keeps its measured time), its plan searched again on them where they differ
    from the measured ones by more than :data:`REFINE_TOLERANCE` (Note [activation plan])."""
    old = [b.forward_s for b in report.blocks]
    times = [float(t) if t is not None else o for t, o in zip(forward_s, old)]
    if comm.distributed:  # every rank plans on the slowest rank's times, as the measured ones were agreed
        t = torch.tensor(times, dtype=torch.float64)
        times = comm.all_reduce_max(t, what="the blocks' forward times", device=device).tolist()
    blocks = tuple(dataclasses.replace(b, forward_s=t) for b, t in zip(report.blocks, times))
    report = dataclasses.replace(report, blocks=blocks, timed_on_frozen_step=True)
    if report.inputs is None or all(abs(t - o) <= REFINE_TOLERANCE * max(o, 1e-9) for t, o in zip(times, old)):
        return report
    return dataclasses.replace(report, plan=_decide(blocks, report.link, report.inputs, comm, device))
