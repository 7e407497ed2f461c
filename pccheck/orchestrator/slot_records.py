"""Incremental checkpoints that keep every slot whole: what each slot holds, and which arrays a
new checkpoint into it must copy (the memory tier's own and replica stores, FORMAT.md §13).

Unlike :mod:`.incremental` (the disk tier's cells, where a checkpoint references bytes in other
slots), here every checkpoint's arrays all lie in its own slot, as in a full checkpoint: a
checkpoint into slot X copies only the arrays whose bytes differ from what slot X already holds,
and leaves the others in place. Retention, replication (which sends a slot's data region) and
every reader stay as they are; a frozen array is copied into each slot once (with 2 alternating
slots: twice), then never again.

What a slot holds is a *record* per array: its fingerprint (the native two 61-bit polynomial
hashes, docs/ARCHITECTURE.md "Incremental checkpoints") under the record's keys, and its crc32c.
Invariants (what keeps a record true):

- a record names only bytes a finished write put there: when a plan picks the arrays to copy
  into slot X, their records in X become unknown at once (under the lock), and become the new
  fingerprints only once the checkpoint's every byte is written and its commit ran
  (:meth:`SlotRecords.end`); an abandoned or failed one leaves them unknown, so the next
  checkpoint into X copies them again;
- the arrays a plan leaves in place keep their record and their crc32c, which go into the new
  manifest unchanged: a reader checks them as any other array's (every byte against its crc32c),
  so a slot whose bytes went stale can never be loaded;
- on opening a store generation only the committed slot's records are known (its manifest's
  fingerprints, its every byte validated by the open); every other slot's are unknown, since a
  checkpoint into it may have been cut short by a crash after its previous manifest was written.

A replica store (``given``: the sender's fingerprints and crc32c) compares both: an array is left
in place only when the slot's record has the sender's fingerprint *and* crc32c under the same
keys, so a receiver that restarted, or whose slot was damaged, needs every array again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

from ..native import _native
from ..persist.layout import ArrayEntry, Layout, Manifest
from ..persist.recovery import read_manifest, read_store
from . import write_watch
from .incremental import _FP_THREADS, CellPlan, ChangeHistory, _fingerprint, _stream, new_keys
from .threads import started_pool

__all__ = ["SlotRecords", "Given"]


@dataclass(frozen=True)
class Given:
    """What a replica's sender says of its arrays: fingerprints (None: unknown) under ``keys``,
    and crc32c, one per array of the layout, in order."""

    keys: tuple[int, int] | None
    fps: tuple[tuple[int, int] | None, ...]
    crcs: tuple[int, ...]


@dataclass
class _Record:
    """What one slot holds: per array of ``entries`` a fingerprint (None: unknown) and crc32c."""

    entries: tuple[ArrayEntry, ...]
    keys: tuple[int, int] | None
    fps: list[tuple[int, int] | None]
    crcs: list[int]


class SlotRecords:
    """Per slot of the open generation, what it holds; plans which arrays a checkpoint copies
    (thread-safe; the Orchestrator's ``in_slot`` planner, the same calls as ``Incremental``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.keys = new_keys()
        self._slots: dict[int, _Record] = {}
        self._flights: dict[int, tuple[int, tuple[int, ...]]] = {}  # counter -> (slot, arrays written)
        self._history = ChangeHistory()  # arrays that keep changing go unfingerprinted (incremental.py)
        self._pool = started_pool(_FP_THREADS, "pccheck-fingerprint")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def reset(self, committed: Manifest | None = None, slot: int = 0) -> None:
        """A store generation was opened: only its committed checkpoint's slot (``committed``, in
        ``slot``, validated by the open) is known, from the fingerprints its manifest records."""
        with self._lock:
            self._slots, self._flights, self._history = {}, {}, ChangeHistory()
            if committed is None or committed.cells is None or committed.cells.keys is None:
                return
            if any(c != slot for c in committed.cells.cells):
                return  # a disk store's references: not this planner's slots
            self.keys = committed.cells.keys  # its fingerprints stay comparable
            self._slots[slot] = _Record(committed.arrays, committed.cells.keys, list(committed.cells.fps),
                                        list(committed.crcs))

    def reset_from(self, store_file: Any, check_word: int) -> None:
        """:meth:`reset` from an opened store file and its CHECK_ADDR word (0: no checkpoint)."""
        if not check_word or store_file is None:
            self.reset(None)
            return
        slot = _native.word_slot(check_word)
        image = read_store(store_file)
        with open(store_file, "rb", buffering=0) as f:
            self.reset(read_manifest(image, slot, f.fileno()), slot)

    def accepts(self, layout: Layout) -> bool:
        """Any layout may be written: a record of other entries is never matched (all copied)."""
        return True

    def started(self, counter: int, layout: Layout) -> None:
        """A checkpoint started; nothing is pinned before its plan."""

    def forget(self, counter: int) -> None:
        """A started checkpoint ended before its plan."""

    def plan(self, layout: Layout, counter: int, home: int, num_slots: int, slot_base: Any,
             given: Given | None = None) -> CellPlan:
        """Picks the arrays slot ``home`` lacks (fingerprinted here, or ``given`` by a replica's
        sender) and makes their records unknown until :meth:`end`. ``slot_base(s)``: the file
        offset of slot s."""
        t0 = time.perf_counter()
        if given is not None:
            if len(given.fps) != len(layout.entries) or len(given.crcs) != len(layout.entries):
                raise ValueError("given fingerprints and crc32c must match the layout's arrays")
            keys, fps = given.keys, list(given.fps)
        else:
            keys = self.keys
            with self._lock:
                skip = self._history.skip(len(layout.infos))
            fps = write_watch.fingerprints(layout.infos, keys, skip, self._pool, _fingerprint)
        fingerprint_s = time.perf_counter() - t0
        n = len(layout.entries)
        with self._lock:
            rec = self._slots.get(home)
            if rec is None or rec.entries != layout.entries or rec.keys != keys or keys is None:
                rec = self._slots[home] = _Record(layout.entries, keys, [None] * n, [0] * n)
            changed, ref_crcs = [], []
            for i, e in enumerate(layout.entries):
                same = fps[i] is not None and rec.fps[i] == fps[i] and (given is None or rec.crcs[i] == given.crcs[i])
                if given is None and fps[i] is not None:
                    self._history.compared(i, None if rec.fps[i] is None else same)
                if not e.nbytes:
                    ref_crcs.append(0)  # a zero-size array's crc32c is 0
                elif same:
                    ref_crcs.append(rec.crcs[i])  # left in place: its bytes and crc32c are the slot's
                else:
                    changed.append(i)
                    ref_crcs.append(None)
                    rec.fps[i] = None  # being written: unknown until the checkpoint ends well
            self._flights[counter] = (home, tuple(changed))
        cells = (home,) * n
        stream, extents = _stream(layout, changed, list(cells), slot_base)
        written = sum(layout.entries[i].nbytes for i in changed)
        return CellPlan(counter, tuple(changed), stream, extents, cells, tuple(fps), tuple(ref_crcs),
                        keys if keys is not None else self.keys, fingerprint_s, written,
                        sum(e.nbytes for e in layout.entries) - written)

    def end(self, plan: CellPlan, outcome: str, crcs: Sequence[int] = ()) -> None:
        """A flight ended. "committed" or "superseded" (every byte written, its commit ran): the
        written arrays' records become their fingerprints and crc32c. Any other outcome leaves
        them unknown (the bytes may be partly written)."""
        with self._lock:
            flight = self._flights.pop(plan.counter, None)
            if flight is None or outcome not in ("committed", "superseded"):
                return
            home, changed = flight
            rec = self._slots.get(home)
            if rec is None or len(crcs) != len(rec.fps):
                return
            self._history.written(plan.counter, changed, crcs)
            for i in changed:
                rec.fps[i], rec.crcs[i] = plan.fps[i], int(crcs[i])
