"""The time model (chunkstar.dryrun.timing): hand-built step records replayed on hand-built hardware.

Every figure here is arithmetic on round numbers, never a timing: a loaded machine cannot
change a verdict. The one test that calibrates this machine asserts only what the
calibration must say whatever the rates it measured.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from torch import nn

from chunkstar.dryrun.record import MomentRecord, Move, StepRecord
from chunkstar.dryrun.timing import HARDWARE, Hardware, calibrate_this_machine, measure_compute, predict

_G = 1e9


def _hw(**changes: object) -> Hardware:
    """Round rates: 1 TFLOP/s of compute, 1 GB/s each way, 1e9 host Adam updates/s, 1 GB/s collectives."""
    base = Hardware(
        "round", "round numbers", 1, 1 << 40, 1e12, 1.0, _G, _G, 1 << 40, 1e9, 1e10, _G,
        disk_read=_G, disk_write=_G,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def _moment(i: int, tflops: float, *moves: Move, stage: str = "fwd", gather: int = 0, reduce: int = 0) -> MomentRecord:
    return MomentRecord(i, f"m{i}", stage, int(tflops * 1e12), list(moves), gather_bytes=gather, reduce_bytes=reduce)


def _mv(nbytes: float, src: str, dst: str, reason: str, chunk_list: str = "param", cid: int = 0, seq: int = 0) -> Move:
    return Move(cid, chunk_list, int(nbytes), src, dst, reason, seq)


def _both(record: StepRecord, hw: Hardware) -> tuple[float, float]:
    return predict(record, hw, overlap=False).seconds, predict(record, hw, overlap=True).seconds


def test_serial_is_the_sum_of_every_resources_work() -> None:
    rec = StepRecord(
        moments=[
            _moment(0, 1.0, _mv(1e9, "host", "device", "access")),  # 1 s compute, 1 s in
            _moment(1, 2.0, _mv(0.5e9, "device", "host", "eviction"), _mv(1e9, "device", "host", "offload"), stage="bwd"),
        ],
        optimizer_moves=[_mv(0.25e9, "host", "device", "prefetch")],
        host_adam_params=int(1e9),  # 1 s of CPU Adam
        device_adam_params=int(1e10),  # 1 s of device Adam
    )
    off = predict(rec, _hw(), overlap=False)
    assert off.busy == pytest.approx(
        {"compute": 3.0, "h2d": 1.25, "d2h": 1.5, "interconnect": 0.0, "host_adam": 1.0, "device_adam": 1.0, "disk": 0.0}
    )
    assert off.seconds == pytest.approx(sum(off.busy.values())) == pytest.approx(7.75)
    assert off.binding == "compute" and off.flops == int(3e12) and off.waits == pytest.approx(4.75)
    # the efficiency scales the compute, and only the compute
    half = predict(rec, _hw(efficiency=0.5), overlap=False)
    assert half.busy["compute"] == pytest.approx(6.0) and half.seconds == pytest.approx(10.75)


def _random_record(rng: random.Random) -> StepRecord:
    reasons = ("access", "prefetch", "eviction", "offload", "optimizer")
    moments = []
    seq = iter(range(1000))
    for i in range(rng.randint(1, 12)):
        moves = []
        for _ in range(rng.randint(0, 4)):
            reason = rng.choice(reasons)
            to_host = reason in ("eviction", "offload")
            moves.append(_mv(rng.uniform(0, 2e9), "device" if to_host else "host", "host" if to_host else "device", reason,
                             chunk_list=rng.choice(("param", "param", "exp_avg")), cid=rng.randint(0, 9), seq=next(seq)))  # fmt: skip
        if rng.random() < 0.2:
            tiers = rng.choice((("disk", "host", "stage_in"), ("host", "disk", "stage_out")))
            moves.append(_mv(rng.uniform(0, 1e9), *tiers, seq=next(seq)))
        moments.append(_moment(i, rng.uniform(0, 2.0), *moves, stage=rng.choice(("fwd", "bwd")),
                               gather=rng.choice((0, 0, int(rng.uniform(0, 1e9)))),
                               reduce=rng.choice((0, 0, int(rng.uniform(0, 1e9))))))  # fmt: skip
    opt_moves = [_mv(rng.uniform(0, 1e9), *rng.choice((("host", "device"), ("device", "host"), ("disk", "host"))), "optimizer",
                     seq=next(seq)) for _ in range(rng.randint(0, 3))]  # fmt: skip
    reduce = sum(m.reduce_bytes for m in moments) + rng.choice((0, int(rng.uniform(0, 1e9))))
    return StepRecord(
        moments=moments, optimizer_moves=opt_moves, host_adam_params=rng.randint(0, int(3e9)),
        device_adam_params=rng.randint(0, int(3e10)), gather_bytes=sum(m.gather_bytes for m in moments),
        reduce_bytes=reduce, world_size=rng.choice((1, 2, 8)),
    )  # fmt: skip


def test_overlap_is_never_slower_than_serial_nor_faster_than_the_busiest_resource() -> None:
    rng = random.Random(26)
    for case in range(300):
        rec = _random_record(rng)
        hw = _hw(
            peak_flops=rng.uniform(0.2e12, 5e12), h2d_bandwidth=rng.uniform(0.1, 10) * _G, d2h_bandwidth=rng.uniform(0.1, 10) * _G,
            host_adam_params_per_s=rng.uniform(0.1, 3) * 1e9, interconnect_bandwidth=rng.uniform(0.1, 10) * _G,
            gpus_per_node=rng.choice((1, 8)), shared_cores=rng.random() < 0.5,
        )  # fmt: skip
        off, on = predict(rec, hw, overlap=False), predict(rec, hw, overlap=True)
        assert on.busy == pytest.approx(off.busy), case  # the same work, only arranged otherwise
        busiest = max(on.busy.values())
        assert busiest * (1 - 1e-9) <= on.seconds <= off.seconds * (1 + 1e-9), (case, on, off)
        assert on.busy[on.binding] == busiest and on.waits >= 0
        # the clock of a predicted profile: every moment and every timed move within the step
        n_moves = len([mv for mv in rec.moves() if "disk" in (mv.src, mv.dst) or {mv.src, mv.dst} == {"host", "device"}])
        for p in (on, off):
            assert len(p.moment_starts) == len(rec.moments) and p.moment_starts == sorted(p.moment_starts), case
            assert len(p.move_spans) == n_moves, case
            assert all(0 <= a <= b <= p.seconds * (1 + 1e-9) for a, b in p.move_spans.values()), case
        # serial: one thing at a time, so no two moves overlap
        spans = sorted(off.move_spans.values())
        assert all(b <= c * (1 + 1e-9) + 1e-9 for (_, b), (c, _) in zip(spans, spans[1:])), case


def test_a_link_bound_step_names_h2d_and_waits_for_it() -> None:
    # every moment fetches 2 GB on demand (2 s at 1 GB/s) for 0.1 s of compute
    rec = StepRecord(moments=[_moment(i, 0.1, _mv(2e9, "host", "device", "access", cid=i)) for i in range(4)])
    on = predict(rec, _hw(), overlap=True)
    assert on.binding == "h2d" and on.busy["h2d"] == pytest.approx(8.0)
    # an on-demand copy starts when its moment does, and the moment's compute waits for it: nothing hides
    assert on.seconds == pytest.approx(4 * 2.1) and on.waits == pytest.approx(8.0)
    # prefetched a moment ahead, the copies run back to back and the compute hides behind them
    ahead = StepRecord(moments=[_moment(i, 0.1, *([_mv(2e9, "host", "device", "prefetch", cid=i)] if i < 3 else [])) for i in range(4)])
    assert predict(ahead, _hw(), overlap=True).seconds == pytest.approx(6.1)
    # a faster link moves the binding to the compute
    assert predict(rec, _hw(h2d_bandwidth=1e12), overlap=True).binding == "compute"


def test_a_prefetch_hides_behind_the_compute_an_on_demand_copy_waits_for_its_evictions() -> None:
    prefetched = StepRecord(moments=[_moment(0, 1.0, _mv(1e9, "host", "device", "prefetch", seq=7)), _moment(1, 1.0)])
    on = predict(prefetched, _hw(), overlap=True)
    assert on.seconds == pytest.approx(2.0)  # in during moment 0's compute
    assert on.moment_starts == pytest.approx([0.0, 1.0]) and on.move_spans[7] == pytest.approx((0.0, 1.0))
    off = predict(prefetched, _hw(), overlap=False)  # serial: the copy, then each moment's compute
    assert off.moment_starts == pytest.approx([1.0, 2.0]) and off.move_spans[7] == pytest.approx((0.0, 1.0))
    late = StepRecord(moments=[_moment(0, 0.5, _mv(1e9, "host", "device", "prefetch")), _moment(1, 1.0)])
    assert predict(late, _hw(), overlap=True).seconds == pytest.approx(2.0)  # moment 1 waits the 0.5 s left
    on_demand = StepRecord(moments=[_moment(0, 1.0, _mv(1e9, "device", "host", "eviction"), _mv(1e9, "host", "device", "access"))])
    assert predict(on_demand, _hw(), overlap=True).seconds == pytest.approx(3.0)  # out 1 s, in 1 s, then compute


def _backward_with_offloads(chunks: int = 4) -> StepRecord:
    """A backward of ``chunks`` moments, 1 s of compute each, each offloading a param chunk's bf16
    gradients (0.2 s at 1 GB/s) whose CPU Adam takes 0.5 s at 2e8 updates/s."""
    moments = [_moment(i, 1.0, _mv(2e8, "device", "host", "offload", cid=i), stage="bwd") for i in range(chunks)]
    return StepRecord(moments=moments, host_adam_params=int(chunks * 1e8), dtype_bytes=2)


def test_cpu_adam_runs_beside_the_backward_as_the_offloads_arrive() -> None:
    rec, hw = _backward_with_offloads(), _hw(host_adam_params_per_s=2e8)
    off, on = predict(rec, hw, overlap=False), predict(rec, hw, overlap=True)
    assert on.busy["host_adam"] == pytest.approx(2.0) and on.busy["d2h"] == pytest.approx(0.8)
    assert off.seconds == pytest.approx(4.0 + 0.8 + 2.0)
    # overlapped: chunk i's Adam runs [i + 0.2, i + 0.7], within the compute of the moments after it
    assert on.seconds == pytest.approx(4.0) and on.binding == "compute"
    # the same Adam without offloads to start it early: all in the optimizer step, after the backward
    late = dataclasses.replace(rec, moments=[_moment(i, 1.0, stage="bwd") for i in range(4)])
    assert predict(late, hw, overlap=True).seconds == pytest.approx(6.0)


def test_on_shared_cores_the_host_adam_adds_to_the_compute() -> None:
    rec, hw = _backward_with_offloads(), _hw(host_adam_params_per_s=2e8, shared_cores=True)
    on = predict(rec, hw, overlap=True)
    assert on.seconds == pytest.approx(4.0 + 2.0)  # the cores did both: nothing hidden
    assert predict(rec, hw, overlap=False).seconds == pytest.approx(6.8)  # serial: the copies add up too
    # in the optimizer step the host's and the device's Adam take turns on the same cores
    opt = StepRecord(moments=[_moment(0, 1.0)], host_adam_params=int(1e9), device_adam_params=int(1e10))
    assert predict(opt, _hw(), overlap=True).seconds == pytest.approx(2.0)
    assert predict(opt, _hw(shared_cores=True), overlap=True).seconds == pytest.approx(3.0)


def test_the_optimizer_steps_copies_wait_for_the_host_adam() -> None:
    rec = StepRecord(
        moments=[_moment(0, 1.0)], optimizer_moves=[_mv(1e9, "host", "device", "prefetch")], host_adam_params=int(1e9)
    )
    on = predict(rec, _hw(), overlap=True)
    assert on.seconds == pytest.approx(3.0)  # compute 1 s, Adam 1 s, then the updated chunk goes back 1 s


def test_collectives_gather_before_the_compute_and_reduce_beside_it() -> None:
    hw = _hw(gpus_per_node=8)
    gather = StepRecord(moments=[_moment(0, 1.0, gather=int(1e9))], gather_bytes=int(1e9), world_size=8)
    assert predict(gather, hw, overlap=True).seconds == pytest.approx(2.0)  # the params first, then the compute
    reduce = StepRecord(moments=[_moment(0, 1.0, stage="bwd", reduce=int(1e9))], reduce_bytes=int(1e9), world_size=8)
    assert predict(reduce, hw, overlap=True).seconds == pytest.approx(1.0)  # beside the compute
    assert predict(reduce, hw, overlap=False).seconds == pytest.approx(2.0)
    # reductions the moments did not issue (the end of the backward) run in the optimizer step
    tail = dataclasses.replace(reduce, reduce_bytes=int(3e9))
    on = predict(tail, hw, overlap=True)
    assert on.busy["interconnect"] == pytest.approx(3.0) and on.seconds == pytest.approx(3.0) and on.binding == "interconnect"
    # a node's ranks share its host Adam: 8 ranks per node, each gets an eighth of the rate
    adam = StepRecord(moments=[_moment(0, 0.0)], host_adam_params=int(1e9), world_size=8)
    assert predict(adam, hw).busy["host_adam"] == pytest.approx(8.0)
    assert predict(adam, hw, ranks_per_node=2).busy["host_adam"] == pytest.approx(2.0)
    # a machine without an interconnect cannot run them
    with pytest.raises(ValueError, match="no interconnect"):
        predict(gather, _hw(interconnect_bandwidth=0.0))


def test_the_disk_tier_is_a_resource_of_its_own() -> None:
    rec = StepRecord(moments=[_moment(0, 1.0, _mv(2e9, "disk", "host", "stage_in"))])
    on, off = predict(rec, _hw(), overlap=True), predict(rec, _hw(), overlap=False)
    assert on.busy["disk"] == pytest.approx(2.0) and on.binding == "disk"
    assert on.seconds == pytest.approx(2.0) and off.seconds == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("peak_flops", 0.0), ("peak_flops", -1e12), ("peak_flops", math.nan), ("peak_flops", math.inf), ("peak_flops", True),
        ("efficiency", 0.0), ("efficiency", 1.5), ("efficiency", math.nan), ("h2d_bandwidth", 0.0),
        ("d2h_bandwidth", -1.0), ("host_adam_params_per_s", math.nan), ("device_adam_params_per_s", 0),
        ("device_memory", 0), ("host_memory", -1), ("interconnect_bandwidth", -1.0), ("interconnect_bandwidth", math.nan),
        ("disk_read", -1.0), ("disk_write", math.inf), ("gpus_per_node", 0), ("gpus_per_node", 1.5), ("gpus_per_node", True),
    ],
)  # fmt: skip
def test_bad_hardware_is_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _hw(**{field: value})


def test_the_table_and_zero_interconnect_or_disk_are_valid() -> None:
    assert all(isinstance(h, Hardware) and h.efficiency <= 1 for h in HARDWARE.values())
    _hw(interconnect_bandwidth=0.0, disk_read=0.0, disk_write=0.0)  # one device, no disk tier: fine


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32))


def test_measure_compute_counts_the_steps_own_ops_as_often_as_they_run() -> None:
    x = torch.zeros(16, 64)
    rate = measure_compute(_tiny, x, torch.float32, min_time_s=0.001)
    # forward: two products; backward: the second layer's input and weight gradients, the first
    # layer's weight gradient only (the input needs none)
    assert rate.flops == 2 * 16 * (64 * 96 + 96 * 32) + 2 * 16 * (96 * 32 * 2 + 64 * 96)
    assert rate.flop_ops == 5 and rate.distinct > rate.flop_ops  # the activation, its gradient, the bias sums ...
    assert rate.skipped == 0 and rate.unmeasured_flops == 0 and rate.seconds >= rate.flop_seconds > 0
    assert measure_compute(_tiny, x, torch.float32, min_time_s=0.001) is rate  # cached: same ops, same threads
    # a batch twice as large is another workload: twice the FLOPs
    assert measure_compute(_tiny, torch.zeros(32, 64), torch.float32, min_time_s=0.001).flops == 2 * rate.flops


def test_calibrating_this_machine_says_what_it_measured() -> None:
    x = torch.zeros(16, 64)
    slow = calibrate_this_machine(torch.float32, link_bandwidth=1e6)
    assert slow.h2d_bandwidth == slow.d2h_bandwidth == 1e6  # the emulated link, slower than any memory copy
    assert slow.efficiency == 1.0 and "link 0.001 GB/s emulated" in slow.source
    fast = calibrate_this_machine(torch.float32, link_bandwidth=1e15, workload=(_tiny, x))
    # a link faster than memory runs at the copy rate: the emulation copies, then sleeps out the rest
    assert fast.h2d_bandwidth == fast.interconnect_bandwidth < 1e15
    assert 0 < fast.efficiency <= 1 and fast.peak_flops >= slow.peak_flops  # the peak is the best rate measured
    assert "FLOP ops" in fast.source and fast.gpus_per_node == 1
    with pytest.raises(ValueError, match="link_bandwidth"):
        calibrate_this_machine(torch.float32, link_bandwidth=-1.0)


def test_a_gathered_chunk_travels_the_interconnect_not_the_host_link() -> None:
    """Another rank's chunk arrives by an all-gather: its bytes are the moment's gather bytes
    (interconnect); the move the engine records for it is not charged to the host link again
    (charged twice, 8-rank steps were predicted up to twice too long)."""
    gathered = dataclasses.replace(_mv(1e9, "host", "device", "access", seq=0), gathered=True)
    rec = StepRecord(moments=[_moment(0, 1.0, gathered, gather=int(1e9))], world_size=2)
    for overlap in (False, True):
        p = predict(rec, _hw(), overlap=overlap)
        assert p.busy["h2d"] == 0.0 and p.busy["interconnect"] == pytest.approx(1.0), overlap
    assert rec.moved("host", "device") == 0  # this rank's host gave none of it
