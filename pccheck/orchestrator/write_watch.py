"""Fingerprints that the kernel vouches for: an array no write touched since its last fingerprint
is not read again.

An incremental checkpoint fingerprints every array to find the changed ones; for a frozen array
that pass reads the same bytes at every checkpoint. Here the kernel tracks writes instead
(native ``WriteWatch``: userfaultfd asynchronous write-protection and ``PAGEMAP_SCAN``, Linux
>= 6.7; docs/ARCHITECTURE.md "Write watch"): an array whose fingerprint came out equal at its
last two passes is *armed* (its pages write-protected) before its next pass, and the fingerprint
that pass computes is kept. Every later call first *scans* the armed pages: a write since they
were protected (any write, through ``.data``, ``copy_``, numpy, C code or an O_DIRECT read)
lifted the protection, and the scan reports it. An armed array none of whose pages was written,
zapped or file-backed has the bytes it had when its kept fingerprint was computed, so the kept
fingerprint is its fingerprint now. A reported array is disarmed and fingerprinted again.

Invariants:
- a kept fingerprint was computed after the array was armed, and is dropped by any scan that
  reports one of its pages (a counter per record: a fingerprint computed across a report is not
  kept);
- only a C-contiguous array's *interior* pages (those holding its bytes alone) are protected;
  its few edge bytes on the pages it shares with neighbours (whose writes would otherwise report
  it at every step) are saved before the pass and compared byte for byte instead;
- every scan covers the union of the armed arrays' pages and maps each reported region to every
  armed array it overlaps, so a write to a page two overlapping arrays (views) share reaches both;
- arming protects pages with the same atomic report-and-protect (``WriteWatch.arm``), so arming
  one array never hides a write from another armed on the same pages;
- only private anonymous memory is armed (``/proc/self/maps``): a shared or file mapping can
  change through another mapping the protection does not see;
- memory a device writes by DMA is invisible to page protection: the watch stays off in a
  process that has initialized CUDA or loaded cupy (host arrays are then fingerprinted at every
  pass, as without the watch), and a forked child starts its own (registrations are not inherited).

Where the kernel lacks any piece, or ``PCCHECK_WRITE_WATCH=0``, every array is fingerprinted at
every pass, as before: the watch only ever saves a read.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..arrays import ArrayInfo
from ..native import _native

__all__ = ["fingerprints", "watch_active", "MIN_WATCHED_BYTES"]

log = logging.getLogger(__name__)

PAGE = os.sysconf("SC_PAGE_SIZE")
# Smaller arrays are fingerprinted at every pass: cheap, and their pages are mostly shared with
# other heap objects whose writes would report them anyway.
MIN_WATCHED_BYTES = 1 << 20
# A record unseen for this many calls is dropped (an armed one's pages stay protected: a later
# write to them costs one fault): state whose arrays move (clones, new tensors) does not grow the table.
_FORGET_AFTER = 64
# A record whose arming was refused (a shared or file mapping) is tried again after this many
# calls: the memory under the same address and geometry may since have been unmapped and mapped
# again as private anonymous memory (a freed shared buffer, then a new tensor in its place).
_RETRY_AFTER = 16

Fingerprint = tuple[int, int]
Keys = tuple[int, int]


@dataclass
class _Record:
    lo: int                       # the array's interior pages: [lo, hi), page-aligned, lo < hi
    hi: int
    edges: tuple[tuple[int, int], ...]  # (address, length) of its bytes outside [lo, hi)
    armed: bool = False
    refused: int | None = None    # the call at which arming was last refused (memory kind)
    epoch: int = 0                # bumped by every report, arming and disarming
    # keys -> (fingerprint, the edge bytes saved before its pass): valid while armed, same epoch
    kept: dict[Keys, tuple[Fingerprint, bytes]] = field(default_factory=dict)
    history: dict[Keys, tuple[Fingerprint | None, Fingerprint | None]] = field(default_factory=dict)
    seen: int = 0

    def edge_bytes(self) -> bytes:
        return b"".join(ctypes.string_at(a, n) for a, n in self.edges)


def _record_for(info: ArrayInfo) -> _Record | None:
    """A record of ``info``'s interior pages and edges, or None if it is not watched (smaller
    than MIN_WATCHED_BYTES, not C-contiguous, or not in host memory)."""
    if info.device != "cpu" or info.nbytes < MIN_WATCHED_BYTES or not info.ptr:
        return None
    want = info.itemsize
    for n, st in reversed(list(zip(info.shape, info.strides))):
        if n != 1 and st != want:
            return None
        want *= n
    start, end = info.ptr, info.ptr + info.nbytes
    lo, hi = -(-start // PAGE) * PAGE, end - end % PAGE
    if lo >= hi:
        return None
    return _Record(lo, hi, tuple((a, n) for a, n in ((start, lo - start), (hi, end - hi)) if n))


def _geometry(info: ArrayInfo) -> tuple:
    return (info.ptr, info.nbytes, info.itemsize, info.shape, info.strides)


def _device_dma_possible() -> bool:
    """Whether a device may write this process's host memory by DMA: CUDA initialized by torch,
    or cupy loaded (its pinned memory is the device's to write)."""
    if "cupy" in sys.modules:
        return True
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a torch build without CUDA support: no device can write host memory
        return False


def _mappings() -> list[tuple[int, int, bool]]:
    """This process's mappings from ``/proc/self/maps``: (start, end, private anonymous)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            a, b = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) > 5 else ""
            anon = parts[1][3] == "p" and parts[4] == "0" and (path in ("", "[heap]") or path.startswith("[anon:"))
            out.append((a, b, anon))
    return out


def _private_anonymous(maps: list[tuple[int, int, bool]], lo: int, hi: int) -> bool:
    """Whether every byte of [lo, hi) lies in private anonymous mappings."""
    covered = lo
    for a, b, anon in maps:
        if b <= covered or a >= hi:
            continue
        if a > covered or not anon:
            return False  # a hole, or a mapping another process or file can change
        covered = b
        if covered >= hi:
            return True
    return False


class _Watch:
    """The process's write watch (one per process; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._native: _native.WriteWatch | None = None
        self._off = os.environ.get("PCCHECK_WRITE_WATCH", "1") == "0"
        self._records: dict[tuple, _Record] = {}
        self._calls = 0
        if self._off:
            return
        try:
            self._native = _native.WriteWatch()
        except RuntimeError as e:
            self._off = True
            log.info("pccheck: no kernel write tracking here (%s); incremental checkpoints fingerprint "
                     "every array at every checkpoint", e)

    @property
    def active(self) -> bool:
        return not self._off and os.getpid() == self._pid

    def _disable(self, why: str) -> None:
        log.info("pccheck: kernel write tracking off (%s); arrays are fingerprinted at every checkpoint", why)
        self._off = True
        self._records.clear()

    def _refresh(self) -> None:
        """Scans every armed page; drops the kept fingerprints of every array a report touches."""
        armed = sorted((r for r in self._records.values() if r.armed), key=lambda r: r.lo)
        runs: list[list[int]] = []  # merged runs of armed pages, each scanned once
        for r in armed:
            if runs and r.lo <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], r.hi)
            else:
                runs.append([r.lo, r.hi])
        assert self._native is not None or not runs
        for lo, hi in runs:
            regions, rc = self._native.scan(lo, hi)  # type: ignore[union-attr]
            if rc != 0:  # part of the run is no longer registered (unmapped, mapped again): all dirty
                regions = [(lo, hi)]
            _report(armed, regions)

    def _arm(self, rec: _Record, maps: list[tuple[int, int, bool]]) -> None:
        """Protects ``rec``'s pages; another armed on the same pages whose write this reports is
        disarmed."""
        if not _private_anonymous(maps, rec.lo, rec.hi):
            rec.refused = self._calls
            return
        assert self._native is not None
        regions, rc = self._native.arm(rec.lo, rec.hi)
        if rc != 0:
            rec.refused = self._calls
            log.debug("pccheck: write tracking refused [%#x, %#x): errno %d", rec.lo, rec.hi, -rc)
            return
        _report([r for r in self._records.values() if r.armed], regions)
        rec.armed, rec.kept, rec.refused = True, {}, None
        rec.epoch += 1

    def _may_arm(self, rec: _Record) -> bool:
        """Whether ``rec`` is tried for arming this call (not one refused in the last
        _RETRY_AFTER calls)."""
        return not rec.armed and (rec.refused is None or self._calls - rec.refused >= _RETRY_AFTER)

    def fingerprints(self, infos: Sequence[ArrayInfo], keys: Keys, skip: Sequence[bool], pool: Executor,
                     compute: Callable[[ArrayInfo, Keys], Fingerprint]) -> list[Fingerprint | None]:
        """Each array's fingerprint under ``keys`` (None where ``skip``): kept ones where the
        kernel saw no write, ``compute``d (on ``pool``) otherwise."""
        out: list[Fingerprint | None] = [None] * len(infos)
        todo: list[tuple[int, _Record | None, int, bytes]] = []
        with self._lock:
            if self.active and _device_dma_possible():
                self._disable("a device runtime is initialized in this process: a device may write host "
                              "memory by DMA, which page protection does not see")
            active = self.active
            maps: list[tuple[int, int, bool]] | None = None
            if active:
                self._calls += 1
                self._refresh()
            for i, info in enumerate(infos):
                if skip[i]:
                    continue
                rec = None
                if active:
                    g = _geometry(info)
                    rec = self._records.get(g)
                    if rec is None and (rec := _record_for(info)) is not None:
                        self._records[g] = rec
                if rec is None:
                    todo.append((i, None, 0, b""))
                    continue
                rec.seen = self._calls
                if rec.armed and keys in rec.kept:
                    fp, edges = rec.kept[keys]
                    if rec.edge_bytes() == edges:
                        out[i] = fp
                        continue
                    rec.kept.pop(keys)  # an edge byte changed: read it again
                prev, last = rec.history.get(keys, (None, None))
                if self._may_arm(rec) and last is not None and prev == last:
                    if maps is None:
                        maps = _mappings()  # read once per call, under the lock
                    self._arm(rec, maps)  # equal at its last two passes: frozen, by the evidence so far
                # the edges are saved before the pass: a write after it then shows as a difference
                todo.append((i, rec, rec.epoch, rec.edge_bytes() if rec.armed else b""))
            if active:
                self._forget()
        computed = list(pool.map(lambda t: compute(infos[t[0]], keys), todo))
        with self._lock:
            for (i, rec, epoch, edges), fp in zip(todo, computed):
                out[i] = fp
                if rec is None:
                    continue
                rec.history[keys] = (rec.history.get(keys, (None, None))[1], fp)
                # kept only when armed before the pass began and no report came since
                if rec.armed and rec.epoch == epoch:
                    rec.kept[keys] = (fp, edges)
        return out

    def _forget(self) -> None:
        stale = [g for g, r in self._records.items() if self._calls - r.seen > _FORGET_AFTER]
        for g in stale:
            del self._records[g]  # an armed one's pages stay protected: a write costs one fault, once


def _report(armed: Sequence[_Record], regions: Sequence[tuple[int, int]]) -> None:
    """Disarms every armed record overlapping a reported region: its pages were written."""
    for a, b in regions:
        for r in armed:
            if r.armed and r.lo < b and a < r.hi:
                r.armed, r.kept = False, {}
                r.epoch += 1


_WATCH: _Watch | None = None
_WATCH_LOCK = threading.Lock()


def _watch() -> _Watch:
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None or _WATCH._pid != os.getpid():  # a forked child starts its own
            _WATCH = _Watch()
        return _WATCH


def watch_active() -> bool:
    """Whether kernel write tracking serves this process's fingerprints."""
    return _watch().active


def fingerprints(infos: Sequence[ArrayInfo], keys: Keys, skip: Sequence[bool], pool: Executor,
                 compute: Callable[[ArrayInfo, Keys], Fingerprint]) -> list[Fingerprint | None]:
    """Fingerprints of ``infos`` under ``keys`` (None where ``skip``), read only where needed."""
    return _watch().fingerprints(infos, keys, skip, pool, compute)
