"""Device tiers and how bytes travel between them (copy engines: streams, threads, events)."""

from chunkstar.device.copy_engine import CopyEngine, CopyEvent, make_copy_engine

__all__ = ["CopyEngine", "CopyEvent", "make_copy_engine"]
