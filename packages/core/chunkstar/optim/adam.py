"""Adam / AdamW over chunk quadruples with PyTorch's fused kernel.

The gradients sit in the param chunk (each in its parameter's slot), the fp32
master and the two moments in the three state chunks at the same offsets. One
step is two passes over the chunks that hold gradients:

1. *place and measure*: move each param chunk to where its update runs (the
   host for host Adam, the device with its state chunks for device Adam,
   see :mod:`chunkstar.placement.optimizer`) and take the L2 norm of its
   gradient ranges (the global norm for clipping; inf/nan means fp16 overflow);
2. *update*: one fused Adam call per device, parameter group and step count,
   over the fp32 views of every chunk's runs of slots, then one foreach cast of
   the new masters back into the param slots.

It subclasses ``torch.optim.Optimizer`` so LR schedulers work through
``param_groups``. Parameters that got no gradient are skipped, as
``torch.optim`` skips parameters whose ``.grad`` is None.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from chunkstar.chunk.layout import TensorSlot
from chunkstar.chunk.state import TensorState
from chunkstar.distributed.comm import Comm
from chunkstar.events import MoveReason
from chunkstar.runtime.chunk_manager import EXP_AVG, EXP_AVG_SQ, MASTER, PARAM

if TYPE_CHECKING:
    from chunkstar.runtime.engine import ChunkEngine

__all__ = ["ChunkAdam", "global_grad_norm"]

_FORMAT = "chunkstar.ChunkAdam/1"
_BATCH_ELEMENTS = 1 << 22  # gradient elements per batch of fused calls (16 MiB of fp32 copies)
# A run longer than a batch is cut every _BATCH_ELEMENTS elements from its start, a multiple
# of any vector width: the fused kernel vectorises each tensor from its start and finishes the
# last (numel mod width) elements with scalar code that rounds differently (measured: a cut
# at element 997 changes exp_avg_sq bits, cuts at multiples of 8 do not).


def _runs(slots: list[TensorSlot], key: Callable[[TensorSlot], Any]) -> list[tuple[Any, int, int]]:
    """Merge slots (sorted by offset) into contiguous (key, start, end) element ranges."""
    out: list[tuple[Any, int, int]] = []
    for s in slots:
        k = key(s)
        if out and out[-1][0] == k and out[-1][2] == s.offset:
            out[-1] = (k, out[-1][1], s.end)
        else:
            out.append((k, s.offset, s.end))
    return out


def global_grad_norm(ranges_by_device: Iterable[list[torch.Tensor]], comm: Comm, device: torch.device) -> torch.Tensor:
    """The L2 norm of every rank's gradient ranges: a 0-dim fp32 CPU tensor, inf or nan
    when a gradient overflowed.

    ``ranges_by_device`` holds the ranges grouped by the device they lie on. Each
    device takes the norms of its ranges in one foreach call and keeps them; they
    travel once per device to ``comm.exchange_device(device)`` (``device`` is the
    engine's: the sum is all-reduced there, on the GPU under NCCL, which reduces CUDA
    tensors only), and the total comes to the CPU once: one sync per step, not one
    per chunk."""
    where = comm.exchange_device(device)
    parts = [torch.stack(torch._foreach_norm(rs, 2, dtype=torch.float32)).to(where) for rs in ranges_by_device if rs]
    norms = torch.cat(parts) if parts else torch.zeros(0, device=where)  # 1-D fp32 on `where`
    if comm.distributed:
        # every rank joins, even one without gradients (Note [collective schedule])
        sq = norms.square().sum().reshape(1)
        total = comm.all_reduce_sum(sq, what="the gradient norm", device=device).sqrt()[0]
    else:
        total = torch.linalg.vector_norm(norms)
    return total.cpu()


class ChunkAdam(torch.optim.Optimizer):
    def __init__(self, engine: ChunkEngine, param_groups: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__(param_groups, defaults)
        self._engine = engine
        self._decoupled = engine.config.optimizer.decoupled
        self._steps: list[int] = [0] * len(engine.mgr.slots)
        self._group_of: list[int] = [0] * len(engine.mgr.slots)
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                self._group_of[engine.index_of(p)] = g
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.step_count = 0  # optimizer.step() calls, skipped ones included (a checkpoint's "step")
        engine.optimizer = self  # engine.save_checkpoint / load_checkpoint carry this optimizer's state

    # ------------------------------------------------------------------ public
    @property
    def loss_scale(self) -> float:
        return self._engine.scaler.scale

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        eng = self._engine
        eng.begin_optimizer_step()
        try:
            self._step()
            self.step_count += 1
        finally:
            eng.end_optimizer_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients live in the param slots and are consumed by ``step``; if
        some are still pending (no step was taken), drop them and restore the
        parameter values from the fp32 masters."""
        self._engine.drop_pending_grads()

    # ------------------------------------------------------------------ step
    def _step(self) -> None:
        eng = self._engine
        mgr = eng.mgr
        scaler = eng.scaler
        comm = eng.comm
        grad_slots: dict[int, list[TensorSlot]] = {}
        for s in mgr.slots:
            if mgr.states[s.index] is TensorState.HOLD_AFTER_BWD:  # only own chunks hold gradients
                grad_slots.setdefault(s.chunk_id, []).append(s)
        if not grad_slots and not comm.distributed:
            return

        # pass 1: place, then the norm of every contiguous gradient range, one foreach
        # call per device (a model of many chunks must not pay a kernel call per chunk)
        ranges: dict[torch.device, list[torch.Tensor]] = {}
        for cid, slots in grad_slots.items():
            self._place(cid)
            g = mgr.chunks[PARAM][cid].payload
            for _, a, b in _runs(slots, lambda s: 0):
                ranges.setdefault(g.device, []).append(g[a:b])
        total = global_grad_norm(ranges.values(), comm, eng.device)  # 0-dim fp32, CPU
        total_f = float(total)
        if not math.isfinite(total_f):  # fp16 overflow
            self.skipped_steps += 1
            self.last_grad_norm = None
            eng.restore_params_from_master(grad_slots)
            scaler.update(overflow=True)
            return
        norm = total_f / scaler.scale
        self.last_grad_norm = norm
        clip = eng.config.gradient_clipping
        # torch.nn.utils.clip_grad_norm_'s coefficient, applied with the same op order
        factor = torch.tensor(1.0)
        if clip > 0:
            factor = torch.clamp(torch.tensor(clip) / (total / scaler.scale + 1e-6), max=1.0)
        if scaler.enabled:
            factor = factor / scaler.scale
        self._update(grad_slots, factor, apply_factor=clip > 0 or scaler.enabled)
        scaler.update(overflow=False)

    def _place(self, cid: int) -> None:
        eng = self._engine
        mgr = eng.mgr
        if cid in eng.device_adam_chunks:
            keys = [(PARAM, cid), (MASTER, cid), (EXP_AVG, cid), (EXP_AVG_SQ, cid)]
            mgr.make_resident(keys, MoveReason.OPTIMIZER, where=f"the optimizer step of chunk {cid}")
        else:
            for name in (PARAM, MASTER, EXP_AVG, EXP_AVG_SQ):
                mgr.to_host((name, cid), MoveReason.OPTIMIZER)

    def _update(self, grad_slots: dict[int, list[TensorSlot]], factor: torch.Tensor, apply_factor: bool) -> None:
        """Pass 2: fused Adam over the fp32 views of many chunks' runs at once, one call
        per (device, parameter group, step count), then a foreach cast of the masters
        back into the param slots. Runs are taken in batches of at most
        ``_BATCH_ELEMENTS`` gradient elements, a longer run in pieces of that size: bf16/fp16
        gradients need fp32 copies, and all of them at once would cost 4 bytes per
        parameter of extra memory (one chunk's worth, too, when a chunk is large: a tied
        embedding alone in its chunk). Which batch a piece joins does not change its bits."""
        mgr = self._engine.mgr
        fused = torch._fused_adamw_ if self._decoupled else torch._fused_adam_
        buckets: dict[tuple[torch.device, int, int], tuple[list[torch.Tensor], ...]] = {}
        pending = 0

        def flush() -> None:
            for (device, gi, step), (masters, grads, ms, vs, params) in buckets.items():
                group = self.param_groups[gi]
                beta1, beta2 = group["betas"]
                if apply_factor:
                    torch._foreach_mul_(grads, factor.to(device))
                step_t = torch.tensor(float(step + 1), device=device)  # read-only in the kernel: shared
                fused(
                    masters, grads, ms, vs, [], [step_t] * len(masters),
                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    amsgrad=False, maximize=False,
                )  # fmt: skip
                torch._foreach_copy_(params, masters)
            buckets.clear()

        for cid, slots in grad_slots.items():
            p = mgr.chunks[PARAM][cid].payload
            master = mgr.chunks[MASTER][cid].payload
            m = mgr.chunks[EXP_AVG][cid].payload
            v = mgr.chunks[EXP_AVG_SQ][cid].payload
            for (gi, step), a, b in _runs(slots, lambda s: (self._group_of[s.index], self._steps[s.index])):
                for lo in range(a, b, _BATCH_ELEMENTS):
                    hi = min(lo + _BATCH_ELEMENTS, b)
                    if pending + hi - lo > _BATCH_ELEMENTS:
                        flush()
                        pending = 0
                    lists = buckets.setdefault((p.device, gi, step), ([], [], [], [], []))
                    lists[0].append(master[lo:hi])
                    lists[1].append(p[lo:hi] if p.dtype == torch.float32 else p[lo:hi].float())  # fp32 gradient
                    lists[2].append(m[lo:hi])
                    lists[3].append(v[lo:hi])
                    lists[4].append(p[lo:hi])
                    pending += hi - lo
        flush()
        for slots in grad_slots.values():
            for s in slots:
                self._steps[s.index] += 1
                mgr.set_state(s.index, TensorState.HOLD)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        mgr = self._engine.mgr
        state: dict[int, dict[str, torch.Tensor]] = {}
        for s in mgr.slots:
            if self._steps[s.index] == 0 or not mgr.own(s.chunk_id):
                continue  # with several processes each rank saves the state of its own chunks
            m = mgr.chunks[EXP_AVG][s.chunk_id].payload[s.offset : s.end]
            v = mgr.chunks[EXP_AVG_SQ][s.chunk_id].payload[s.offset : s.end]
            state[s.index] = {
                "step": torch.tensor(float(self._steps[s.index])),
                "exp_avg": m.detach().to("cpu", copy=True).view(s.shape),
                "exp_avg_sq": v.detach().to("cpu", copy=True).view(s.shape),
            }
        groups = []
        for g, group in enumerate(self.param_groups):
            entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            entry["params"] = [self._engine.index_of(p) for p in group["params"]]
            groups.append(entry)
        return {
            "format": _FORMAT,
            "state": state,
            "param_groups": groups,
            "loss_scaler": self._engine.scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if state_dict.get("format") != _FORMAT:
            raise ValueError(
                f"not a chunkstar optimizer state dict (format {state_dict.get('format')!r}, expected {_FORMAT!r})"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} parameter groups, this optimizer {len(self.param_groups)}")
        for mine, theirs in zip(self.param_groups, groups):
            if [self._engine.index_of(p) for p in mine["params"]] != list(theirs["params"]):
                raise ValueError("parameter groups of the state dict do not match this optimizer's")
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if k == "betas" else v
        mgr = self._engine.mgr
        with torch.no_grad():
            self._steps = [0] * len(mgr.slots)
            for s in mgr.slots:
                if not mgr.own(s.chunk_id):
                    continue
                st = state_dict["state"].get(s.index)
                m = mgr.chunks[EXP_AVG][s.chunk_id].payload[s.offset : s.end]
                v = mgr.chunks[EXP_AVG_SQ][s.chunk_id].payload[s.offset : s.end]
                if st is None:
                    m.zero_()
                    v.zero_()
                    continue
                for key, dst in (("exp_avg", m), ("exp_avg_sq", v)):
                    src = st[key]
                    if src.numel() != s.numel:
                        raise ValueError(f"optimizer state '{key}' of parameter '{s.name}' has {src.numel()} elements, expected {s.numel}")
                    dst.copy_(src.reshape(-1))
                self._steps[s.index] = int(st["step"])
        self._engine.scaler.load_state_dict(state_dict["loss_scaler"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def scalar_state(self) -> dict[str, Any]:
        """The optimizer's state apart from its chunks, JSON-ready (a checkpoint shard
        stores it next to the moment chunks): this rank's Adam step count per
        parameter slot (0 for other ranks' slots), the parameter groups' settings
        and members (slot indices), the skipped steps and the steps taken."""
        mgr = self._engine.mgr
        groups = []
        for group in self.param_groups:
            entry = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
            entry["params"] = [self._engine.index_of(p) for p in group["params"]]
            groups.append(entry)
        return {
            "steps": [self._steps[s.index] if mgr.own(s.chunk_id) else 0 for s in mgr.slots],
            "param_groups": groups,
            "skipped_steps": self.skipped_steps,
            "step_count": self.step_count,
        }

    def load_scalar_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`scalar_state` (the caller checked that the groups' members match)."""
        mgr = self._engine.mgr
        for mine, theirs in zip(self.param_groups, state["param_groups"]):
            for k, v in theirs.items():
                if k != "params":
                    mine[k] = tuple(v) if isinstance(v, list) else v
        self._steps = [int(n) if mgr.own(s.chunk_id) else 0 for s, n in zip(mgr.slots, state["steps"])]
        self.skipped_steps = int(state["skipped_steps"])
        self.step_count = int(state["step_count"])
