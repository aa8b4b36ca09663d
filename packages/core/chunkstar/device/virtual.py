"""The strict CPU virtual device's autograd device thread: backward off the caller's thread, as on CUDA.

Mechanism only. For CUDA tensors autograd runs the backward's nodes, and every
hook they fire, on a device thread of its own while the calling thread waits;
the engine's evictions, gradient offloads and deferred frees of the backward
therefore run off the thread that built the engine. For CPU tensors autograd
runs them in the calling thread, which would hide every bug of that kind. So on
the strict virtual device (:data:`STRICT_ENV`, the test suite's setting)
``engine.backward`` hands the call to a :class:`DeviceThread` (one per engine,
reused) and waits, and the backward runs there exactly as it would on a GPU's
device thread.

Note [strict device]: the strict device is for finding bugs, not for training:
a second compute thread costs every op of the process its OpenMP spin (Note
[one OpenMP team] in :mod:`chunkstar.device.threads`: 5-10% of a step on 2
cores). So the device thread, and the meter that measures every step
(``CHUNKSTAR_DEVICE_METER``, :mod:`chunkstar.device.memory`), come with
``CHUNKSTAR_STRICT_DEVICE=1``, which ``tests/conftest.py`` sets for the whole
suite; a training run on the CPU device runs its backward where PyTorch runs a
CPU backward, on the caller's thread, with the same engine code around it.

Autograd gives its device threads the caller's thread-local state; this thread
gets the parts the backward can see: grad mode, the CPU autocast settings, and
the Python dispatch and function modes on the caller's stacks (a memory probe's
dispatch mode counts the backward's allocations, as it would on CUDA through
the allocator). An exception in the backward is raised to the caller.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from typing import Any, Callable

import torch
import torch.overrides as _function_modes
import torch.utils._python_dispatch as _dispatch_modes

__all__ = ["STRICT_ENV", "DeviceThread", "env_switch", "strict_device"]

STRICT_ENV = "CHUNKSTAR_STRICT_DEVICE"
"""Set to 1, the CPU virtual device is the strict one (Note [strict device]): backward on a
device thread of its own, and every step measured by the device meter."""


def env_switch(name: str) -> bool:
    """A debugging switch from the environment: ``1`` on, ``0`` or unset (or empty) off. Any
    other value is refused, so a misspelt switch (``true``, ``yes``) does not leave the run
    quietly without what it asked for."""
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 1 (on) or 0 (off)")
    return raw == "1"


def strict_device() -> bool:
    """Whether this process asked for the strict CPU virtual device (:data:`STRICT_ENV`)."""
    return env_switch(STRICT_ENV)


def _modes_now() -> tuple[list[Any], list[Any]]:
    """The calling thread's Python dispatch and function mode stacks, bottom first."""
    return _dispatch_modes._get_current_dispatch_mode_stack(), _function_modes._get_current_function_mode_stack()


def _run_with(state: tuple[bool, bool, torch.dtype, list[Any], list[Any]], fn: Callable[[], None]) -> None:
    grad, autocast, autocast_dtype, dispatch, function = state
    for m in function:
        _function_modes._push_mode(m)
    for m in dispatch:
        _dispatch_modes._push_mode(m)
    try:
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast):
            fn()
    finally:
        for _ in dispatch:
            _dispatch_modes._pop_mode()
        for _ in function:
            _function_modes._pop_mode()


def _loop(jobs: queue.SimpleQueue) -> None:  # type: ignore[type-arg]
    while True:
        job = jobs.get()
        if job is None:
            return
        state, fn, box, done = job
        try:
            _run_with(state, fn)
        except BaseException as e:  # raised in the caller
            box.append(e)
        finally:
            del job, fn, state
            done.set()


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread) -> None:  # type: ignore[type-arg]
    jobs.put(None)
    if thread is not threading.current_thread():
        thread.join()


class DeviceThread:
    """Runs a function (the backward) on the virtual device's own thread; the caller waits."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # type: ignore[type-arg]
        self._thread = threading.Thread(target=_loop, args=(self._jobs,), name="chunkstar-autograd-device", daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def run(self, fn: Callable[[], None]) -> None:
        """``fn()`` on the device thread with the caller's thread-local state; returns when it
        has, raising what it raised. Called from the device thread itself, it runs in place."""
        if threading.current_thread() is self._thread:
            fn()
            return
        state = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), *_modes_now())
        box: list[BaseException] = []
        done = threading.Event()
        self._jobs.put((state, fn, box, done))
        try:
            done.wait()
        except BaseException:
            done.wait()  # an interrupt: the backward cannot be stopped half-way; let it finish
            raise
        if box:
            raise box[0]

    def close(self) -> None:
        self._finalizer()
