"""Filling the chunks at start-up: from the model's own tensors, from a meta-device
model's initialisers, or from a checkpoint streamed tensor by tensor.

Note [construction]: the chunks are the only home the model's values ever get.
Every rank allocates the chunks it owns (all four lists, zero-filled; a frozen
chunk its param chunk only), then points each parameter at the place its value
lives (``torch.utils.swap_tensors``, so the Python object, its attributes and
every module that holds it stay the same; tied parameters are one object): the
fp32 master slot of a trainable parameter, the param slot of a frozen one, and,
for a parameter of a chunk another rank owns, a scratch buffer shared by all
such parameters (writes to it are thrown away; nothing reads it). Then:

* a parameter that came with real values (the model was built for real) is
  copied into its place, and its own storage freed with the swap, one
  parameter at a time;
* a meta-device parameter gets :func:`chunkstar.construction.init.init_weights`,
  which every rank runs over the whole model (Note [meta initialisation]),
  unless the checkpoint holds every parameter;
* with ``pretrained=``, each parameter the checkpoint holds is read from it
  into its place, on the rank that owns it only (bit-exact: the master is the
  file's value, widened exactly from bf16/fp16), overriding both.

Last, each trainable param slot is cast from its master. Host memory peaks at
the chunks' own bytes plus the scratch buffer (the largest parameter another
rank keeps) and one tensor of a checkpoint whose dtype differs from the
chunk's; never at the whole fp32 model beside its chunks.

Meta buffers are rebuilt for real (Note [meta buffers]) or read from the
checkpoint (persistent ones are in it).

Note [what a checkpoint may lack]: before anything is read, the checkpoint is
held against the model. One that matches none of its parameters is refused (a
``PretrainedError`` naming a few names of each side, so a prefix that differs is
visible): training would start from the initialisers, with a checkpoint the user
believes was loaded. Someone who wants that leaves out ``pretrained=``. A partial
match loads, and ``engine.construction`` lists what was loaded, what the
checkpoint lacks and what of it matched nothing, with a warning for the last two
naming how many and a few. The warning leaves out what checkpoints lack, or
hold, on purpose, so a real checkpoint of the model warns of nothing:

* a tied parameter is one parameter under several names, found under any of them
  (``save_pretrained`` stores one), and a checkpoint tensor found under any name
  of a parameter is used, even when another name was read;
* buffers are not asked for (non-persistent ones are never saved; missing ones
  keep their built or rebuilt values);
* a PEFT adapter's parameters (a tuner layer's ``adapter_layer_names``) are not
  in the base model's checkpoint: they are initialised, as PEFT does;
* Hugging Face's own exceptions: the model's ``_keys_to_ignore_on_load_missing``
  and ``_keys_to_ignore_on_load_unexpected`` patterns, and old checkpoints'
  ``rotary_emb.inv_freq`` and ``position_ids`` buffers, as ``from_pretrained``
  applies them.

Values are not judged, but a parameter read with NaN or infinities is named in
``engine.construction.nonfinite`` and warned about.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from chunkstar.chunk.layout import ChunkLayout, TensorSlot
from chunkstar.chunk.lists import ChunkList
from chunkstar.chunk.store import Chunks, ChunkStore
from chunkstar.construction.init import draw_base_seed, init_weights, meta_buffer_names, modules_for, rebuild_buffers
from chunkstar.construction.pretrained import PretrainedError, PretrainedSource, match_names
from chunkstar.device.tiers import holds_values, host_device

__all__ = ["ConstructionReport", "fill_chunks", "origin_fingerprint"]


@dataclass
class ConstructionReport:
    """How the chunks got their values (``engine.construction``)."""

    meta_params: int = 0
    """Parameters built on the meta device (initialised or read, never allocated whole)."""
    initialised: bool = False
    """Whether the model's initialisers ran (Note [meta initialisation])."""
    pretrained: str | None = None
    """The checkpoint read, if any."""
    loaded: list[str] = field(default_factory=list)
    """Parameter names read from the checkpoint (on any rank)."""
    not_in_checkpoint: list[str] = field(default_factory=list)
    """Parameter names the checkpoint lacks: initialised, or kept as built."""
    unused_keys: list[str] = field(default_factory=list)
    """Checkpoint tensors that match no parameter or buffer."""
    nonfinite: list[str] = field(default_factory=list)
    """Parameter names read from the checkpoint with NaN or infinite values (on this rank)."""
    bytes_read: int = 0
    """Checkpoint bytes this rank read."""
    rebuilt_buffers: list[str] = field(default_factory=list)
    """Meta buffers computed by a second ``model_func()`` (Note [meta buffers])."""


