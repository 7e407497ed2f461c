"""Where the memory tier lives (FORMAT.md §13): the root, each rank's own store, the replicas."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["MEMORY_ROOT", "default_memory_dir", "memory_rank_dir", "replica_dir"]

MEMORY_ROOT = Path("/dev/shm/pccheck")


def default_memory_dir(path: str | os.PathLike[str]) -> Path:
    """``/dev/shm/pccheck/<store>``: the disk path's last component plus 8 hex digits of a hash of
    its absolute form (two stores with one name never share a memory directory)."""
    p = Path(path).resolve()
    return MEMORY_ROOT / f"{p.name or 'store'}-{hashlib.sha1(str(p).encode()).hexdigest()[:8]}"


def memory_rank_dir(root: Path, rank: int | None) -> Path:
    """This rank's own memory store: ``root`` alone, ``root/rank-<r>`` in a group (FORMAT.md §8)."""
    return root if rank is None else root / f"rank-{rank}"


def replica_dir(root: Path, source: int) -> Path:
    """Where a peer keeps the replicas of ``source``'s memory checkpoints (FORMAT.md §13)."""
    return root / f"replica-{source}"
