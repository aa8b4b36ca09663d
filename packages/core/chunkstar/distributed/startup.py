"""Start-up agreement: before the first chunk collective, the ranks check that
they are about to train the same thing, and agree on one run id.

Note [start-up agreement]: chunks are sharded by rank and gathered on a
schedule every rank derives on its own (Note [collective schedule] in
distributed/grad_reduce.py). That only works if every rank parsed the same config,
built the same chunk layout in the same dtype, and filled it with the same
initial weights; otherwise collectives of different sizes abort inside gloo or
NCCL, or the all-gathers silently stitch together chunks of differently seeded
models. So :func:`agree_on_startup` runs inside ``ChunkEngine.__init__``, once
the layout is built and before any chunk collective:

1. every rank all-gathers the length of its fingerprint vector (ranks running
   different chunkstar versions would otherwise enter the next collective with
   different sizes);
2. every rank all-gathers a fixed-size int64 vector: a hash of each config field
   that must agree, of the layout (:func:`~chunkstar.chunk.layout.layout_fingerprint`)
   and of the compute dtype, the parameter count, and its own random run id;
3. when the parameter counts agree, every rank all-gathers a float64 checksum per
   parameter of the weights as it built them (plain and position-weighted sums,
   each with its sum of absolute values as the scale), compared with a relative
   tolerance: float64 sums may round differently on different hardware, while
   different seeds differ at once.

Every rank then compares all of it, so every rank reaches the same verdict and
either all go on or all raise :class:`DistributedError` with the same list of
differences (which field or what, and which ranks); no rank is left waiting in a
collective. The run id is rank 0's. A single process only draws its run id.

What must agree: every :class:`~chunkstar.config.EngineConfig` field (new fields
are compared unless listed in :data:`MAY_DIFFER`) and the device *type*. What may
differ per rank: the device index (``cuda:<local_rank>``), the device memory
budget and slack (GPUs with different free memory), and the raw config text;
the collective schedule never depends on them. Eviction
policy, prefetch and hybrid Adam only decide where a rank's own bytes sit, but
ranks launched with different values are misconfigured, so they must agree too.

This module is not a general config diff: it compares fingerprints, so a rank
knows *that* and *where* it differs from another, and shows its own value only.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import uuid
from typing import Any, Sequence

import torch

from chunkstar.chunk.layout import ChunkLayout, layout_fingerprint
from chunkstar.config import ActivationsConfig, DiskConfig, EngineConfig, LossScaleConfig, OptimizerConfig, PlacementConfig, ScheduleConfig
from chunkstar.distributed.comm import Comm, DistributedError

__all__ = ["MAY_DIFFER", "agree_on_startup", "config_fields", "weights_checksum"]

MAY_DIFFER = frozenset(
    {"placement.device", "placement.budget", "placement.slack", "placement.overlap", "placement.link_bandwidth", "raw"}
)
"""EngineConfig fields (dotted, by section) a rank may set for itself (the device is compared by its type only)."""

_BLOCK = 1 << 20  # elements per block of the weighted sum (bounds its float64 temporaries to 8 MiB)
_REL_TOL = 1e-7  # of the absolute sums: far above float64 rounding (different hardware may sum in another
# order), far below what another seed changes (about 1/sqrt(numel) of the absolute sum)


def _h64(text: str) -> int:
    """A signed 64-bit hash of ``text`` (an int64 tensor element)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


def _text(value: object) -> str:
    return repr(value.value) if isinstance(value, enum.Enum) else repr(value)


def config_fields(cfg: EngineConfig) -> list[tuple[str, str]]:
    """(dotted field name, value text) of every config field that must agree across ranks."""
    out = [("device.type", repr(cfg.device.type))]

    def walk(obj: object, prefix: str) -> None:
        assert dataclasses.is_dataclass(obj)
        for f in dataclasses.fields(obj):
            name = prefix + f.name
            if name in MAY_DIFFER:
                continue
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, name + ".")
            else:
                out.append((name, _text(value)))

    walk(cfg, "")
    return out


