"""One step committed by W ranks (FORMAT.md §12.7): each rank's part, and the commit from all W.

The remote tier's two multi-rank paths share these: a torch.distributed group's
(:class:`~pccheck.tiers.remote.group.GroupUploader`, rank 0 announces and commits) and the sets
their caller pairs (:mod:`pccheck.tiers.remote.sets`, ``pccheck.dcp``: the caller's coordinator
commits). Invariant: a rank's part is PUT create-only only after its data object is whole, and
the step manifest (the commit) only after every part is up; a step lacking a part is never
committed, and what it left is collected by §12.6's rules.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from ...errors import RemoteError
from .commit import advance_pointer, commit_step
from .layout import MAX_MANIFEST_BYTES, RankPart, StepManifest, rank_part_from_json
from .objstore import NotFound, ObjectStore
from .increment import IncrementalUpload, RemoteBase, upload_changed
from .upload import Aborter, BufferPool, SlotRef, abort_after, upload_slot

__all__ = ["part_key", "put_part", "put_changed_part", "read_part", "commit_parts"]


def part_key(generation: int, step: int, rank: int) -> str:
    """Where rank ``rank``'s part of ``step`` lives (§12.7)."""
    return f"parts/g{generation:08d}/s{step}/rank-{rank}.json"


def put_part(store: ObjectStore, ref: SlotRef, generation: int, rank: int, part_size: int, pool: BufferPool,
             senders: ThreadPoolExecutor, cancelled: Callable[[], bool],
             aborter: Aborter = abort_after) -> RankPart:
    """Uploads the committed slot ``ref`` as rank ``rank``'s data object of ``generation``, then
    PUTs its part create-only (``aborter``: as :func:`~.upload.upload_slot`'s). CorruptCheckpointError if the slot no longer holds the step;
    RemoteError if the store fails (RemoteConflictError: the part exists, another job wrote it)."""
    part = upload_slot(store, ref, generation, rank, part_size, pool, senders, cancelled, aborter)
    store.put_new(part_key(generation, ref.step, rank), json.dumps(part.as_json()).encode("utf-8"))
    return part


def put_changed_part(store: ObjectStore, ref: SlotRef, generation: int, rank: int, part_size: int,
                     pool: BufferPool, senders: ThreadPoolExecutor, cancelled: Callable[[], bool],
                     base: RemoteBase | None, aborter: Aborter = abort_after) -> IncrementalUpload:
    """:func:`put_part` for an incremental writer (§12.8): uploads only the arrays of ``ref``
    that differ from ``base`` (this rank's part of the newest step the group committed), then
    PUTs the part, which references the rest, create-only. ``aborter`` and the errors: as
    :func:`put_part`'s."""
    inc = upload_changed(store, ref, generation, rank, part_size, pool, senders, cancelled, base, aborter)
    store.put_new(part_key(generation, ref.step, rank), json.dumps(inc.part.as_json()).encode("utf-8"))
    return inc


def read_part(store: ObjectStore, generation: int, step: int, rank: int) -> RankPart:
    """Rank ``rank``'s part of ``step``, every field checked; RemoteError if it is missing."""
    try:
        raw, _ = store.get(part_key(generation, step, rank), MAX_MANIFEST_BYTES)
    except NotFound:
        raise RemoteError(f"rank {rank}'s part of step {step} is missing under {store.url}") from None
    return rank_part_from_json(raw, f"rank {rank}'s part of step {step}")


def commit_parts(store: ObjectStore, generation: int, step: int, world_size: int) -> None:
    """Once every rank's part of ``step`` is up: the step manifest create-only (the commit), then
    the pointer forward. RemoteConflictError if another job committed the step or owns the
    prefix; RemoteError if a part is missing."""
    parts = tuple(read_part(store, generation, step, r) for r in range(world_size))
    commit_step(store, StepManifest(generation, step, world_size, time.time(), parts))
    advance_pointer(store, generation, step)
