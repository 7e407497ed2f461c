"""Fast reads of a slot's data region for recovery.

The region (4096-aligned in the file, a multiple of 4096 long: FORMAT §5) is read with O_DIRECT
by a few threads into one fresh anonymous mapping with transparent huge pages, and each
thread checksums the array bytes of its piece while they are hot in cache. Arrays are returned
as views into that one buffer. Where O_DIRECT is refused (e.g. some tmpfs), buffered reads are
used instead.

Fresh memory must be faulted in (zeroed by the kernel) before a read can land in it, and on these
machines (0.25–1.3 GB/s for fresh pages) that costs about as much as the read itself. A prefault
thread therefore populates the pieces in file order, ahead of the readers (each reader waits
until its piece is populated), so the faults of later pieces overlap the I/O of earlier ones
instead of adding to it.

The prefault replaces each not-yet-written piece of the fresh mapping by a new anonymous mapping
populated at mmap time (``MAP_FIXED | MAP_POPULATE``, :func:`populate`): on these machines that
faults 256 MiB in 0.11 s against 0.19 s for ``MADV_POPULATE_WRITE`` and 0.23-0.30 s for one
write per page (bench/micro/first_touch.py). Where it is refused, ``MADV_POPULATE_WRITE``.
"""

from __future__ import annotations

import bisect
import errno
import itertools
import mmap
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .. import shutdown
from ..errors import CorruptCheckpointError
from ..native import _native
from .layout import ArrayEntry

__all__ = ["read_region", "read_array", "read_entry", "read_uncached", "aligned_span", "cached_fraction", "crc32c", "crc32c_combine", "prefault", "fresh_buffer",
           "populate", "Prefaulter", "open_direct"]

PIECE = 32 << 20


def prefault(view: memoryview) -> None:
    """Faults fresh memory in (writes one byte per page), so a later timed read or copy does not
    pay for it (for readers above persist: the tuner's scratch chunks)."""
    _native.prefault(view)


