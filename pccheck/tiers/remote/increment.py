"""An incremental writer's data object: only the arrays that changed since its base step, the
rest referenced in the data objects earlier committed steps uploaded (FORMAT.md §12.8).

The *base* is the newest step this uploader committed (:class:`RemoteBase`: where each of its
arrays lies, its fingerprint and crc32c). :func:`upload_changed` reads the committed local
checkpoint's manifest (format 3, FORMAT.md §14), and for each array

- *references* the base's copy when its geometry, fingerprint (same keys) and crc32c equal the
  base's: the part names the object and offset the base read it from;
- else reads it from the local cell holding it (O_DIRECT, whole blocks: a cell owns its padding)
  into the part buffers and uploads it, each array at a block-aligned offset of the new object.

Invariants: a step references only objects its base names, so retention, which never deletes
the newest committed step nor what a kept step names, keeps every referenced byte (retention.py);
the object is completed only when the crc32c of every array read matches the local manifest (the
uploader holds the checkpoint's cells from reuse meanwhile, ``Incremental.hold`` through ``Orchestrator.cells``).
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ...errors import ConfigError, CorruptCheckpointError
from ...persist.layout import ArrayEntry, Manifest
from ...persist.reader import crc32c, crc32c_combine, open_direct
from ...persist.recovery import slot_base
from .layout import MAX_PARTS, RankPart, data_key, parts_of
from .objstore import ObjectStore
from .upload import Aborter, BufferPool, Cancelled, SlotRef, _read_part, _send, abort_after, slot_manifest

__all__ = ["RemoteBase", "IncrementalUpload", "upload_changed"]

_BLOCK = 4096


@dataclass(frozen=True)
class _Placed:
    """One array of a committed remote step: what it is and where its bytes lie."""

    entry: ArrayEntry
    fp: tuple[int, int] | None
    keys: tuple[int, int] | None
    crc: int
    key: str      # the data object holding it
    size: int     # that object's size
    offset: int   # its offset in that object


@dataclass(frozen=True)
class RemoteBase:
    """The newest step this uploader committed: each array's place, by name."""

    step: int
    arrays: dict[str, _Placed]


@dataclass(frozen=True)
class IncrementalUpload:
    """One rank's part of a step, the base it makes for the next, and its byte counts."""

    part: RankPart
    base: RemoteBase
    uploaded: int     # bytes of the new data object (the changed arrays, block-aligned)
    referenced: int   # array bytes read from earlier steps' objects instead


def _same(e: ArrayEntry, p: _Placed) -> bool:
    a = p.entry
    return (e.dtype, e.shape, e.nbytes, e.torch_dtype) == (a.dtype, a.shape, a.nbytes, a.torch_dtype)


def _manifest(ref: SlotRef) -> tuple[bytes, Manifest, list[int]]:
    """The slot's manifest bytes (checked against its meta record and counter), parsed, and the
    file offset of the slot region holding each array (its cell, FORMAT.md §14)."""
    image, raw, man = slot_manifest(ref)
    slots = len(image.slots)
    cells = [man.cell_of(i, ref.slot) for i in range(len(man.arrays))]
    if any(not 0 <= c < slots for c in cells):
        raise CorruptCheckpointError(f"{ref.store_file.name} slot {ref.slot}: an array's cell is not a slot")
    return raw, man, [slot_base(image, c) for c in cells]


def upload_changed(store: ObjectStore, ref: SlotRef, generation: int, rank: int, part_size: int,
                   pool: BufferPool, senders: ThreadPoolExecutor, cancelled: Callable[[], bool],
                   base: RemoteBase | None, aborter: Aborter = abort_after) -> IncrementalUpload:
    """Uploads the arrays of committed local checkpoint ``ref`` that differ from ``base``'s as
    one new data object and references the rest; returns the part (manifest version 2). An
    upload that does not complete is aborted by ``aborter`` (as :func:`~.upload.upload_slot`'s:
    an uploader passes one that waits for the parts in flight on a thread of its own)."""
    raw, man, bases = _manifest(ref)
    fps = man.cells.fps if man.cells is not None else (None,) * len(man.arrays)
    keys = man.cells.keys if man.cells is not None else None
    objects: dict[str, int] = {}   # referenced key -> its index in the part's objects (1-based)
    sizes: dict[str, int] = {}
    where: list[tuple[int, int]] = []  # per array: (0, offset in the new object) or (k, offset in objects[k-1])
    changed: list[int] = []
    size = 0
    for i, (e, crc) in enumerate(zip(man.arrays, man.crcs)):
        p = base.arrays.get(e.name) if base is not None else None
        if p is not None and _same(e, p) and keys is not None and p.keys == keys and fps[i] is not None \
                and p.fp == fps[i] and p.crc == crc:  # unchanged: the base's copy
            where.append((objects.setdefault(p.key, len(objects) + 1), p.offset))
            sizes[p.key] = p.size
            continue
        where.append((0, size))
        if e.nbytes:
            changed.append(i)
        size += (e.nbytes + _BLOCK - 1) // _BLOCK * _BLOCK
    while len(parts_of(size, part_size)) > MAX_PARTS:
        part_size *= 2
    if part_size > pool.size:
        raise ConfigError(f"step {ref.step}'s {size} bytes need parts of {part_size} bytes ({MAX_PARTS} parts "
                          f"at most per upload): set RemoteOptions(part_size=...) to at least {part_size}")
    key = data_key(generation, ref.step, uuid.uuid4().hex[:16], rank)
    part_crcs = _send_arrays(store, key, ref, man, bases, changed, size, part_size, pool, senders, cancelled, aborter)
    refs = tuple(sorted(objects, key=objects.__getitem__))
    part = RankPart(rank, key, size, part_size, tuple(part_crcs), raw, tuple((k, sizes[k]) for k in refs),
                    tuple(where))
    names = [key, *refs]
    placed = {}
    for i, (e, crc) in enumerate(zip(man.arrays, man.crcs)):
        o, off = where[i]
        placed[e.name] = _Placed(e, fps[i], keys, crc, names[o], size if o == 0 else sizes[names[o]], off)
    referenced = sum(e.nbytes for e, w in zip(man.arrays, where) if w[0] != 0)
    return IncrementalUpload(part, RemoteBase(ref.step, placed), size, referenced)


