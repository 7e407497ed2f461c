"""Every name pccheck gives an entry of a store directory (FORMAT.md §1), the default directory,
and the one way to write a small file durably.

    PATH/LOCK                  the writer's flock (persist/store.py)
    PATH/store-GGGGGG.pcc      store generations; `.tmp` while being created
    PATH/pccheck-tune.json     the tuner's choice (tuner/config.py)
    PATH/GLOBAL                a group's newest globally committed step (distributed.py)
    PATH/rank-<r>/             one rank's store directory (distributed.py)
    PATH/history/              the disk tier's kept copies (keep_last, keep_every; history.py)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["LOCK", "STORE_GLOB", "GLOBAL", "TUNE_CONFIG", "HISTORY_DIR", "default_path", "store_name",
           "store_generation", "rank_dir", "fsync_dir", "write_durably"]

LOCK = "LOCK"
STORE_GLOB = "store-*.pcc"
GLOBAL = "GLOBAL"
TUNE_CONFIG = "pccheck-tune.json"
HISTORY_DIR = "history"
_STORE_RE = re.compile(r"^store-(\d{6,})\.pcc$")


def default_path() -> Path:
    """``$PCCHECK_DIR``, else ``./checkpoints``: the default for writers and readers alike."""
    return Path(os.environ.get("PCCHECK_DIR") or "checkpoints")


def store_name(generation: int) -> str:
    """The file name of store generation ``generation``."""
    return f"store-{generation:06d}.pcc"


def store_generation(name: str) -> int | None:
    """The generation a store file name carries, or None if ``name`` is not a store file."""
    m = _STORE_RE.match(name)
    return int(m.group(1)) if m else None


def rank_dir(path: Path, rank: int) -> Path:
    """The store directory of ``rank`` in a distributed job writing to ``path``."""
    return Path(path) / f"rank-{rank}"


def fsync_dir(path: Path) -> None:
    """fsync a directory, so a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Writes ``path`` crash-safely: temporary name, ``write(f)``, fsync, rename, fsync directory.

    On any error the temporary file is removed and ``path`` is left as it was; a crash leaves
    either the old file or the new one, and at most a ``*.tmp`` beside it.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are durable before the name points at them
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself is durable
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
