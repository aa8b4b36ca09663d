"""The profiler's version, written into every profile (a leaf module: the file format reads it without importing the package)."""

__version__ = "0.1.0"
