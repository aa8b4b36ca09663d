"""An optimizer step and a checkpoint load change chunks one after another: what an interrupt leaves.

Note [all or nothing]: ``optimizer.step()`` updates chunk after chunk (fused
Adam on the device chunks, one host-worker job per host chunk), then counts the
step; ``engine.load_checkpoint`` copies a shard into chunk after chunk, then
restores the step counts, the parameter groups and the loss scaler. Stopped
half-way, each leaves an engine that matches neither the state before nor the
state after (some chunks stepped or loaded, the step count not), and training
on would go on from a mix in silence. Copying every chunk first, to put it back
on a failure, would cost the optimizer state twice over (12 bytes per
parameter) at every step; so instead:

* a Ctrl-C (SIGINT) while a step or a load writes is held until it is done and
  raised then (:func:`deferred_interrupts`): the step or load is whole, and the
  KeyboardInterrupt comes from the call that was running, as the user expects.
  A second Ctrl-C is not held: whoever presses twice means it. Python runs
  signal handlers on the main thread only, so this holds there (and for a
  handler of Python's own or the user's; one installed outside Python is left
  alone);
* anything else that stops a step or a load once it has changed a chunk (an
  exception of any kind, a second Ctrl-C, an error of the disk tier) makes the
  optimizer refuse to go on (:meth:`chunkstar.optim.adam.ChunkAdam.interrupted`):
  ``optimizer.step()``, ``optimizer.zero_grad()`` (the usual next call after an
  interrupt) and ``engine.save_checkpoint`` raise a ChunkStateError that says
  what was interrupted and how to restore a whole state, until a load completes
  (``engine.load_checkpoint``, or ``engine.load_state_dict`` together with
  ``optimizer.load_state_dict``). The model still runs meanwhile: each chunk's
  values are its own, only their mix is wrong, and refusing reads would help no
  one;
* a step stopped before it changed anything (while placing chunks or taking
  the gradient norm) is no step: its gradients are dropped, as by
  ``zero_grad()``, and training goes on as if it had not been called.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Any, Callable, Iterator

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Inside the block a first SIGINT is held and delivered (to the handler it would have
    reached) when the block ends normally; a second one is delivered at once (Note [all or
    nothing]). Off the main thread, or under a handler Python did not install, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or a handler installed outside Python
        yield
        return
    handler: Callable[[int, FrameType | None], Any] = previous
    held: list[tuple[int, FrameType | None]] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        if held:  # the second Ctrl-C: the user insists
            handler(signum, frame)
        else:
            held.append((signum, frame))

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        handler(*held[0])  # Python's own handler raises KeyboardInterrupt here
