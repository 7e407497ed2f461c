"""Loading from the remote tier: the newest committed step whose every checksum holds (FORMAT.md §12.4).

:func:`load_remote` lists the committed step manifests (newest first by (generation, step)), and
for each: fetches and checks the manifest, checks the local manifest it embeds (§5's rules, the
same parser as a local load), fetches the data object by parallel ranged GETs, one per part,
straight into one buffer, checks every part's crc32c and every array's crc32c, and returns the
arrays. A step whose parts reference earlier steps' data objects (version 2, FORMAT.md §12.8)
is read array by array, each from the object and offset its part names, every array's crc32c
checked. A missing or damaged object makes it fall back to the next older committed step, with a
warning naming what was wrong. Nothing read is unpickled; every size and offset is bounded by the
manifest before a byte is allocated.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError, NoCheckpointError, RemoteError
from ...persist.layout import Manifest, parse_manifest
from ...persist.reader import crc32c, crc32c_combine, fresh_buffer
from ...persist.recovery import Restored
from .commit import committed
from .layout import (MAX_MANIFEST_BYTES, RankPart, StepManifest, array_sources, decode_manifest, manifest_key,
                     parts_of)
from .objstore import NotFound, ObjectStore

__all__ = ["load_remote", "locate_remote", "RemoteLocated", "read_array", "local_manifest"]

log = logging.getLogger("pccheck")

GET_THREADS = 8
GET_PIECE = 8 << 20  # ranged GETs in flight: 8 of 8 MiB (parts are 32 MiB: too few for a small state)


def local_manifest(part: RankPart, step: int) -> Manifest:
    """The local manifest (FORMAT.md §5) a rank part embeds, checked by §5's rules with its
    ``data_len`` equal to the data object's size."""
    try:
        counter = json.loads(part.manifest.decode("utf-8")).get("counter")
    except (UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        raise CorruptCheckpointError("the embedded local manifest is not a JSON object") from None
    if type(counter) is not int:
        raise CorruptCheckpointError("the embedded local manifest has no counter")
    if part.where is not None:  # §12.8: the arrays lie where the part says, bounded there
        man = parse_manifest(part.manifest, step=step, counter=counter, data_len_limit=1 << 62)
        array_sources(part, man.arrays)
        return man
    man = parse_manifest(part.manifest, step=step, counter=counter, data_len_limit=part.size)
    if man.data_len != part.size:
        raise CorruptCheckpointError(f"the data object holds {part.size} bytes, its manifest says {man.data_len}")
    return man


def _fetch(store: ObjectStore, part: RankPart, man: Manifest) -> np.ndarray:
    """The data object into one buffer by parallel ranged GETs of at most ``GET_PIECE`` bytes,
    each part's crc32c (combined from its pieces') and each array's crc32c checked."""
    buf = fresh_buffer(part.size)
    view = memoryview(buf)
    parts = parts_of(part.size, part.part_size)
    pieces = [(i, off + o, min(GET_PIECE, n - o)) for i, (off, n) in enumerate(parts) for o in range(0, max(n, 1), GET_PIECE)]

    def get(k: int) -> int:
        _, off, n = pieces[k]
        try:
            store.read_into(part.data, off, view[off:off + n])
        except NotFound as exc:
            raise CorruptCheckpointError(f"data object {part.data} is missing or short ({exc})") from None
        return crc32c(view[off:off + n])

    with ThreadPoolExecutor(min(GET_THREADS, len(pieces))) as pool:
        crcs = list(pool.map(get, range(len(pieces))))
    got = [0] * len(parts)
    for (i, _, n), c in zip(pieces, crcs):  # in order: combine each part's pieces
        got[i] = crc32c_combine(got[i], c, n)
    for i, (want, have) in enumerate(zip(part.part_crcs, got)):
        if want != have:
            raise CorruptCheckpointError(f"data object {part.data}: part {i + 1} checksum mismatch")
    for e, want in zip(man.arrays, man.crcs):
        if crc32c(view[e.offset:e.offset + e.nbytes]) != want:
            raise CorruptCheckpointError(f"array {e.name!r} checksum mismatch in {part.data}")
    return buf


def _fetch_arrays(store: ObjectStore, part: RankPart, man: Manifest) -> tuple[np.ndarray, list[int]]:
    """A version-2 part's arrays (§12.8) into one buffer, each at a 64-byte aligned offset
    (returned), by parallel ranged GETs of at most ``GET_PIECE`` bytes from the object its part
    names; every array's crc32c combined from its pieces' and checked."""
    sources = array_sources(part, man.arrays)
    offsets, at = [], 0
    for e in man.arrays:
        offsets.append(at)
        at += (e.nbytes + 63) // 64 * 64
    try:
        buf = fresh_buffer(at)
    except MemoryError:
        raise CorruptCheckpointError(f"{part.data}: its arrays ({at} bytes) do not fit in memory") from None
    view = memoryview(buf)
    pieces = [(i, o, min(GET_PIECE, e.nbytes - o)) for i, e in enumerate(man.arrays) for o in range(0, e.nbytes, GET_PIECE)]

    def get(k: int) -> int:
        i, o, n = pieces[k]
        key, off = sources[i]
        dest = view[offsets[i] + o:offsets[i] + o + n]
        try:
            store.read_into(key, off + o, dest)
        except NotFound as exc:
            raise CorruptCheckpointError(f"data object {key} is missing or short ({exc})") from None
        return crc32c(dest)

    got = [0] * len(man.arrays)
    if pieces:
        with ThreadPoolExecutor(min(GET_THREADS, len(pieces))) as pool:
            for (i, _, n), c in zip(pieces, pool.map(get, range(len(pieces)))):  # in order per array
                got[i] = crc32c_combine(got[i], c, n)
    for e, want, have, (key, _) in zip(man.arrays, man.crcs, got, sources):
        if want != have:
            raise CorruptCheckpointError(f"array {e.name!r} checksum mismatch in {key}")
    return buf, offsets


def _load_step(store: ObjectStore, generation: int, step: int, rank: int = 0, world_size: int = 1) -> Restored:
    try:
        raw, _ = store.get(manifest_key(generation, step), MAX_MANIFEST_BYTES)
    except NotFound:
        raise CorruptCheckpointError("its manifest disappeared (deleted by retention?)") from None
    sm: StepManifest = decode_manifest(raw, generation, step)
    if sm.world_size != world_size and sm.world_size != 1:
        raise CorruptCheckpointError(f"it was written by {sm.world_size} ranks, and {world_size} load it "
                                     "(only a sharded step, FSDP2 / DTensor, loads on another world size)")
    part = sm.ranks[rank if sm.world_size > 1 else 0]  # one writer (replicated="rank0"): every rank reads it
    man = local_manifest(part, step)
    if part.where is None:
        buf, offsets = _fetch(store, part, man), [e.offset for e in man.arrays]
    else:
        buf, offsets = _fetch_arrays(store, part, man)
    state = {}
    for e, at in zip(man.arrays, offsets):
        try:
            arr = np.frombuffer(buf, dtype=e.dtype, count=e.nbytes // e.dtype.itemsize if e.dtype.itemsize else 0,
                                offset=at).reshape(e.shape) if e.nbytes else np.empty(e.shape, dtype=e.dtype)
        except (ValueError, TypeError, OverflowError, MemoryError) as exc:
            raise CorruptCheckpointError(f"array {e.name!r} cannot be built: {exc}") from None
        state[e.name] = arr
    return Restored(man.step, state, man.metadata, man.counter, generation, 0, Path(store.url.replace("s3://", "")),
                    {e.name: e.torch_dtype for e in man.arrays if e.torch_dtype}, man.tree, man.epoch,
                    tier="remote")


def load_remote(url: str, group: Any = None) -> Restored:
    """Loads the newest committed remote step under ``url`` whose every checksum holds, falling
    back to older committed steps. NoCheckpointError when none loads. In a torch.distributed
    group (every rank calls it) each rank loads its own part, and a step counts only if every
    rank's part loads (the ranks vote after each try, on pccheck's gloo group)."""
    store = ObjectStore(url)
    try:
        candidates = committed(store)
    except RemoteError as exc:
        candidates, listing = [], exc
    else:
        listing = None
    if group is not None:  # rank 0's list for everyone: the ranks try the same steps in order
        candidates = _vote(group, candidates, rank0=True)
    if not candidates:
        raise NoCheckpointError(f"cannot list {url}: {listing}" if listing else
                                f"{url} holds no committed pccheck checkpoint")
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    problems = []
    for generation, step in candidates:
        try:
            r: Restored | None = _load_step(store, generation, step, rank, world)
        except (CorruptCheckpointError, RemoteError) as exc:
            r = None
            problems.append(f"step {step} (generation {generation}): {exc}")
            log.warning("pccheck: %s: cannot load step %d (generation %d): %s; trying the previous committed step",
                        url, step, generation, exc)
        if group is not None and not all(_vote(group, r is not None)):
            continue  # some rank's part failed: every rank moves on together
        if r is None:
            continue
        if problems:
            log.warning("pccheck: %s: fell back to step %d because: %s", url, step, "; ".join(problems))
        return r
    raise NoCheckpointError(f"no committed checkpoint under {url} loads: " + "; ".join(problems))


def _vote(group: Any, mine: Any, rank0: bool = False) -> Any:
    """Every rank's ``mine`` (a list), or rank 0's (``rank0``), over pccheck's gloo group."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * group.world_size
    dist.all_gather_object(everyone, mine, group=group.pg)
    return [tuple(x) for x in everyone[0]] if rank0 else everyone



@dataclass(frozen=True)
class _Where:
    path: str  # the prefix's URL, in messages


@dataclass(frozen=True)
class RemoteLocated:
    """The newest committed remote step whose manifests check out (no data read): what a lazy
    restore needs (``manifest``, ``image.path``, ``slot``, ``generation``), and ``read``, which
    fetches one array by parallel ranged GETs and checks its crc32c."""

    manifest: Manifest
    image: _Where
    slot: int
    generation: int
    read: Any


def locate_remote(url: str, group: Any = None) -> RemoteLocated:
    """The step a lazy restore from ``url`` loads: the newest committed one whose manifest and
    embedded local manifest check out (its arrays are checked as they arrive). In a
    torch.distributed group (every rank calls it) the ranks try rank 0's list of steps in order,
    each locating its own part (the step's world size must be the group's, or 1: one part every
    rank reads), and take the first step every rank located (they vote after each)."""
    store = ObjectStore(url)
    problems = []
    try:
        candidates = committed(store)
    except RemoteError as exc:
        candidates = []
        problems.append(f"cannot list it: {exc}")
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    if group is not None:
        candidates = _vote(group, candidates, rank0=True)
    for generation, step in candidates:
        found: RemoteLocated | None = None
        try:
            raw, _ = store.get(manifest_key(generation, step), MAX_MANIFEST_BYTES)
            sm = decode_manifest(raw, generation, step)
            if sm.world_size not in (1, world):
                raise CorruptCheckpointError(f"it was written by {sm.world_size} ranks and {world} restore it lazily "
                                             "(a resharded load is eager: drop lazy=)")
            part = sm.ranks[rank if sm.world_size > 1 else 0]
            man = local_manifest(part, step)
            found = RemoteLocated(man, _Where(url), 0, generation, _array_reader(store, part, man))
        except (NotFound, CorruptCheckpointError, RemoteError) as exc:
            problems.append(f"step {step} (generation {generation}): {exc}")
        if group is not None and not all(_vote(group, found is not None)):
            continue  # some rank cannot restore it: every rank moves on together
        if found is not None:
            return found
    raise NoCheckpointError(f"no committed checkpoint under {url} can be restored lazily"
                            + (": " + "; ".join(problems) if problems else ""))


def _array_reader(store: ObjectStore, part: RankPart, man: Manifest) -> Any:
    pool = ThreadPoolExecutor(GET_THREADS, thread_name_prefix="pccheck-remote-get")
    sources = dict(zip((e.name for e in man.arrays), array_sources(part, man.arrays)))

    def read(entry: Any, crc: int, into: np.ndarray | None) -> np.ndarray:
        key, offset = sources[entry.name]  # the part's own object, or the one it references (§12.8)
        return read_array(store, key, replace(entry, offset=offset), crc, into, pool)

    return read


def read_array(store: ObjectStore, key: str, entry: Any, crc: int, into: np.ndarray | None,
               pool: ThreadPoolExecutor) -> np.ndarray:
    """One array (a manifest entry) of data object ``key``: ranged GETs of at most GET_PIECE bytes
    on ``pool`` into ``into`` (a uint8 array of ``entry.nbytes``) or a new buffer, its crc32c
    combined from the pieces' and checked. The entry's offset and size were bounded by the data
    object's size when its manifest was parsed. CorruptCheckpointError for a missing or short
    object or a mismatch; RemoteError for a failing store."""
    if not entry.nbytes:
        return np.empty(entry.shape, dtype=entry.dtype)
    buf = into if into is not None else fresh_buffer(entry.nbytes)
    view = memoryview(buf).cast("B")
    if len(view) != entry.nbytes:
        raise CorruptCheckpointError(f"array {entry.name!r} holds {entry.nbytes} bytes, the destination {len(view)}")
    pieces = [(o, min(GET_PIECE, entry.nbytes - o)) for o in range(0, entry.nbytes, GET_PIECE)]

    def get(p: tuple[int, int]) -> int:
        try:
            store.read_into(key, entry.offset + p[0], view[p[0]:p[0] + p[1]])
        except NotFound as exc:
            raise CorruptCheckpointError(f"data object {key} is missing or short ({exc})") from None
        return crc32c(view[p[0]:p[0] + p[1]])

    got = 0
    for (_, n), c in zip(pieces, pool.map(get, pieces)):
        got = crc32c_combine(got, c, n)
    if got != crc:
        raise CorruptCheckpointError(f"array {entry.name!r} checksum mismatch in {key}")
    return np.frombuffer(buf, dtype=np.uint8, count=entry.nbytes).view(entry.dtype).reshape(entry.shape)
