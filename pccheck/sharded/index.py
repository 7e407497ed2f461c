"""The checkpoints of a job as sets across its rank directories, and the shards each set holds.

A distributed job of W ranks writes ``PATH/rank-<r>/`` per rank (a job of one writes ``PATH``
itself). A *set* is one (epoch, step) held by every rank 0..W-1 of the job that wrote it: the
header of each member's store names that W and the member's rank (FORMAT.md §8). Only complete
sets are checkpoints; the newest one wins (by step, then epoch, as ``agree_and_load`` picks).

A set's tensors are the union of its members' ``"shards"`` sections (FORMAT.md §9): per tensor
(fqn) the dtype, the global shape, and the chunks (a box of the global tensor, stored as an
array of one member's slot). Everything read from the files is untrusted: the sections are
checked against each other and against the manifests' arrays before a byte of data is read, and
every array read is checked against its crc32c.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping

import numpy as np

from ..arrays import TORCH_DTYPES, TORCH_ONLY
from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..persist.files import rank_dir
from ..persist.layout import ArrayEntry, Manifest
from ..persist.reader import aligned_span, open_direct, read_entry, read_uncached
from ..persist.recovery import StoreImage, array_bases, scan, slot_manifests
from .geometry import Box

__all__ = ["Member", "Chunk", "TensorInfo", "CheckpointSet", "find_sets", "newest_set", "rank_dirs"]

log = logging.getLogger("pccheck")

_MAX_DIMS = 64


@dataclass(frozen=True)
class Member:
    """One rank's slot of a set."""

    rank: int
    image: StoreImage
    slot: int
    manifest: Manifest

    @cached_property
    def entries(self) -> dict[str, tuple[ArrayEntry, int]]:
        return {e.name: (e, c) for e, c in zip(self.manifest.arrays, self.manifest.crcs)}

    @cached_property
    def bases(self) -> dict[str, int]:
        """The file offset of the slot region holding each array (an incremental checkpoint's
        arrays may lie in other slots' cells, FORMAT.md §14)."""
        return dict(zip((e.name for e in self.manifest.arrays), array_bases(self.image, self.slot, self.manifest)))


@dataclass(frozen=True)
class Chunk:
    """A box of a global tensor, stored as array ``array`` of rank ``rank``'s slot."""

    rank: int
    array: str
    box: Box


@dataclass(frozen=True)
class TensorInfo:
    """One global tensor of a set."""

    fqn: str
    dtype: str                 # torch dtype name ("float32", "bfloat16", ...)
    shape: tuple[int, ...]     # global shape
    chunks: tuple[Chunk, ...]


