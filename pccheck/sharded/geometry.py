"""Shard geometry: where a local shard lies in its global tensor, and where two shards overlap.

Pure arithmetic on tuples (no torch): a *box* is ``(offsets, sizes)``, one entry per dimension,
in elements of the global tensor. A DTensor's local shard is the box that ``Shard(d)`` placements
cut with ``torch.chunk`` semantics (``ceil(n / k)`` per piece, trailing pieces shorter or empty:
10 on 3 ranks is 4, 4, 2), applied mesh dimension by mesh dimension; ``Replicate()`` cuts nothing.
A resharded load copies, for every destination box, the overlap of each saved box with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["Box", "chunk_range", "local_box", "overlap", "full_box", "numel"]


@dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor: ``offsets[i] .. offsets[i] + sizes[i]`` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Index slices of this box in a tensor whose element 0 is at ``origin`` (default 0)."""
        o = origin if origin is not None else (0,) * len(self.offsets)
        return tuple(slice(a - b, a - b + n) for a, b, n in zip(self.offsets, o, self.sizes))

    def within(self, shape: Sequence[int]) -> bool:
        """True if the box lies inside a tensor of ``shape`` (same rank, non-negative)."""
        return (len(self.offsets) == len(self.sizes) == len(shape)
                and all(0 <= a and 0 <= n and a + n <= s for a, n, s in zip(self.offsets, self.sizes, shape)))


def full_box(shape: Sequence[int]) -> Box:
    """The whole of a tensor of ``shape``."""
    return Box((0,) * len(shape), tuple(int(s) for s in shape))


def numel(box: Box) -> int:
    n = 1
    for s in box.sizes:
        n *= s
    return n


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` when ``torch.chunk`` cuts ``n`` elements in ``parts``."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"piece {index} of {parts}")
    step = -(-n // parts) if n else 0
    start = min(index * step, n)
    return start, min(n, start + step) - start


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
              shard_dims: Sequence[int | None]) -> Box:
    """The box of the shard at mesh ``coordinate``: ``shard_dims[i]`` is the tensor dimension mesh
    dimension ``i`` shards (``Shard(d)``), or None (``Replicate()``). Mesh dimensions apply in
    order, each cutting what the previous ones left (as DTensor does)."""
    offsets = [0] * len(global_shape)
    sizes = [int(s) for s in global_shape]
    for mesh_dim, d in enumerate(shard_dims):
        if d is None:
            continue
        start, length = chunk_range(sizes[d], int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim]))
        offsets[d] += start
        sizes[d] = length
    return Box(tuple(offsets), tuple(sizes))


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same tensor, or None if it is empty."""
    offsets, sizes = [], []
    for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offsets), tuple(sizes))
