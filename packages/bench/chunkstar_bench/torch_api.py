"""The torch APIs chunkstar's engine calls, probed one at a time where it will run.

``benchmarks/gpu_check.py`` runs :func:`probe` first (its ``api`` row): on a GPU
machine whose torch build nobody has tried, a missing or changed API then shows
as one FAILED line naming it, not as a traceback in the middle of a training
run. Each probe calls its APIs the way ``packages/core/chunkstar`` calls them,
on small tensors, and checks the result. The CUDA probes are ``n/a`` without
CUDA; the others run on the CPU everywhere (on a GPU machine host Adam, the
gradient norms and the copies into host chunks run on the CPU too).

:data:`COVERED` names every API the probes reach, in the form
``tests/bench/test_gpu_check_script.py`` reads out of the engine's source
(``torch.cuda.Event``, ``torch._fused_adamw_``, ``.wait_event`` for a method):
an API the engine starts to use without a probe here fails that test.

Importing this module imports torch; nothing else beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
from typing import Any, Callable

import torch

__all__ = ["COVERED", "PROBES", "Probe", "probe"]

_MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Probe:
    name: str
    apis: tuple[str, ...]
    """What it covers (``torch.cuda.Stream``; ``.resize_`` for a method on any object)."""
    where: str
    """``cuda``: on the GPU only (``n/a`` without one); ``both``: on the CPU and on the GPU;
    ``host``: once, on the CPU (what does not depend on the device)."""
    run: Callable[[torch.device], str]
    """Raises when the API is missing or wrong; returns a short detail."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------- CUDA only


def _cuda_device(dev: torch.device) -> str:
    _check(torch.cuda.is_available(), "torch.cuda.is_available() is False")
    count = torch.cuda.device_count()
    torch.cuda.set_device(dev)
    _check(torch.cuda.current_device() == dev.index, f"set_device({dev}) left current_device() {torch.cuda.current_device()}")
    props = torch.cuda.get_device_properties(dev)
    torch.cuda.synchronize(dev)
    _check(torch.cuda.is_initialized(), "torch.cuda.is_initialized() is False after CUDA work")
    return f"{props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}, {count} visible"


def _streams_events(dev: torch.device) -> str:
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    src = torch.arange(_MiB, dtype=torch.float32, device=dev)  # written on the compute stream
    dst = torch.empty_like(src)
    side.wait_stream(compute)  # the side stream runs after what the compute stream issued so far
    with torch.cuda.stream(side):
        _check(torch.cuda.current_stream(dev).cuda_stream == side.cuda_stream, "torch.cuda.stream(s) did not make s current")
        dst.copy_(src)
        dst.mul_(2.0)
        event = torch.cuda.Event()
        event.record(side)
    _check(torch.cuda.current_stream(dev).cuda_stream == compute.cuda_stream, "the compute stream was not restored")
    compute.wait_event(event)  # the compute stream reads dst after the side stream's copy
    got = float(dst.double().sum())
    want = float(src.double().sum()) * 2
    _check(got == want, f"a copy on a side stream read {got}, expected {want}")
    event.synchronize()
    _check(bool(event.query()), "Event.query() is False after Event.synchronize()")
    side.synchronize()
    # a worker thread on the engine's device waits on an event (the host worker does)
    later = torch.cuda.Event()
    later.record(compute)
    seen: list[Any] = []

    def worker() -> None:
        try:
            torch.cuda.set_device(dev)
            later.synchronize()
            seen.append(bool(later.query()))
        except BaseException as exc:  # noqa: BLE001  (reported by the probe)
            seen.append(exc)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    _check(not thread.is_alive(), "Event.synchronize() in another thread did not return within 30 s")
    if seen and isinstance(seen[0], BaseException):
        raise seen[0]
    _check(seen == [True], f"Event.query() in another thread: {seen}")
    torch.cuda.synchronize(dev)
    return "side-stream copy ordered by wait_stream / record / wait_event; synchronize and query, also from a worker thread"


