"""Acceptance tests of the chunkstar engine against plain PyTorch (CPU)."""