def origin_fingerprint(model: nn.Module, source: PretrainedSource | None) -> str:
    """What must agree across ranks when the values are not all on every rank to checksum:
    the RNG state the initialisers will draw from, and the checkpoint's tensors (names,
    dtypes, shapes, sizes). A hex digest (Note [start-up agreement])."""
    h = hashlib.sha256()
    h.update(bytes(torch.random.get_rng_state().tolist()))
    if source is not None:
        for key in sorted(source.keys):
            h.update(f"{key}:{source.dtype(key)}:{source.shape(key)};".encode())
    h.update(str(sum(p.numel() for p in model.parameters())).encode())
    return h.hexdigest()


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    module._buffers[leaf] = value


def _prefixes(model: nn.Module) -> list[str]:
    # a PEFT model names its base model's tensors "base_model.model.<base name>"
    out: list[str] = ["base_model.model"] if type(model).__name__.startswith("Peft") else []
    for m in model.modules():
        p = getattr(m, "base_model_prefix", None)
        if isinstance(p, str) and p and p not in out:
            out.append(p)
    return out


def _patterns(model: nn.Module, attribute: str) -> list[str]:
    """The regexes of a Hugging Face load exception list (``_keys_to_ignore_on_load_*``) of any module."""
    out: list[str] = []
    for m in model.modules():
        found = getattr(m, attribute, None)
        if isinstance(found, (list, tuple, set, frozenset)):
            out += sorted(p for p in found if isinstance(p, str) and p not in out)
    return out


def _search(patterns: list[str]) -> Callable[[str], bool]:
    if not patterns:
        return lambda name: False
    rx = re.compile("|".join(f"(?:{p})" for p in patterns))
    return lambda name: rx.search(name) is not None


def _may_lack(model: nn.Module, names_of: dict[int, list[str]]) -> Callable[[nn.Parameter], bool]:
    """Whether a checkpoint may leave out a parameter without a warning (Note [what a checkpoint may lack])."""
    adapters: set[int] = set()
    for m in model.modules():
        layers = getattr(m, "adapter_layer_names", None)  # a PEFT tuner layer's adapter submodules
        if isinstance(layers, (list, tuple)):
            for attr in layers:
                sub = getattr(m, attr, None) if isinstance(attr, str) else None
                if isinstance(sub, nn.Module):
                    adapters.update(id(p) for p in sub.parameters())
    ignored = _search(_patterns(model, "_keys_to_ignore_on_load_missing"))
    return lambda p: id(p) in adapters or any(ignored(n) for n in names_of[id(p)])


def _may_hold(model: nn.Module) -> Callable[[str], bool]:
    """Whether a checkpoint may hold a tensor the model has no place for without a warning (as
    ``from_pretrained`` judges: Note [what a checkpoint may lack])."""
    patterns = _patterns(model, "_keys_to_ignore_on_load_unexpected")
    buffers = [n for n, _ in model.named_buffers()]
    if any(n.endswith("rotary_emb.inv_freq") for n in buffers):  # moved out of every layer
        patterns.append(r"rotary_emb\.inv_freq")
    if any(n.endswith("position_ids") for n in buffers):  # persistent in older versions
        patterns.append(r"(^|\.)position_ids$")
    return _search(patterns)