def _memory_stats(dev: torch.device) -> str:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    _check(0 < free <= total, f"mem_get_info gave free {free}, total {total}")
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    _check(torch.cuda.max_memory_allocated(dev) == base, "max_memory_allocated after reset_peak_memory_stats is not the current figure")
    x = torch.empty(64 * _MiB, dtype=torch.uint8, device=dev)
    grew = torch.cuda.memory_allocated(dev) - base
    _check(grew >= 64 * _MiB, f"memory_allocated grew by {grew} bytes for a 64 MiB tensor")
    _check(torch.cuda.memory_reserved(dev) >= 64 * _MiB, "memory_reserved below a live 64 MiB tensor")
    del x
    peak = torch.cuda.max_memory_allocated(dev) - base
    _check(peak >= 64 * _MiB, f"max_memory_allocated saw {peak} bytes above the base, expected >= 64 MiB")
    _check(torch.cuda.max_memory_reserved(dev) >= 64 * _MiB, "max_memory_reserved below 64 MiB")
    _check(torch.cuda.memory_allocated(dev) == base, "memory_allocated did not come back after del")
    torch.cuda.empty_cache()
    return f"mem_get_info: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"


def _host_register(dev: torch.device) -> str:
    cudart = torch.cuda.cudart()
    for fn in ("cudaHostRegister", "cudaHostUnregister"):
        _check(hasattr(cudart, fn), f"torch.cuda.cudart() has no {fn}")
    n = 2 * _MiB + 123  # an odd size, as the engine's exactly-sized buffers
    host = torch.empty(n, dtype=torch.bfloat16)
    nbytes = host.numel() * host.element_size()
    err = int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 1))  # cudaHostRegisterPortable
    _check(err == 0, f"cudaHostRegister returned error {err}")
    try:
        _check(host.is_pinned(), "a cudaHostRegister'ed buffer is not is_pinned(): the engine would copy it synchronously")
        host.copy_(torch.arange(n) % 251)
        compute = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        on_dev = torch.empty(n, dtype=torch.bfloat16, device=dev)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            on_dev.copy_(host, non_blocking=True)
            to_dev = torch.cuda.Event()
            to_dev.record(side)
        compute.wait_event(to_dev)
        _check(torch.equal(on_dev.cpu(), host), "a non_blocking copy from a registered buffer differs")
        on_dev.add_(1)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            host.copy_(on_dev, non_blocking=True)
            to_host = torch.cuda.Event()
            to_host.record(side)
        to_host.synchronize()
        _check(torch.equal(host, on_dev.cpu()), "a non_blocking copy into a registered buffer differs after Event.synchronize()")
    finally:
        torch.cuda.synchronize(dev)
        err = int(cudart.cudaHostUnregister(host.data_ptr()))
    _check(err == 0, f"cudaHostUnregister returned error {err}")
    # page-aligned memory of its own, as the engine maps it (an anonymous mmap seen through torch.frombuffer)
    page = mmap.PAGESIZE
    mapped = mmap.mmap(-1, 64 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(mapped, dtype=torch.bfloat16, count=(64 * page) // 2 - 7)
    err = int(cudart.cudaHostRegister(view.data_ptr(), 64 * page, 1))
    _check(err == 0, f"cudaHostRegister of mmap'ed pages returned error {err}")
    try:
        _check(view.is_pinned(), "registered mmap'ed pages are not is_pinned()")
        view.fill_(3.0)
        back = view.to(dev, non_blocking=True).cpu()
        _check(bool((back == 3.0).all()), "a non_blocking copy from registered mmap'ed pages differs")
    finally:
        torch.cuda.synchronize(dev)
        err = int(cudart.cudaHostUnregister(view.data_ptr()))
    _check(err == 0, f"cudaHostUnregister of mmap'ed pages returned error {err}")
    pinned = torch.empty(1000, dtype=torch.bfloat16, pin_memory=True)  # the engine's fallback
    _check(pinned.is_pinned(), "torch.empty(pin_memory=True) is not is_pinned()")
    return ("register (odd-sized torch.empty, and mmap'ed pages via torch.frombuffer), is_pinned, non_blocking "
            "copies both ways on a side stream, unregister; pin_memory=True")


def _distributed(_dev: torch.device) -> str:
    import torch.distributed as dist

    _check(dist.is_available(), "torch.distributed.is_available() is False")
    missing = [name for name in _DIST_NAMES if not hasattr(dist, name)]
    _check(not missing, f"torch.distributed lacks {', '.join(missing)}")
    _check(hasattr(dist.ReduceOp, "MAX"), "torch.distributed.ReduceOp has no MAX")
    nccl = "NCCL available" if dist.is_nccl_available() else "no NCCL in this build"
    return f"{', '.join(_DIST_NAMES[:2])} and {len(_DIST_NAMES) - 2} more present; {nccl} (existence only: one process)"


# --------------------------------------------------------------------------- CPU and CUDA


def _adam_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int,
                    lr: float, b1: float, b2: float, wd: float, eps: float, decoupled: bool) -> torch.Tensor:  # fmt: skip
    p, g, m, v = (t.double() for t in (p, g, m, v))
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    return p - lr * (m / bc1) / (v.sqrt() / bc2**0.5 + eps)


def _fused_adam(dev: torch.device) -> str:
    gen = torch.Generator().manual_seed(0)
    lr, beta1, beta2, weight_decay, eps = 1e-3, 0.9, 0.999, 0.01, 1e-8
    step = 3
    for decoupled, fused in ((True, torch._fused_adamw_), (False, torch._fused_adam_)):
        sizes = (1000, 4097)
        ps = [torch.randn(n, generator=gen) for n in sizes]
        gs = [torch.randn(n, generator=gen) for n in sizes]
        ms = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
        vs = [torch.rand(n, generator=gen) * 0.1 for n in sizes]
        want = [
            _adam_reference(p, g, m, v, step, lr, beta1, beta2, weight_decay, eps, decoupled)
            for p, g, m, v in zip(ps, gs, ms, vs)
        ]
        masters, grads, exp_avgs, exp_avg_sqs = ([t.to(dev) for t in ts] for ts in (ps, gs, ms, vs))
        step_t = torch.full((), float(step), dtype=torch.float32, device=dev)  # one read-only step tensor shared by the list, as adam.py makes it
        fused(masters, grads, exp_avgs, exp_avg_sqs, [], [step_t] * len(masters),
              lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)  # fmt: skip
        _sync(dev)
        for got, w in zip(masters, want):
            diff = (got.double().cpu() - w).abs()
            _check(bool((diff <= 1e-6 + 1e-6 * w.abs()).all()),
                   f"{fused.__name__} on {dev.type}: max error {float(diff.max()):.2e} against the Adam formula")  # fmt: skip
        _check(float(step_t) == step, f"{fused.__name__} changed the shared step tensor")
    return "_fused_adamw_ and _fused_adam_ (fp32 lists, one shared step tensor) match the Adam formula"


def _foreach(dev: torch.device) -> str:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16).to(dev) for n in (3, 1000, 70000)]
    norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    _check(norms.dtype == torch.float32 and norms.device == grads[0].device, f"_foreach_norm gave {norms.dtype} on {norms.device}")
    want = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    _check(torch.allclose(norms, want, rtol=1e-4, atol=0), f"_foreach_norm(dtype=float32) {norms.tolist()} vs {want.tolist()}")
    fp32 = [g.float() for g in grads]
    factor = torch.clamp(torch.tensor(1.0) / (torch.tensor(3.0) + 1e-6), max=1.0)  # a 0-dim CPU tensor, as the clip factor
    torch._foreach_mul_(fp32, float(factor))  # the clip factor as a Python float, as adam.py applies it
    for a, g in zip(fp32, grads):
        _check(torch.allclose(a, g.float() * float(factor)), "_foreach_mul_ by a Python float")
    params = [torch.empty_like(g) for g in grads]
    torch._foreach_copy_(params, fp32)  # fp32 masters into bf16 param slots
    for p, a in zip(params, fp32):
        _check(p.dtype == torch.bfloat16 and torch.equal(p, a.to(torch.bfloat16)), "_foreach_copy_ fp32 -> bf16")
    _sync(dev)
    return "_foreach_norm(dtype=float32) of bf16, _foreach_mul_ by a Python float, _foreach_copy_ fp32 -> bf16"


