"""The activation plan's search and cost model on made-up numbers (Note [activation plan])."""

from __future__ import annotations

from chunkstar.activations.plan import (
    MARGIN_BYTES, ActivationPlan, BlockCost, LinkLoad, _added, plan_activations, predict_step,
)  # fmt: skip
from chunkstar.config import ActivationPolicy
from chunkstar.placement.chunk_traffic import CacheModel

KEEP, CKPT, OFF = ActivationPolicy.KEEP, ActivationPolicy.CHECKPOINT, ActivationPolicy.OFFLOAD
MB = 1 << 20


def _blocks(n: int, saved: int = 100 * MB, inputs: int = 4 * MB, forward_s: float = 0.01) -> list[BlockCost]:
    """n alike blocks over 4n+2 moments: forward i at moments 1+2i.., backward in reverse."""
    out = []
    for i in range(n):
        held_from = 2 + 2 * i  # after its forward moments (1+2i, 2+2i)
        held_until = 2 * n + 2 + 2 * (n - 1 - i)  # its backward's first moment
        out.append(BlockCost(f"h.{i}", saved, inputs, forward_s, held_from, held_until))
    return out


def _room(n: int, free: int) -> list[int]:
    return [free] * (4 * n + 2)


def test_everything_kept_where_it_fits() -> None:
    blocks = _blocks(4)
    plan = plan_activations(blocks, _room(4, 4 * 100 * MB + 100 * MB), link=8e9)
    assert plan.policies == (KEEP,) * 4 and plan.fits and plan.least_room >= 0


def test_offloads_while_the_link_has_time_then_recomputes() -> None:
    # room for two blocks' activations; each block's forward hides 10 ms of copies (80 MB at 8 GB/s)
    blocks = _blocks(8, saved=100 * MB, forward_s=0.02)  # forward 160 ms: 1.28 GB each way hidden
    plan = plan_activations(blocks, _room(8, 2 * 100 * MB + 150 * MB), link=8e9)
    assert plan.fits and plan.count(KEEP) >= 1 and plan.count(CKPT) == 0 and plan.count(OFF) >= 5
    # a slow link (80 MB/s): every offloaded byte is on the step's path, recomputing is cheaper
    slow = plan_activations(blocks, _room(8, 2 * 100 * MB + 150 * MB), link=8e7)
    assert slow.fits and slow.count(OFF) == 0 and slow.count(CKPT) >= 5
    assert slow.step_s < predict_step(blocks, [OFF] * 8, 8e7, LinkLoad())


def test_chunk_traffic_shares_the_link() -> None:
    """With the backward's prefetch already filling the link, offloading costs its bytes' time."""
    blocks = _blocks(6, saved=100 * MB, forward_s=0.02)
    room = _room(6, 150 * MB)
    free_link = plan_activations(blocks, room, link=8e9)
    busy = plan_activations(blocks, room, link=8e9, chunks=LinkLoad(backward_to_device=int(8e9 * 1.0)))
    assert free_link.count(OFF) > busy.count(OFF) and busy.count(CKPT) > 0


def test_kept_activations_that_push_chunks_out_pay_for_their_reloads() -> None:
    """Note [chunk traffic under a plan]: a 180 MB chunk used at the first and last moments stays
    on the device between them while the room allows; keeping both blocks (200 MB) pushes it out
    and the backward loads it again over a slow link, where recomputing one block costs 10 ms."""
    blocks = _blocks(2, saved=100 * MB, inputs=MB, forward_s=0.01)
    headroom = _room(2, 300 * MB)
    uses = [(0,)] + [()] * 8 + [(0,)]
    cache = CacheModel(uses, [180 * MB], [h + (180 * MB if u else 0) for h, u in zip(headroom, uses)], backward_from=6)
    measured = LinkLoad(backward_to_device=180 * MB)  # the warm-up's: only each moment's chunks kept
    blind = plan_activations(blocks, headroom, link=1e9, chunks=measured)
    assert blind.policies == (KEEP, KEEP)  # the measured traffic is the same whatever the plan
    seeing = plan_activations(blocks, headroom, link=1e9, chunks=measured, cache=cache)
    assert seeing.count(KEEP) == 1 and seeing.count(CKPT) == 1 and seeing.chunk_bytes_to_device == 0
    assert seeing.step_s < predict_step(blocks, [KEEP, KEEP], 1e9, measured)


def test_the_plan_fits_every_moment_with_its_margin() -> None:
    blocks = _blocks(6)
    room = _room(6, 250 * MB)
    room[13] = 60 * MB  # one tight moment inside every block's span
    plan = plan_activations(blocks, room, link=8e9)
    assert plan.fits and plan.least_room >= 0
    # the offloaded blocks' copies back one block ahead count where they land
    assert all(p is not KEEP for p in plan.policies[:4])


def test_nothing_fits_gives_every_block_offloaded_and_says_so() -> None:
    blocks = _blocks(3)
    plan = plan_activations(blocks, _room(3, -MB), link=8e9)
    assert plan == ActivationPlan((OFF,) * 3, plan.step_s, False, plan.least_room, overlap=False) and plan.least_room < 0
    assert plan.as_measured  # the measuring run itself, which fit