def _held_against(
    model: nn.Module, source: PretrainedSource, params: list[nn.Parameter], slots: Sequence[TensorSlot],
    names_of: dict[int, list[str]], key_of: dict[int, str], used: set[str], report: ConstructionReport,
) -> None:  # fmt: skip
    """Refuse a checkpoint that matches no parameter, or whose tensors do not fit theirs; report
    and warn of what it lacks and what of it matches nothing (Note [what a checkpoint may lack])."""
    if not key_of:
        keys = sorted(source.keys)
        seen = "it holds no tensors" if not keys else (
            f"none of the model's parameters is in it (the model has {[s.name for s in slots[:3]]}, "
            f"the checkpoint {keys[:3]})"
        )  # fmt: skip
        raise PretrainedError(
            f"{source.path}: {seen}; pass this model's checkpoint (names may differ only by the model's "
            "base_model_prefix), or leave out pretrained= to train from the model's initialisation"
        )
    for i, key in key_of.items():
        source.check(key, slots[i].shape, params[i].dtype, f"parameter {slots[i].name!r}")
    report.loaded = [slots[i].name for i in sorted(key_of)]
    report.not_in_checkpoint = [s.name for s in slots if s.index not in key_of]
    report.unused_keys = sorted(source.keys - used)
    may_lack = _may_lack(model, names_of)
    lacking = [s.name for s in slots if s.index not in key_of and not may_lack(params[s.index])]
    if lacking:
        warnings.warn(
            f"{source.path}: {len(lacking)} of the model's {len(slots)} parameters are not in the checkpoint and "
            f"start from the model's initialisation, e.g. {lacking[:3]} (engine.construction.not_in_checkpoint)",
            stacklevel=3,
        )
    may_hold = _may_hold(model)
    unexpected = [k for k in report.unused_keys if not may_hold(k)]
    if unexpected:
        warnings.warn(
            f"{source.path}: {len(unexpected)} of the checkpoint's {len(source.keys)} tensors match no parameter or "
            f"buffer of the model and are not read, e.g. {unexpected[:3]} (engine.construction.unused_keys)",
            stacklevel=3,
        )


def _rehome(model: nn.Module, p: nn.Parameter, place: torch.Tensor, *, fresh: bool = False) -> nn.Parameter:
    """Point parameter ``p`` at ``place``; returns the parameter object that now does.

    A real parameter takes ``place`` as its ``.data`` (its old storage is freed). A meta
    one cannot (``set_data`` refuses another device type), so the tensors are swapped
    under the same Python object (``torch.utils.swap_tensors``); a parameter something
    holds a weak reference to (an RNN's flat weights) cannot be swapped, so a new
    object takes its place in every module that holds it (RNNs refresh their flat weights).
    ``fresh``: swapped even when real, so that ``p`` no longer shares its version counter
    with what it viewed before (Note [a parameter's version counter])."""
    if not p.is_meta and not fresh:
        p.data = place
        return p
    new = nn.Parameter(place, requires_grad=p.requires_grad)
    # the parameter's own attributes go along, but not Hugging Face's record that it was
    # initialised (a meta build ties weights and marks them so; their values were never made)
    new.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_hf_initialized"})
    try:
        torch.utils.swap_tensors(p, new)  # p now views its place; the meta tensor leaves with `new`
        return p
    except RuntimeError:
        pass
    for m in model.modules():
        for name, q in list(m._parameters.items()):
            if q is p:
                m._parameters[name] = new
        refresh = getattr(m, "_init_flat_weights", None)
        if callable(refresh):
            refresh()
    return new


