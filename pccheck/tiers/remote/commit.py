"""The commit on the object store (FORMAT.md §12): data at unique keys, the step manifest last
with ``If-None-Match: *``, the ``latest`` pointer forward only by ``If-Match``.

Straight-line, one failure exit per step, like the local commit (§4):

1. every rank's data object is complete (multipart completed at a key no one else uses);
2. :func:`commit_step` PUTs ``manifests/g<G>/s<S>.json`` create-only: this is the commit point.
   Losing (404/409/412) means another writer committed that step of that generation first;
3. :func:`advance_pointer` moves ``latest`` to (G, S) by compare-and-swap, only forward in
   (generation, step) order; losing the CAS re-reads and tries again while ours is newer.

A crash between 2 and 3 leaves a committed step that the pointer does not name yet: readers take
the newest committed manifest, listing past the pointer (:func:`committed`), so nothing is lost.
"""

from __future__ import annotations

import logging

from ...errors import CorruptCheckpointError, RemoteConflictError
from .layout import (MANIFESTS, MAX_POINTER_BYTES, POINTER, Pointer, StepManifest, decode_pointer,
                     encode_manifest, encode_pointer, manifest_key, parse_manifest_key)
from .objstore import LostRace, NotFound, ObjectStore

__all__ = ["commit_step", "advance_pointer", "read_pointer", "committed", "next_generation"]

log = logging.getLogger("pccheck")

_CAS_TRIES = 16


def commit_step(store: ObjectStore, manifest: StepManifest) -> None:
    """Step 2: the create-only PUT of the step manifest. RemoteConflictError if it lost."""
    key = manifest_key(manifest.generation, manifest.step)
    try:
        store.put_new(key, encode_manifest(manifest))
    except LostRace:
        raise RemoteConflictError(
            f"step {manifest.step} of generation {manifest.generation} is already committed under "
            f"{store.url}: another job writes the same prefix. Give each job its own prefix") from None


def read_pointer(store: ObjectStore) -> tuple[Pointer | None, str | None]:
    """The pointer and its ETag; (None, None) if there is none. A damaged pointer reads as
    (None, etag): readers list instead, writers replace it."""
    try:
        raw, etag = store.get(POINTER, MAX_POINTER_BYTES)
    except NotFound:
        return None, None
    try:
        return decode_pointer(raw), etag
    except CorruptCheckpointError as exc:
        log.warning("pccheck: %s: %s; ignoring it", store.url, exc)
        return None, etag


def advance_pointer(store: ObjectStore, generation: int, step: int) -> bool:
    """Step 3: moves ``latest`` forward to (generation, step). Returns False if it already names
    something as new or newer of this generation; RemoteConflictError if a newer generation
    (another job, started later on this prefix) owns it: this job is superseded."""
    ours = Pointer(generation, step)
    for _ in range(_CAS_TRIES):
        current, etag = read_pointer(store)
        if current is not None and current.order >= ours.order:
            if current.generation > generation:
                raise RemoteConflictError(
                    f"a newer job (generation {current.generation}) writes {store.url}; this one "
                    f"(generation {generation}) stops uploading. Give each job its own prefix")
            return False
        try:
            store.put_swap(POINTER, encode_pointer(ours), etag)
            return True
        except LostRace:  # someone moved it between our read and our write: look again
            continue
    raise RemoteConflictError(f"the 'latest' pointer of {store.url} kept changing under {_CAS_TRIES} "
                              "compare-and-swap tries: another job writes the same prefix")


def committed(store: ObjectStore) -> list[tuple[int, int]]:
    """Every committed (generation, step) under the prefix, newest first (§12.4's order)."""
    found = {k for o in store.list(MANIFESTS) if (k := parse_manifest_key(o.key)) is not None}
    return sorted(found, reverse=True)


def next_generation(store: ObjectStore) -> int:
    """One more than any generation the prefix holds: a new job's commits supersede every older
    job's, even where its steps are lower (a resume past a damaged newer step)."""
    ptr, _ = read_pointer(store)
    gens = [g for g, _ in committed(store)] + ([ptr.generation] if ptr else [])
    return max(gens, default=0) + 1
