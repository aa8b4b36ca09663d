"""Real faults for the file tests, with no privileges: a file size limit makes writes fail
as on a full disk (EFBIG, the process lives on: SIGXFSZ is ignored meanwhile)."""

from __future__ import annotations

import contextlib
import resource
import signal
from typing import Iterator

__all__ = ["file_size_limit"]


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A write past ``limit`` bytes fails (EFBIG), as on a full disk; works as root too."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal that kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
