"""Errors of the checkpoint package that a user or another process sees: plain, picklable
``ValueError`` subclasses with a one-line message saying what is wrong and how to fix it.

Imports nothing else of the package, so every room may raise them.
"""

from __future__ import annotations

__all__ = ["ConversionError", "StorageUnavailable"]


class ConversionError(ValueError):
    """A bad export or import request, or an unusable checkpoint: one line saying what and how to fix it."""


class StorageUnavailable(ValueError):
    """A checkpoint URI whose filesystem cannot be used here (package missing, unknown scheme)."""
