"""Copy engines: move one snapshot's bytes from live arrays into DRAM chunks.

Call protocol, per checkpoint::

    sources = engine.sources(arrays, layout)      # describe the arrays (no copying)
    job = native_engine.begin(store, slot, sources, layout.data_len)
    engine.copy(job)                              # returns when every byte is in a chunk

After ``copy`` returns the live arrays may be mutated again. Chunks go to the writer threads as
soon as each is filled, so persisting overlaps copying (the paper's pipelining, §4.1).
The CUDA and cupy engines (device → pinned chunk over a dedicated stream) implement the same
protocol and arrive with the PyTorch front-end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ..persist.layout import Layout

__all__ = ["CopyEngine", "CpuCopyEngine"]


class CopyEngine(ABC):
    """Moves array bytes into the chunk pool. Implementations must not allocate per checkpoint."""

    name: str = "abstract"

    @abstractmethod
    def sources(self, arrays: Sequence[np.ndarray], layout: Layout) -> list[tuple]:
        """Native source descriptors ``(ptr, offset, nbytes, itemsize, shape, strides)``."""

    @abstractmethod
    def copy(self, job: object) -> None:
        """Fills the job's chunks and hands them to the writers; blocks until all are filled."""


class CpuCopyEngine(CopyEngine):
    """Host memory → chunks with memcpy in native code, the GIL released.

    Non-contiguous arrays (any strides, including negative and 0) are copied run by run in C
    order; nothing is made contiguous in Python first.
    """

    name = "cpu"

    def sources(self, arrays: Sequence[np.ndarray], layout: Layout) -> list[tuple]:
        return [(a.ctypes.data, e.offset, e.nbytes, a.itemsize, a.shape, a.strides)
                for a, e in zip(arrays, layout.entries)]

    def copy(self, job: object) -> None:
        job.copy()  # type: ignore[attr-defined]