def _send_arrays(store: ObjectStore, key: str, ref: SlotRef, man: Manifest, bases: list[int], changed: list[int],
                 size: int, part_size: int, pool: BufferPool, senders: ThreadPoolExecutor,
                 cancelled: Callable[[], bool], aborter: Aborter = abort_after) -> list[int]:
    """Streams the changed arrays, each from its cell and block-aligned in the object, through the
    part buffers to a multipart upload at ``key``; returns the parts' crc32c. Each array's crc32c
    is combined from its pieces' and checked against the manifest before the upload completes."""
    upload_id = store.start_multipart(key, crc32c=True)
    part_crcs: list[int] = []
    futures: list[Future[str]] = []
    done = False
    state = {"buf": None, "fill": 0, "crc": 0}

    def flush() -> None:
        buf, fill = state["buf"], state["fill"]
        view = memoryview(buf)[:fill]
        part_crcs.append(state["crc"])
        futures.append(senders.submit(_send, store, key, upload_id, len(part_crcs), view, state["crc"], buf, pool,
                                      cancelled))  # a given-up upload cuts its parts in flight short
        state.update(buf=None, fill=0, crc=0)

    try:
        fd = open_direct(ref.store_file)
        try:
            for i in changed:
                e, want = man.arrays[i], man.crcs[i]
                run = (e.nbytes + _BLOCK - 1) // _BLOCK * _BLOCK
                got, done_bytes = 0, 0
                while done_bytes < run:
                    if cancelled():
                        raise Cancelled()
                    if state["buf"] is None:
                        state["buf"] = pool.take()  # blocks while every buffer is in flight
                        if cancelled():  # given up meanwhile: read nothing more (the finally gives it back)
                            raise Cancelled()
                    buf, fill = state["buf"], state["fill"]
                    n = min(run - done_bytes, part_size - fill)
                    piece = memoryview(buf)[fill:fill + n]
                    try:
                        _read_part(fd, piece, bases[i] + e.offset + done_bytes, ref.store_file.name, cancelled)
                    except BaseException:
                        pool.give(buf)
                        state["buf"] = None
                        raise
                    k = max(0, min(n, e.nbytes - done_bytes))  # the array's own bytes in this piece
                    c_arr, c_pad = crc32c(piece[:k]), crc32c(piece[k:])
                    got = crc32c_combine(got, c_arr, k)
                    state["crc"] = crc32c_combine(crc32c_combine(state["crc"], c_arr, k), c_pad, n - k)
                    state["fill"] = fill + n
                    done_bytes += n
                    if state["fill"] == part_size:
                        flush()
                if got != want:
                    raise CorruptCheckpointError(
                        f"{ref.store_file.name} slot {ref.slot} (step {ref.step}): array {e.name!r}'s crc32c does "
                        "not match its manifest: its cell is damaged or was reused; not uploading it")
        finally:
            os.close(fd)
        if state["buf"] is not None or not part_crcs:  # the last part (one empty part for no bytes)
            if state["buf"] is None:
                state["buf"] = pool.take()
            flush()
        assert len(part_crcs) == len(parts_of(size, part_size))  # the manifest's rule (§12.2)
        etags = [fut.result() for fut in futures]
        store.complete_multipart(key, upload_id, etags, part_crcs)
        done = True
    finally:
        if state["buf"] is not None:
            pool.give(state["buf"])
        if not done:
            aborter(store, key, upload_id, futures)
    return part_crcs
