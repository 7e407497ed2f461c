"""Retention on the remote tier (FORMAT.md §12.6): ``keep_last`` / ``keep_every``, the rule every
tier applies (pccheck.tiers.keep).

:func:`prune` runs on the uploader's thread after a remote commit. It deletes a step by deleting
its manifest first (the step is no longer committed: readers never pick it again), then the
data objects it named that no kept step names (a step of an incremental writer names the data
objects of earlier steps it reads its unchanged arrays from, §12.8). It never deletes the newest
committed step nor the one the pointer names.

Invariant (no kept step loses a byte): every kept manifest is read before any data object is
deleted, and a pass that cannot read one deletes no data objects at all. A writer references only
objects its base names (the newest step it committed), and the base is the newest committed step
in any listing taken before the referencing step commits, so a pass whose listing predates that
commit keeps the base and everything it names. A pccheck.dcp set's coordinator may commit newer
steps while a part planned on an older base is in flight: it passes every base still leased
(``also_keep``, sets.py), kept like the newest. Besides, it deletes data objects no committed manifest names and aborts multipart
uploads, but only those of older generations (their jobs are gone or superseded: nobody can still
be about to commit them); this job's own leftovers are the next job's to collect.
"""

from __future__ import annotations

import logging
from typing import Iterable

from ...errors import CorruptCheckpointError, RemoteError
from .commit import committed, read_pointer
from .layout import DATA, MAX_MANIFEST_BYTES, decode_manifest, manifest_key
from .objstore import NotFound, ObjectStore
from ..keep import retained

__all__ = ["prune", "PruneCounts"]

log = logging.getLogger("pccheck")


class PruneCounts:
    def __init__(self) -> None:
        self.steps = self.orphans = self.aborted = 0


def _keep(steps: list[tuple[int, int]], keep_last: int | None, keep_every: int | None,
          pinned: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Which committed (generation, step)s stay: the newest ``keep_last``, every step divisible
    by ``keep_every``, and the pinned ones (newest and pointer)."""
    return set(pinned) | retained(steps, lambda gs: gs[1], keep_last, keep_every)


def _generation_of(key: str) -> int | None:
    """G of a ``data/g<G>/...`` key."""
    parts = key.split("/")
    if len(parts) < 2 or not parts[1].startswith("g") or not parts[1][1:].isdigit():
        return None
    return int(parts[1][1:])


def prune(store: ObjectStore, own_generation: int, keep_last: int | None, keep_every: int | None,
          also_keep: Iterable[int] = ()) -> PruneCounts:
    """One retention pass. Errors are the caller's to log; a half-done pass is harmless (a
    manifest deleted before its data leaves orphans, collected by a later pass of a later job).
    ``also_keep``: steps of ``own_generation`` kept whatever the rules say, with all they name
    (a pccheck.dcp set's leased bases: parts in flight reference them, sets.py)."""
    counts = PruneCounts()
    steps = committed(store)
    if not steps:
        return counts
    ptr, _ = read_pointer(store)
    pinned = {steps[0]} | ({ptr.order} if ptr is not None else set()) | {(own_generation, s) for s in also_keep}
    keep = _keep(steps, keep_last, keep_every, pinned)
    named: set[str] = set()  # every data object a kept step reads (its own and those it references)
    doomed: list[tuple[int, int, list[str]]] = []
    blind = False  # a kept step could not be read: what it references is unknown
    for g, s in steps:
        try:
            raw, _ = store.get(manifest_key(g, s), MAX_MANIFEST_BYTES)
            data = [k for r in decode_manifest(raw, g, s).ranks for k in r.keys()]
        except (NotFound, CorruptCheckpointError) as exc:
            log.warning("pccheck: remote retention: skipping step %d (generation %d): %s", s, g, exc)
            blind = blind or (g, s) in keep
            continue
        if (g, s) in keep:
            named.update(data)
        else:
            doomed.append((g, s, data))
    if blind:
        log.warning("pccheck: remote retention: a kept step could not be read; no data object is deleted in this pass")
    for g, s, data in doomed:
        store.delete(manifest_key(g, s))  # first: the step is no longer committed
        for key in data:
            if not blind and key not in named:  # a kept step may still read it
                store.delete(key)
        counts.steps += 1
    for o in [] if blind else store.list(DATA):  # data no committed manifest names, of older generations only
        g = _generation_of(o.key)
        if g is not None and g < own_generation and o.key not in named:
            store.delete(o.key)
            counts.orphans += 1
    try:
        for key, upload_id, _ in store.stale_uploads(DATA):
            g = _generation_of(key)
            if g is not None and g < own_generation:
                store.abort_multipart(key, upload_id)
                counts.aborted += 1
    except RemoteError as exc:  # some stores do not list uploads: nothing else depends on it
        log.info("pccheck: remote retention: cannot list multipart uploads (%s)", exc)
    if counts.steps or counts.orphans or counts.aborted:
        log.info("pccheck: remote retention under %s: %d steps, %d orphaned objects deleted, %d uploads aborted",
                 store.url, counts.steps, counts.orphans, counts.aborted)
    return counts