def _storage_resize(dev: torch.device) -> str:
    t = torch.ones(_MiB, dtype=torch.float32, device=dev)
    view = t[10:20]  # a parameter's view into its chunk
    st = t.untyped_storage()
    nbytes = st.nbytes()
    _sync(dev)
    before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
    st.resize_(0)
    _check(st.nbytes() == 0, "UntypedStorage.resize_(0) left bytes")
    if dev.type == "cuda":
        freed = before - torch.cuda.memory_allocated(dev)
        _check(freed >= nbytes, f"resize_(0) freed {freed} device bytes of {nbytes}")
    st.resize_(nbytes)
    _check(st.nbytes() == nbytes, "resize_(nbytes) did not grow the storage back")
    t.fill_(2.0)
    view.fill_(3.0)
    _check(float(t.sum()) == 2.0 * (_MiB - 10) + 30.0, "a view of the storage does not see the regrown bytes")
    _sync(dev)
    return "resize_(0) frees, resize_(n) regrows under the same tensor and its views"


def _swap_tensors(dev: torch.device) -> str:
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(4, 3))
    holder = torch.nn.Linear(3, 4, bias=False, device="meta")
    holder.weight = p
    chunk = torch.arange(24, dtype=torch.float32, device=dev)
    place = chunk[6:18].view(4, 3)
    new = torch.nn.Parameter(place, requires_grad=True)
    torch.utils.swap_tensors(p, new)
    _check(holder.weight is p and p.device == chunk.device and not p.is_meta, "swap_tensors did not move the parameter object")
    _check(p.data_ptr() == place.data_ptr(), "the swapped parameter does not view its place in the chunk")
    return "a meta nn.Parameter now views a slice of a chunk, same Python object"