@dataclass
class CheckpointSet:
    """A complete (epoch, step) across the ``world_size`` ranks that wrote it."""

    epoch: int
    step: int
    world_size: int
    members: list[Member]  # by rank
    bytes_read: int = 0    # array bytes read through :meth:`read` so far
    tier: ClassVar[str] = "disk"              # Restored.tier of a load of it
    read_threads: ClassVar[int | None] = None  # reads at once (None: the loader's READ_THREADS)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tensors: dict[str, TensorInfo] | None = field(default=None, repr=False)
    _fds: dict[int, int] = field(default_factory=dict, repr=False)

    @property
    def sharded(self) -> bool:
        """True if the set was written as shards (its trees carry a ``"shards"`` section)."""
        tree = self.members[0].manifest.tree
        return isinstance(tree, dict) and "shards" in tree

    def tensors(self) -> dict[str, TensorInfo]:
        """fqn -> the tensor's dtype, global shape and every chunk of it, over all members;
        CorruptCheckpointError if the members disagree or a chunk does not fit."""
        if self._tensors is None:
            self._tensors = _merge(self.members)
        return self._tensors

    def read(self, rank: int, name: str, into: np.ndarray | None = None) -> np.ndarray:
        """Array ``name`` of rank ``rank``'s slot, checked against its crc32c (thread-safe); read
        straight into ``into`` (a uint8 array of the array's size) when given."""
        m = self.members[rank]
        entries = m.entries
        if name not in entries:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot}: no array {name!r}")
        try:
            entry, crc = entries[name]
            if into is not None and into.nbytes != entry.nbytes:
                raise ValueError(f"array {name!r} holds {entry.nbytes} bytes, the destination {into.nbytes}")
            arr = read_entry(self._fd(rank), m.bases[name], entry, crc, into=into)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot} (step {self.step}): {exc}") from None
        with self._lock:
            self.bytes_read += arr.nbytes
        return arr

    def read_aligned(self, rank: int, name: str, buf: np.ndarray) -> np.ndarray:
        """Array ``name`` of rank ``rank``'s slot, checked against its crc32c, as a uint8 view into
        ``buf`` (page-aligned, at least :meth:`aligned_bytes` long), for a reader that reads each
        array once and copies it on: bytes not in the page cache are read with O_DIRECT
        (:func:`pccheck.persist.reader.read_uncached`). Thread-safe."""
        m = self.members[rank]
        if name not in m.entries:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot}: no array {name!r}")
        entry, crc = m.entries[name]
        fd, direct = self._fd(rank), self._fd(rank, direct=True)
        try:
            arr, got = read_uncached(fd, direct, m.bases[name] + entry.offset, entry.nbytes, buf)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot} (step {self.step}): array {name!r}: "
                                         f"{exc}") from None
        if got != crc:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot} (step {self.step}): array {name!r} "
                                         "checksum mismatch")
        with self._lock:
            self.bytes_read += entry.nbytes
        return arr

    def aligned_bytes(self, rank: int, name: str) -> int:
        """Bytes of the buffer :meth:`read_aligned` needs for array ``name`` of rank ``rank``."""
        m = self.members[rank]
        entry = m.entries[name][0]
        return aligned_span(m.bases[name] + entry.offset, entry.nbytes)

    def position(self, rank: int, name: str) -> tuple[int, int]:
        """(rank, file offset) of array ``name`` of rank ``rank``'s slot: the order in which a load
        reads arrays so that each member file is read front to back."""
        m = self.members[rank]
        if name not in m.entries:
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot}: no array {name!r}")
        return rank, m.bases[name] + m.entries[name][0].offset

    def _fd(self, rank: int, direct: bool = False) -> int:
        """One descriptor per member file (and one with O_DIRECT, where allowed, when ``direct``),
        opened at its first read (closed by :meth:`close`)."""
        key = -1 - rank if direct else rank  # direct descriptors under negative keys
        with self._lock:
            if key not in self._fds:
                path = self.members[rank].image.path
                self._fds[key] = open_direct(path) if direct else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return self._fds[key]

    def close(self) -> None:
        """Closes the member files :meth:`read` opened."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


def rank_dirs(path: Path) -> list[tuple[int, Path]]:
    """(rank, directory) of every store under ``path``: ``path`` itself (a job of one rank) and
    each ``rank-<r>/``. Both may hold stores (a job resharded to one process writes ``path``)."""
    found = [(0, path)]
    if path.is_dir():
        for d in path.iterdir():
            if d.is_dir() and d.name.startswith("rank-") and d.name[5:].isdigit():
                found.append((int(d.name[5:]), d))
    return sorted(found)


def _slots(directory: Path, rank: int) -> Iterator[tuple[int, int, int, Member]]:
    """(epoch, step, world_size, member) of every slot of ``directory`` whose meta record and
    manifest check out (data not read), newest generation first."""
    for gen in scan(directory):
        image = gen.image
        if image is None:
            log.warning("pccheck: %s", gen.problem)
            continue
        h = image.header
        if h["rank"] != rank or not 0 <= rank < h["world_size"]:
            log.warning("pccheck: %s says rank %d of %d, but it is in the directory of rank %d: ignored",
                        gen.path, h["rank"], h["world_size"], rank)
            continue
        for st, man in slot_manifests(gen.path, image):
            yield man.epoch or 0, man.step, h["world_size"], Member(rank, image, st.slot, man)


def find_sets(path: str | os.PathLike[str]) -> list[CheckpointSet]:
    """Every complete set under ``path``, newest first (by step, then epoch)."""
    path = Path(path)
    by_key: dict[tuple[int, int, int], dict[int, Member]] = {}
    for rank, directory in rank_dirs(path):
        for epoch, step, world, member in _slots(directory, rank):
            ranks = by_key.setdefault((epoch, step, world), {})
            ranks.setdefault(rank, member)  # newest generation first: keep the first seen
    sets = [CheckpointSet(epoch, step, world, [ranks[r] for r in range(world)])
            for (epoch, step, world), ranks in by_key.items() if all(r in ranks for r in range(world))]
    return sorted(sets, key=lambda s: (s.step, s.epoch), reverse=True)


def newest_set(path: str | os.PathLike[str]) -> CheckpointSet:
    """The newest complete set; NoCheckpointError if there is none."""
    sets = find_sets(path)
    if not sets:
        raise NoCheckpointError(f"no complete checkpoint under {path} (every rank of the job that wrote it "
                                "must hold the same step)")
    return sets[0]


def check_visible(path: Path, world_size: int) -> None:
    """Raises ConfigError unless every rank directory of a ``world_size`` job is visible here."""
    missing = [r for r in range(world_size) if not rank_dir(path, r).is_dir()] if world_size > 1 else []
    if missing:
        raise ConfigError(
            f"{path} holds a checkpoint of {world_size} ranks, but rank directories {missing} are not visible "
            "from this process: a resharded load reads every rank's shards, so the checkpoint directory must be "
            "on a filesystem every loading rank sees (a shared filesystem, or one host)")


def _merge(members: list[Member]) -> dict[str, TensorInfo]:
    out: dict[str, tuple[str, tuple[int, ...], list[Chunk]]] = {}
    for m in members:
        tree = m.manifest.tree
        section = tree.get("shards") if isinstance(tree, dict) else None
        if not isinstance(section, dict):
            raise CorruptCheckpointError(f"{m.image.path} slot {m.slot}: no shards section")
        arrays = {e.name: e for e in m.manifest.arrays}
        for fqn, doc in section.items():
            dtype, shape, chunks = _parse_tensor(fqn, doc, arrays, m)
            have = out.setdefault(fqn, (dtype, shape, []))
            if have[:2] != (dtype, shape):
                raise CorruptCheckpointError(f"tensor {fqn!r}: rank {m.rank} says {dtype}{list(shape)}, an earlier "
                                             f"rank {have[0]}{list(have[1])}")
            have[2].extend(chunks)
    return {fqn: TensorInfo(fqn, d, s, tuple(c)) for fqn, (d, s, c) in out.items()}


def _ints(x: Any, where: str) -> tuple[int, ...]:
    if (not isinstance(x, list) or len(x) > _MAX_DIMS
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in x)):
        raise CorruptCheckpointError(f"{where}: expected a list of at most {_MAX_DIMS} non-negative integers")
    return tuple(x)


def _parse_tensor(fqn: str, doc: Any, arrays: Mapping[str, ArrayEntry],
                  m: Member) -> tuple[str, tuple[int, ...], list[Chunk]]:
    """One entry of a shards section, bounds-checked against the global shape and the arrays."""
    where = f"{m.image.path} slot {m.slot}: shards[{fqn!r}]"
    if not isinstance(doc, dict) or not isinstance(doc.get("dtype"), str) or not isinstance(doc.get("chunks"), list):
        raise CorruptCheckpointError(f"{where}: malformed")
    shape = _ints(doc.get("shape"), f"{where}.shape")
    chunks = []
    for c in doc["chunks"]:
        if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], str)):
            raise CorruptCheckpointError(f"{where}: malformed chunk {c!r}")
        entry = arrays.get(c[0])
        if entry is None:
            raise CorruptCheckpointError(f"{where}: chunk array {c[0]!r} is not in the slot")
        if not _same_dtype(doc["dtype"], entry):
            raise CorruptCheckpointError(f"{where}: chunk {c[0]!r} holds {entry.torch_dtype or entry.dtype}, "
                                         f"the tensor is {doc['dtype']}")
        box = Box(_ints(c[1], f"{where}.chunk"), tuple(entry.shape))
        if not box.within(shape):
            raise CorruptCheckpointError(f"{where}: chunk {c[0]!r} at {list(box.offsets)} of shape "
                                         f"{list(box.sizes)} does not fit the global shape {list(shape)}")
        chunks.append(Chunk(m.rank, c[0], box))
    return doc["dtype"], shape, chunks


def _same_dtype(name: str, entry: ArrayEntry) -> bool:
    """True if ``entry`` stores elements of torch dtype ``name``: its numpy carrier (FORMAT.md §5),
    and the manifest's ``torch_dtype`` exactly for the dtypes numpy lacks."""
    carrier = TORCH_DTYPES.get(name)
    want = name if name in TORCH_ONLY else None
    return carrier is not None and entry.dtype == np.dtype(carrier) and entry.torch_dtype == want
