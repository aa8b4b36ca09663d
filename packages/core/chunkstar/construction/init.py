"""How a model built on the meta device gets its initial values: each module's own
initialiser, and its buffers rebuilt for real.

A model built under ``with torch.device("meta"):`` has shapes but no values.
Its parameters are materialised by :mod:`chunkstar.construction.materialize`
straight into the chunks; this module says what values they then get
(:func:`init_weights`) and where the buffers come from
(:func:`rebuild_buffers`). It moves no chunk and knows nothing of ranks.

Note [meta initialisation]: :func:`init_weights` does what building the model
for real would have done, in the same spirit and the same order kinds:

1. ``reset_parameters()`` of every module that has one, in registration order
   (what each ``nn.Linear``, ``nn.Embedding``, norm ... constructor ran);
   ``nn.MultiheadAttention``'s ``_reset_parameters()`` likewise;
2. for each module inside a Hugging Face ``PreTrainedModel``, children before
   parents, that model's ``_initialize_weights(module)`` (what HF's
   ``post_init`` runs: the model's own scheme over ``_init_weights``, rotary
   ``inv_freq`` buffers included; a sub-model uses its own);
3. for PEFT LoRA layers, ``reset_lora_parameters(adapter, True)`` (PEFT's
   default: ``lora_A`` Kaiming-uniform, ``lora_B`` zero, so the adapted model
   starts as the base model).

Each of these calls draws from a generator seeded for that call alone, from
one base seed (drawn once from torch's global RNG: seed it alike on every rank
before ``initialize_engine``) and the module's position, so a value depends on
the seed and the model only: never on the world size, the rank, or which other
modules ran. That is what lets a rank, or a wave of a construction with the
masters on disk (Note [construction in waves]), run only the modules whose
parameters it fills (and their ancestors, whose initialisers may reach into
their children), and still get every value a single pass gives. The same
function applied to a plain model (``model.to_empty(device="cpu")``, then
``chunkstar.init_weights(model)``) gives the same values, bit for bit: that is
the reference the tests hold the engine to.

Note [meta buffers]: buffers computed in ``__init__`` (position ids, causal
masks, rotary caches) are lost on the meta device: their values were never
computed. :func:`rebuild_buffers` runs ``model_func`` a second time with every
factory call that asked for the meta device sent to the CPU instead, and each
parameter moved to the meta device as soon as it is registered, so only the
buffers become real and host memory holds one parameter at a time. The RNG is
forked around it, so the rebuild draws nothing from the user's stream.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = [
    "draw_base_seed", "init_weights", "meta_buffer_names", "meta_parameter_names", "meta_parameters", "modules_for",
    "rebuild_buffers",
]  # fmt: skip


def meta_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.is_meta]


def meta_buffer_names(model: nn.Module) -> list[str]:
    return [n for n, b in model.named_buffers() if b.is_meta]


def _is_hf_model(module: nn.Module) -> bool:
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers") for c in type(module).__mro__)


def _outermost_hf_models(model: nn.Module) -> list[nn.Module]:
    out: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        if _is_hf_model(m):
            out.append(m)
            return
        for child in m.children():
            walk(child)

    walk(model)
    return out


def _hf_init_guard() -> contextlib.AbstractContextManager[Any]:
    """transformers' guard that makes ``torch.nn.init`` respect its flags (as ``initialize_weights`` runs)."""
    try:
        from transformers import initialization
    except ImportError:
        return contextlib.nullcontext()
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if callable(guard) else contextlib.nullcontext()


def _post_order(model: nn.Module) -> list[tuple[nn.Module, nn.Module | None]]:
    """Every module, children before parents, with the Hugging Face model whose scheme
    initialises it (the nearest ``PreTrainedModel`` at or above it; None outside any)."""
    out: list[tuple[nn.Module, nn.Module | None]] = []

    def walk(m: nn.Module, hf: nn.Module | None) -> None:
        hf = m if _is_hf_model(m) else hf
        for child in m.children():
            walk(child, hf)
        out.append((m, hf))

    walk(model, None)
    return out


def draw_base_seed() -> int:
    """The base seed of :func:`init_weights`, drawn from torch's global RNG."""
    return int(torch.randint(0, 2**62, (1,)).item())