def fill_chunks(
    model: nn.Module,
    params: list[nn.Parameter],
    layout: ChunkLayout,
    store: ChunkStore,
    allocate: Callable[[int], None],
    *,
    model_func: Callable[[], nn.Module] | None = None,
    source: PretrainedSource | None = None,
    wave_bytes: int = 0,
) -> ConstructionReport:
    """Give every chunk this rank owns its values (Note [construction]); ``params`` are the
    model's unique parameters in layout order, ``allocate(chunk_id)`` allocates a chunk's
    lists on the host (the store's). Afterwards each parameter is a view of its value's
    place in the chunks (the caller points it at the param chunk's device views); an
    entry of ``params`` may have been replaced by a new object (see :func:`_rehome`).
    With the masters on disk, the chunks are filled in waves of at most ``wave_bytes`` of
    masters (Note [construction in waves])."""
    report = ConstructionReport(pretrained=None if source is None else str(source.path))
    slots = layout.slots
    report.meta_params = sum(1 for p in params if p.is_meta)

    # names: every parameter under all of its (tied) names; buffers by name
    names_of: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)
    all_names = [n for p in params for n in names_of[id(p)]]
    matched = match_names(all_names, source.keys, _prefixes(model)) if source is not None else {}
    key_of: dict[int, str] = {}
    for i, p in enumerate(params):
        for n in names_of[id(p)]:
            if n in matched:
                key_of[i] = matched[n]
                break

    # buffers: real already, read from the checkpoint, or rebuilt (Note [meta buffers])
    meta_buffers = meta_buffer_names(model)
    buffers = dict(model.named_buffers())
    buffer_keys = match_names(list(buffers), source.keys, _prefixes(model)) if source is not None else {}
    if source is not None:  # everything is checked before anything is read or rebuilt
        for n, key in buffer_keys.items():
            source.check(key, buffers[n].shape, buffers[n].dtype, f"buffer {n!r}")
        used = set(matched.values()) | set(buffer_keys.values())  # a tied parameter's every name
        _held_against(model, source, params, slots, names_of, key_of, used, report)
    to_rebuild = [n for n in meta_buffers if n not in buffer_keys]
    if to_rebuild:
        if model_func is None:
            raise ValueError(f"buffers {to_rebuild[:5]} are on the meta device and there is no model_func to rebuild them")
        for n, value in rebuild_buffers(model_func, to_rebuild).items():
            _set_buffer(model, n, value)
        report.rebuilt_buffers = to_rebuild
    if source is not None:
        for n, b in list(model.named_buffers()):
            if n in buffer_keys:
                value = torch.empty(b.shape, dtype=b.dtype)
                source.read_into(buffer_keys[n], value.reshape(-1))
                _set_buffer(model, n, value)

    # on the meta device nothing has values to initialise (Note [the meta device] in device/tiers.py)
    needs_init = report.meta_params > 0 and len(key_of) < len(params) and holds_values(store.chunks.device)
    job = _Fill(model, params, layout, store, allocate, key_of, source, needs_init)
    if store.chunks.disk is not None:
        _fill_in_waves(job, wave_bytes)
    else:
        _fill_at_once(job)
    report.initialised = needs_init
    if source is not None:
        report.bytes_read = source.bytes_read
        name_of = {key: slots[i].name for i, key in key_of.items()}
        report.nonfinite = sorted(name_of[k] for k in set(source.nonfinite) if k in name_of)
        if report.nonfinite:
            warnings.warn(
                f"{source.path}: {len(report.nonfinite)} parameters hold NaN or infinite values in the checkpoint, "
                f"e.g. {report.nonfinite[:3]}; they are loaded as they are, and training from them gives NaN losses "
                "(engine.construction.nonfinite)",
                stacklevel=2,
            )
    return report


@dataclass
class _Fill:
    """What both ways of filling the chunks work on: the model, its parameters in layout order
    (entries are replaced as parameters are rehomed), the store and its allocator, the
    checkpoint's key for each parameter index it holds, and whether initialisers run."""

    model: nn.Module
    params: list[nn.Parameter]
    layout: ChunkLayout
    store: ChunkStore
    allocate: Callable[[int], None]
    key_of: dict[int, str]
    source: PretrainedSource | None
    needs_init: bool


def _cast_params(chunks: Chunks, chunk_ids: Iterable[int]) -> None:
    """Each trainable param chunk from its master (a frozen chunk's param slots are its values already)."""
    for cid in chunk_ids:
        if chunks.own(cid) and not chunks.frozen(cid):
            with chunks.staged([(ChunkList.PARAM, cid)], write=True):  # from its file and back, if it lives there
                chunks.chunk(ChunkList.PARAM, cid).payload.copy_(chunks.chunk(ChunkList.MASTER, cid).payload)