def _grad_hooks(dev: torch.device) -> str:
    w = torch.nn.Parameter(torch.randn(8, 8, device=dev))
    b = torch.nn.Parameter(torch.randn(8, device=dev))
    x = torch.randn(4, 8, device=dev)
    fired: list[str] = []
    threads: set[int] = set()

    def post(param: torch.Tensor) -> None:
        fired.append("post")
        threads.add(threading.get_ident())
        _check(param.grad is not None, "post-accumulate hook ran before .grad was set")

    def multi(_grads: Any) -> None:
        fired.append("multi")
        threads.add(threading.get_ident())

    h1 = w.register_post_accumulate_grad_hook(post)
    y = x @ w + b
    h2 = torch.autograd.graph.register_multi_grad_hook((y,), multi, mode="any")
    y.sum().backward()
    h1.remove()
    h2.remove()
    _sync(dev)
    _check(sorted(fired) == ["multi", "post"], f"hooks fired: {fired}")
    where = "autograd's device thread" if threads - {threading.get_ident()} else "the calling thread"
    return f"register_post_accumulate_grad_hook and register_multi_grad_hook(mode='any') fired, on {where}"


def _backward_tasks(dev: torch.device) -> str:
    """What a plain loss.backward() and reentrant checkpoints are told apart by (Note [plain
    backward], Note [reentrant regions]): graph task ids, whether a node will run, queued callbacks."""
    from torch.autograd.graph import get_gradient_edge
    from torch.utils.checkpoint import checkpoint

    w = torch.nn.Parameter(torch.randn(8, 8, device=dev))
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    _check(torch._C._current_graph_task_id() == -1, "_current_graph_task_id() outside a backward is not -1")
    seen: dict[str, Any] = {"tasks": set(), "will": [], "ended": 0}

    def at_output(_grad: torch.Tensor) -> None:
        seen["tasks"].add(torch._C._current_graph_task_id())
        seen["will"].append(torch._C._will_engine_execute_node(get_gradient_edge(w).node))
        torch.autograd.Variable._execution_engine.queue_callback(lambda: seen.__setitem__("ended", seen["ended"] + 1))

    def at_grad(_p: torch.Tensor) -> None:
        seen["tasks"].add(torch._C._current_graph_task_id())

    y = x @ w
    y.register_hook(at_output)
    torch.autograd.grad(y.sum(), [x], retain_graph=True)  # gradients only: w's node does not run
    y.sum().backward()  # a backward: it does
    _check(seen["will"] == [False, True], f"_will_engine_execute_node gave {seen['will']}, not [False, True]")
    _check(seen["ended"] == 2, f"queued callbacks ran {seen['ended']} times, not 2")
    seen["tasks"].clear()
    h = w.register_post_accumulate_grad_hook(at_grad)
    z = checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=True)
    outer: list[int] = []
    z.register_hook(lambda _g: outer.append(torch._C._current_graph_task_id()))
    (z * 2).sum().backward()
    h.remove()
    _sync(dev)
    inner = seen["tasks"]
    _check(len(inner) == 1 and len(outer) == 1 and -1 not in inner and outer[0] not in inner,
           f"a reentrant region's gradient came in graph task {inner}, the outer backward's is {outer}")
    return "graph task ids, _will_engine_execute_node and queue_callback behave as the engine expects"


