"""A CRIU image directory as named byte arrays, and back.

Each regular file of the image becomes one uint8 array named ``criu/<file name>`` (CRIU's image
directories are flat), mapped read-only from tmpfs so the copy engine reads it in place; CRIU's own
logs are left out. Writing back checks each name before it is used as a path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np

from ..errors import CorruptCheckpointError
from .criu import LOGS

__all__ = ["PREFIX", "read_image", "write_image", "image_names"]

PREFIX = "criu/"


def read_image(images: Path) -> dict[str, np.ndarray]:
    """The image files of ``images`` as read-only uint8 arrays, by ``criu/<name>``, sorted."""
    out: dict[str, np.ndarray] = {}
    for entry in sorted(os.scandir(images), key=lambda e: e.name):
        if not entry.is_file(follow_symlinks=False) or entry.name in LOGS:
            continue
        size = entry.stat(follow_symlinks=False).st_size
        out[PREFIX + entry.name] = (np.memmap(entry.path, dtype=np.uint8, mode="r", shape=(size,)) if size
                                    else np.empty(0, dtype=np.uint8))
    return out


def image_names(state: Mapping[str, object]) -> list[str]:
    """The file names of a loaded checkpoint's image (its ``criu/`` arrays)."""
    return [name[len(PREFIX):] for name in state if name.startswith(PREFIX)]


def write_image(state: Mapping[str, np.ndarray], images: Path) -> int:
    """Writes a loaded image's files into the (empty) directory ``images``; returns the bytes."""
    total = 0
    for name in image_names(state):
        # Invariant: names come from a validated manifest, but are still never trusted as paths.
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise CorruptCheckpointError(f"image file name {name!r} is not a plain file name")
        data = np.ascontiguousarray(state[PREFIX + name]).view(np.uint8)
        with open(images / name, "xb") as f:
            f.write(memoryview(data))
        total += data.nbytes
    return total
