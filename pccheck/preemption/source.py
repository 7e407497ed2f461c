"""The flushed state when it comes from another tier: the committed checkpoint of one step in a
store directory (the memory tier's tmpfs store), as read-only views of the mapped file.

Nothing is copied or checksummed here: the disk checkpoint made from these views is committed
only if the crc32c its writers compute of every array matches the manifest's
(``StartArgs.expect_crcs``), so a slot that changed under the copy is never committed.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..persist.layout import Manifest
from ..persist.recovery import read_manifest, read_store, slot_base, store_files

__all__ = ["Held", "held_checkpoint"]


@dataclass(frozen=True)
class Held:
    """A committed checkpoint: its manifest and its arrays (views of ``mapping``), and where it
    lies (``file``, ``slot``, ``counter``: the remote tier uploads it from there)."""

    manifest: Manifest
    arrays: dict[str, Any]
    nbytes: int
    mapping: mmap.mmap
    file: Path
    slot: int
    counter: int

    @property
    def crcs(self) -> dict[str, int]:
        return {e.name: c for e, c in zip(self.manifest.arrays, self.manifest.crcs)}


def held_checkpoint(directory: Path, step: int) -> Held | None:
    """The newest committed checkpoint of ``step`` in the store under ``directory`` (newest
    generation first), or None if none holds it. Offsets come from the checked meta record and
    manifest, and are bounds-checked against the file before any view is made."""
    from ..tiers.memory.replicate import arrays_of, data_end  # the memory tier's own views of a slot

    for _, file in store_files(directory):
        try:
            image = read_store(file)
        except (CorruptCheckpointError, OSError):
            continue
        slots = sorted((st for st in image.slots if st.meta and st.meta["step"] == step),
                       key=lambda st: st.meta["counter"], reverse=True)
        with open(file, "rb", buffering=0) as f:
            for st in slots:
                try:
                    man = read_manifest(image, st.slot, f.fileno())
                except CorruptCheckpointError:
                    continue
                base, end = slot_base(image, st.slot), data_end(man)
                size = f.seek(0, 2)
                if man.step != step or end > image.header["slot_capacity"] or base + end > size:
                    continue
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                buf = np.frombuffer(mm, dtype=np.uint8, count=end, offset=base)
                return Held(man, arrays_of(man, buf), end, mm, file, st.slot, st.meta["counter"])
    return None
