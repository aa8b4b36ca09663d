"""The disk tier's mechanism: chunk files, asynchronous I/O lanes, host staging buffers, a bandwidth probe.

A third tier below the host (docs/design.md, 'The disk tier'): the chunks of chosen state lists
(fp32 master, Adam moments, optionally the params) live in preallocated files,
one per (rank, list), and stream through a bounded set of host buffers during
the optimizer step, read ahead and written behind on I/O threads. This
package knows *how* to move a chunk's bytes to and from disk, exactly and at
disk bandwidth; which lists go to disk, how far to read ahead and when to write
back is the runtime's policy (:mod:`chunkstar.runtime.disk_tier`).

* :class:`ChunkFiles` - the files, their directory claim (lock, manifest,
  stale files refused or wiped) and exact chunk reads and writes, each read
  checked against what was written (Note [chunk checks]);
* :class:`DiskLanes` - a read lane and a write lane returning events;
* :class:`StagingBuffers` - the bounded, reusing pool of host buffers;
* :func:`measure_disk_bandwidth` - what the directory's disk can do;
* :func:`aligned_empty` - a host tensor at a 4096-byte address, for ``O_DIRECT``.
"""

from chunkstar.disk.bandwidth import DiskBandwidth, measure_disk_bandwidth
from chunkstar.disk.blockio import ALIGNMENT, aligned_empty, is_aligned
from chunkstar.disk.claim import OnStale
from chunkstar.disk.errors import DiskFullError, DiskTierError
from chunkstar.disk.files import ChunkFiles, DiskIOStats, FilesState
from chunkstar.disk.io_lanes import DiskEvent, DiskLanes
from chunkstar.disk.staging import StagingBuffers

__all__ = [
    "ALIGNMENT",
    "ChunkFiles",
    "DiskBandwidth",
    "DiskEvent",
    "DiskFullError",
    "DiskIOStats",
    "DiskLanes",
    "DiskTierError",
    "FilesState",
    "OnStale",
    "StagingBuffers",
    "aligned_empty",
    "is_aligned",
    "measure_disk_bandwidth",
]
