"""Sharded and resharded loads from the remote tier (FORMAT.md §12.4, §12.7 with §9).

A committed remote step of a W-rank sharded job is a §9 *set*: its step manifest embeds every
rank's local manifest, whose ``"shards"`` sections say where each chunk lies in its global tensor
and at which offset of that rank's data object its bytes are. :class:`RemoteSet` presents such a
step with the interface of :class:`pccheck.sharded.index.CheckpointSet`, so the local resharding
planner (pccheck/sharded/load.py: which chunks overlap what this rank's model holds, read into
its own tensors) runs unchanged on a job of any world size W'. Its :meth:`RemoteSet.read` is a
set of parallel ranged GETs of one array's bytes, checked against the array's crc32c: each rank
fetches only the chunks its shards need (plus its per-rank state), never a whole data object,
and no rank needs a filesystem another rank sees.

Every rank tries the same steps in the same order: rank 0's listing of the committed steps,
shared over pccheck's gloo group. Each rank fetches the step manifest itself (one GET) and checks
it and every embedded local manifest (§12.2, §5) before a byte of data is read.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError, RemoteError
from ...sharded.index import CheckpointSet, Member, TensorInfo
from .commit import committed
from .layout import MAX_MANIFEST_BYTES, StepManifest, array_sources, decode_manifest, manifest_key
from .load import GET_THREADS, local_manifest, read_array
from .objstore import NotFound, ObjectStore

__all__ = ["RemoteSet", "remote_sets", "newest_remote_is_sharded"]

# Arrays fetched at once by the resharding planner's reads (each by GET_PIECE ranged GETs on
# the set's own pool): small chunks are latency-bound on an object store, so more than the
# local reader's four.
READ_THREADS = 8


@dataclass(frozen=True)
class _Image:
    """What a Member's ``image`` says in messages and in ``Restored``: the prefix, the generation."""

    path: Path
    generation: int


class RemoteSet:
    """One committed remote step as a §9 set (the CheckpointSet interface load_sharded uses).
    Its manifest is fetched at the first use of :attr:`members`, inside the planner's try, so
    a missing or damaged manifest is a CorruptCheckpointError the ranks vote on."""

    tier = "remote"
    read_threads = READ_THREADS

    def __init__(self, store: ObjectStore, generation: int, step: int) -> None:
        self.store, self.generation, self.step = store, generation, step
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @cached_property
    def _manifest(self) -> StepManifest:
        try:
            raw, _ = self.store.get(manifest_key(self.generation, self.step), MAX_MANIFEST_BYTES)
        except NotFound:
            raise CorruptCheckpointError("its manifest disappeared (deleted by retention?)") from None
        except RemoteError as exc:
            raise CorruptCheckpointError(f"its manifest cannot be read: {exc}") from None
        return decode_manifest(raw, self.generation, self.step)

    @cached_property
    def members(self) -> list[Member]:
        """Every rank's part as a Member (slot 0 of an image named by the prefix), its local
        manifest checked (§5, ``data_len`` equal to the data object's size)."""
        image = _Image(Path(self.store.url.replace("s3://", "")), self.generation)
        return [Member(p.rank, image, 0, local_manifest(p, self.step)) for p in self._manifest.ranks]  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        return self._manifest.world_size

    @property
    def epoch(self) -> int:
        return self.members[0].manifest.epoch or 0

    @cached_property
    def _set(self) -> CheckpointSet:
        return CheckpointSet(self.epoch, self.step, self.world_size, self.members)

    @property
    def sharded(self) -> bool:
        return self._set.sharded

    def tensors(self) -> dict[str, TensorInfo]:
        """fqn -> dtype, global shape and chunks over every rank (CheckpointSet's merge and checks)."""
        return self._set.tensors()

    def position(self, rank: int, name: str) -> tuple[int, int]:
        """(rank, offset in its data object): reads go out in object order."""
        entries = self._entries(rank)
        if name not in entries:
            raise CorruptCheckpointError(f"step {self.step}: rank {rank}'s part has no array {name!r}")
        return rank, entries[name][0].offset

    def read(self, rank: int, name: str, into: np.ndarray | None = None) -> np.ndarray:
        """Array ``name`` of rank ``rank``'s data object by parallel ranged GETs (into ``into``
        when given), checked against its crc32c; a failing store counts as damage here (the
        ranks then vote to fall back)."""
        entries = self._entries(rank)
        if name not in entries:
            raise CorruptCheckpointError(f"step {self.step}: rank {rank}'s part has no array {name!r}")
        entry, crc = entries[name]
        part = self._manifest.ranks[rank]
        if part.where is None:
            key = part.data
        else:  # the data object and offset the part names for it (FORMAT.md §12.8)
            i = next(k for k, e in enumerate(self.members[rank].manifest.arrays) if e.name == name)
            key, offset = array_sources(part, self.members[rank].manifest.arrays)[i]
            entry = replace(entry, offset=offset)
        try:
            arr = read_array(self.store, key, entry, crc, into, self._get_pool())
        except RemoteError as exc:
            raise CorruptCheckpointError(f"step {self.step}: {key}: {exc}") from None
        with self._lock:
            self.bytes_read += entry.nbytes
        return arr

    def _entries(self, rank: int) -> dict[str, Any]:
        if not 0 <= rank < self.world_size:
            raise CorruptCheckpointError(f"step {self.step} has no rank {rank}")
        return self.members[rank].entries

    def _get_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(GET_THREADS, thread_name_prefix="pccheck-remote-get")
            return self._pool

    def close(self) -> None:
        """Ends the set's GET threads (the planner calls it after each try)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def remote_sets(url: str, group: Any) -> list[RemoteSet]:
    """The committed steps under ``url`` as sets, newest first: rank 0's listing on every rank
    of ``group`` (None: one process). An unreadable listing is an empty list."""
    store = ObjectStore(url)
    try:
        steps = committed(store)
    except RemoteError:
        steps = []
    if group is not None:
        import torch.distributed as dist

        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, steps, group=group.pg)
        steps = [tuple(x) for x in everyone[0]]
    return [RemoteSet(store, g, s) for g, s in steps]


def newest_remote_is_sharded(url: str, group: Any) -> bool:
    """Whether the newest committed step under ``url`` whose manifests check out was written as
    shards (§9): rank 0 decides for the whole group, so every rank takes the same loader."""
    answer = False
    if group is None or group.rank == 0:
        for cand in remote_sets(url, None):
            try:
                answer = cand.sharded
                break
            except CorruptCheckpointError:
                continue
    if group is not None:
        import torch.distributed as dist

        everyone: list[Any] = [None] * group.world_size
        dist.all_gather_object(everyone, answer, group=group.pg)
        answer = bool(everyone[0])
    return answer
