"""Which copy engine a state needs: CUDA (torch), cupy or the CPU, by where its arrays live.

Kept apart from the engines so that neither engine module imports the other; the GPU engines are
imported only when a state holds device arrays (``import pccheck`` never imports torch or cupy).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..arrays import describe
from .copy_engine import CopyEngine, CpuCopyEngine

__all__ = ["select_copy_engine"]


def select_copy_engine(arrays: Mapping[str, Any]) -> CopyEngine:
    """The engine for where the arrays live: CUDA (torch) or cupy device memory, else the CPU."""
    devices = {describe(name, a).device.split(":")[0] for name, a in arrays.items()}
    if "cuda" in devices:
        from .cuda_engine import TorchCudaCopyEngine

        return TorchCudaCopyEngine()
    if "cupy" in devices:
        from .cuda_engine import CupyCopyEngine

        return CupyCopyEngine()
    return CpuCopyEngine()
