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
  autograd (wrapping the functions while it is entered), as autocast does, and those of the matrix products to the autocast dtype,
  and autograd saves what it would save. It covers the ops of torch's lists that hold
  activations (the matrix products and attention; the losses; softmax, log-softmax,
  layer and group norm on CUDA), not the pointwise ones whose outputs are temporaries.
* Code that reads a value (``.item()``, ``bool(t)``, ``if mask.all():``) cannot run
  on the meta device: there is no value to read, and nothing here guesses one in
  general (a guess changes the path the model takes, and with it the memory). Two
  reads are answered, in Hugging Face's mask code, with what a real pre-training
  batch gives: a meta padding mask counts as all ones (no padding: the causal mask
  is skipped for the fused kernel's own, as a real run skips it), and meta position
  ids as one sequence per row (not packed). A dry run is for batches of full rows;
  a batch whose padding shapes the run needs a real one. Any other read stops the
  dry run with an error that names it.

:func:`meta_kernels` applies both for as long as it is entered, and only to meta
tensors: a real tensor takes torch's and Hugging Face's own paths.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn.functional as F

__all__ = ["autocast_like", "loss_of", "meta_kernels", "on_meta", "value_read"]


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


def _all_ones_if_meta(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fast_all(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return True  # a meta padding mask: no padding (Note [meta kernels])
        return original(tensor, *args, **kwargs)

    return fast_all


def _unpacked_if_meta(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(position_ids, torch.Tensor) and position_ids.is_meta:
            return None  # one sequence per row (Note [meta kernels])
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


@contextlib.contextmanager
def meta_kernels() -> Iterator[None]:
    """Within: attention on meta tensors takes the fused kernel, and Hugging Face's mask code
    takes meta masks as full rows (Note [meta kernels]). Not thread-safe against other code
    patching the same names."""
    patches: list[tuple[Any, str, Any]] = [(F, "scaled_dot_product_attention", _fused_attention(F.scaled_dot_product_attention))]
    try:
        masking = importlib.import_module("transformers.masking_utils")
    except ImportError:  # no transformers, or one without this module: nothing of it to answer for
        masking = None
    if masking is not None:
        for name, wrap in (("fast_all", _all_ones_if_meta), ("find_packed_sequence_indices", _unpacked_if_meta)):
            if callable(getattr(masking, name, None)):
                patches.append((masking, name, wrap(getattr(masking, name))))
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


_FP32_LOSSES = tuple((F, n) for n in (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss", "margin_ranking_loss",
    "soft_margin_loss", "multilabel_margin_loss", "hinge_embedding_loss", "triplet_margin_loss", "multi_margin_loss",
))  # fmt: skip
"""In torch's fp32 autocast lists on the CPU and on CUDA alike."""
_FP32_ON_CUDA = (
    *((F, n) for n in ("softmax", "log_softmax", "layer_norm", "group_norm")),
    *((torch, n) for n in ("softmax", "log_softmax")),
    *((torch.Tensor, n) for n in ("softmax", "log_softmax")),
)
"""In CUDA's fp32 autocast list only."""
_LOWER = (
    *((F, n) for n in ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                       "prelu", "scaled_dot_product_attention")),
    *((torch, n) for n in ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum")),
    *((torch.Tensor, n) for n in ("matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm")),
)  # fmt: skip
"""In torch's lower-precision autocast lists on the CPU and on CUDA (the matrix products)."""


def _cast(x: Any, wide: tuple[torch.dtype, ...], to: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_meta and x.dtype in wide:
        return x.to(to)
    if isinstance(x, (list, tuple)):  # einsum's operands, a list of tensors
        return type(x)(_cast(v, wide, to) for v in x)
    return x


def _casting(original: Callable[..., Any], wide: tuple[torch.dtype, ...], to: torch.dtype) -> Callable[..., Any]:
    @functools.wraps(original)
    def cast_first(*args: Any, **kwargs: Any) -> Any:
        return original(*[_cast(a, wide, to) for a in args], **{k: _cast(v, wide, to) for k, v in kwargs.items()})

    return cast_first


@contextlib.contextmanager
def autocast_like(target: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Within: meta tensors go through the ops autocast casts on ``target`` ("cuda" or
    "cpu") as they would under autocast to ``dtype`` (Note [meta kernels]); nothing when
    ``dtype`` is None (an fp32 run has no autocast). The functions themselves are
    wrapped, not a torch-function mode entered: a mode is thread-local and steps aside
    inside ``Tensor.backward``, where a checkpointed block's recomputation runs, and that
    recomputation must cast as its forward did (torch.utils.checkpoint restores autocast)."""
    if dtype is None:
        yield
        return
    low, wide = (torch.bfloat16, torch.float16), (torch.float32,)
    fp32 = _FP32_LOSSES + (_FP32_ON_CUDA if target == "cuda" else ())
    plan = [(o, n, _casting(getattr(o, n), low, torch.float32)) for o, n in fp32 if hasattr(o, n)]
    plan += [(o, n, _casting(getattr(o, n), wide, dtype)) for o, n in _LOWER if hasattr(o, n)]
    saved = [(o, n, getattr(o, n)) for o, n, _ in plan]
    try:
        for o, n, new in plan:
            setattr(o, n, new)
        yield
    finally:
        for o, n, old in reversed(saved):
            setattr(o, n, old)


def on_meta(x: Any) -> Any:
    """``x`` (a tensor, or a dict, list or tuple of them) with its tensors on the meta device."""
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, Mapping):
        return {k: on_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_meta(v) for v in x)
    return x


def loss_of(out: Any) -> torch.Tensor:
    """A model output's loss: its ``.loss`` (or ``["loss"]``), or the output itself (its mean
    when it is not a scalar)."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor):
        loss = out if out.dim() == 0 else out.float().mean()
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model's output ({type(out).__name__}) has no loss: give inputs that make one (labels= for a Hugging "
            "Face model) or pass loss_fn"
        )
    return loss
