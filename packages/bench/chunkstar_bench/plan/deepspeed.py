"""DeepSpeed's own memory estimator for ZeRO-3, re-implemented: DeepSpeed's verdict on a node. A PREDICTION.

DeepSpeed publishes how it sizes ZeRO-3's model states:
``estimate_zero3_model_states_mem_needs`` in ``deepspeed/runtime/zero/stage3.py``
(documented at https://deepspeed.readthedocs.io/en/latest/memory.html; read at
DeepSpeed commit edaa7221, unchanged in substance since 2021). Its arithmetic is
re-implemented here, line for line, so the planner can set DeepSpeed's verdict
beside chunkstar's without importing DeepSpeed (which the planner's machine need
not have). :func:`zero3_model_states_mem_needs` takes the same arguments and
returns the same three integers as DeepSpeed's function;
:func:`model_to_params` is its ``model_to_params`` (the total and the largest
module's parameters), made to work on the meta device.

What the estimator counts, and what it does not: *model states only*. Per node,
on the host (``cpu_offload`` and ``cpu_offload_params``, the configuration the
paper's DeepSpeed runs and this bench's ``deepspeed`` system use): 18 bytes per
parameter (16-bit param 2, fp32 gradient 4, fp32 master 4, Adam's two moments
8), divided by the node count, times an ``additional_buffer_factor`` of 1.5;
per GPU: 4 bytes per parameter of the largest layer (its gathered 16-bit
parameters and gradients). Activations, the reduce and prefetch buckets, the
CUDA context and pinned-memory limits are not in it, so the verdict is an upper
bound on what fits: a model it refuses does not fit; a model it accepts may
still run out of GPU memory on activations.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from chunkstar_bench import zoo
from chunkstar_bench.zoo import ModelSpec

__all__ = [
    "ADDITIONAL_BUFFER_FACTOR",
    "DeepSpeedVerdict",
    "deepspeed_largest",
    "deepspeed_verdict",
    "gpt2_largest_layer_params",
    "model_to_params",
    "zero3_model_states_mem_needs",
]

ADDITIONAL_BUFFER_FACTOR = 1.5
"""DeepSpeed's default ``additional_buffer_factor`` (its estimate of what the host needs beyond the states)."""


def zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR,
) -> tuple[int, int, int]:
    """``(cpu_mem, gpu_mem, largest_layer_memory)`` in bytes, as DeepSpeed's
    ``estimate_zero3_model_states_mem_needs`` computes them: host bytes per node, GPU
    bytes per GPU, and the largest layer's 16-bit params and gradients (4 bytes per parameter)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem), largest_layer_memory


class _Param(Protocol):
    def numel(self) -> int: ...


class _Module(Protocol):
    def parameters(self, recurse: bool = ...) -> Iterable[_Param]: ...

    def modules(self) -> Iterable[_Module]: ...


def model_to_params(model: _Module) -> tuple[int, int]:
    """``(total_params, largest_layer_params)`` of a built model, as DeepSpeed's ``model_to_params``:
    shared parameters counted once, the largest layer the module with the most parameters of its own
    (``parameters(recurse=False)``). DeepSpeed tells shared parameters apart by ``data_ptr()``, which
    is 0 for every tensor on the meta device; here they are told apart by identity, the same answer on
    a real device and a usable one on meta."""
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = 0
    for m in model.modules():
        largest = max(largest, sum(p.numel() for p in m.parameters(recurse=False)))
    return total, largest


def gpt2_largest_layer_params(spec: ModelSpec) -> int:
    """:func:`model_to_params`'s largest layer of ``zoo.build_hf(spec)``, computed, not built: the
    biggest of the token embedding (``V*h``; the tied LM head is the same tensor), the position
    embedding (``s*h``) and a block's projections (qkv ``3h^2+3h``, MLP up ``4h^2+4h``, MLP down
    ``4h^2+h``)."""
    h, s, v = spec.hidden, spec.seq_len, spec.vocab
    return max(v * h, s * h, h * 3 * h + 3 * h, h * 4 * h + 4 * h, 4 * h * h + h)


@dataclass(frozen=True)
class DeepSpeedVerdict:
    """DeepSpeed's estimator on one model and node (ZeRO-3, params and optimizer offloaded to CPU, zero_init)."""

    model: str
    n_params: int
    largest_layer_params: int
    cpu_bytes: int
    """Host bytes the estimator asks for on the node."""
    gpu_bytes: int
    """Bytes per GPU the estimator asks for."""
    host_bytes: int
    """The node's host memory."""
    device_bytes: int
    """Memory per GPU a process may use."""

    @property
    def host_fits(self) -> bool:
        return self.cpu_bytes <= self.host_bytes

    @property
    def device_fits(self) -> bool:
        return self.gpu_bytes <= self.device_bytes

    @property
    def fits(self) -> bool:
        return self.host_fits and self.device_fits

    @property
    def binding(self) -> str | None:
        """``"host"`` or ``"device"`` when it does not fit (host first), else None."""
        if not self.host_fits:
            return "host"
        if not self.device_fits:
            return "device"
        return None


def deepspeed_verdict(spec: ModelSpec, gpus: int, host_bytes: int, device_bytes: int) -> DeepSpeedVerdict:
    """DeepSpeed's estimator for ``spec`` on one node of ``gpus`` GPUs of ``device_bytes`` each and
    ``host_bytes`` of host memory: ZeRO-3 with ``offload_param`` and ``offload_optimizer`` to CPU
    and ``zero_init``, as the paper ran DeepSpeed."""
    total, largest = zoo.n_params(spec), gpt2_largest_layer_params(spec)
    cpu, gpu, _ = zero3_model_states_mem_needs(total, largest, num_gpus_per_node=gpus, num_nodes=1)
    return DeepSpeedVerdict(spec.name, total, largest, cpu, gpu, host_bytes, device_bytes)


def deepspeed_largest(
    models: Sequence[ModelSpec], gpus: int, host_bytes: int, device_bytes: int
) -> tuple[DeepSpeedVerdict | None, DeepSpeedVerdict | None]:
    """Walk ``models`` smallest first: ``(the last that fits, the first that does not)`` (either None)."""
    best: DeepSpeedVerdict | None = None
    for spec in sorted(models, key=zoo.n_params):
        v = deepspeed_verdict(spec, gpus, host_bytes, device_bytes)
        if not v.fits:
            return best, v
        best = v
    return best, None
