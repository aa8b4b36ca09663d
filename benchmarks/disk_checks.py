"""What the disk tier's chunk checks cost: checked chunk transfers against the same transfers unchecked.

    python benchmarks/disk_checks.py --dir /path/on/the/disk            # 16 chunks of 64 MiB, 3 rounds

Each round writes and reads the chunks through ``ChunkFiles`` (each write summed,
each read summed and compared: Note [chunk checks] in chunkstar/disk/files.py) and
the same bytes with the same O_DIRECT primitives and no sum, the two interleaved
(a virtual disk's bandwidth drifts from minute to minute), and prints GB/s and
CPU seconds per GB of each, with crc32 alone on a thread (Note [chunk checksum]).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Callable

import torch

from chunkstar.disk import ChunkFiles, aligned_empty
from chunkstar.disk.blockio import O_DIRECT, byte_view, pread_full, pwrite_full


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(nbytes: int, fn: Callable[[], None]) -> tuple[float, float]:
    """(GB/s, CPU s per GB) of ``fn`` moving ``nbytes``, every thread's CPU counted."""
    t0, c0 = time.perf_counter(), _cpu_s()
    fn()
    dt, dc = time.perf_counter() - t0, _cpu_s() - c0
    return nbytes / dt / 1e9, dc / (nbytes / 1e9)


def _each(k: int, fn: Callable[[int], object]) -> Callable[[], None]:
    """``fn(c)`` for every chunk ``c``, in order."""

    def run() -> None:
        for c in range(k):
            fn(c)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure (a subdirectory is made and removed)")
    ap.add_argument("--chunk-mib", type=int, default=64, help="MiB per chunk (default %(default)s)")
    ap.add_argument("--chunks", type=int, default=16, help="chunks (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (default %(default)s)")
    args = ap.parse_args()
    n, k = args.chunk_mib << 20, args.chunks
    total = n * k
    root = Path(args.dir) / f"chunkstar-disk-checks-{uuid.uuid4().hex[:8]}"
    buf = aligned_empty(n)  # 1-D uint8 host, 4096-aligned: what a staging buffer is
    buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    view = byte_view(buf)
    rows: dict[str, list[tuple[float, float]]] = {}

    def row(name: str, fn: Callable[[], None]) -> None:
        rows.setdefault(name, []).append(_timed(total, fn))

    try:
        for _ in range(args.rounds):
            files = ChunkFiles.create(
                root / "checked", run_tag="bench", rank=0, lists=["m"], chunk_nbytes={c: n for c in range(k)}
            )
            try:
                row("checked write", _each(k, lambda c: files.write_from("m", c, buf)))
                row("checked read", _each(k, lambda c: files.read_into("m", c, buf)))
            finally:
                files.remove()
            (root / "raw").mkdir(parents=True, exist_ok=True)
            path = root / "raw" / "chunks"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | O_DIRECT, 0o600)
            try:
                os.posix_fallocate(fd, 0, total)
                row("unchecked write", _each(k, lambda c: pwrite_full(fd, view, c * n)))
                row("unchecked read", _each(k, lambda c: pread_full(fd, view, c * n)))
            finally:
                os.close(fd)
                os.unlink(path)
            # the sum alone, on a thread of its own as the check threads are
            t = threading.Thread(target=row, args=("crc32 alone, on a thread", _each(k, lambda c: zlib.crc32(view))))
            t.start()
            t.join()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{k} chunks of {args.chunk_mib} MiB in {args.dir}, {args.rounds} rounds")
    for name, vals in rows.items():
        rates = " ".join(f"{g:.2f}" for g, _ in vals)
        cpus = " ".join(f"{c:.3f}" for _, c in vals)
        print(f"  {name:26s} GB/s: {rates:24s} CPU s/GB: {cpus}")


if __name__ == "__main__":
    main()