def test_a_block_with_no_moments_is_left_kept() -> None:
    blocks = [BlockCost("h.0", 100 * MB, MB, 0.01, 0, 0)]  # no span: keeping it adds nowhere
    assert plan_activations(blocks, [MARGIN_BYTES * 2] * 4, link=8e9).policies == (KEEP,)


def test_a_hundred_blocks() -> None:
    """The paper's scale: a hundred blocks, room for twenty blocks' activations beside the chunks."""
    blocks = _blocks(100, saved=500 * MB, forward_s=0.05)
    plan = plan_activations(blocks, _room(100, 20 * 500 * MB), link=25e9)
    assert plan.fits and 0 < plan.count(KEEP) < 20 and plan.count(KEEP) + plan.count(OFF) + plan.count(CKPT) == 100


def test_where_each_block_holds_its_bytes_in_the_trace() -> None:
    from chunkstar.memory.tracer import MemoryTrace, MomentRecord
    from chunkstar.runtime.activation_planning import Span, block_spans, costs

    labels = [("wte", "fwd"), ("h.0.a", "fwd"), ("h.0.b", "fwd"), ("h.1.a", "fwd"), ("h.1.b", "fwd"), ("h.10.a", "fwd"),
              ("head", "fwd"), ("head", "bwd"), ("h.10.a", "bwd"), ("h.1.b", "bwd"), ("h.1.a", "bwd"), ("h.0.b", "bwd"),
              ("h.0.a", "bwd"), ("wte", "bwd")]  # fmt: skip
    trace = MemoryTrace(records=[MomentRecord(m, s, ()) for m, s in labels])
    names = ["h.0", "h.1", "h.10", "h.2"]  # h.1 is no prefix of h.10's moments; h.2 has none
    spans = block_spans(trace, names)
    assert spans == [Span(1, 3, 11, 13), Span(3, 5, 9, 11), Span(5, 6, 8, 9), Span(-1, -1, -1)]
    blocks = costs(spans, names, [10.0] * 4, [1.0] * 4, [0.1] * 4, backward_begins=7)
    h0, h1, h10, h2 = blocks
    # kept: from the end of its forward through its backward; offloaded: let go after the next
    # block's forward (the last block: when the backward begins)
    assert (h0.held_from, h0.held_until, h0.let_go_at, h0.backward_end) == (3, 11, 5, 13)
    assert (h1.held_from, h1.held_until, h1.let_go_at, h1.backward_end) == (5, 9, 6, 11)
    assert (h10.held_from, h10.held_until, h10.let_go_at, h10.backward_end) == (6, 8, 7, 9)
    assert (h2.held_from, h2.held_until) == (0, 0)
    # offloaded ones come back when the backward reaches the next offloaded block: h.0 when h.10's
    # begins if h.1 is kept, when h.1's begins if h.1 is offloaded too; h.10, the first reached, as read
    n = 14
    kept_between = _added(blocks[:3], [OFF, KEEP, OFF], n)
    assert kept_between[8] == 10 + 10 and kept_between[7] == 10  # h.1 kept from 5; h.0 back from 8
    chained = _added(blocks[:3], [OFF, OFF, OFF], n)
    assert chained[8] == 10 and chained[7] == 0 and chained[9] == 10 + 10  # h.1 back from 8, h.0 from 9
    # within its own backward a block holds beyond the measuring run only what that run had not yet
    # read back: h.0's backward (moments 11, 12) read 4 bytes at 11 and 6 at 12
    from chunkstar.runtime.activation_planning import unread_bytes

    assert unread_bytes(spans[0], 10, {11: 4, 12: 6}) == [6, 0] and unread_bytes(spans[3], 10, {}) == []
    read = costs(spans, names, [10.0] * 4, [1.0] * 4, [0.1] * 4, 7, [[6, 0], [10, 10], [10], []])
    assert _added(read[:1], [KEEP], n)[10:13] == [10, 6, 0]  # kept: all before its backward, then the unread


def test_device_room_is_priced_as_hybrid_adam_places_state() -> None:
    """Where keeping blocks would push optimizer state off the device, and a host update costs
    more than a recomputation, the plan recomputes even though keeping fits."""
    from chunkstar.activations.plan import StateRoom

    blocks = _blocks(4, saved=100 * MB, forward_s=0.001)
    room = _room(4, 1000 * MB)  # everything fits
    assert plan_activations(blocks, room, link=8e9).policies == (KEEP,) * 4
    # 4 state chunks of 100 MB in 700 MB of room: keeping all four blocks leaves room for two of them
    state = StateRoom(base=[0] * len(room), over=-(700 * MB), state_chunks=[100 * MB] * 4)
    assert state.left_out([0] * len(room)) == 0 and state.left_out([400 * MB] * len(room)) == 200 * MB
    # a host update of 1 us per parameter at 12 bytes a parameter: far dearer than 1 ms of forward per block
    priced = plan_activations(blocks, room, link=8e9, room_value=1e-6 / 12, state_room=state)
    assert priced.fits and priced.count(KEEP) < 4
    assert state.left_out([sum(b.saved for b, p in zip(blocks, priced.policies) if p is KEEP)] * len(room)) == 0
