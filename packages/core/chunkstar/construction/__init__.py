"""Construction: filling the chunks at start-up (Note [construction]) from the model's own
tensors, a meta-device model's initialisers, or a safetensors checkpoint."""

from __future__ import annotations

from chunkstar.construction.init import init_weights
from chunkstar.construction.materialize import ConstructionReport, fill_chunks, origin_fingerprint
from chunkstar.construction.pretrained import PretrainedError, PretrainedSource

__all__ = ["ConstructionReport", "PretrainedError", "PretrainedSource", "fill_chunks", "init_weights", "origin_fingerprint"]
