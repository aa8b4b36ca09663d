"""Each block's forward, run as its activation policy says: mechanism.

The engine wraps the forward of every block (:func:`~chunkstar.activations.blocks.find_blocks`)
once, as an attribute of the block object, so neither the model's class nor its
code changes and :meth:`BlockActivations.remove` gives the model back as it was.
The wrapper reads the block's policy at each call, so a plan can change between
iterations without wrapping again:

* keep: the forward as it is;
* checkpoint: ``torch.utils.checkpoint.checkpoint`` around the forward, non-reentrant,
  with the RNG state preserved (a dropout draws the same mask again in the
  recomputation), so gradients equal keeping's; a key/value cache the forward
  would write is left out (:func:`_without_cache`);
* offload: the forward inside :meth:`HostOffload.block_call` (Note [activation offload]).

Without gradients (evaluation, ``torch.no_grad``, ``inference_mode``) nothing is
saved, and every block runs as kept. A block the model already checkpoints
(Hugging Face's ``gradient_checkpointing_enable()``) keeps its own
checkpointing: the wrapper runs inside it and does nothing more.

The block's own forward hooks (the engine's, which make its parameters resident)
sit outside the wrapped forward, in ``Module.__call__``; a recomputation runs the
forward alone, inside the block's backward, whose hooks have made them resident
again (Note [activation policies] in :mod:`chunkstar.activations`).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunkstar.activations.offload import HostOffload, SavedBytes
from chunkstar.config import ActivationPolicy

__all__ = ["BlockActivations"]


class _Measure:
    """One block's measurements while the plan is measured (Note [activation plan] in
    :mod:`chunkstar.activations.plan`): per iteration, summed over its calls."""

    __slots__ = (
        "saved", "small", "inputs", "forward_s", "calls", "back", "_it_saved", "_it_small", "_it_s", "_it_calls", "_timers",
        "_it_back",
    )  # fmt: skip

    def __init__(self) -> None:
        self.saved = 0  # bytes offloaded in one iteration (the largest iteration's)
        self.small = 0  # bytes of small saved tensors left on the device
        self.inputs = 0  # bytes of its tensor inputs (the largest iteration's)
        self.forward_s: float | None = None  # forward seconds in one iteration (the fastest iteration's)
        self.calls = 0  # calls in one iteration
        self.back: dict[int, int] = {}  # moment -> bytes the backward brought back then (the last iteration's)
        self._it_back: dict[int, int] = {}
        self._it_saved = self._it_small = self._it_calls = 0
        self._it_s = 0.0
        self._timers: list[tuple[Any, Any, float]] = []  # CUDA: (start, end, seconds waited) per call

    def add(self, saved: SavedBytes, inputs: int, seconds: float | None, timer: tuple[Any, Any] | None) -> None:
        self._it_saved += saved.large
        self._it_small += saved.small
        self._it_calls += 1
        self.inputs = max(self.inputs, inputs)
        if timer is not None:
            self._timers.append((*timer, saved.waited_s))
        elif seconds is not None:
            self._it_s += max(seconds - saved.waited_s, 0.0)

    def brought_back(self, moment: int, nbytes: int) -> None:
        self._it_back[moment] = self._it_back.get(moment, 0) + nbytes

    def close_iteration(self) -> None:
        if not self._it_calls:
            return
        self.back, self._it_back = self._it_back, {}
        if self._timers:
            torch.cuda.synchronize()
            self._it_s += sum(max(a.elapsed_time(b) / 1e3 - w, 0.0) for a, b, w in self._timers)
            self._timers.clear()
        self.saved = max(self.saved, self._it_saved)
        self.small = max(self.small, self._it_small)
        self.calls = max(self.calls, self._it_calls)
        self.forward_s = self._it_s if self.forward_s is None else min(self.forward_s, self._it_s)
        self._it_saved = self._it_small = self._it_calls = 0
        self._it_s = 0.0


class BlockActivations:
    """The blocks of one model and the policy each runs under (the module docstring).

    ``policy`` AUTO: every block runs offloaded while :attr:`measuring` (the measuring policy,
    Note [activation plan]), each call measured, until :meth:`apply` sets the plan."""

    def __init__(
        self, blocks: Sequence[nn.Module], policy: ActivationPolicy, offload: HostOffload, names: Sequence[str] | None = None
    ) -> None:
        self.blocks = list(blocks)
        self.names = list(names) if names is not None else [type(b).__name__ for b in self.blocks]
        self.auto = policy is ActivationPolicy.AUTO
        self.policies = [ActivationPolicy.OFFLOAD if self.auto else policy] * len(self.blocks)
        """Each block's policy, by position in :attr:`blocks` (read at every call)."""
        self.measuring = self.auto
        """Calls are measured for a plan (AUTO, until the plan is applied)."""
        self.measures = [_Measure() for _ in self.blocks]
        self.offload = offload
        if self.measuring:
            self._measuring_copies()
        self.recomputed_calls = 0
        self.offloaded_calls = 0
        self.timing = False
        """Time each block's forward in the next training iteration (a frozen step under the plan:
        the warm-up's times include its chunk loads, which the frozen schedule prefetches)."""
        self.frozen_measures = [_Measure() for _ in self.blocks]
        self._timed_by_events = offload.device.type == "cuda"
        self.cost: Callable[[Callable[[], Any]], tuple[Any, float]] | None = None
        """How a measured call's forward seconds are known: None, timed as it runs; a dry run
        sets its FLOPs at the target's rate (``cost(run) -> (output, seconds)``)."""
        self._originals: list[Callable[..., Any] | None] = []
        for i, block in enumerate(self.blocks):
            own = block.__dict__.get("forward")  # an instance forward the user set, kept under ours
            self._originals.append(own)
            block.forward = self._wrapped(i, own if own is not None else block.forward)  # type: ignore[method-assign]

    def _wrapped(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        block = self.blocks[index]
        name = self.names[index]

        def call(policy: ActivationPolicy, args: tuple[Any, ...], kwargs: dict[str, Any], saved: SavedBytes | None) -> Any:
            if policy is ActivationPolicy.OFFLOAD:
                self.offloaded_calls += 1
                with self.offload.block_call(name, saved):
                    return forward(*args, **kwargs)
            if policy is ActivationPolicy.KEEP:
                out = forward(*args, **kwargs)
            else:
                self.recomputed_calls += 1
                out = checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **_without_cache(block, kwargs))
            # the offloaded block before this one lets its device bytes go at this block's end, as the
            # plan counts them (Note [activation offload])
            t0 = time.perf_counter()
            self.offload.block_ended()
            if saved is not None:
                saved.waited_s += time.perf_counter() - t0
            return out

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            policy = self.policies[index]
            # a block the model checkpoints itself (Hugging Face's GradientCheckpointingLayer, once
            # gradient_checkpointing_enable() ran) is recomputed already: read at each call
            if not torch.is_grad_enabled() or getattr(block, "gradient_checkpointing", False):
                return forward(*args, **kwargs)
            if self.measuring and policy is ActivationPolicy.OFFLOAD:
                self.offloaded_calls += 1
                return self._measured(index, forward, args, kwargs)
            if self.timing:
                return self._timed(index, lambda saved: call(policy, args, kwargs, saved))
            return call(policy, args, kwargs, None)

        return run

    def _timed(self, index: int, call: Callable[[SavedBytes], Any]) -> Any:
        """One call timed on a frozen step: its forward's seconds, waits for copies excluded."""
        saved = SavedBytes()
        timer = None
        if self._timed_by_events:
            timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timer[0].record()
        t0 = time.perf_counter()
        out = call(saved)
        seconds = time.perf_counter() - t0
        if timer is not None:
            timer[1].record()
        self.frozen_measures[index].add(saved, 0, seconds, timer)
        return out

    def _measured(self, index: int, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        saved = SavedBytes()
        device = self.offload.device
        # what a recomputation would keep instead: the inputs' storages (a view of a larger one keeps it all)
        inputs = sum(t.untyped_storage().nbytes() for t in _tensors(args, kwargs) if t.device == device and t.is_floating_point())
        if self.cost is not None:
            with self.offload.block_call(self.names[index], saved):
                out, seconds = self.cost(lambda: forward(*args, **kwargs))
            self.measures[index].add(saved, inputs, seconds + saved.waited_s, None)
            return out
        timer = None
        if self._timed_by_events:
            timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timer[0].record()
        t0 = time.perf_counter()
        with self.offload.block_call(self.names[index], saved):
            out = forward(*args, **kwargs)
        seconds = time.perf_counter() - t0
        if timer is not None:
            timer[1].record()
        self.measures[index].add(saved, inputs, seconds, timer)
        return out

    def close_iteration(self) -> None:
        """A training iteration ended: its calls' measurements are one iteration's."""
        log = self.offload.back_log or []
        self.offload.back_log = [] if self.measuring else None
        if self.measuring:
            index = {name: i for i, name in enumerate(self.names)}
            for block, moment, nbytes in log:
                if block in index:
                    self.measures[index[block]].brought_back(moment, nbytes)
            for m in self.measures:
                m.close_iteration()
        if self.timing:
            for m in self.frozen_measures:
                m.close_iteration()
            self.timing = False

    def time_frozen_step(self) -> None:
        """Time the blocks' forward in the next training iteration (:attr:`timing`); a dry run's
        times are its stand-ins already, and stay."""
        if self.cost is None:
            self.frozen_measures = [_Measure() for _ in self.blocks]
            self.timing = True

    def frozen_forward_s(self) -> list[float | None]:
        """Per block, its forward's seconds on the last timed step (None: not called with gradients)."""
        return [m.forward_s for m in self.frozen_measures]

    def _measuring_copies(self) -> None:
        # the measuring run holds no more than recomputing every block would (Note [activation
        # plan]): each copy to the host waited for, each storage sent for when it is read
        self.offload.pipelined = False
        self.offload.prefetch = False
        self.offload.back_log = []

    def measure(self) -> None:
        """Measure again (the run changed shape): every block offloaded, fresh measurements."""
        if self.auto:
            self.measuring = True
            self.timing = False
            self.measures = [_Measure() for _ in self.blocks]
            self.policies = [ActivationPolicy.OFFLOAD] * len(self.blocks)
            self._measuring_copies()

    def apply(self, policies: Sequence[ActivationPolicy], overlap: bool = True) -> None:
        """Run the blocks under ``policies`` from the next call on (the plan); offloaded ones with
        their copies overlapped (``overlap``: to the host waited for a block later, back to the
        device one block ahead), or each waited for at once, as measured."""
        assert len(policies) == len(self.blocks)
        self.policies = list(policies)
        self.measuring = False
        self.offload.back_log = None
        self.offload.prefetch = overlap
        self.offload.pipelined = overlap

    def model_checkpointed(self) -> int:
        """Blocks the model checkpoints itself now (Hugging Face's gradient checkpointing)."""
        return sum(1 for b in self.blocks if getattr(b, "gradient_checkpointing", False))

    def counts(self) -> dict[str, int]:
        """Blocks under each policy now (by the policies' names; AUTO is never one)."""
        out = {p.value: 0 for p in ActivationPolicy if p is not ActivationPolicy.AUTO}
        for p in self.policies:
            out[p.value] += 1
        return out

    def remove(self) -> None:
        """Give every block its forward back."""
        for block, own in zip(self.blocks, self._originals):
            if own is not None:
                block.forward = own  # type: ignore[method-assign]
            else:
                block.__dict__.pop("forward", None)
        self._originals = [None] * len(self.blocks)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among a call's arguments (one level into tuples, lists and dicts), each storage once."""
    out: dict[int, torch.Tensor] = {}

    def add(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.setdefault(v.untyped_storage()._cdata, v)

    for v in (*args, *kwargs.values()):
        if isinstance(v, (tuple, list)):
            for x in v:
                add(x)
        elif isinstance(v, dict):
            for x in v.values():
                add(x)
        else:
            add(v)
    return list(out.values())


def _without_cache(block: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a recomputed block without a cache its forward would write.

    A decoder layer handed a key/value cache (T5's ``cache``, GPT-2's ``layer_past``, or
    ``use_cache=True``) writes it in the forward; replayed in the backward it would write
    it again, and read what the first forward wrote: torch's checkpoint then finds other
    tensors saved and stops. Hugging Face's own checkpointing drops them the same way (a
    layer that only reads a cache says so with ``_can_checkpoint_with_cache``); in training
    the cache is not read."""
    if getattr(block, "_can_checkpoint_with_cache", False):
        return kwargs
    out = dict(kwargs)
    if out.get("use_cache"):
        out["use_cache"] = False
    for name in ("cache", "layer_past"):
        if out.get(name) is not None:
            out[name] = None
    return out