def _fill_at_once(job: _Fill) -> None:
    """Every value in memory: one pass (Note [construction])."""
    model, params, layout, store, allocate = job.model, job.params, job.layout, job.store, job.allocate
    key_of, source, needs_init = job.key_of, job.source, job.needs_init
    chunks = store.chunks
    slots = layout.slots
    # chunk by chunk: allocate the chunks this rank owns, then point each parameter at its
    # value's place; a real parameter's own storage is freed as it goes, so host memory
    # holds the model's tensors or their chunks, not both
    scratch = _scratch([s for s in slots if not chunks.own(s.chunk_id)], host_device(chunks.device))
    real: list[int] = []  # slot indices of parameters that came with values
    for cid in range(layout.n_chunks):
        allocate(cid)
        for s in store.slots_of(cid):
            p = params[s.index]
            own = chunks.own(cid)
            place = chunks.value_view(s).view(s.shape) if own else scratch[: s.numel].view(s.shape)
            if not p.is_meta:
                if own:
                    with torch.no_grad():
                        place.copy_(p.detach())
                real.append(s.index)
            params[s.index] = _rehome(model, p, place)
    with torch.no_grad():
        if needs_init:
            # init_weights re-initialises the parameters that came with values too: keep those
            saved = [(i, chunks.value_view(slots[i]).clone()) for i in real if chunks.own(slots[i].chunk_id)]
            # each rank runs the initialisers of the modules holding its own parameters (and their
            # ancestors): the values do not depend on which modules run (Note [meta initialisation])
            own_params = {id(params[s.index]) for s in slots if chunks.own(s.chunk_id)}
            everything = len(own_params) == len(params)
            init_weights(model, only=None if everything else modules_for(model, own_params))
            for i, t in saved:
                chunks.value_view(slots[i]).copy_(t)
        if source is not None:
            for i, key in key_of.items():
                if chunks.own(slots[i].chunk_id):
                    source.read_into(key, chunks.value_view(slots[i]))
        _cast_params(chunks, range(layout.n_chunks))


def _scratch(slots: list[TensorSlot], device: torch.device) -> torch.Tensor:
    """One fp32 buffer every parameter without a place of its own views (aliased: written, never
    read), on the host tier (the meta device's is meta: Note [the meta device])."""
    return torch.empty(max((s.numel for s in slots), default=0), dtype=torch.float32, device=device)


# Note [a parameter's version counter]: a meta parameter takes its place as a new Parameter
# made from a view of a chunk buffer, and such a Parameter shares that buffer's version
# counter (as ``detach()`` does); assigning ``.data`` later keeps it. autograd checks the
# counter of every parameter a forward saved, and the engine reads it to see writes (Note
# [clean host copy], Note [writes in a forward]). A master buffer is its own chunk's, written
# only by its own update; a staging buffer of the disk tier goes on to hold any chunk (a
# param chunk copied back mid-backward, an update's result), and every write there would
# count as a write of the parameters that once viewed it: autograd then refuses the
# backward. So a wave's parameters leave its staging buffers as fresh Parameters, each
# viewing a one-element placeholder of its own.
def _placeholder(chunks: Chunks, shape: tuple[int, ...]) -> torch.Tensor:
    """A one-element tensor of its own (its own version counter), expanded to ``shape``; on the
    host tier's device (meta in a dry run, as the chunks)."""
    return torch.zeros(1, device=host_device(chunks.device)).expand(shape)


def _wave_lists(chunks: Chunks, chunk_id: int) -> list[ChunkList]:
    """The lists of chunk ``chunk_id`` a wave stages: those of its lists that live on disk
    and hold values (the master, or a frozen chunk's param chunk; the param chunk of a
    trainable one too, cast from its master in the wave)."""
    lists = [ChunkList.PARAM] if chunks.frozen(chunk_id) else [ChunkList.MASTER, ChunkList.PARAM]
    return [n for n in lists if chunks.on_disk(n)]