def _config_key(name: str) -> str:
    """The key a user writes in the config for a dotted EngineConfig field (from the fields'
    metadata: Note [config sections] in :mod:`chunkstar.config`)."""
    if name == "device.type":
        return "device"
    obj: Any = EngineConfig
    key: str | None = None
    for part in name.split("."):
        f = next((f for f in dataclasses.fields(obj) if f.name == part), None)
        if f is None:
            return name
        key = f.metadata.get("key", key)
        obj = _SECTIONS.get(part)  # the annotations are strings here (from __future__ import annotations)
        if obj is None:
            break
    return key or name


_SECTIONS: dict[str, Any] = {
    "placement": PlacementConfig, "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
    "loss_scale": LossScaleConfig, "disk": DiskConfig, "activations": ActivationsConfig,
}


def weights_checksum(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per parameter, in float64: sum, sum of absolute values, position-weighted
    sum, and position-weighted sum of absolute values.

    Returns a ``[len(params), 4]`` float64 CPU tensor. The weighted sum (weights
    1..B within each block of B elements, times the block's number) tells apart
    permuted or transposed values, which plain sums miss. Reads each parameter
    where it is (CPU or GPU), with one block of float64 temporaries at a time."""
    rows: list[torch.Tensor] = []
    ramps: dict[torch.device, torch.Tensor] = {}  # 1-D float64, 1..B, per device
    with torch.no_grad():
        for p in params:
            flat = p.detach().reshape(-1)
            ramp = ramps.get(flat.device)
            if ramp is None:
                ramp = ramps[flat.device] = torch.arange(1, _BLOCK + 1, dtype=torch.float64, device=flat.device)
            row = torch.zeros(4, dtype=torch.float64, device=flat.device)
            for b, start in enumerate(range(0, flat.numel(), _BLOCK)):
                blk = flat[start : start + _BLOCK].double()
                absb = blk.abs()
                w = ramp[: blk.numel()]
                row += torch.stack([blk.sum(), absb.sum(), (b + 1) * torch.dot(blk, w), (b + 1) * torch.dot(absb, w)])
            rows.append(row)
    if not rows:
        return torch.zeros(0, 4, dtype=torch.float64)
    return torch.stack(rows).cpu()


def _between(groups: list[list[int]]) -> str:
    """'rank 0 and rank 1', 'ranks 0, 2 and ranks 1, 3', 'rank 0, rank 1 and rank 2'."""
    names = [f"rank {g[0]}" if len(g) == 1 else "ranks " + ", ".join(map(str, g)) for g in groups]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _partition(values: Sequence[object]) -> list[list[int]]:
    """Ranks grouped by equal value, groups in order of their first rank."""
    groups: dict[object, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    return list(groups.values())


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two rows of :func:`weights_checksum` agree: each signed sum within the tolerance
    of the larger of the two absolute sums that bound it."""
    if bool((a.view(torch.int64) == b.view(torch.int64)).all()):  # the same bits (NaN included)
        return True
    scale = torch.maximum(a[[1, 3]], b[[1, 3]])
    return bool(((a[[0, 2]] - b[[0, 2]]).abs() <= _REL_TOL * scale).all())


def _weights_verdict(sums: list[torch.Tensor], names: Sequence[str]) -> str | None:
    """The first parameter whose checksums differ between ranks, as a message; None if none."""
    for i, name in enumerate(names):
        groups: list[list[int]] = []
        for r in range(len(sums)):
            for g in groups:
                if _close(sums[r][i], sums[g[0]][i]):
                    g.append(r)
                    break
            else:
                groups.append([r])
        if len(groups) > 1:
            return (
                f"initial weights differ between {_between(groups)} (first at parameter '{name}'): build the model "
                "from the same seed on every rank (torch.manual_seed before model_func), or load the same weights "
                "on every rank"
            )
    return None


def agree_on_startup(
    comm: Comm,
    cfg: EngineConfig,
    layout: ChunkLayout,
    params: Sequence[torch.Tensor] | str,
) -> str:
    """Check that every rank builds the same engine (Note [start-up agreement]); return the run id.

    ``params`` are the model's unique parameters in layout order, as this rank
    built them (before they move into chunks), or, where the values are not all
    on every rank to checksum (a meta-device model, a checkpoint read in shares),
    a fingerprint of where they come from (the RNG state, the checkpoint's
    tensors). Raises :class:`DistributedError` on every rank when anything that
    must agree differs."""
    run = uuid.uuid4()
    if not comm.distributed:
        return run.hex
    device = cfg.device
    fields = config_fields(cfg)
    dtype = str(cfg.precision.dtype)
    run_words = [int.from_bytes(run.bytes[:8], "little", signed=True), int.from_bytes(run.bytes[8:], "little", signed=True)]
    head = [
        _h64("\n".join(name for name, _ in fields)),
        *run_words,
        _h64(layout_fingerprint(layout, dtype)),
        _h64(dtype),
        len(params) if not isinstance(params, str) else len(layout.slots),
        _h64(params) if isinstance(params, str) else 0,
    ]
    vector = head + [_h64(f"{name}={value}") for name, value in fields]

    sizes = comm.all_gather_ints([len(vector)], "the start-up check's sizes", device)
    if len({s[0] for s in sizes}) > 1:
        raise DistributedError(
            f"rank {comm.rank} of {comm.world_size}: the ranks run different chunkstar versions (start-up "
            f"fingerprints of {', '.join(str(s[0]) for s in sizes)} numbers, by rank): install the same version everywhere"
        )
    everyone = comm.all_gather_ints(vector, "the start-up fingerprints", device)

    problems: list[str] = []
    if len(_partition([v[0] for v in everyone])) > 1:
        problems.append("the config schemas differ (different chunkstar versions): install the same version everywhere")
    else:
        for i, (name, value) in enumerate(fields):
            groups = _partition([v[len(head) + i] for v in everyone])
            if len(groups) > 1:
                problems.append(
                    f"config field '{name}' (config key '{_config_key(name)}') differs between {_between(groups)}; "
                    f"this rank ({comm.rank}) has {value}"
                )
    groups = _partition([v[3] for v in everyone])
    if len(groups) > 1:
        problems.append(
            f"the chunk layout (chunk sizes; order, names and shapes of the parameters) differs between {_between(groups)}: "
            "every rank must build the same model with the same chunk size"
        )
    groups = _partition([v[4] for v in everyone])
    if len(groups) > 1:
        problems.append(f"the compute dtype differs between {_between(groups)}; this rank ({comm.rank}) has {dtype}")
    if isinstance(params, str):
        groups = _partition([v[6] for v in everyone])
        if len(groups) > 1:
            problems.append(
                f"the initial weights' origin (the RNG state the initialisers draw from, the pretrained checkpoint's "
                f"tensors) differs between {_between(groups)}: seed every rank alike (torch.manual_seed) before "
                "initialize_engine, and give every rank the same pretrained checkpoint"
            )
    elif len({v[5] for v in everyone}) == 1:  # same parameter count: the checksums line up
        own = weights_checksum(params).to(comm.exchange_device(device))
        outs = [torch.empty_like(own) for _ in range(comm.world_size)]
        comm.all_gather_group(outs, own, what="the initial weights' checksums")
        verdict = _weights_verdict([t.cpu() for t in outs], [s.name for s in layout.slots])
        if verdict is not None:
            problems.append(verdict)
    if problems:
        raise DistributedError(
            f"rank {comm.rank} of {comm.world_size}: the ranks do not agree at start-up (training would mix their "
            "weights or hang in a collective):\n  - " + "\n  - ".join(problems)
        )
    hi, lo = everyone[0][1], everyone[0][2]  # rank 0's run id
    return uuid.UUID(bytes=hi.to_bytes(8, "little", signed=True) + lo.to_bytes(8, "little", signed=True)).hex
