"""Power-loss simulation over a recorded I/O trace (ALICE / CrashMonkey style; SQLite's test6.c).

The native I/O layer records every pwrite, fdatasync, msync and posix_fallocate of the store with
its file, offset, length and bytes, and the position of the call's start and end in one global
order (``_native.trace_start`` / ``trace_take``; pccheck/native/io.h). From such a trace this
module builds the disk images a power loss could leave behind, and the oracle each must satisfy.

The disk model, for a crash at point ``p`` (after the first ``p`` events of the trace):

* A write whose call started before ``p`` may have reached the disk, wholly or in part.
* It is certainly on the disk once an fdatasync of the file that *began after the write ended*
  has itself ended before ``p``: O_DIRECT completion only means the device cache has it, and a
  buffered write sits in the page cache, until a flush.
* Every other write started before ``p`` is *volatile*: it may be kept, dropped, or torn at
  512-byte sector granularity (each sector old or new; sectors are atomic). Later writes to the
  same bytes land over earlier ones.
* A posix_fallocate not yet made durable may be lost: the file is then shorter.
* The CHECK_ADDR word (header offset 128) lives in a MAP_SHARED page and reaches the disk by an
  msync or by kernel writeback at any moment after the in-memory CAS. So the disk may hold any
  value the word had in memory since the start of the last msync that completed. The values it
  had are the msync snapshots and the words of the commits whose CAS won (a commit thread CASes
  after its fdatasync returns and before its msync starts). The word only moves forward
  (FORMAT.md §4), which this module checks on the snapshots.

The oracle (FORMAT.md §4 invariants): recovery of every image returns a checkpoint whose bytes are
right for its step, whose counter is at least the word of the last msync that completed before
``p`` (the last commit barrier), or raises NoCheckpointError only when no barrier has completed.

Only the O_DIRECT writer is modelled (its only mapped page is block 0). A trace with an msync of
any other page (the mmap writer) is rejected.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
import struct
from dataclasses import dataclass, field
from typing import Iterator

from pccheck.native import _native

__all__ = ["Op", "record", "PowerLossSim", "CrashState", "Commit", "SECTOR", "WORD_OFFSET"]

SECTOR = 512
BLOCK = 4096
WORD_OFFSET = 128
_META_MAGIC = b"PCCMETA\0"


@dataclass(frozen=True)
class Op:
    """One recorded I/O call (see io.h, TraceRecord)."""

    kind: str      # "pwrite", "fdatasync", "msync", "fallocate"
    tid: int
    ino: int
    off: int
    len: int
    data: bytes
    begin: int     # position of the call's start in the global order
    end: int       # position of its return; -1 if it never returned
    rc: int

    @property
    def ok(self) -> bool:
        return self.end >= 0 and self.rc == 0


@contextlib.contextmanager
def record() -> Iterator[list[Op]]:
    """Records every native I/O call in the block; the list is filled when the block exits."""
    ops: list[Op] = []
    _native.trace_start()
    try:
        yield ops
    finally:
        _native.trace_stop()
        ops.extend(Op(r["op"], r["tid"], r["ino"], r["off"], r["len"], r["data"], r["begin"], r["end"], r["rc"])
                   for r in _native.trace_take())


@dataclass(frozen=True)
class Commit:
    """A meta record write in the trace: one checkpoint's commit."""

    counter: int
    slot: int
    step: int
    meta: Op           # the meta record's pwrite
    sync: Op | None    # the first fdatasync on the same thread after it (the commit barrier 1)
    msync: Op | None   # the first msync on the same thread after that (the word barrier)

    @property
    def word(self) -> int:
        return (self.counter << 8) | self.slot


@dataclass(frozen=True)
class CrashState:
    """One post-crash disk image and what recovery of it must satisfy."""

    point: int            # crash after this many events
    image: bytes          # the whole file
    floor: int            # recovery must return counter >= floor; 0: NoCheckpointError allowed
    word: int | None      # the CHECK_ADDR value forced into the image (None: as the writes left it)
    decisions: tuple = field(repr=False, default=())  # per volatile write: "keep", "drop" or a sector mask


def _word_of(page: bytes) -> int:
    return struct.unpack_from("<Q", page, WORD_OFFSET)[0]


