"""In which dtype a module's forward sees its own parameters under bf16/fp16: pure policy.

Every param chunk holds the compute dtype, and the engine's forward runs under
``torch.autocast`` to it; for most modules that is what the reference (fp32
weights under ``torch.autocast``) computes with too, since autocast casts a
Linear's or a conv's weight to it at the op. Norm layers are the exception this
module decides. It reads a module's type and the dtypes of the tensors it
registered itself (:class:`ModuleFacts`), never a tensor's values; the
mechanism that acts on the answer is :mod:`chunkstar.hooks.param_upcast`.

Note [norm dtypes]: what autocast does with a norm layer, and how chunkstar
matches it.

* The reference. Autocast casts only the ops on its lists. ``batch_norm``
  (and ``instance_norm``, which calls it) is on none of them, on CPU or CUDA;
  ``layer_norm`` and ``group_norm`` are on none on CPU and on the fp32 list on
  CUDA; ``rms_norm`` is on none. So a norm layer's op always meets its
  parameters and running statistics in fp32, beside an input in the compute
  dtype (the conv before it) or in fp32, and torch's norm kernels are built for
  exactly that "mixed" case: they compute in fp32 and return the input's dtype
  (CUDA's fp32 list returns fp32). Parameters in bf16 beside fp32 running
  statistics are no case of theirs: ``expected scalar type BFloat16 but found
  Float`` on the first forward (ResNet, EfficientNet, Segformer); and bf16
  parameters beside an fp32 input fail on CPU for every norm kernel (``mixed
  dtype (CPU): expect parameter to have scalar type of Float``).
* The choice. Within such a module's forward, its parameters are seen as fp32:
  a differentiable upcast of the compute-dtype param slot, made when the
  forward starts and dropped when it ends. Inputs, outputs and buffers are left
  alone, so the op gets the reference's dtypes on either device and autocast
  decides the output's dtype as it would there; the running statistics stay
  fp32 and are updated in fp32 from the same batch statistics. The op's
  values differ from the reference's by the rounding of the weights to the
  compute dtype only (2**-8 relative in bf16: autocast gives a Linear the same
  rounded weight the param slot holds, a norm its fp32 one); the gradient flows
  back through the cast into the param slot's gradient, so nothing downstream
  (gradient chunks, the optimizer, checkpoints, collectives) changes. The fp32
  copies live from the forward to the backward (the op saves them): non-model
  memory the warm-up measures, a norm layer's few KB.
* Rejected: fp32 param slots for these modules (a second dtype in the layout,
  the master -> param copies, the gradient chunks and every collective: a large
  change for parameters a few KB in size); casting inputs or outputs too (it
  would give a different dtype from the reference's, and nothing needs it);
  buffers in the compute dtype (the running statistics would drift from the
  reference's fp32 ones).
* Which modules. Two rules, in order: (1) a module that registered floating
  buffers of a dtype other than the compute dtype beside floating parameters
  meets them in its ops, so it sees its parameters in fp32 whatever its type
  (a custom or Hugging Face norm with fp32 statistics needs no entry); buffers
  all in the compute dtype (a model built in bf16) mean the module was built to
  compute so, and it is left as built. (2) Otherwise the type decides, by
  :data:`PRECISION_BY_TYPE` (subclasses included): torch's norm layers, whose
  kernels take a low-precision input beside fp32 parameters. Every other module
  keeps the compute dtype: an upcast there would cost a copy of a large weight
  that autocast casts straight back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

__all__ = ["PRECISION_BY_TYPE", "ModuleFacts", "ParamPrecision", "param_precision", "upcast_dtype"]


class ParamPrecision(enum.Enum):
    """What a module's forward sees in place of its own parameters."""

    COMPUTE = "compute"
    """The param slots as they are, in the compute dtype (autocast casts them per op)."""
    FP32 = "fp32"
    """An fp32 copy of each param slot, made at the forward and dropped after it (Note [norm dtypes])."""


PRECISION_BY_TYPE: Mapping[type[nn.Module], ParamPrecision] = {
    nn.BatchNorm1d: ParamPrecision.FP32,
    nn.BatchNorm2d: ParamPrecision.FP32,
    nn.BatchNorm3d: ParamPrecision.FP32,
    nn.SyncBatchNorm: ParamPrecision.FP32,
    nn.InstanceNorm1d: ParamPrecision.FP32,
    nn.InstanceNorm2d: ParamPrecision.FP32,
    nn.InstanceNorm3d: ParamPrecision.FP32,
    nn.GroupNorm: ParamPrecision.FP32,
    nn.LayerNorm: ParamPrecision.FP32,
    nn.RMSNorm: ParamPrecision.FP32,
}
"""Module types autocast's reference runs with fp32 parameters, and that torch's kernels
accept beside a low-precision input (rule 2 of Note [norm dtypes]); a subclass takes
its nearest listed base's entry."""


@dataclass(frozen=True)
class ModuleFacts:
    """What the policy reads of one module: its type and the dtypes of the floating
    tensors it registered itself (not its children's)."""

    kind: type
    param_dtypes: frozenset[torch.dtype]
    buffer_dtypes: frozenset[torch.dtype]

    @classmethod
    def of(cls, module: nn.Module) -> ModuleFacts:
        params = frozenset(p.dtype for p in module.parameters(recurse=False) if p.is_floating_point())
        buffers = frozenset(b.dtype for b in module.buffers(recurse=False) if b.is_floating_point())
        return cls(type(module), params, buffers)


def _by_type(kind: type) -> ParamPrecision:
    for base in kind.__mro__:
        if base in PRECISION_BY_TYPE:
            return PRECISION_BY_TYPE[base]
    return ParamPrecision.COMPUTE


def param_precision(facts: ModuleFacts, compute_dtype: torch.dtype) -> ParamPrecision:
    """What the module's forward sees in place of its parameters (Note [norm dtypes])."""
    if not facts.param_dtypes or compute_dtype == torch.float32:
        return ParamPrecision.COMPUTE
    if facts.buffer_dtypes:  # rule 1: the buffers its ops meet its parameters beside
        return ParamPrecision.COMPUTE if facts.buffer_dtypes == {compute_dtype} else ParamPrecision.FP32
    return _by_type(facts.kind)  # rule 2


def upcast_dtype(module: nn.Module, compute_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype ``module``'s forward sees its parameters in, when not the compute dtype
    (what :func:`chunkstar.hooks.param_upcast.install_upcasts` asks)."""
    return torch.float32 if param_precision(ModuleFacts.of(module), compute_dtype) is ParamPrecision.FP32 else None
