"""One rank's data object of one step, read from its committed local slot and uploaded in parts.

:func:`upload_slot` never reads training memory: it reads the slot a local commit (FORMAT.md §4)
made durable, which the uploader holds from reuse until this returns (uploader.py). One thread
reads the slot front to back into a fixed set of part buffers (O_DIRECT where the filesystem
takes it: the store writes with O_DIRECT, so its pages are not cached and a buffered read would
copy every byte through the page cache first), and computes each crc32c once: every piece of a
part that lies in one array (or in the padding between arrays) is checksummed once, and the
part's crc32c and the array's are combined from the pieces' (crc32c_combine). ``concurrency``
threads send the parts (multipart upload, parts in parallel), each with its crc32c in the
signed ``x-amz-checksum-crc32c`` header (objstore.py), so the server checks the bytes it received
against those read here. Memory: ``concurrency + 1`` buffers of ``part_size`` bytes, allocated
once per uploader and reused.

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
from typing import Any, Callable

import numpy as np

from ...errors import ConfigError, CorruptCheckpointError
from ...persist.layout import Manifest
from ...persist.reader import crc32c, crc32c_combine, fresh_buffer, open_direct, prefault
from ...persist.recovery import manifest_from, manifest_region, read_store, slot_base
from .layout import MAX_PARTS, RankPart, data_key, parts_of
from .objstore import BodyCancelled, ObjectStore

__all__ = ["BufferPool", "upload_slot", "slot_manifest", "abort_after", "Aborter", "SlotRef", "Cancelled"]


class Cancelled(Exception):
    """The upload was given up (the uploader is closing without waiting)."""


@dataclass(frozen=True)
class SlotRef:
    """A committed local checkpoint: the store file, the slot and its counter and step.
    ``disk``: a slot of the disk store, held from reuse for the upload (False: another tier's
    committed slot, the memory tier's during a flush, which nothing holds: the counter and
    crc32c checks abandon the upload if it is reused meanwhile)."""

    store_file: Path
    slot: int
    counter: int
    step: int
    disk: bool = True


class BufferPool:
    """``count`` part buffers of ``size`` bytes, page-aligned (O_DIRECT reads straight into them)
    and touched once (first touch is slow here, GUIDE §4)."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self._free: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(count):
            b = fresh_buffer(size)
            prefault(memoryview(b))
            self._free.put(b)

    def take(self) -> np.ndarray:
        return self._free.get()

    def give(self, b: np.ndarray) -> None:
        self._free.put(b)


def abort_after(store: ObjectStore, key: str, upload_id: str, futures: list[Future]) -> None:
    """Aborts a multipart upload once every part sent has ended (each gives its buffer back)."""
    for fut in futures:
        try:
            fut.result()
        except BaseException:
            pass
    store.abort_multipart(key, upload_id)


