"""One rank's data object of one step, read from its committed local slot and uploaded in parts.

:func:`upload_slot` never reads training memory: it reads the slot a local commit (FORMAT.md §4)
made durable, which the uploader holds from reuse until this returns (uploader.py). One thread
reads the slot front to back into a fixed set of part buffers, computing each part's crc32c and
each array's crc32c on the way; ``concurrency`` threads send the parts (multipart upload, parts
in parallel). Memory: ``concurrency + 1`` buffers of ``part_size`` bytes, allocated once per
uploader and reused.

Invariant: the data object is completed only when every array's crc32c matches the local
manifest (a slot damaged on disk is never uploaded as a checkpoint), and at a key no other upload
uses (``data/g<G>/s<S>-<token>/rank-<r>.bin``, §12.1).
"""

from __future__ import annotations

import os
import queue
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ...errors import CorruptCheckpointError
from ...persist.reader import crc32c
from ...persist.recovery import manifest_from, manifest_region, read_store, slot_base
from .layout import MAX_PARTS, RankPart, data_key, parts_of
from .objstore import ObjectStore

__all__ = ["BufferPool", "upload_slot", "SlotRef", "Cancelled"]


class Cancelled(Exception):
    """The upload was given up (the uploader is closing without waiting)."""


@dataclass(frozen=True)
class SlotRef:
    """A committed local checkpoint: the store file, the slot and its counter and step."""

    store_file: Path
    slot: int
    counter: int
    step: int


class BufferPool:
    """``count`` part buffers of ``size`` bytes, touched once (first touch is slow here, GUIDE §4)."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(count):
            b = np.empty(size, dtype=np.uint8)
            b[::4096] = 0
            self._free.put(b)

    def take(self) -> np.ndarray:
        return self._free.get()

    def give(self, b: np.ndarray) -> None:
        self._free.put(b)


def _read_manifest(ref: SlotRef) -> tuple[bytes, list[tuple[int, int, int]], int]:
    """The slot's manifest bytes (checked against its meta record and counter), each array's
    (offset, nbytes, crc32c) and the data length."""
    image = read_store(ref.store_file)
    if ref.slot >= len(image.slots) or image.slots[ref.slot].meta is None \
            or image.slots[ref.slot].meta["counter"] != ref.counter:
        raise CorruptCheckpointError(f"slot {ref.slot} of {ref.store_file.name} no longer holds counter {ref.counter}")
    off, n = manifest_region(image, ref.slot)
    with open(ref.store_file, "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), n, off)
    man = manifest_from(image, ref.slot, raw)
    arrays = [(e.offset, e.nbytes, c) for e, c in zip(man.arrays, man.crcs)]
    return raw, arrays, man.data_len


class _ArrayCrcs:
    """Each array's crc32c, accumulated as the slot's bytes stream past in order."""

    def __init__(self, arrays: list[tuple[int, int, int]]) -> None:
        self.arrays = arrays
        self.got = [0] * len(arrays)
        self._i = 0

    def feed(self, off: int, view: memoryview) -> None:
        end = off + len(view)
        i = self._i
        while i < len(self.arrays):
            a_off, a_n, _ = self.arrays[i]
            lo, hi = max(a_off, off), min(a_off + a_n, end)
            if hi > lo:
                self.got[i] = crc32c(view[lo - off:hi - off], self.got[i])
            if a_off + a_n <= end:
                i += 1  # done with this array
            else:
                break
        self._i = i

    def check(self, where: str) -> None:
        for (_, _, want), got in zip(self.arrays, self.got):
            if want != got:
                raise CorruptCheckpointError(f"{where}: an array's crc32c does not match its manifest: the slot "
                                             "is damaged or was reused; not uploading it")


def upload_slot(store: ObjectStore, ref: SlotRef, generation: int, rank: int, part_size: int,
                pool: BufferPool, senders: ThreadPoolExecutor, cancelled: Callable[[], bool]) -> RankPart:
    """Uploads the slot's data region as one object; returns its :class:`RankPart`."""
    raw, arrays, data_len = _read_manifest(ref)
    while len(parts_of(data_len, part_size)) > MAX_PARTS:
        part_size *= 2
    key = data_key(generation, ref.step, uuid.uuid4().hex[:16], rank)
    upload_id = store.start_multipart(key)
    crcs = _ArrayCrcs(arrays)
    part_crcs: list[int] = []
    futures: list[Future[str]] = []
    done = False
    try:
        base = slot_base(read_store(ref.store_file), ref.slot)
        with open(ref.store_file, "rb", buffering=0) as f:
            for number, (off, n) in enumerate(parts_of(data_len, part_size), start=1):
                if cancelled():
                    raise Cancelled()
                buf = pool.take()  # blocks while every buffer is in flight: memory stays bounded
                try:
                    view = memoryview(buf)[:n]
                    got = os.preadv(f.fileno(), [view], base + off) if n else 0
                    if got != n:
                        raise CorruptCheckpointError(f"{ref.store_file.name}: short read: the store file is truncated")
                    part_crcs.append(crc32c(view))
                    crcs.feed(off, view)
                except BaseException:
                    pool.give(buf)
                    raise
                futures.append(senders.submit(_send, store, key, upload_id, number, view, buf, pool))
        crcs.check(f"{ref.store_file.name} slot {ref.slot} (step {ref.step})")
        etags = [fut.result() for fut in futures]
        store.complete_multipart(key, upload_id, etags)
        done = True
    finally:
        if not done:  # every part ends before the abort (and each gives its buffer back)
            for fut in futures:
                try:
                    fut.result()
                except BaseException:
                    pass
            store.abort_multipart(key, upload_id)
    return RankPart(rank, key, data_len, part_size, tuple(part_crcs), raw)


def _send(store: ObjectStore, key: str, upload_id: str, number: int, view: memoryview, buf: np.ndarray,
          pool: BufferPool) -> str:
    try:
        return store.upload_part(key, upload_id, number, view)
    finally:
        pool.give(buf)  # invariant: a buffer is reused only once its part has been sent

