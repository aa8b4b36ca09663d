"""Integrations of the chunk engine with training frameworks.

Each integration is a module of its own that imports its framework when it is
itself imported, never from here: ``import chunkstar`` (and this package) keep
needing torch only.

* :mod:`chunkstar.integrations.transformers`: ``ChunkstarTrainer``, a Hugging
  Face ``transformers.Trainer`` whose model lives in chunks (the ``[hf]`` extra).
* :mod:`chunkstar.integrations.lightning`: ``ChunkstarStrategy``, a PyTorch
  Lightning strategy that trains a LightningModule in chunks (the
  ``[lightning]`` extra; importing it registers ``strategy="chunkstar"``).
"""

from __future__ import annotations

__all__: list[str] = []