def slot_manifest(ref: SlotRef) -> tuple[Any, bytes, Manifest]:
    """The store image, and the slot's manifest bytes (checked against its meta record and
    counter) and parsed."""
    image = read_store(ref.store_file)
    if ref.slot >= len(image.slots) or image.slots[ref.slot].meta is None \
            or image.slots[ref.slot].meta["counter"] != ref.counter:
        raise CorruptCheckpointError(f"slot {ref.slot} of {ref.store_file.name} no longer holds counter {ref.counter}")
    off, n = manifest_region(image, ref.slot)
    with open(ref.store_file, "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), n, off)
    return image, raw, manifest_from(image, ref.slot, raw)


def _read_manifest(ref: SlotRef) -> tuple[bytes, list[tuple[int, int, int]], int]:
    """The slot's manifest bytes (checked, :func:`slot_manifest`), each array's (offset, nbytes,
    crc32c) and the data length."""
    _, raw, man = slot_manifest(ref)
    arrays = [(e.offset, e.nbytes, c) for e, c in zip(man.arrays, man.crcs)]
    return raw, arrays, man.data_len


class _Crcs:
    """Each part's and each array's crc32c from one pass over the slot's bytes, in order.

    A part is cut where arrays begin and end; each piece is checksummed once and folded into the
    part's crc32c and, if it lies in an array, into that array's (crc32c_combine: a few
    microseconds per piece, against a second pass over every byte)."""

    def __init__(self, arrays: list[tuple[int, int, int]]) -> None:
        self.arrays = arrays
        self.got = [0] * len(arrays)
        self._i = 0

    def part(self, off: int, view: memoryview) -> int:
        """The crc32c of the part ``view`` at ``off``; feeds the arrays it overlaps."""
        end, pos, crc, i = off + len(view), off, 0, self._i
        arrays = self.arrays
        while pos < end:
            while i < len(arrays) and arrays[i][0] + arrays[i][1] <= pos:
                i += 1  # done with this array (zero-size ones too: their crc32c is 0)
            inside = i < len(arrays) and arrays[i][0] <= pos
            cut = min(end, arrays[i][0] + arrays[i][1]) if inside else (
                min(end, arrays[i][0]) if i < len(arrays) else end)
            piece = crc32c(view[pos - off:cut - off])
            crc = crc32c_combine(crc, piece, cut - pos)
            if inside:
                self.got[i] = crc32c_combine(self.got[i], piece, cut - pos)
            pos = cut
        self._i = i
        return crc

    def check(self, where: str) -> None:
        for (_, _, want), got in zip(self.arrays, self.got):
            if want != got:
                raise CorruptCheckpointError(f"{where}: an array's crc32c does not match its manifest: the slot "
                                             "is damaged or was reused; not uploading it")


# A part is read in slices of this many bytes, ``cancelled`` asked before each: a given-up upload
# (a flush's upload takes its place) stops reading within one slice, not one part (32 MiB by
# default, about 0.1 s from a disk busy with the flush's own write)
_READ_SLICE = 4 << 20


def _read_part(fd: int, view: memoryview, at: int, name: str, cancelled: Callable[[], bool] | None = None) -> None:
    """Reads ``len(view)`` bytes at ``at``; CorruptCheckpointError if the file ends first,
    Cancelled once ``cancelled()`` says so."""
    got = 0
    while got < len(view):
        if got and cancelled is not None and cancelled():
            raise Cancelled()
        r = os.preadv(fd, [view[got:got + _READ_SLICE]], at + got)
        if r <= 0:
            raise CorruptCheckpointError(f"{name}: short read: the store file is truncated")
        got += r


Aborter = Callable[[ObjectStore, str, str, list[Future]], None]


def upload_slot(store: ObjectStore, ref: SlotRef, generation: int, rank: int, part_size: int,
                pool: BufferPool, senders: ThreadPoolExecutor, cancelled: Callable[[], bool],
                aborter: Aborter = abort_after) -> RankPart:
    """Uploads the slot's data region as one object; returns its :class:`RankPart`. An upload
    that does not complete is aborted by ``aborter`` (:func:`abort_after`, or a function that
    hands it to another thread, so that the caller goes on while the parts in flight end)."""
    raw, arrays, data_len = _read_manifest(ref)
    while len(parts_of(data_len, part_size)) > MAX_PARTS:
        part_size *= 2
    if part_size > pool.size:  # the buffers hold part_size bytes: a part must fit in one
        raise ConfigError(f"step {ref.step}'s {data_len} bytes need parts of {part_size} bytes ({MAX_PARTS} parts "
                          f"at most per upload): set RemoteOptions(part_size=...) to at least {part_size}")
    key = data_key(generation, ref.step, uuid.uuid4().hex[:16], rank)
    upload_id = store.start_multipart(key, crc32c=True)
    crcs = _Crcs(arrays)
    part_crcs: list[int] = []
    futures: list[Future[str]] = []
    done = False
    try:
        base = slot_base(read_store(ref.store_file), ref.slot)
        # part_size and data_len are multiples of 4096 (options, FORMAT.md §5), the slot's base too:
        # every O_DIRECT read below is aligned
        fd = open_direct(ref.store_file)
        try:
            for number, (off, n) in enumerate(parts_of(data_len, part_size), start=1):
                if cancelled():
                    raise Cancelled()
                buf = pool.take()  # blocks while every buffer is in flight: memory stays bounded
                try:
                    if cancelled():  # given up while waiting for a buffer: read nothing more
                        raise Cancelled()
                    view = memoryview(buf)[:n]
                    _read_part(fd, view, base + off, ref.store_file.name, cancelled)
                    part_crcs.append(crcs.part(off, view))
                except BaseException:
                    pool.give(buf)
                    raise
                futures.append(senders.submit(_send, store, key, upload_id, number, view, part_crcs[-1], buf, pool,
                                              cancelled))
        finally:
            os.close(fd)
        crcs.check(f"{ref.store_file.name} slot {ref.slot} (step {ref.step})")
        etags = [fut.result() for fut in futures]
        store.complete_multipart(key, upload_id, etags, part_crcs)
        done = True
    finally:
        if not done:
            aborter(store, key, upload_id, futures)
    return RankPart(rank, key, data_len, part_size, tuple(part_crcs), raw)


def _send(store: ObjectStore, key: str, upload_id: str, number: int, view: memoryview, crc: int,
          buf: np.ndarray, pool: BufferPool, cancelled: Callable[[], bool] | None = None) -> str:
    """Sends one part; ``cancelled`` cuts its body short, or stops it before it is sent (the
    part then raises Cancelled, whatever error the HTTP client wrapped the cut in)."""
    try:
        if cancelled is not None and cancelled():
            raise Cancelled()
        return store.upload_part(key, upload_id, number, view, crc32c=crc, stop=cancelled)
    except BodyCancelled:
        raise Cancelled() from None
    except Exception:
        if cancelled is not None and cancelled():
            raise Cancelled() from None
        raise
    finally:
        pool.give(buf)  # invariant: a buffer is reused only once its part has been sent