@torch.no_grad()
def init_weights(model: nn.Module, *, base_seed: int | None = None, only: set[int] | None = None) -> None:
    """Give every parameter (and rotary buffer) of ``model`` its initial value, the way
    building the model for real would (Note [meta initialisation]). The parameters
    must hold real storage (not the meta device), those of the modules in ``only`` at least.

    ``base_seed`` (default: drawn from torch's global RNG) seeds each module's call
    apart; ``only`` (ids of modules) runs just those modules' initialisers, which gives
    them the values a full pass would."""
    modules = list(model.modules())
    meta = [f"{n}.{k}".lstrip(".") for n, m in model.named_modules() if only is None or id(m) in only
            for k, p in m.named_parameters(recurse=False) if p.is_meta]  # fmt: skip
    if meta:
        raise ValueError(f"init_weights() needs real parameters, but {meta[:3]} are on the meta device (to_empty first)")
    seed = draw_base_seed() if base_seed is None else base_seed
    position = {id(m): i for i, m in enumerate(modules)}
    def run(phase: int, m: nn.Module, call: Callable[[], Any]) -> None:
        if only is not None and id(m) not in only:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed((seed * 1_000_003 + phase * 7_919 + position[id(m)] * 104_729) % (2**63))
            call()

    # Hugging Face skips modules and tensors it marked as initialised; here everything is
    # initialised, every time (a construction in waves calls this once per wave)
    for m in modules:
        for t in [m, *m.parameters(recurse=False), *m.buffers(recurse=False)]:
            if getattr(t, "_is_hf_initialized", False):
                setattr(t, "_is_hf_initialized", False)
    for m in modules:
        reset: Any = getattr(m, "_reset_parameters" if isinstance(m, nn.MultiheadAttention) else "reset_parameters", None)
        if callable(reset):
            run(1, m, reset)
    with _hf_init_guard():
        for m, hf in _post_order(model):
            if hf is None:
                continue
            initialize: Any = getattr(hf, "_initialize_weights", None) or getattr(hf, "_init_weights")
            run(2, m, lambda: initialize(m))
    for m in modules:
        adapters = getattr(m, "lora_A", None)
        reset_lora: Any = getattr(m, "reset_lora_parameters", None)
        if callable(reset_lora) and isinstance(adapters, nn.ModuleDict):
            for name in adapters.keys():
                run(3, m, lambda: reset_lora(name, True))


def modules_for(model: nn.Module, params: set[int]) -> set[int]:
    """Ids of the modules whose initialisers may write the parameters ``params`` (ids):
    the modules holding them and every ancestor of those."""
    out: set[int] = set()

    def walk(m: nn.Module, path: list[nn.Module]) -> None:
        here = [*path, m]
        if any(id(p) in params for p in m.parameters(recurse=False)):
            out.update(id(a) for a in here)
        for child in m.children():
            walk(child, here)

    walk(model, [])
    return out


class _MetaToCpu(TorchFunctionMode):
    """Factory calls that ask for the meta device (a ``torch.device("meta")`` block above
    this mode injects it) get the CPU instead."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "meta":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def _parameters_to_meta() -> Iterator[None]:
    """Every parameter registered inside moves to the meta device at once (its storage freed)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            moved = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            param = moved
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and their buffers for
    real (where they would be built without it): the engine then builds each parameter in
    its chunk (Note [construction] in :mod:`chunkstar.construction.materialize`), and the
    buffers need no second ``model_func()`` (Note [meta buffers]), so a model that cannot
    be built again (a LightningModule's ``configure_model``) can be built so. Each
    parameter is made for real first, then freed: one at a time, never the whole model."""
    with _parameters_to_meta():
        yield


def rebuild_buffers(model_func: Callable[[], nn.Module], names: list[str]) -> dict[str, torch.Tensor]:
    """The buffers ``names`` of ``model_func()``'s model, computed for real on the CPU
    (Note [meta buffers]). Raises ValueError naming any that stay on the meta device."""
    with torch.random.fork_rng(devices=[]), _parameters_to_meta(), _MetaToCpu():
        rebuilt = model_func()
    found = dict(rebuilt.named_buffers())
    missing = [n for n in names if n not in found]
    still_meta = [n for n in names if n in found and found[n].is_meta]
    if missing or still_meta:
        raise ValueError(
            f"buffers {(missing + still_meta)[:5]} of the meta-device model could not be computed for real "
            f"({'not built by a second model_func() call' if missing else 'still on the meta device when rebuilt'}): "
            "build the model with real buffers (only the parameters need the meta device), or give them values in "
            "a checkpoint passed as pretrained="
        )
    return {n: found[n] for n in names}
