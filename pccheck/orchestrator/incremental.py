"""Incremental checkpoints: which arrays changed, and where each changed one is written.

Every slot of a store generation has the same layout, so array i sits at the same offset in
every slot: each array position has ``num_slots`` *cells*, one per slot (FORMAT.md §14). A
checkpoint's manifest names, per array, the cell holding its bytes. A checkpoint

- fingerprints every array (native ``fingerprint``: two 61-bit polynomial hashes, the bound in
  docs/ARCHITECTURE.md "Incremental checkpoints"; write_watch.py skips the read of an array the
  kernel saw no write to), except an array whose fingerprints showed a change at the last two
  checkpoints that took one: that one is written without a fingerprint (writing is always safe;
  only a reference needs equal fingerprints) until two successive writes of it have equal crc32c;
- *references* the cell of the newest committed checkpoint (the *base*) for each array whose
  fingerprint and geometry equal the base's;
- writes every other array into a *free* cell: one that neither the base nor any checkpoint in
  flight references.

Invariant (what keeps the newest committed checkpoint complete at every instant): a cell is
written only while free, and the set of pinned cells (the base's, plus every flight's from its
plan until it ends) is updated under one lock. With N in flight and N + 1 slots, at most N cells
of a position are pinned by others (the base and N - 1 flights), so one is always free; a held
checkpoint (an upload's, or a group's possible step) occupies a slot its retention keeps on top. A flight
that won its commit becomes the base; one whose commit failed keeps its cells pinned (the word on
disk may name it) until a later commit succeeds. A committed checkpoint the remote tier uploads
is *held* (:meth:`Incremental.hold`): its cells stay pinned until the upload ends, so the upload
reads the bytes its manifest names (the uploader's retention adds the slot this takes).

Invariant (one layout per generation): every checkpoint of a generation has the same entries, so
cells never overlap a manifest (all manifests lie at the same ``data_len``) nor each other; a new
layout goes to a new generation (Orchestrator.start).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..arrays import ArrayInfo
from ..errors import ConfigError, CorruptCheckpointError, StorageError
from ..native import _native
from ..persist.layout import ArrayEntry, Cells, Layout, Manifest
from ..persist.recovery import read_manifest, read_store
from . import write_watch
from .threads import started_pool

log = logging.getLogger("pccheck")

__all__ = ["CellPlan", "Incremental", "aligned", "eager_end", "own_prefix", "new_keys", "refuse_incremental", "INCREMENTAL_SUPPORTED"]

BLOCK: int = _native.BLOCK
_PRIME = 2**61 - 1
_FP_THREADS = 2  # the fingerprint pass releases the GIL; memory bandwidth bounds it beyond 2 here
# An array whose fingerprint changed at its last two fingerprinted checkpoints is written
# unfingerprinted (writing is always safe; only a reference needs equal fingerprints) while the
# crc32c its writes get anyway says it still changes: two writes of it with different crc32c had
# different bytes. Once two successive writes of it have equal crc32c (it may have stopped
# changing), it is fingerprinted again at the next checkpoint, and referenced from the one after if
# it stayed unchanged. When every array changes at every step, no fingerprint is taken after the
# first checkpoints.
_SKIP_AFTER = 2
# What incremental=True supports now; everything else is refused naming it (refuse_incremental).
INCREMENTAL_SUPPORTED = ("the disk tier (history copies included), of one process, of every rank of a "
                         "torch.distributed group (DDP, FSDP2/DTensor) or of a pccheck.dcp set, the remote tier of "
                         "one process, of a group or of a pccheck.dcp set, and the memory tier with its replicas, "
                         "with state in host (CPU) memory")


def refuse_incremental(what: str) -> ConfigError:
    """The error for a setting incremental=True does not support yet, saying what it does."""
    return ConfigError(f"incremental=True does not support {what} yet; supported now: {INCREMENTAL_SUPPORTED}. "
                       "Use incremental=False there")


def new_keys() -> tuple[int, int]:
    """Two independent fingerprint keys, uniform in [1, 2^61 - 1)."""
    return tuple(1 + int.from_bytes(os.urandom(8), "little") % (_PRIME - 1) for _ in range(2))  # type: ignore[return-value]


def _fingerprint(info: ArrayInfo, keys: tuple[int, int]) -> tuple[int, int]:
    if info.device != "cpu":
        raise ConfigError(f"incremental=True fingerprints host arrays only for now; {info.device!r} state is "
                          "not supported yet: keep incremental=False for device state")
    return tuple(_native.fingerprint(info.ptr, info.nbytes, info.itemsize, list(info.shape),  # type: ignore[return-value]
                                     list(info.strides), keys[0], keys[1]))


class ChangeHistory:
    """Which arrays a checkpoint fingerprints (the rule above ``_SKIP_AFTER``); the caller locks."""

    def __init__(self) -> None:
        # per array: how many of its last fingerprints in a row differed from the ones compared
        # (_SKIP_AFTER or more: written unfingerprinted while its crc32c say it changes)
        self._changes: dict[int, int] = {}
        # per array: (counter, crc32c) of its newest write that ended, and whether the two newest
        # had equal crc32c (it may have stopped changing: fingerprint it again)
        self._written_crc: dict[int, tuple[int, int]] = {}
        self._steady: dict[int, bool] = {}

    def skip(self, n: int) -> list[bool]:
        """Per array of ``n``: whether it goes unfingerprinted this checkpoint."""
        return [self._changes.get(i, 0) >= _SKIP_AFTER and not self._steady.get(i, False) for i in range(n)]

    def compared(self, i: int, equal: bool | None) -> None:
        """Array ``i`` was fingerprinted: equal (or not) to the fingerprint it was compared with;
        None when there was none to compare with."""
        n = self._changes.get(i, 0)
        self._changes[i] = min(n, _SKIP_AFTER - 1) if equal is None else (0 if equal else n + 1)

    def written(self, counter: int, changed: Sequence[int], crcs: Sequence[int]) -> None:
        """Checkpoint ``counter`` wrote the arrays ``changed`` with (every array's) ``crcs``."""
        for i in changed:
            last = self._written_crc.get(i)
            if last is None or last[0] < counter:  # flights may end out of order
                if last is not None:
                    self._steady[i] = last[1] == crcs[i]
                self._written_crc[i] = (counter, crcs[i])


@dataclass(frozen=True)
class _Pins:
    """The cells a checkpoint references, with what the base needs to be referenced again."""

    entries: tuple[ArrayEntry, ...]
    cells: tuple[int, ...]
    fps: tuple[tuple[int, int] | None, ...] | None  # None: a full checkpoint's (pinned, never the base)
    crcs: tuple[int, ...] | None  # None: a failed commit whose crc32c are unknown (never the base)
    counter: int


@dataclass(frozen=True)
class CellPlan:
    """One checkpoint's plan: the stream of changed arrays and where each run of it goes."""

    counter: int
    changed: tuple[int, ...]          # indices (in the full layout) of the arrays written, in stream order
    stream: Layout                    # the changed arrays, block-aligned, as the job's stream
    extents: list[tuple[int, int, int]]  # (stream offset, length, file offset), tiling the stream
    cells: tuple[int, ...]            # per array: the slot holding its bytes
    fps: tuple[tuple[int, int] | None, ...]  # None: written unfingerprinted
    ref_crcs: tuple[int | None, ...]  # per array: the base's crc32c if referenced, else None
    keys: tuple[int, int]
    fingerprint_s: float
    bytes_written: int
    bytes_referenced: int

    def manifest_cells(self) -> Cells:
        return Cells(self.cells, self.fps, self.keys)

    def crcs(self, written: Sequence[int]) -> list[int]:
        """Every array's crc32c: the job's for the written ones (stream order), the base's else."""
        out = list(self.ref_crcs)
        for i, crc in zip(self.changed, written):
            out[i] = crc
        return [0 if c is None else c for c in out]


class Incremental:
    """The pinned cells of the open generation and the base to compare against (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.keys = new_keys()
        self._base: _Pins | None = None
        self._flights: dict[int, _Pins] = {}   # counter -> a checkpoint in flight
        # counter -> a commit that failed after its CAS may have happened (the word may name it):
        # pinned until a later commit succeeds, or the base once its word is made durable (settled)
        self._zombies: dict[int, _Pins] = {}
        # counter -> on a reopen whose latest checkpoint is still being validated, that checkpoint
        # and the fallback recovery would pick if it were damaged (reset_unchecked): pinned until
        # a later commit succeeds, never the base
        self._reopened: dict[int, _Pins] = {}
        self._held: dict[int, _Pins] = {}      # counter -> a committed checkpoint an upload reads
        # counter -> the layout of a checkpoint started but not planned yet (its plan runs on the
        # commit thread): it counts for the one-layout rule before it pins anything
        self._pending: dict[int, tuple[ArrayEntry, ...]] = {}
        self._history = ChangeHistory()
        # In a group (set by the coordinator, pccheck/group/distributed.py): every commit is held
        # as it ends committed (atomically with its becoming the base: a newer commit could replace
        # the base before any later hold() ran), and on open the slots ``protected()`` names (the
        # group's step, older than this rank's newest) are held too; the coordinator releases each
        # once its step can no longer be the group's (its ``_settle_locked``).
        self.hold_commits = False
        self.protected: Any = None               # () -> slots of the open generation to hold on open
        self._pinned_on_open: dict[int, int] = {}  # counter -> step, held on open, not taken yet
        self._pool = started_pool(_FP_THREADS, "pccheck-fingerprint")  # threads.py says why started now

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def reset(self, committed: Manifest | None = None, slot: int = 0) -> None:
        """A store generation was opened: its committed checkpoint (``committed``, in ``slot``; its
        every byte validated by the store's reopen) becomes the base, or there is none."""
        with self._lock:
            if self._flights or self._pending:
                raise RuntimeError("reset with checkpoints in flight")  # the orchestrator drains first
            # held checkpoints of the generation before are in its own file, which no write of
            # this generation touches (the uploader keeps that file from retiring meanwhile)
            self._zombies, self._reopened, self._pending, self._held = {}, {}, {}, {}
            self._base = None
            self._history = ChangeHistory()
            if committed is None:
                return
            n = len(committed.arrays)
            same_keys = committed.cells is not None and committed.cells.keys is not None
            if same_keys:
                self.keys = committed.cells.keys  # its fingerprints stay comparable
            self._base = _Pins(committed.arrays, tuple(committed.cell_of(i, slot) for i in range(n)),
                               committed.cells.fps if same_keys else (None,) * n, committed.crcs,
                               committed.counter)

    def reset_from(self, store_file: Any, check_word: int, unchecked: Sequence[int] | None = None) -> None:
        """:meth:`reset` from an opened store file and its CHECK_ADDR word (0: no checkpoint), or,
        where the store's open left its latest unchecked (``unchecked``: the fallback slots it
        keeps), :meth:`reset_unchecked`."""
        if unchecked is not None and check_word and store_file is not None:
            self.reset_unchecked(store_file, check_word, unchecked)
            return
        if not check_word or store_file is None:
            self.reset(None)
            return
        slot = _native.word_slot(check_word)
        image = read_store(store_file)
        with open(store_file, "rb", buffering=0) as f:
            self.reset(read_manifest(image, slot, f.fileno()), slot)
            self.hold_slots(image, f.fileno(), self.protected() if self.protected is not None else ())

    def reset_unchecked(self, store_file: Any, check_word: int, fallback: Sequence[int]) -> None:
        """A generation was opened whose latest checkpoint is validated in the background
        (SlotStore._verify), with ``fallback`` kept from reuse meanwhile: there is no base, so the
        next checkpoint writes every array (it never references bytes not checked yet), and the
        cells of the latest and of the fallback stay pinned until a later commit succeeds, so a
        crash before it still finds either complete. What a reopen costs is then one full
        checkpoint instead of a read of the whole state before the Checkpointer returns."""
        self.reset(None)
        image = read_store(store_file)
        with open(store_file, "rb", buffering=0) as f:
            for s in (_native.word_slot(check_word), *fallback):
                if (found := _pins_in(image, f.fileno(), s)) is not None:
                    with self._lock:
                        self._reopened[found[0].counter] = found[0]

    def hold_slots(self, image: Any, fd: int, slots: Sequence[int]) -> None:
        """Holds the cells of the committed checkpoints in ``slots`` (validated by the store's open,
        which keeps protected slots) until :meth:`release`; :meth:`take_held_on_open` says which."""
        for s in slots:
            found = _pins_in(image, fd, s)
            if found is None or found[0].fps is None:  # a full checkpoint: only its own slot, which is kept
                continue
            with self._lock:
                self._held[found[0].counter] = found[0]
                self._pinned_on_open[found[0].counter] = found[1]

    def take_held_on_open(self) -> dict[int, int]:
        """The holds :meth:`hold_slots` took (counter -> step), handed over once."""
        with self._lock:
            out, self._pinned_on_open = self._pinned_on_open, {}
        return out

    def accepts(self, layout: Layout) -> bool:
        """Whether ``layout`` may be written to the open generation (one layout per generation)."""
        with self._lock:
            known = [p.entries for p in (self._base, *self._flights.values(), *self._zombies.values(),
                                         *self._reopened.values(),
                                         *self._held.values()) if p]
            known += list(self._pending.values())
        return all(e == layout.entries for e in known)

    def started(self, counter: int, layout: Layout) -> None:
        """A checkpoint of ``layout`` started; its plan comes later (:meth:`plan` or :meth:`end`)."""
        with self._lock:
            self._pending[counter] = layout.entries

    def forget(self, counter: int) -> None:
        """A started checkpoint ended before its plan (the plan failed, or never ran)."""
        with self._lock:
            self._pending.pop(counter, None)

    def plan(self, layout: Layout, counter: int, home: int, num_slots: int, slot_base: Any,
             known_crcs: Mapping[str, int] | None = None) -> CellPlan:
        """Fingerprints the arrays (``layout.infos``), picks the referenced and the written ones
        and their cells, and pins them for ``counter`` until :meth:`end`. ``slot_base(s)``: the
        file offset of slot s. ``known_crcs`` (array name -> crc32c): the bytes' checksums, known
        before the copy (another tier's committed slot: StartArgs.expect_crcs); an array whose
        crc32c differs from the base's, or with no base, is written without a fingerprint pass:
        it changed, or nothing could reference it (the next checkpoint fingerprints it again)."""
        t0 = time.perf_counter()
        infos = layout.infos
        with self._lock:
            skip = self._history.skip(len(infos))
            if known_crcs is not None:
                # a base that changes before the lock below only makes a skipped array written
                # (always safe): a reference needs equal fingerprints, taken only where not skipped
                base_crcs = self._base.crcs if self._base is not None else None
                skip = [sk or base_crcs is None or base_crcs[i] != known_crcs.get(e.name)
                        for i, (sk, e) in enumerate(zip(skip, layout.entries))]
        fps = write_watch.fingerprints(infos, self.keys, skip, self._pool, _fingerprint)
        fingerprint_s = time.perf_counter() - t0
        with self._lock:
            self._pending.pop(counter, None)
            base = self._base
            others = [p.cells for p in (base, *self._flights.values(), *self._zombies.values(),
                                        *self._reopened.values(), *self._held.values()) if p]
            if base is not None and base.entries != layout.entries:
                raise RuntimeError("a layout other than the generation's")  # the orchestrator never plans one
            cells, changed, ref_crcs = [], [], []
            for i, e in enumerate(layout.entries):
                if fps[i] is not None:  # evidence only against a base fingerprint
                    self._history.compared(i, None if base is None or base.fps[i] is None else base.fps[i] == fps[i])
                if base is not None and fps[i] is not None and base.fps[i] == fps[i]:
                    cells.append(base.cells[i])  # unchanged: equal geometry and fingerprint
                    ref_crcs.append(base.crcs[i])
                    continue
                taken = {c[i] for c in others}
                free = [home] if home not in taken else [s for s in range(num_slots) if s not in taken]
                if not free:
                    raise StorageError(0, f"no free cell for array {e.name!r}: earlier commits failed and keep "
                                          "every cell pinned; check the device, then reopen the store")
                cells.append(free[0])
                if e.nbytes:
                    changed.append(i)
                ref_crcs.append(None if e.nbytes else 0)  # a zero-size array's crc32c is 0
            self._flights[counter] = _Pins(layout.entries, tuple(cells), tuple(fps), (), counter)
        stream, extents = _stream(layout, changed, cells, slot_base)
        written = sum(layout.entries[i].nbytes for i in changed)
        return CellPlan(counter, tuple(changed), stream, extents, tuple(cells), tuple(fps), tuple(ref_crcs),
                        self.keys, fingerprint_s, written, sum(e.nbytes for e in layout.entries) - written)

    def end(self, plan: CellPlan, outcome: str, crcs: Sequence[int] = ()) -> None:
        """A flight ended: "committed" (it is the newest durable checkpoint: the base, and failed
        commits before it are settled), "superseded" or "abandoned" (never loadable as the
        newest: its cells are free again), "failed-commit" (the word may name it: pinned until a
        later commit succeeds)."""
        with self._lock:
            self._pending.pop(plan.counter, None)
            pins = self._flights.pop(plan.counter, None)
            if pins is None:
                return
            if crcs:  # committed or superseded: the written arrays' bytes had these crc32c
                self._history.written(plan.counter, plan.changed, crcs)
            if outcome == "committed":
                self._durable_locked(_Pins(pins.entries, pins.cells, pins.fps, tuple(crcs), plan.counter))
            elif outcome == "failed-commit":
                # its data, manifest and meta record were durable before its CAS (FORMAT.md §4 step
                # 3) when only the word's barrier failed: with crcs, it can become the base (settled)
                self._zombies[plan.counter] = _Pins(pins.entries, pins.cells, pins.fps, tuple(crcs) or None,
                                                    plan.counter)

    def _durable_locked(self, done: _Pins) -> None:
        """``done`` is the newest durable checkpoint: the base; the failed commits and the
        reopened checkpoints before it are settled (their cells are free unless it names them)."""
        if self._base is None or done.counter > self._base.counter:
            self._base = done
        if self.hold_commits:
            self._held[done.counter] = done
        self._zombies = {c: z for c, z in self._zombies.items() if c > done.counter}
        self._reopened = {c: z for c, z in self._reopened.items() if c > done.counter}

    def settle_failed(self, native: Any) -> None:
        """After commits whose word barrier failed (the CAS happened in memory), persists the word
        in memory again (``native.settle_word``; the native store's acquire_slot does so only when
        no slot is free): on success the commit it names is the base, as if its commit had
        succeeded, and the cells the failed commits pinned are free. Without this N failed word
        barriers would pin every cell of a position, and no checkpoint could commit again."""
        with self._lock:
            if not self._zombies:
                return
        try:
            native.settle_word()
        except OSError as exc:  # still failing: they stay pinned, and the plan may find no free cell
            log.warning("pccheck: persisting CHECK_ADDR again failed (%s); failed commits keep their cells", exc)
            return
        with self._lock:
            z = self._zombies.get(_native.word_counter(native.check_word))
            if z is not None and z.crcs is not None:
                self._durable_locked(z)

    def hold(self, counter: int) -> bool:
        """Pins the cells of committed checkpoint ``counter`` until :meth:`release` (an upload
        reads them). False if it is no longer the base (a newer commit replaced it: its cells
        may be rewritten, and a reader of them checks every crc32c)."""
        with self._lock:
            if self._base is None or self._base.counter != counter:
                return False
            self._held[counter] = self._base
            return True

    def release(self, counter: int) -> None:
        """Ends a :meth:`hold` (a no-op if there is none)."""
        with self._lock:
            self._held.pop(counter, None)


def _pins_in(image: Any, fd: int, slot: int) -> tuple[_Pins, int] | None:
    """The pins of the committed checkpoint in ``slot`` and its step (its fingerprints None when
    it is a full one), or None when it is not loadable."""
    try:
        man = read_manifest(image, slot, fd)
    except CorruptCheckpointError:  # not loadable: nothing of it to keep
        return None
    if man is None:
        return None
    cells = tuple(man.cell_of(i, slot) for i in range(len(man.arrays)))
    return _Pins(man.arrays, cells, None if man.cells is None else man.cells.fps, man.crcs, man.counter), man.step


def aligned(layout: Layout, incremental: bool) -> Layout:
    """The layout as a store writes it: block-aligned arrays when incremental (each array's cells
    must be whole blocks, FORMAT.md §14)."""
    if not incremental or all(e.offset % BLOCK == 0 for e in layout.entries):
        return layout
    return layout.realigned(BLOCK)


def eager_end(layout: Layout, cells: CellPlan | None, n_eager: int) -> int:
    """The stream byte the eager prefix (the first ``n_eager`` arrays) ends at; 0 when none of
    them is written (an incremental checkpoint that references them all)."""
    if cells is None:
        e = layout.entries[n_eager - 1]
        return e.offset + e.nbytes
    pos = {i: k for k, i in enumerate(cells.changed)}
    ends = [cells.stream.entries[pos[i]] for i in range(n_eager) if i in pos]
    return ends[-1].offset + ends[-1].nbytes if ends else 0


def own_prefix(arrays: Mapping[str, Any], n: int) -> dict[str, Any]:
    """``arrays`` with its first ``n`` (the eager prefix: buffers, which the next forward changes)
    replaced by private copies, so a plan made later on the commit thread sees them as they are now."""
    out = {}
    for i, (name, a) in enumerate(arrays.items()):
        if i < n:
            a = a.detach().clone() if hasattr(a, "detach") else np.array(a, copy=True)
        out[name] = a
    return out


def _stream(layout: Layout, changed: list[int], cells: list[int],
            slot_base: Any) -> tuple[Layout, list[tuple[int, int, int]]]:
    """The changed arrays as one block-aligned stream (the job's data), and the extents that send
    each array's run to its cell: the array's offset in the slot its cell names. Runs that follow
    each other in the stream and in one slot share an extent, so a checkpoint that rewrites
    neighbouring arrays (every array, in full-parameter training) writes them as large O_DIRECT
    writes instead of one or more per array. Invariant (the native engine checks it): every
    extent lies inside one slot."""
    entries, infos, extents = [], [], []
    at, prev_cell = 0, None
    for i in changed:  # non-empty arrays only
        e = layout.entries[i]
        run = (e.nbytes + BLOCK - 1) // BLOCK * BLOCK
        entries.append(ArrayEntry(e.name, e.dtype, e.shape, at, e.nbytes, e.torch_dtype))
        infos.append(layout.infos[i])
        where = slot_base(cells[i]) + e.offset
        if extents and cells[i] == prev_cell and extents[-1][2] + extents[-1][1] == where:
            s0, n0, f0 = extents[-1]
            extents[-1] = (s0, n0 + run, f0)  # the stream is contiguous by construction
        else:
            extents.append((at, run, where))
        at, prev_cell = at + run, cells[i]
    return Layout(tuple(entries), at, tuple(infos)), extents