def fresh_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory as a uint8 array over an anonymous mapping with transparent huge
    pages (its first touch faults 2 MiB at a time instead of 4 KiB: several times cheaper on these
    machines). The array keeps the mapping alive."""
    mm = mmap.mmap(-1, max(1, nbytes))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes)


_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10  # Linux's value (Python's mmap module does not export it)
_libc_mmap = None


def _mmap_fn():  # noqa: ANN202 - libc's mmap through ctypes, or None where there is none
    global _libc_mmap
    if _libc_mmap is None and not (sys.platform.startswith("linux") and hasattr(mmap, "MAP_POPULATE")):
        _libc_mmap = False
    if _libc_mmap is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).mmap
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            _libc_mmap = fn
        except (OSError, AttributeError):
            _libc_mmap = False
    return _libc_mmap or None


def populate(buf: np.ndarray, off: int, n: int) -> None:
    """Faults in bytes ``[off, off + n)`` of a :func:`fresh_buffer` that *nothing has written
    yet* (``off`` a multiple of the page size): that range of the mapping is replaced by a fresh
    anonymous one populated at once (``MAP_FIXED | MAP_POPULATE``; the GIL is released). Its
    contents stay zero, as they were. Falls back to ``MADV_POPULATE_WRITE`` (or a write per page).

    Invariant (the caller's): the range lies in a mapping of this process that ``buf`` keeps
    alive, and no thread reads or writes it until this returns; it is never used on memory that
    holds data (the replacement's pages are zero)."""
    if n <= 0:
        return
    fn = _mmap_fn()
    addr = buf.ctypes.data + off
    end = (addr + n + _PAGE - 1) // _PAGE * _PAGE  # within the mapping: the kernel maps whole pages
    if fn is not None and addr % _PAGE == 0:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | mmap.MAP_POPULATE
        if fn(addr, end - addr, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) == addr:
            return
    _native.prefault(memoryview(buf)[off:off + n])


class Prefaulter:
    """Populates a :func:`fresh_buffer` piece by piece, in file order, in a thread of its own,
    ahead of a consumer that writes it in the same order: the consumer calls :meth:`wait` with
    the end of what it is about to write. The thread keeps ``buf`` (hence its mapping) alive
    until it ends; :meth:`close` stops it early (call it before dropping the buffer on an error
    path: nothing is populated after close returns)."""

    def __init__(self, buf: np.ndarray, piece: int = PIECE) -> None:
        self._buf, self._piece = buf, piece
        self._done = 0          # bytes from the start that are populated (or given up on)
        self._stop = False
        self._cv = threading.Condition()
        self._thread = shutdown.thread(self._run, "pccheck-prefault")

    def _run(self) -> None:
        n = self._buf.nbytes
        try:
            for off in range(0, n, self._piece):
                if self._stop:
                    break
                populate(self._buf, off, min(self._piece, n - off))
                with self._cv:
                    self._done = min(n, off + self._piece)
                    self._cv.notify_all()
        finally:  # never leave a consumer waiting: past here it faults its pages itself
            with self._cv:
                self._done = n
                self._cv.notify_all()

    def wait(self, end: int) -> None:
        """Returns once bytes ``[0, end)`` are populated (or the thread gave up on them)."""
        with self._cv:
            self._cv.wait_for(lambda: self._done >= end)

    def close(self) -> None:
        """Stops populating; returns once the thread has ended."""
        self._stop = True
        self._thread.join()


def read_array(fd: int, offset: int, nbytes: int, piece: int = 8 << 20,
               into: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Reads ``nbytes`` at ``offset`` (buffered) into ``into`` (a uint8 array of that size: e.g.
    the destination tensor's own memory, already faulted in) or a fresh uint8 array, checksumming
    each piece while it is hot in cache; returns (array, crc32c). One array of a slot, for the
    lazy loader; CorruptCheckpointError if the file ends early."""
    buf = np.empty(nbytes, dtype=np.uint8) if into is None else into
    view = memoryview(buf)
    crc, done = 0, 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:done + piece]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"short read at offset {offset + done}: the file is truncated")
        crc = _native.crc32c(view[done:done + n], crc)
        done += n
    return buf, crc


def read_entry(fd: int, base: int, entry: ArrayEntry, crc: int, into: np.ndarray | None = None) -> np.ndarray:
    """One array of a slot at ``base``, checked against its crc32c, with its dtype and shape
    (read into ``into``, a uint8 array of ``entry.nbytes``, when given)."""
    if not entry.nbytes:
        return np.empty(entry.shape, dtype=entry.dtype)
    buf, got = read_array(fd, base + entry.offset, entry.nbytes, into=into)
    if got != crc:
        raise CorruptCheckpointError(f"array {entry.name!r} checksum mismatch")
    return buf.view(entry.dtype).reshape(entry.shape)


DIRECT_ALIGN = 4096  # O_DIRECT's alignment of file offsets, lengths and buffer addresses


def aligned_span(offset: int, nbytes: int) -> int:
    """Bytes of the smallest ``DIRECT_ALIGN``-aligned file range holding ``nbytes`` at ``offset``:
    what a buffer given to :func:`read_uncached` must hold."""
    lo = offset - offset % DIRECT_ALIGN
    return -(-(offset + nbytes) // DIRECT_ALIGN) * DIRECT_ALIGN - lo


def read_uncached(fd: int, direct_fd: int, offset: int, nbytes: int, buf: np.ndarray,
                  piece: int = 8 << 20) -> tuple[np.ndarray, int]:
    """Reads ``nbytes`` at ``offset`` into ``buf`` (a page-aligned uint8 array of at least
    :func:`aligned_span` bytes) and returns (a view of those bytes in ``buf``, their crc32c), each
    piece checksummed while hot in cache. For a reader that reads bytes once and passes them on.

    When the page cache holds every page of them (:func:`cached_fraction`), the bytes are read
    through it (``fd``); else with O_DIRECT (``direct_fd``, from :func:`open_direct`) from the device straight
    into ``buf``, which allocates no page cache and copies nothing out of it: on these machines a
    cold buffered read costs about 0.4 CPU seconds a GiB, a direct one under 0.1. Both return the
    same bytes (an O_DIRECT read writes dirty cached pages back first). CorruptCheckpointError if
    the file ends early."""
    lo = offset - offset % DIRECT_ALIGN
    head, span = offset - lo, aligned_span(offset, nbytes)
    if buf.nbytes < span:
        raise ValueError(f"the buffer holds {buf.nbytes} bytes, the aligned read {span}")
    # Through the cache only when it holds all of the range: a cold read would fill it for
    # nothing, and a part (the readahead of the bytes before) is cheaper to read again than to copy.
    if nbytes == 0 or cached_fraction(fd, lo, span) == 1.0:
        return read_array(fd, offset, nbytes, piece, into=buf[head:head + nbytes])
    view = memoryview(buf)
    end = head + nbytes
    crc, done = 0, 0  # done: bytes of buf filled, buf[0] being the file's byte lo
    while done < end:
        n = os.preadv(direct_fd, [view[done:min(span, done + piece)]], lo + done)
        # Invariant: every read starts aligned; a short one (not a multiple) ends the file.
        if n <= 0 or (n % DIRECT_ALIGN and done + n < end):
            raise CorruptCheckpointError(f"short read at offset {lo + done + max(n, 0)}: the file is truncated")
        a, b = max(done, head), min(done + n, end)
        if a < b:
            crc = _native.crc32c(view[a:b], crc)
        done += n
    return buf[head:end], crc


_libc_mincore = None


def cached_fraction(fd: int, offset: int, nbytes: int) -> float:
    """The fraction of the pages of ``fd`` under ``[offset, offset + nbytes)`` (``offset`` a
    multiple of the page size) that the page cache holds: ``mincore`` over a private mapping of
    the range, which reads nothing. 0.0 where it cannot be told (no libc mincore, an empty file)."""
    global _libc_mincore
    import ctypes

    if _libc_mincore is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).mincore
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            _libc_mincore = fn
        except (OSError, AttributeError):
            _libc_mincore = False
    pages = -(-nbytes // _PAGE)
    if not _libc_mincore or pages == 0:
        return 0.0
    try:  # copy-on-write: a writable buffer (ctypes needs one) that is never written
        mm = mmap.mmap(fd, pages * _PAGE, access=mmap.ACCESS_COPY, offset=offset)
    except (OSError, ValueError):
        return 0.0
    try:
        ref = ctypes.c_char.from_buffer(mm)
        vec = ctypes.create_string_buffer(pages)
        ok = _libc_mincore(ctypes.addressof(ref), pages * _PAGE, vec) == 0
        del ref  # the mapping cannot close while a ctypes view of it lives
        return np.frombuffer(vec.raw, dtype=np.uint8).__and__(1).sum() / pages if ok else 0.0
    finally:
        mm.close()


def crc32c(data: bytes | memoryview, crc: int = 0) -> int:
    """The crc32c (Castagnoli) of ``data``, continuing from ``crc`` (for readers above persist)."""
    return _native.crc32c(data, crc)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The crc32c of A+B from those of A and of B (``len_b`` bytes): pieces checked in parallel."""
    return _native.crc32c_combine(crc_a, crc_b, len_b)

THREADS = 2
SMALL_READ = 1 << 20  # read_region reads pieces under this size after the others


def _open(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def open_direct(path: Path) -> int:
    """A read-only fd on ``path`` with O_DIRECT (plain where the filesystem refuses it): for
    readers above persist that read a slot once (the remote upload), bypassing the page cache."""
    return _open(path)


def read_region(path: Path, offset: int, length: int, spans: list[tuple[int, int]],
                extents: list[tuple[int, int, int]] | None = None) -> tuple[np.ndarray, list[int]]:
    """Reads ``length`` bytes at ``offset`` (both multiples of 4096) and returns them as a uint8
    array plus the crc32c of each ``(start, nbytes)`` span of it (spans sorted, disjoint).

    ``extents``: the region is gathered instead from runs ``(start, end, file offset)`` (sorted,
    disjoint, block-aligned; an incremental checkpoint's cells, FORMAT.md §14); bytes no run
    covers stay zero and are not read."""
    if length == 0:
        return np.empty(0, np.uint8), [0] * len(spans)
    buf = fresh_buffer(length)
    view = memoryview(buf)
    starts = [s for s, _ in spans]
    runs = [(0, length, offset)] if extents is None else extents
    # (buffer offset, length, file offset) of each read, at most PIECE long, in buffer order, but
    # the small ones last: a small read issued beside another reader's large one waits for it in
    # the device's queue (an incremental checkpoint's changed arrays between its frozen ones: 25
    # reads of 128 KiB took 0.4 s so, of a 0.6 s load); at the end they run back to back
    pieces = [(p, min(PIECE, hi - p), f + p - lo) for lo, hi, f in runs for p in range(lo, hi, PIECE)]
    pieces = [x for x in pieces if x[1] >= SMALL_READ] + [x for x in pieces if x[1] < SMALL_READ]
    fd = _open(path)
    # the pieces' pages populated in file order, ahead of the readers (Prefaulter's invariant:
    # a piece is read into only once pre.wait says it is populated)
    pre = Prefaulter(buf, PIECE)

    # Pieces are handed out in buffer order to whichever reader is free: a fixed split (every
    # THREADS-th piece) gives one reader all the large runs when runs of two sizes alternate (an
    # incremental checkpoint's frozen arrays between its small changed ones).
    turn = itertools.count()
    turn_lock = threading.Lock()

    def work(_: int) -> list[tuple[int, int, int, int]]:
        done = []
        while True:
            with turn_lock:
                k = next(turn)
            if k >= len(pieces):
                break
            p, n, at = pieces[k]
            pre.wait(p + n)
            got = 0
            while got < n:
                r = os.preadv(fd, [view[p + got:p + n]], at + got)
                if r <= 0:
                    raise CorruptCheckpointError(f"{path}: short read at offset {at + got}")
                got += r
            # Checksum the spans' bytes of this piece now, while they are in cache.
            j = max(0, bisect.bisect_right(starts, p) - 1)
            while j < len(spans) and spans[j][0] < p + n:
                s, ln = spans[j]
                lo, hi = max(s, p), min(s + ln, p + n)
                if lo < hi:
                    done.append((j, lo, _native.crc32c(view[lo:hi]), hi - lo))
                j += 1
        return done

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            parts = [x for part in pool.map(work, range(THREADS)) for x in part]
    finally:
        pre.close()
        os.close(fd)
    crcs = [0] * len(spans)
    for j, _, crc, n in sorted(parts, key=lambda t: (t[0], t[1])):  # combine in buffer order
        crcs[j] = _native.crc32c_combine(crcs[j], crc, n)
    return buf, crcs