def _fill_in_waves(job: _Fill, wave_bytes: int) -> None:
    """Note [construction in waves]: with the masters on disk, they are never all in host
    memory, so the chunks are filled a wave at a time: the masters of a few chunks (at most
    ``wave_bytes``) are staged in, their parameters point into them and every other
    parameter at the shared scratch buffer, the values are made (a real parameter's copied,
    the checkpoint's read, or the initialisers run over the whole model), the param chunks
    cast from them, and the masters written back to disk. Each wave runs the initialisers
    of the modules holding its parameters and of their ancestors only, each call seeded
    apart from one base seed (Note [meta initialisation]), so every value is the one a
    single pass gives, whatever the waves, and the initialisers cost about one pass in all
    (the ancestors' own calls repeat, and they are small)."""
    model, params, layout, store, allocate = job.model, job.params, job.layout, job.store, job.allocate
    key_of, source, needs_init = job.key_of, job.source, job.needs_init
    chunks = store.chunks
    slots = layout.slots
    if needs_init and any(not p.is_meta for p in params):
        raise ValueError(
            "a model with some parameters on the meta device and some real ones cannot be initialised with the "
            "masters on disk (the initialisers would overwrite the real values before their turn): build all "
            "parameters on the meta device, or give their values in pretrained="
        )
    for cid in range(layout.n_chunks):
        allocate(cid)  # the disk lists' chunks on disk (zeros), the others on the host
    # a wave's chunks of the lists on disk are staged at once: a master, and the param chunk
    # (trainable or frozen) when its home is a file too (Note [param chunks on disk])
    params_on_disk = chunks.on_disk(ChunkList.PARAM)
    waves: list[list[int]] = [[]]
    size = 0
    frozen_own: list[int] = []
    for cid in range(layout.n_chunks):
        if not chunks.own(cid):
            continue
        if chunks.frozen(cid) and not params_on_disk:
            frozen_own.append(cid)  # in memory (param list only): the first wave
            continue
        nbytes = sum(chunks.chunk(n, cid).nbytes for n in _wave_lists(chunks, cid))
        if waves[-1] and size + nbytes > wave_bytes:
            waves.append([])
            size = 0
        waves[-1].append(cid)
        size += nbytes
    waves[0] = frozen_own + waves[0]
    base_seed = draw_base_seed() if needs_init else 0  # one draw from the user's RNG, as one pass makes
    slot_of = {id(p): s for s, p in zip(slots, params)}
    for wave in waves:
        members = set(wave)
        # the modules whose initialisers run in this wave, and the parameters they may touch:
        # this wave's get their places; the others they hold (an ancestor's own, a tied one)
        # a scratch buffer of this wave; every other parameter is left alone (nothing runs it)
        run: set[int] = set()
        touched: list[TensorSlot] = []
        if needs_init:
            run = modules_for(model, {id(params[s.index]) for s in slots if s.chunk_id in members})
            seen: set[int] = set()
            for m in model.modules():
                if id(m) in run:
                    for q in m.parameters(recurse=False):
                        if id(q) not in seen:
                            seen.add(id(q))
                            touched.append(slot_of[id(q)])
        scratch = _scratch([s for s in touched if s.chunk_id not in members], host_device(chunks.device))  # written, never read
        with chunks.staged([(n, c) for c in wave for n in _wave_lists(chunks, c)], write=True), torch.no_grad():
            placed = [*(s for s in slots if s.chunk_id in members), *(s for s in touched if s.chunk_id not in members)]
            for s in placed:
                p = params[s.index]
                here = s.chunk_id in members
                place = chunks.value_view(s).view(s.shape) if here else scratch[: s.numel].view(s.shape)
                if here and not p.is_meta:
                    place.copy_(p.detach())  # its own values (a real model): its storage is freed next
                params[s.index] = _rehome(model, p, place)
            if needs_init:
                init_weights(model, base_seed=base_seed, only=run)
            if source is not None:
                for i, key in key_of.items():
                    if slots[i].chunk_id in members:
                        source.read_into(key, chunks.value_view(slots[i]))
            _cast_params(chunks, wave)
            # nothing may keep viewing this wave's staging buffers once they go back to the pool:
            # a view would keep a buffer alive after the pool dropped it (host memory past the
            # budget), and share its version counter (Note [a parameter's version counter])
            for s in placed:
                params[s.index] = _rehome(model, params[s.index], _placeholder(chunks, s.shape), fresh=True)
        # leaving the block writes the wave's masters behind; their buffers go to the next wave
        del scratch
    # nor stay on the meta device (another rank's parameters, say): a one-element placeholder
    # each, until the caller points them at the param chunks' device views
    for s in slots:
        if params[s.index].is_meta:
            params[s.index] = _rehome(model, params[s.index], _placeholder(chunks, s.shape))
