"""Compute backends of the worker: the NumPy reference (and CuPy on GPUs)."""
