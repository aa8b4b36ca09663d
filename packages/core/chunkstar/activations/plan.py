"""The activation plan: which blocks keep, recompute or offload their saved tensors. Pure policy.

Note [activation plan]: ``"policy": "auto"`` runs the warm-up with every block
offloaded (the measuring policy: the least device memory a block can be left
with short of recomputation, and the one whose pack hook sees every tensor a
block saves), then plans from what it measured, per block:

* ``saved``: the bytes of the storages its calls of one iteration offloaded,
  which keeping would leave on the device from the end of its forward to the
  start of its backward;
* ``inputs``: the bytes of its tensor inputs, which recomputation keeps instead;
* ``forward_s``: its forward's compute time (copy waits excluded), what a
  recomputation costs in the backward. The measuring run's times include the
  chunk loads a warm-up waits for and a frozen step prefetches, so the plan's
  first frozen step times the blocks again, and where its times differ from the
  measured ones by more than 10% the plan is searched again on them (and traced
  afresh if it changes: once per shape of the run);

and, per moment of the traced iteration, the ``headroom``: the capacity less the
moment's chunks and the non-model bytes measured with every block offloaded.
The measuring run sends each storage back only when the backward reads it and
waits for every copy to the host before the forward goes on, so it holds about
what recomputing every block holds (a block's activations during its backward,
and less than a recomputation's inputs before): where full checkpointing fits,
the measuring run fits. A plan fits when at every moment the bytes it adds to
that stay within the headroom less a margin: a kept block's saved bytes and a
recomputed block's inputs, over the moments between the block's forward and its
backward; an offloaded block's saved bytes until the next block's forward is
over (its copies to the host overlap that forward, Note [activation offload])
and again from the moment its copy back is sent for (when the backward reaches
the next offloaded block: one offloaded block ahead) to its backward. Within a
block's own backward a kept, recomputed or prefetched block holds everything it
saved from the first moment, where the measuring run brings each storage back
only as the backward reads it: what that run had not read by a moment (it logs
each copy back) counts there too.

The step time the plan changes is predicted as compute plus the link time the
compute cannot hide:

* compute: the blocks' forward ``F`` (the sum of ``forward_s``), a backward of
  ``2F`` (a backward does about twice a forward's work) and the recomputations;
* the link: offloaded bytes travel to the host during the forward beside the
  chunks' own traffic that way, and back during the backward beside the
  chunks' prefetch; each direction of each pass is hidden up to the compute
  time of that pass, and what exceeds it is on the step's path. The chunks'
  loads are predicted per plan (Note [chunk traffic under a plan] in
  :mod:`chunkstar.placement.chunk_traffic`): the frozen schedule keeps chunks on
  the device while the room allows, so what a plan holds beside them costs
  their reloads. The search weighs them once a plan fits (before, the warm-up's
  traffic, which kept only each moment's chunks, stands in for every plan);
  the traffic to the host stays the warm-up's, an upper bound.

Device memory the activations do not take is not free of value: hybrid Adam
keeps as much optimizer state on the device as the room beside the chunks and
the activations allows, and each parameter it cannot keep there costs a host
update. So the cost of a plan is its predicted step time plus ``room_value``
seconds per byte of state that no longer fits beside the chunks and what the
plan holds at its worst moment, counted as hybrid Adam counts it (the
runtime measures the host update's time per parameter in the warm-up's first
optimizer step; 0 on the CPU device, whose host and device updates run on the
same cores).

The search is greedy by price: from every block kept, while some moment does
not fit, the worst such moment is relieved by the change that costs the least
per byte it frees there (offloading a block, or recomputing it); then, while
some change lowers the cost and still fits, the best of them is made (a
recomputed block offloaded where the link has time, a kept block given up
where its room is worth more than its recomputation). State goes to the
device in whole chunks, so where room has a price the search also tries
giving up the k largest kept blocks at once, for every k, and descends again
from the best: no single change shows the gain of several. Offloading costs nothing until the link is
busy and then a fixed price per byte, and recomputing a block costs its
forward: both prices only grow as more is taken, so the greedy order is the
knapsack's fractional order, and the blocks of one model are alike, so little
is lost to rounding. ProTrain's enumeration over (swap, checkpoint) counts is
the exact version of the same search. Each plan weighed costs interval sums by
prefix over the moments (not a scan per block), and once a plan fits, a replay
of the chunks' eviction: the GPT3_12B dry run's search (60 blocks, 728
moments, room priced, chunk loads predicted) took 4.6 s on this project's
2-core CPU machine, 18 s when the replay also ran while no plan fit yet. When nothing fits (a model whose offloaded warm-up fit only barely),
the plan is the measured one: every block offloaded, each storage brought back
when the backward reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from chunkstar.config import ActivationPolicy
from chunkstar.placement.chunk_traffic import CacheModel

__all__ = ["ActivationPlan", "BlockCost", "LinkLoad", "StateRoom", "plan_activations", "predict_step"]

KEEP, CHECKPOINT, OFFLOAD = ActivationPolicy.KEEP, ActivationPolicy.CHECKPOINT, ActivationPolicy.OFFLOAD

BACKWARD_PER_FORWARD = 2.0
"""A backward's compute time as a multiple of the forward's (two matrix products per forward one)."""

MARGIN_FRACTION = 0.05
"""Of the bytes a plan adds on the device, the part kept free beside them (measurement jitter:
allocator rounding, a tensor's shape that differs between calls)."""

MARGIN_BYTES = 64 << 10
"""And a fixed part, for the tensors too small to measure one by one."""


@dataclass(frozen=True)
class BlockCost:
    """One block's measurements (Note [activation plan])."""

    name: str
    saved: int
    """Bytes of the storages its calls of one iteration saved and offloading moves."""
    inputs: int
    """Bytes of its tensor inputs (what recomputation keeps)."""
    forward_s: float
    """Forward compute seconds per iteration (a recomputation's cost)."""
    held_from: int
    """The first moment at which keeping holds its saved bytes (after its last forward moment)."""
    held_until: int
    """The moment its backward begins (its saved bytes are held before it)."""
    let_go_at: int = -1
    """Offloaded, the moment its device bytes go once its copies are done: after the next block's
    forward (-1: at once, as the measuring run waits for each copy)."""
    released_at: int = -1
    """The moment after its backward's last (-1: ``held_until``). Within its backward a kept,
    recomputed or prefetched block holds all it saved from the first moment on, where the
    measuring run brings each storage back only as the backward reads it."""
    unread: tuple[int, ...] | None = None
    """Per moment of its backward (from ``held_until``), the saved bytes the measuring run had not
    brought back by then: what the other policies hold there beyond it (None: not measured, all
    of ``saved`` at every moment, an upper bound)."""

    @property
    def backward_end(self) -> int:
        return max(self.released_at, self.held_until)


@dataclass(frozen=True)
class LinkLoad:
    """Chunk bytes one iteration moves over the host link, by pass and direction."""

    forward_to_device: int = 0
    forward_to_host: int = 0
    backward_to_device: int = 0
    backward_to_host: int = 0


@dataclass(frozen=True)
class StateRoom:
    """Where hybrid Adam places optimizer state beside the forward and backward, as it counts it
    (:func:`chunkstar.placement.optimizer.resident_footprint`): per moment what the moment holds
    beside this rank's chunks (``base``), this rank's chunks less the capacity (``over``: negative),
    and the state chunks' bytes in the order they are placed, each whole or not at all."""

    base: Sequence[int]
    over: int
    state_chunks: Sequence[int]

    def left_out(self, added: Sequence[int]) -> int:
        """State bytes left on the host when the activations hold ``added`` more at each moment
        (with the plan's margin)."""
        worst = max((b + a for b, a in zip(self.base, added)), default=0)
        margin = MARGIN_BYTES + int(MARGIN_FRACTION * max(added, default=0))
        room = -(self.over + worst + margin)
        left = 0
        for b in self.state_chunks:
            if b <= room:
                room -= b
            else:
                left += b
                room = -1  # hybrid Adam takes them in order and stops at the first that does not fit
        return left


@dataclass(frozen=True)
class ActivationPlan:
    policies: tuple[ActivationPolicy, ...]
    step_s: float
    """The predicted time of the parts of a step the plan changes (Note [activation plan])."""
    fits: bool
    """Every moment fits its headroom (False: nothing did, and this is every block offloaded)."""
    least_room: int
    """The smallest headroom left at any moment (bytes; negative where it does not fit)."""
    overlap: bool = True
    """Offloaded blocks' copies overlap the compute: to the host let go a block later, back one
    block ahead (False: each waited for at once, as measured: the plans for the least room)."""
    chunk_bytes_to_device: int = -1
    """The chunk bytes one iteration is predicted to bring to the device under the plan (-1:
    not predicted, the measuring run's own)."""

    @property
    def as_measured(self) -> bool:
        """The plan is the measuring run's own: every block offloaded, each copy waited for."""
        return not self.overlap and all(p is OFFLOAD for p in self.policies)

    def count(self, policy: ActivationPolicy) -> int:
        return sum(1 for p in self.policies if p is policy)

    def offloaded_bytes(self, blocks: Sequence[BlockCost]) -> int:
        """Bytes the plan sends to the host (and back) per iteration."""
        return sum(b.saved for b, p in zip(blocks, self.policies) if p is OFFLOAD)


def predict_step(
    blocks: Sequence[BlockCost], policies: Sequence[ActivationPolicy], link: float, chunks: LinkLoad, overlap: bool = True
) -> float:
    """The compute and exposed link seconds of one iteration under ``policies`` (Note [activation
    plan]); without ``overlap`` every offloaded byte's copy is on the step's path, both ways."""
    forward = sum(b.forward_s for b in blocks)
    backward = BACKWARD_PER_FORWARD * forward + sum(b.forward_s for b, p in zip(blocks, policies) if p is CHECKPOINT)
    off = sum(b.saved for b, p in zip(blocks, policies) if p is OFFLOAD)
    if link <= 0:
        return forward + backward
    waited = 0.0
    if not overlap:  # every copy on the step's path, none on the link beside the chunks
        waited, off = 2 * off / link, 0
    exposed = waited + (
        max(0.0, (off + chunks.forward_to_host) / link - forward)
        + max(0.0, chunks.forward_to_device / link - forward)
        + max(0.0, (off + chunks.backward_to_device) / link - backward)
        + max(0.0, chunks.backward_to_host / link - backward)
    )
    return forward + backward + exposed


def _added(blocks: Sequence[BlockCost], policies: Sequence[ActivationPolicy], n_moments: int, overlap: bool = True) -> list[int]:
    """Per moment, the bytes ``policies`` hold beyond every block offloaded (prefix sums of intervals)."""
    diff = [0] * (n_moments + 1)
    def add(extra: int, lo: int, hi: int) -> None:
        lo, hi = max(lo, 0), min(hi, n_moments)
        if extra and lo < hi:
            diff[lo] += extra
            diff[hi] -= extra

    # an offloaded block is sent for when the backward first reads the next offloaded block, in the
    # forward's order (the mechanism chains the offloaded calls, Note [activation offload]): one
    # offloaded block ahead, however many kept or recomputed blocks lie between; the first the
    # backward reaches is brought back as it is read, as measured
    sent_for: dict[int, int] = {}
    if overlap:
        chain = sorted((b.held_from, i) for i, (b, p) in enumerate(zip(blocks, policies)) if p is OFFLOAD and b.held_from < b.held_until)
        for (_, j), (_, k) in zip(chain, chain[1:]):
            sent_for[j] = blocks[k].held_until
    def own_backward(b: BlockCost) -> None:
        # all it saved is there from its backward's first moment; the measuring run has what it read
        if b.unread is None:
            add(b.saved, b.held_until, b.backward_end)
            return
        for k, extra in enumerate(b.unread[: b.backward_end - b.held_until]):
            add(extra, b.held_until + k, b.held_until + k + 1)

    for i, (b, p) in enumerate(zip(blocks, policies)):
        if p is KEEP:
            add(b.saved, b.held_from, b.held_until)
            own_backward(b)
        elif p is CHECKPOINT:  # its inputs until the backward, then the recomputed forward's tensors
            add(b.inputs, b.held_from, b.held_until)
            own_backward(b)
        elif overlap:  # offloaded: held until the next block's forward is over, and from its copy back on
            if b.let_go_at >= 0:
                add(b.saved, b.held_from, b.let_go_at)
            if i in sent_for:
                add(b.saved, sent_for[i], b.held_until)
                own_backward(b)
    out, run = [], 0
    for m in range(n_moments):
        run += diff[m]
        out.append(run)
    return out


def _room(
    blocks: Sequence[BlockCost], policies: Sequence[ActivationPolicy], headroom: Sequence[int], overlap: bool = True
) -> tuple[int, int]:
    """(least room, the moment of it): headroom less what the plan adds and its margin."""
    added = _added(blocks, policies, len(headroom), overlap)
    margin = MARGIN_BYTES + int(MARGIN_FRACTION * max(added, default=0))
    least, where = None, -1
    for m, (h, a) in enumerate(zip(headroom, added)):
        r = h - a - margin
        if least is None or r < least:
            least, where = r, m
    return (least if least is not None else 0), where


def plan_activations(
    blocks: Sequence[BlockCost], headroom: Sequence[int], link: float, chunks: LinkLoad = LinkLoad(),
    room_value: float = 0.0, state_room: StateRoom | None = None, cache: CacheModel | None = None,
) -> ActivationPlan:
    """The plan of least cost predicted to fit every moment's ``headroom`` (Note [activation plan]).
    ``link``: the host link's bytes per second each way (0: no link to speak of, offloading free);
    ``chunks``: the chunk traffic measured with every block offloaded; ``cache``: the chunks'
    uses and room, to predict each plan's chunk loads instead (Note [chunk traffic under a
    plan]); ``room_value``: the seconds a step saves per byte of optimizer state hybrid Adam
    keeps on the device; ``state_room``: where that state has to fit (:class:`StateRoom`).
    Offloaded blocks' copies overlap the compute where that fits; else they are waited for."""
    plan = _search(blocks, headroom, link, chunks, room_value, state_room, cache, overlap=True)
    if plan.fits:
        return plan
    waited = _search(blocks, headroom, link, chunks, room_value, state_room, cache, overlap=False)
    return waited if waited.fits else plan


def _search(
    blocks: Sequence[BlockCost], headroom: Sequence[int], link: float, measured: LinkLoad, room_value: float,
    state_room: StateRoom | None, cache: CacheModel | None, overlap: bool,
) -> ActivationPlan:
    n = len(blocks)
    policies = [KEEP] * n
    traffic: dict[tuple[ActivationPolicy, ...], LinkLoad] = {}
    fitting = True  # while no plan fits yet, the measured traffic (the model's loads are for plans that fit)

    def chunks(p: Sequence[ActivationPolicy]) -> LinkLoad:
        """The chunk traffic under ``p``: the cache model's loads where there is one (at most the
        measured ones, which kept only each moment's chunks), the measured traffic else."""
        if cache is None or link <= 0 or fitting:
            return measured
        key = tuple(p)
        if key not in traffic:
            fwd, bwd = cache.loads(_added(blocks, p, len(headroom), overlap))
            traffic[key] = dataclasses.replace(
                measured, forward_to_device=min(fwd, measured.forward_to_device),
                backward_to_device=min(bwd, measured.backward_to_device),
            )  # fmt: skip
        return traffic[key]

    def step(p: Sequence[ActivationPolicy]) -> float:
        return predict_step(blocks, p, link, chunks(p), overlap)

    def cost(p: Sequence[ActivationPolicy]) -> float:
        if not room_value or state_room is None:
            return step(p)
        return step(p) + room_value * state_room.left_out(_added(blocks, p, len(headroom), overlap))

    def room(p: Sequence[ActivationPolicy]) -> tuple[int, int]:
        return _room(blocks, p, headroom, overlap)

    least, where = room(policies)
    while least < 0:
        now = cost(policies)
        best: tuple[float, int, ActivationPolicy] | None = None
        for i, b in enumerate(blocks):
            if policies[i] is not KEEP or not b.held_from <= where < b.held_until:
                continue
            for choice, freed in ((OFFLOAD, b.saved), (CHECKPOINT, b.saved - b.inputs)):
                if freed <= 0:
                    continue
                trial = list(policies)
                trial[i] = choice
                price = (cost(trial) - now) / freed
                if best is None or price < best[0] - 1e-15:
                    best = (price, i, choice)
        if best is None:
            break
        policies[best[1]] = best[2]
        least, where = room(policies)
    if least < 0:
        every = [OFFLOAD] * n
        return ActivationPlan(tuple(every), predict_step(blocks, every, link, measured, False), False,
                              _room(blocks, every, headroom, False)[0], overlap=False)  # fmt: skip
    fitting = False
    # then the change that lowers the cost most while it still fits, for as long as one does: a
    # recomputed block offloaded where the link has time, a kept block given up where its room
    # is worth more to the optimizer's state than its recomputation costs
    def descend(start: list[ActivationPolicy]) -> list[ActivationPolicy]:
        current = start
        for _ in range(3 * n + 3):
            now = cost(current)
            best_trial: tuple[float, list[ActivationPolicy]] | None = None
            for i in range(n):
                for choice in (KEEP, CHECKPOINT, OFFLOAD):
                    if choice is current[i]:
                        continue
                    trial = list(current)
                    trial[i] = choice
                    if room(trial)[0] < 0:
                        continue
                    gain = now - cost(trial)
                    if gain > 1e-12 and (best_trial is None or gain > best_trial[0]):
                        best_trial = (gain, trial)
            if best_trial is None:
                break
            current = best_trial[1]
        return current

    policies = descend(policies)
    if room_value and state_room is not None:
        # state goes to the device in whole chunks, so giving up one kept block may place none of it
        # and no single change shows the gain of several: try giving up the k largest kept blocks
        # (recomputed) for every k, and descend again from the best
        kept = sorted((i for i in range(n) if policies[i] is KEEP), key=lambda i: (-blocks[i].saved, -i))
        cheapest: tuple[float, list[ActivationPolicy]] = (cost(policies), policies)
        for k in range(1, len(kept) + 1):
            trial = list(policies)
            for i in kept[:k]:
                trial[i] = CHECKPOINT
            if room(trial)[0] >= 0 and cost(trial) < cheapest[0] - 1e-12:
                cheapest = (cost(trial), trial)
        if cheapest[1] is not policies:
            policies = descend(cheapest[1])
    least, _ = room(policies)
    load = chunks(policies)
    return ActivationPlan(
        tuple(policies), step(policies), True, least, overlap=overlap,
        chunk_bytes_to_device=load.forward_to_device + load.backward_to_device,
    )  # fmt: skip