def _modes(dev: torch.device) -> str:
    from torch.overrides import TorchFunctionMode
    from torch.utils import _python_dispatch

    for name in ("_push_mode", "_pop_mode", "_get_current_dispatch_mode_stack"):
        _check(hasattr(_python_dispatch, name), f"torch.utils._python_dispatch has no {name}")
    import torch.overrides as overrides

    for name in ("_push_mode", "_pop_mode", "_get_current_function_mode_stack"):
        _check(hasattr(overrides, name), f"torch.overrides has no {name}")
    seen: list[str] = []

    class Count(_python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    mode = Count()
    _python_dispatch._push_mode(mode)
    try:
        _check(mode in _python_dispatch._get_current_dispatch_mode_stack(), "a pushed dispatch mode is not on the stack")
        torch.ones(3, device=dev).add_(1)
    finally:
        popped = _python_dispatch._pop_mode()
    _check(popped is mode, "_pop_mode() did not return the mode pushed")
    _check(bool(seen), "a pushed TorchDispatchMode saw no op")
    class Through(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    fmode = Through()
    overrides._push_mode(fmode)
    try:
        _check(fmode in overrides._get_current_function_mode_stack(), "a pushed function mode is not on the stack")
    finally:
        fpopped = overrides._pop_mode()
    _check(fpopped is fmode, "torch.overrides._pop_mode() did not return the mode pushed")
    with torch._C.DisableTorchFunctionSubclass():
        torch.ones(2).sum()
    # the watched class's data property reaches torch's own descriptor (Note [data aliases])
    p = torch.nn.Parameter(torch.ones(3))
    alias = torch._C.TensorBase.data.__get__(p)  # type: ignore[attr-defined]
    alias.mul_(2)
    _check(alias._version == 1 and p._version == 0 and float(p.sum()) == 6.0, "TensorBase.data does not alias with a counter of its own")
    torch._C.TensorBase.data.__set__(p, torch.zeros(3))  # type: ignore[attr-defined]
    _check(float(p.sum()) == 0.0, "TensorBase.data's setter did not replace the data")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        torch.get_rng_state()
    with torch.profiler.record_function("chunkstar::probe"):
        torch.ones(2).sum()
    return "dispatch / function mode push-pop, DisableTorchFunctionSubclass, TensorBase.data, fork_rng(devices=[]), record_function"


_DIST_NAMES = (
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "all_reduce", "broadcast", "barrier",
    "get_rank", "get_world_size", "get_backend", "is_initialized", "is_available", "new_group", "ReduceOp",
)  # fmt: skip

def _saved_tensor_hooks(dev: torch.device) -> str:
    """What the activation offload rests on (Note [activation offload]): saved_tensors_hooks
    whose pack gives autograd a host copy of a whole storage and whose unpack rebuilds the
    view on the device; the gradients are the same bits as without them."""
    w = torch.randn(64, 64, device=dev, requires_grad=True)
    x = torch.randn(16, 64, device=dev)
    packed: list[int] = []

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, tuple[Any, ...]]:
        raw = t.new_empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        packed.append(raw.numel())
        return raw.to("cpu", copy=True), (t.dtype, t.size(), t.stride(), t.storage_offset())

    def unpack(p: tuple[torch.Tensor, tuple[Any, ...]]) -> torch.Tensor:
        host, (dtype, size, stride, offset) = p
        return host.to(dev).view(dtype).as_strided(size, stride, offset)

    torch.tanh(x @ w).sum().backward()
    want = w.grad.clone()  # type: ignore[union-attr]
    w.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        torch.tanh(x @ w).sum().backward()
    _sync(dev)
    _check(bool(packed), "the pack hook never ran")
    _check(torch.equal(w.grad, want), "gradients through host copies of the saved tensors differ")  # type: ignore[arg-type]
    return f"saved_tensors_hooks: {len(packed)} saved tensors through the host, the same gradients"


PROBES: tuple[Probe, ...] = (
    Probe("cuda device", ("torch.cuda.is_available", "torch.cuda.device_count", "torch.cuda.set_device",
                          "torch.cuda.current_device", "torch.cuda.get_device_properties", "torch.cuda.synchronize",
                          "torch.cuda.is_initialized"),
          "cuda", _cuda_device),
    Probe("streams and events", ("torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.current_stream", "torch.cuda.stream",
                                 ".wait_stream", ".wait_event", ".record", ".query", ".synchronize"),
          "cuda", _streams_events),
    Probe("memory statistics", ("torch.cuda.mem_get_info", "torch.cuda.memory_allocated", "torch.cuda.memory_reserved",
                                "torch.cuda.max_memory_allocated", "torch.cuda.max_memory_reserved",
                                "torch.cuda.reset_peak_memory_stats", "torch.cuda.empty_cache"),
          "cuda", _memory_stats),
    Probe("cudaHostRegister", ("torch.cuda.cudart", ".is_pinned", ".pin_memory", "torch.frombuffer"), "cuda", _host_register),
    Probe("torch.distributed", tuple(f"torch.distributed.{n}" for n in _DIST_NAMES) + ("torch.distributed.ReduceOp.MAX",),
          "host", _distributed),
    Probe("fused Adam", ("torch._fused_adamw_", "torch._fused_adam_"), "both", _fused_adam),
    Probe("foreach ops", ("torch._foreach_norm", "torch._foreach_mul_", "torch._foreach_copy_"), "both", _foreach),
    Probe("storage resize", (".untyped_storage", ".resize_"), "both", _storage_resize),
    Probe("swap_tensors", ("torch.utils.swap_tensors",), "both", _swap_tensors),
    Probe("gradient hooks", (".register_post_accumulate_grad_hook", "torch.autograd.graph.register_multi_grad_hook"),
          "both", _grad_hooks),
    Probe("backward tasks", ("torch._C._current_graph_task_id", "torch._C._will_engine_execute_node",
                             "torch.autograd.graph.get_gradient_edge"), "both", _backward_tasks),
    Probe("saved tensor hooks", ("torch.autograd.graph.saved_tensors_hooks",), "both", _saved_tensor_hooks),
    Probe("modes and misc", ("torch.utils._python_dispatch._push_mode", "torch.utils._python_dispatch._pop_mode",
                             "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
                             "torch.utils._python_dispatch.TorchDispatchMode", "torch.overrides._push_mode",
                             "torch.overrides._pop_mode", "torch.overrides._get_current_function_mode_stack",
                             "torch.overrides.TorchFunctionMode", "torch._C.DisableTorchFunctionSubclass",
                             "torch._C.TensorBase", "torch._C.TensorBase.data", "torch._C.TensorBase.data.__get__",
                             "torch._C.TensorBase.data.__set__", "torch.random.fork_rng", "torch.profiler.record_function"),
          "host", _modes),
)  # fmt: skip
"""In the order they run: the CUDA basics first (a failure there explains the rest)."""

COVERED: frozenset[str] = frozenset(api for p in PROBES for api in p.apis)


def probe(device: torch.device, on_result: Callable[[dict[str, str]], None] | None = None) -> list[dict[str, str]]:
    """Every probe for ``device`` (cuda: the CUDA ones, the others on the CPU and, where they
    touch device tensors, on the GPU too; cpu: the CUDA ones ``n/a``): ``{"name", "device", "status": ok|FAILED|n/a, "detail"}``
    each, never an exception. ``on_result`` sees each as it is made (progress)."""
    results: list[dict[str, str]] = []
    targets: list[tuple[Probe, torch.device | None]] = []
    on_cuda = device.type == "cuda"
    for p in PROBES:
        if p.where == "cuda":
            targets.append((p, device if on_cuda else None))
        else:
            targets.append((p, torch.device("cpu")))
            if p.where == "both" and on_cuda:
                targets.append((p, device))
    for p, dev in targets:
        if dev is None:
            entry = {"name": p.name, "device": "cuda", "status": "n/a", "detail": "no CUDA device"}
        else:
            try:
                entry = {"name": p.name, "device": dev.type, "status": "ok", "detail": p.run(dev)}
            except Exception as exc:  # noqa: BLE001  (a missing or broken API is a result)
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                entry = {"name": p.name, "device": dev.type, "status": "FAILED", "detail": f"{type(exc).__name__}: {first}"[:300]}
        results.append(entry)
        if on_result is not None:
            on_result(entry)
    return results
