"""What a model's forward needs to run on the meta device as it would on a real one.

Note [meta kernels]: on the meta device torch runs each op's meta function, which
gives the output's shape and dtype and saves for backward what the op's autograd
formula saves, so activations are measured as on a real device. Two places differ:

* ``scaled_dot_product_attention`` chooses its kernel per device. A CPU or CUDA
  device runs a fused kernel (flash or memory-efficient attention), which saves the
  output and a log-sum-exp row per query; the meta device has no fused kernel to
  choose, takes the math path, and saves the whole score matrix, ``seq x seq`` per
  head: at 4k tokens more than all the rest of the block's activations. On the meta
  device the attention is routed to the fused kernel's own meta function (the CPU
  flash kernel's, whose outputs and saved tensors have the sizes the CUDA kernels'
  have), where the fused kernel would take it: no dropout mask to save, and key and
  value of the query's head count or, under ``enable_gqa``, a divisor of it.
* Autocast. A real run's forward runs under ``torch.autocast`` in bf16 or fp16, which
  runs some ops in fp32 whatever their inputs (the losses everywhere; on CUDA also
  softmax and the norms): a loss over bf16 logits saves fp32 copies of them, which at
  a 50k vocabulary is the largest tensor of the step. Torch has no autocast for the
  meta device, so :func:`autocast_like` casts the inputs of those ops to fp32 above
  autograd, as autocast does, and autograd saves what it would save. It covers the
  ops of torch's fp32 lists that hold activations (the losses; softmax, log-softmax,
  layer and group norm on CUDA), not the pointwise ones whose outputs are temporaries.
* Code that reads a value (``.item()``, ``bool(t)``, ``if mask.all():``) cannot run
  on the meta device: there is no value to read. Nothing here guesses one (a guess
  changes the path the model takes, and with it the memory: Hugging Face's mask
  code, told a meta mask is "traced", builds the full mask a real run skips). Such
  a read stops the dry run with an error that names it; the common cause, an
  all-ones ``attention_mask``, is best left out of the inputs (the real run skips
  it too).

:func:`meta_kernels` reroutes the attention for as long as it is entered, and only on
meta tensors: a real tensor takes torch's own path.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["autocast_like", "meta_kernels", "value_read"]


def _fused_attention(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def sdpa(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        fused = (
            query.is_meta
            and query.dim() == 4
            and key.dim() == 4
            # grouped heads (enable_gqa): the fused kernels take them as they are
            and (key.size(-3) == query.size(-3) or (enable_gqa and query.size(-3) % key.size(-3) == 0))
            and value.size(-1) == query.size(-1)
            and dropout_p == 0.0
        )
        if not fused:
            kwargs: dict[str, Any] = {"scale": scale}
            if enable_gqa:
                kwargs["enable_gqa"] = True
            return original(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
        return out[0]

    return sdpa


@contextlib.contextmanager
def meta_kernels() -> Iterator[None]:
    """Within: attention on meta tensors takes the fused kernel (Note [meta kernels]). Not
    thread-safe against other code patching the same name."""
    patches: list[tuple[Any, str, Any]] = [(F, "scaled_dot_product_attention", _fused_attention(F.scaled_dot_product_attention))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)


def value_read(err: BaseException) -> bool:
    """Whether ``err`` is torch refusing to read a meta tensor's value (Note [meta kernels])."""
    text = str(err)
    return isinstance(err, (RuntimeError, NotImplementedError)) and (
        "cannot be called on meta tensors" in text
        or "Cannot copy out of meta tensor" in text
        or "data-independent implementation does not exist" in text
    )


_FP32_LOSSES: frozenset[Callable[..., Any]] = frozenset({
    F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
    F.binary_cross_entropy, F.binary_cross_entropy_with_logits, F.poisson_nll_loss, F.cosine_embedding_loss,
    F.margin_ranking_loss, F.soft_margin_loss, F.multilabel_margin_loss, F.hinge_embedding_loss,
    F.triplet_margin_loss, F.multi_margin_loss,
})  # fmt: skip
"""In torch's fp32 autocast lists on the CPU and on CUDA alike."""
_FP32_ON_CUDA: frozenset[Callable[..., Any]] = frozenset({
    F.softmax, F.log_softmax, torch.softmax, torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax,
    F.layer_norm, F.group_norm,
})  # fmt: skip
"""In CUDA's fp32 autocast list only."""


class _Autocast(TorchFunctionMode):
    def __init__(self, ops: frozenset[Callable[..., Any]]) -> None:
        super().__init__()
        self.ops = ops

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.ops:
            args = tuple(_fp32(a) for a in args)
            kwargs = {k: _fp32(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_meta and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def autocast_like(target: str, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Within: meta tensors go through the ops autocast runs in fp32 on ``target``
    ("cuda" or "cpu") as they would under autocast (Note [meta kernels]); nothing when
    not ``enabled`` (an fp32 run has no autocast)."""
    if not enabled:
        return contextlib.nullcontext()
    return _Autocast(_FP32_LOSSES | _FP32_ON_CUDA if target == "cuda" else _FP32_LOSSES)