class PowerLossSim:
    """The post-crash disk images of one recorded trace of one store file.

    Args:
        ops: the trace (``record()``), any order.
        ino: the store file's inode; calls on other files are ignored.
        won: counters of the commits whose CAS succeeded (``CheckpointStats.outcome ==
            "committed"``): the values the in-memory word took.
        initial: the file's contents before the trace (a crashed image being reopened), else empty.
        initial_floor: the counter recovery of ``initial`` reached (what reopening must never lose);
            default: the counter of the word in ``initial``.
    """

    def __init__(self, ops: list[Op], *, ino: int, won: set[int], initial: bytes = b"",
                 initial_floor: int | None = None) -> None:
        self.ops = sorted((o for o in ops if o.ino == ino or (o.kind == "msync" and o.ino == 0)),
                          key=lambda o: o.begin)
        self.initial = initial
        self.events = 1 + max([o.end for o in self.ops] + [o.begin for o in self.ops] + [-1])
        for o in self.ops:
            if o.kind == "msync" and not (o.ino == ino and o.off == 0 and o.len == BLOCK):
                raise NotImplementedError(f"msync of anything but block 0 ({o}): only the O_DIRECT "
                                          "writer is modelled")
        self.writes = [o for o in self.ops if o.kind in ("pwrite", "fallocate")]
        syncs = [o for o in self.ops if o.kind == "fdatasync" and o.ok]
        self.msyncs = [o for o in self.ops if o.kind == "msync"]
        # When each write becomes certainly durable: the earliest end of a successful fdatasync
        # that began after the write ended (never, for a write that failed or never returned).
        inf = self.events + 1
        self._durable_at = {}
        for w in self.writes:
            at = inf
            if w.ok:
                at = min((s.end for s in syncs if s.begin > w.end), default=inf)
            self._durable_at[w.begin] = at
        self.initial_word = _word_of(initial) if len(initial) >= BLOCK else 0
        self.initial_floor = self.initial_word >> 8 if initial_floor is None else initial_floor
        self.commits = self._find_commits()
        self._check_word_monotone()
        # Every value the in-memory word took, with the earliest point it can have been there.
        self._word_values: dict[int, int] = {}
        for c in self.commits:
            if c.counter in won and c.sync is not None and c.sync.ok:
                self._word_values[c.word] = c.sync.end + 1  # the CAS follows the sync's return
        for m in self.msyncs:
            w = _word_of(m.data)
            self._word_values[w] = min(self._word_values.get(w, m.begin + 1), m.begin + 1)
        self.size_hint = max([len(initial)] + [w.off + w.len for w in self.writes])

    # -- reading the trace -----------------------------------------------------------------------

    def _find_commits(self) -> list[Commit]:
        out = []
        for o in self.ops:
            if o.kind != "pwrite" or o.len != BLOCK or o.off < BLOCK or not o.data.startswith(_META_MAGIC):
                continue
            slot, counter, step = struct.unpack_from("<IQq", o.data, 12)
            sync = next((s for s in self.ops if s.kind == "fdatasync" and s.tid == o.tid and s.begin > o.end
                         and o.end >= 0), None)
            msync = None
            if sync is not None:
                msync = next((m for m in self.msyncs if m.tid == o.tid and m.begin > sync.end and sync.end >= 0),
                             None)
            out.append(Commit(counter, slot, step, o, sync, msync))
        return out

    def _check_word_monotone(self) -> None:
        """FORMAT.md §4: an older checkpoint never replaces a newer one in CHECK_ADDR. (The first
        msync may move it anywhere: reopening repairs a damaged word.)"""
        last = 0
        for m in self.msyncs:
            w = _word_of(m.data)
            assert (w >> 8) >= (last >> 8), f"CHECK_ADDR went backwards: {last:#x} then {w:#x} at msync {m}"
            last = w

    def max_concurrency(self) -> int:
        """The most checkpoints in flight at once: from the zeroing of a slot's meta record to the
        end of its commit's msync (or of its meta write when it has none)."""
        spans = []
        for c in self.commits:
            zero = [o for o in self.ops if o.kind == "pwrite" and o.off == c.meta.off and o.begin < c.meta.begin
                    and not any(o.data)]
            start = zero[-1].begin if zero else c.meta.begin
            end = c.msync.end if c.msync is not None and c.msync.end >= 0 else c.meta.end
            spans.append((start, end))
        best = 0
        for s, _ in spans:
            best = max(best, sum(1 for a, b in spans if a <= s < b))
        return best

    # -- the crash states ------------------------------------------------------------------------

    def floor(self, p: int) -> int:
        """Counter recovery must reach after a crash at p: the word of the last completed msync
        (the last commit barrier), else the word the file started with; 0 means none."""
        done = [m for m in self.msyncs if m.ok and m.end < p]
        if done:
            return max(self.initial_floor, _word_of(max(done, key=lambda m: m.begin).data) >> 8)
        return self.initial_floor

    def word_candidates(self, p: int) -> list[int | None]:
        """CHECK_ADDR values the disk may hold after a crash at p. None: whatever the writes left.

        The disk holds the snapshot of the last completed msync or any later in-memory value
        (those have larger counters); before any msync completed, the word the file had or any
        value stored in memory since it was opened.
        """
        done = [m for m in self.msyncs if m.ok and m.end < p]
        if done:
            base: int | None = _word_of(max(done, key=lambda m: m.begin).data)
            later = [w for w, t in self._word_values.items() if t <= p and (w >> 8) > (base >> 8)]
        else:
            base = None
            later = [w for w, t in self._word_values.items() if t <= p]
        return [base] + sorted(later)

    def volatile(self, p: int) -> list[Op]:
        return [w for w in self.writes if w.begin < p and self._durable_at[w.begin] >= p]

    def _apply(self, img: bytearray, size: list[int], w: Op, how) -> None:
        if w.kind == "fallocate":
            if how != "drop":
                size[0] = max(size[0], w.off + w.len)
            return
        if how == "drop":
            return
        end = w.off + w.len
        if how == "keep":
            img[w.off:end] = w.data
            size[0] = max(size[0], end)
            return
        for i, bit in enumerate(how):  # torn: sector i lands iff bit
            if bit:
                a = i * SECTOR
                img[w.off + a:w.off + a + SECTOR] = w.data[a:a + SECTOR]
                size[0] = max(size[0], w.off + a + SECTOR)

    def _decision_sets(self, vol: list[Op], words: list, rng: random.Random, exhaustive_cap: int,
                       torn: int) -> Iterator[tuple[tuple, int | None]]:
        k = len(vol)
        if (2 ** k) * len(words) <= exhaustive_cap:
            for word in words:
                for bits in itertools.product(("keep", "drop"), repeat=k):
                    yield bits, word
        else:
            for word in words:
                yield ("keep",) * k, word
                yield ("drop",) * k, word
            for _ in range(exhaustive_cap):
                yield tuple(rng.choice(("keep", "drop")) for _ in vol), rng.choice(words)
        for _ in range(torn if k else 0):
            ds = []
            for w in vol:
                nsec = w.len // SECTOR if w.kind == "pwrite" else 0
                how = rng.choice(("keep", "drop", "torn") if nsec >= 2 else ("keep", "drop"))
                if how == "torn":  # a proper, non-empty subset of the sectors lands
                    mask = [rng.random() < 0.5 for _ in range(nsec)]
                    if all(mask) or not any(mask):
                        mask[rng.randrange(nsec)] = not mask[0]
                    how = tuple(mask)
                ds.append(how)
            yield tuple(ds), rng.choice(words)

    def states(self, rng: random.Random, *, exhaustive_cap: int = 32, torn: int = 4,
               points: Iterator[int] | None = None) -> Iterator[CrashState]:
        """Every crash point (after each event), and for each the images of its volatile writes
        kept / dropped (all subsets up to ``exhaustive_cap`` combinations, else a sample) and
        ``torn`` random sector-torn variants, times the possible CHECK_ADDR values."""
        prefix = bytearray(self.initial) + bytearray(max(0, self.size_hint - len(self.initial)))
        prefix_size = [len(self.initial)]
        applied = 0  # writes [0, applied) are in `prefix`: all durable at every later point
        for p in (points if points is not None else range(self.events + 1)):
            # Grow the prefix while the next write is durable at p (durability only grows with p).
            while applied < len(self.writes) and self._durable_at[self.writes[applied].begin] < p:
                self._apply(prefix, prefix_size, self.writes[applied], "keep")
                applied += 1
            tail = [w for w in self.writes[applied:] if w.begin < p]
            vol = [w for w in tail if self._durable_at[w.begin] >= p]
            words = self.word_candidates(p)
            floor = self.floor(p)
            for decisions, word in self._decision_sets(vol, words, rng, exhaustive_cap, torn):
                img = bytearray(prefix)
                size = list(prefix_size)
                it = iter(decisions)
                for w in tail:
                    self._apply(img, size, w, next(it) if self._durable_at[w.begin] >= p else "keep")
                if word is not None and size[0] >= BLOCK:
                    struct.pack_into("<Q", img, WORD_OFFSET, word)
                yield CrashState(p, bytes(img[:size[0]]), floor, word, decisions)


def digest(state: CrashState) -> tuple:
    """Identity of a state for de-duplication: same image and same oracle. The crc32c of the whole
    image (fast) plus a cryptographic hash of its header and meta blocks, where states differ most."""
    return (len(state.image), _native.crc32c(state.image), state.floor,
            hashlib.blake2b(state.image[:64 * BLOCK], digest_size=16).digest())
