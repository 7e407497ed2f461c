"""Lazy (on-demand) restore: ``pccheck.load_latest(..., lazy=True)`` and ``pccheck.aio``."""

from .restore import LazyRestore, restore_lazily, restoring, wait_for_pending

__all__ = ["LazyRestore", "restore_lazily", "restoring", "wait_for_pending"]
