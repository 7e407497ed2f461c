"""The orchestrator: runs up to N checkpoints concurrently through one DRAM chunk pool.

Life of a checkpoint (paper §3.1, Fig. 5; FORMAT.md §4 for the commit):

1. ``start`` waits only if N checkpoints are already in flight (recorded as stall).
2. It takes a counter and a free slot, and the copy engine copies the arrays into chunks; each filled
   chunk goes to the writer threads at once. When the pool is empty the copy waits for a persisted
   chunk to come back (back-pressure); it never allocates beyond the budget.
3. ``start`` returns: the live arrays may change again (with soft copy-on-write, once ``ensure_copied``
   has returned: it finishes the copy, or stages what is left into the device reserve, see :mod:`.reserve`).
4. A background thread waits for the writers, builds the manifest with the array checksums and runs
   the native commit (barrier, CAS on CHECK_ADDR, barrier, free the replaced slot).

The orchestrator owns the store (persist/store.py): it opens it from the path, the engine options
and a retention policy (:mod:`.retention`), makes a new generation when the state outgrows the
slots, and is the one place that retires older generations.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, wait as futures_wait
from pathlib import Path
from typing import Any, Callable, Mapping

from ..errors import (ConfigError, CorruptCheckpointError, PCCheckError, SnapshotError, StorageError,
                      storage_error_from_oserror)
from ..native import _native
from ..persist.layout import Layout, build_manifest, plan
from ..persist.store import SlotStore
from .args import StartArgs
from .copy_engine import CopyEngine, abandon
from .flight import CommitInfo, Flight
from .incremental import BLOCK, Incremental, aligned, eager_end, own_prefix
from .slot_records import SlotRecords
from .slot_size import SlotSize
from .options import EngineOptions, chunk_geometry
from .reserve import Reserve, resolve_reserve, ship_chunks, stage_chunks
from .threads import started_pool
from .retention import Retention
from .stats import CheckpointStats

__all__ = ["Orchestrator", "CheckpointStats", "CommitInfo", "StartArgs", "chunk_geometry"]

log = logging.getLogger("pccheck")


def _closed_error(exc: PCCheckError) -> None:
    log.error("pccheck: error after close: %s", exc)


class Orchestrator:
    """Runs checkpoints of a mapping of arrays into the store at ``path``, which it opens (and
    locks: StoreLockedError if another writer has it) and owns."""

    def __init__(self, path: Path, layout: Layout, engine: EngineOptions, *, copy_engine: CopyEngine,
                 on_error: Callable[[PCCheckError], None], retention: Retention | None = None,
                 world_size: int = 1, rank: int = 0,
                 on_commit: Callable[[CommitInfo], None] | None = None,
                 on_finished: Callable[[CheckpointStats], None] | None = None,
                 device_reserve: int | str | None = None, pool: bool = True, populate_store: bool = False,
                 incremental: bool = False, in_slot: bool = False) -> None:
        if not engine.resolved:
            raise ConfigError(f"the orchestrator needs resolved engine options, got {engine}")
        self.engine_options = engine
        self.max_concurrent = int(engine.max_concurrent)
        self.retention = retention if retention is not None else Retention()
        # N+1 slots: N in flight plus the latest (+ the policy's: a group's global latest).
        self.num_slots = self.max_concurrent + 1 + self.retention.extra_slots
        if self.num_slots > 255:  # a slot number is one byte of CHECK_ADDR (FORMAT.md §4)
            raise ConfigError(f"max_concurrent={self.max_concurrent} needs {self.num_slots} slots here; "
                              f"at most 255 fit: lower max_concurrent")
        self.copy_engine = copy_engine
        self._on_error, self._on_commit = on_error, on_commit
        self._on_finished = on_finished  # sees every checkpoint's stats once (the online tuner)
        self._chunk_size, self._dram_budget = int(engine.chunk_size), engine.dram_budget
        self._writer_threads, self._reserve_request = int(engine.writer_threads), device_reserve
        # A populated tmpfs store (the memory tier's) is filled in place: the CPU engine copies straight
        # into the slot's mapping, the writers only checksum it: one memcpy, not two (engine.h, "In place").
        self._in_place = populate_store
        # incremental.py (``cells``: the remote tier pins them), or for the memory tier (in_slot) whole
        # slots that copy only the arrays they lack (slot_records.py). Block-aligned (FORMAT.md §14).
        self._cells: Any = SlotRecords() if in_slot else Incremental() if incremental else None
        self.cells = self._cells
        self.reserve: Reserve | None = None
        # Guards opening, growing and retiring the store's generations (start, commit threads and
        # a coordinator's thread all reach them).
        self._store_lock = threading.Lock()
        try:
            # in_slot: the continued-from checkpoint is validated at open (its kept arrays are relied
            # on); an incremental store references nothing unchecked (Incremental.reset_unchecked)
            self.store = SlotStore(path, engine.storage, world_size, rank, hold_replaced=self.retention.hold_replaced,
                                   populate=populate_store,  # tmpfs (memory tier): slots faulted in at open
                                   validate_latest=in_slot)
        except BaseException:
            copy_engine.close()
            if self._cells is not None:
                self._cells.close()  # e.g. StoreLockedError: nothing else was made, its threads go too
            raise
        self._pool = started_pool(self.max_concurrent, "pccheck-commit")
        # pool=False: the chunk pool waits for prepare() or the first start(), once the state's size is
        # final (Adam's state appears at its first step; a lazy restore should not share the memory bus).
        self.engine: Any = None
        self._pool_state_bytes = 0
        self._slot_size = SlotSize(incremental=self._cells is not None)
        try:
            if pool:
                self._make_engine(aligned(layout, self._cells is not None).data_len)
        except BaseException:
            self._pool.shutdown(wait=True)
            self.store.close()
            copy_engine.close()
            raise
        self._inflight = threading.BoundedSemaphore(self.max_concurrent)
        self._futures: set[Future] = set()
        self._lock = threading.Lock()
        # (counter, step, wall time) of the newest durable commit
        self._durable: tuple[int, int, float] | None = None
        self._copying: list[Flight] = []  # checkpoints whose copy may still read live memory
        self.skipped = 0  # checkpoints skipped by when_busy="skip"
        self.stats: deque[CheckpointStats] = deque(maxlen=10_000)
        self._closed = False

    def _make_engine(self, state_bytes: int) -> None:
        """The chunk pool and writers, sized for ``state_bytes`` of state (allocated once; again
        only if the state outgrows a default-sized pool)."""
        chunk, count = chunk_geometry(state_bytes, self._chunk_size, self._dram_budget)
        try:
            self.engine = _native.Engine(chunk, count, self._writer_threads)
        except OSError as exc:
            raise StorageError(exc.errno, f"cannot allocate the DRAM chunk pool ({count} x {chunk} bytes): "
                               f"{exc.strerror}; lower dram_budget") from None
        self._pool_state_bytes = state_bytes
        self.copy_engine.attach(self.engine)
        # The reserve is carved in chunks of the pool's size, so it follows the pool.
        self.reserve = None
        slots = resolve_reserve(self._reserve_request, self.copy_engine, state_bytes, chunk)
        if slots:
            try:
                self.reserve = Reserve(self.copy_engine, slots, chunk)
            except BaseException:
                self.copy_engine.detach()
                self.engine.close()
                raise

    @property
    def last_durable_step(self) -> int | None:
        with self._lock:
            return self._durable[1] if self._durable else None

    @property
    def last_durable_time(self) -> float | None:
        """Wall-clock time (time.time()) of the newest durable commit of this process."""
        with self._lock:
            return self._durable[2] if self._durable else None

    def slot_bytes(self, layout: Layout, metadata: Mapping[str, Any] | None, tree: Any = None,
                   epoch: int | None = None) -> int:
        """Slot capacity this layout needs: data, then the manifest with slack (slot_size.py)."""
        return self._slot_size(aligned(layout, self._cells is not None), metadata, tree, epoch)

    # -- the store -------------------------------------------------------------------------------

    def open_store(self, slot_bytes: int) -> None:
        """Opens the newest generation if its slots hold ``slot_bytes``, else makes a new one.
        Called by the front-end once the state's size is known (else by the first ``start``)."""
        with self._store_lock:
            self.store.open(self.num_slots, slot_bytes, self.retention.protected_slots())
            self._reset_cells()

    def _reset_cells(self) -> None:
        """A generation was opened: its committed checkpoint, if checked, is the base (incremental)."""
        if self._cells is not None:  # in_slot stores (SlotRecords) are validated at the open
            self._cells.reset_from(self.store.file, self.store.native.check_word,
                                   **({} if self.store.latest_checked else {"unchecked": self.store.fallback}))

    def _fit_store(self, slot_bytes: int, layout: Layout | None = None) -> None:
        """Opens the store, or moves to a new generation when the state outgrew the slots (or,
        incremental, when ``layout`` differs from the generation's: one layout per generation)."""
        if self.store.native is None:
            self.open_store(slot_bytes)
        fits = self.store.fits(self.num_slots, slot_bytes)
        if fits and (self._cells is None or layout is None or self._cells.accepts(layout)):
            return
        self._drain()  # every slot of the old generation must be settled first
        if fits and self._cells.accepts(layout):  # the flights of the other layout have ended
            return
        with self._store_lock:
            self.copy_engine.release_host()  # the old generation's mapping goes: no DMA registration may outlive it
            self.store.new_generation(self.num_slots, slot_bytes)
            self._reset_cells()

    def _fit_pool(self, state_bytes: int) -> None:
        """Makes the chunk pool if there is none yet, or remakes it when the default budget (2x
        the state) must follow a state that grew, e.g. Adam's state created at its first step."""
        if self.engine is None:
            self._make_engine(state_bytes)
        elif self._dram_budget is None and state_bytes > self._pool_state_bytes:
            self._drain()
            self.copy_engine.detach()
            self.engine.close()
            self._make_engine(state_bytes)

    def prepare(self, layout: Layout, metadata: Mapping[str, Any] | None, tree: Any = None,
                epoch: int | None = None) -> float:
        """Does now what the first ``start`` of this layout would otherwise do inside the call:
        opens the store (or a new generation the state needs) and makes (or regrows) the chunk
        pool, whose prefaulter then runs in the background. Returns the seconds it took."""
        if self._closed:
            raise ConfigError("this Checkpointer is closed")
        t0 = time.perf_counter()
        layout = aligned(layout, self._cells is not None)
        self._fit_store(self.slot_bytes(layout, metadata, tree, epoch), layout)
        self._fit_pool(layout.data_len)
        return time.perf_counter() - t0

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the store is open and the pool faulted in (False: timed out, or not prepared)."""
        if self._closed:
            raise ConfigError("this Checkpointer is closed")
        ready = self.engine is not None and self.store.native is not None
        return ready and bool(self.engine.wait_prefaulted(-1.0 if timeout is None else max(0.0, timeout)))

    def retire_if_allowed(self) -> None:
        """Deletes older store generations once the newest has a durable commit and the retention
        policy allows it: the one place that decides. Called after each commit, and by a group
        coordinator when a new global step arrives."""
        with self._store_lock:
            if self._closed:  # the LOCK may be released: another writer may own the directory
                return
            if self.store.retire_pending and self.retention.may_retire(self.store.generation):
                self.store.retire_older_generations()

    @property
    def generation(self) -> int:
        """The store generation open for writing (0 before it opens)."""
        return self.store.generation

    @property
    def storage_mode(self) -> str:
        """The write mode in use: "odirect", "mmap" or "pmem" ("closed" when not open)."""
        return self.store.mode

    def take_held(self, generation: int) -> list[int]:
        """Replaced slots of ``generation`` held for the retention policy since the last call
        (hold_replaced); none once another generation is open."""
        return self.store.take_held(generation)

    def release_slot(self, slot: int, generation: int) -> None:
        """Gives a held slot of ``generation`` back for reuse (a no-op in another generation)."""
        self.store.release_slot(slot, generation)

    def start(self, step: int, arrays: Mapping[str, Any], metadata: Mapping[str, Any] | None,
              args: StartArgs = StartArgs()) -> bool:
        """Starts one checkpoint. Returns False if it was skipped (``when_busy="skip"``). ``args``
        (:class:`StartArgs`) says when it returns (``n_eager``, ``hold``), how it is checked
        (``validate``) and what goes to its manifest and stats."""
        tree, epoch, n_eager, hold = args.tree, args.epoch, args.n_eager, args.hold
        if self._closed:
            raise ConfigError("this Checkpointer is closed")
        if hold is not None and n_eager != 0:
            raise ValueError("hold needs n_eager=0: a chunk copied early could hold bytes not final yet")
        t0 = time.perf_counter()
        # Incremental with soft copy-on-write: the fingerprint pass, the plan and the copy run on
        # the commit thread, and ensure_copied (the optimizer step's pre-hook) waits for them; the
        # eager prefix (buffers: the next forward changes them) is cloned here first.
        defer = self._cells is not None and n_eager is not None and hold is None
        if defer and n_eager:
            arrays = own_prefix(arrays, n_eager)
        layout = plan(arrays, BLOCK) if self._cells is not None else plan(arrays)
        if not self._permit():
            return False
        stall = time.perf_counter() - t0
        try:
            self._fit_store(self.slot_bytes(layout, metadata, tree, epoch), layout)
            self._fit_pool(layout.data_len)
            native = self.store.native
            counter = native.next_counter()
            t_slot = time.perf_counter()
            slot = self._acquire_slot(native)
            slot_wait = time.perf_counter() - t_slot
        except BaseException:
            self._inflight.release()
            raise
        fl = Flight(None, None, native, layout, step, counter, metadata, tree, epoch, args.validate, t0, stall,
                    cow_wait=args.cow_wait, hold=hold, extra_stats=args.extra_stats or {}, arrays=arrays,
                    expect=args.expect_crcs, slot=slot, given=args.given, on_plan=args.on_plan)
        if args.copied is not None:
            fl.copied = args.copied
        fl.slot_wait = slot_wait
        if defer:
            self._cells.started(counter, layout)  # its layout counts before its plan pins cells
            fl.planned = threading.Event()
            fl.prepare = time.perf_counter() - t0 - stall
            self._launch(fl, copying=True)
            return True
        try:
            self._begin(fl)
        except BaseException:
            native.release_slot(slot)
            self._inflight.release()
            raise
        job, src, cells = fl.job, fl.src, fl.cells
        t1 = time.perf_counter()
        try:
            if n_eager is None:
                self.copy_engine.copy(job, src)
            elif n_eager > 0 and (until := eager_end(layout, cells, n_eager)):
                self.copy_engine.copy(job, src, until)
        except BaseException:
            abandon(job, errno.EIO)
            job.wait()
            if cells is not None:
                self._cells.end(cells, "abandoned")
            native.release_slot(slot)
            self._inflight.release()
            raise
        fl.prepare = t1 - t0 - stall
        fl.blocked_copy = time.perf_counter() - t1
        if n_eager is None:
            fl.copied_s = time.perf_counter() - t0
            fl.copied.set()
        self._launch(fl, copying=n_eager is not None and hold is None)  # else: soft copy-on-write
        return True

    def _begin(self, fl: Flight) -> None:
        """The native job of ``fl``: for an incremental checkpoint, after the fingerprint pass and
        the plan (the changed arrays alone, each to a free cell). Raises with nothing pinned."""
        cells = None
        try:
            if self._cells is not None:
                extra: dict[str, Any] = {} if fl.given is None else {"given": fl.given}  # a replica's
                if isinstance(self._cells, Incremental):
                    self._cells.settle_failed(fl.native)
                    extra["known_crcs"] = fl.expect  # another tier's slot: its crc32c spare fingerprint passes
                h = self.store.header
                cells = self._cells.plan(fl.layout, fl.counter, fl.slot, h["num_slots"],
                                         lambda s: h["slots_offset"] + s * h["slot_capacity"], **extra)
                if fl.on_plan is not None:
                    fl.on_plan(cells)  # e.g. a replica asks its sender for the arrays its slot lacks
            stream = fl.layout if cells is None else cells.stream
            src = self.copy_engine.sources(fl.arrays, stream)
            job = self.engine.begin(fl.native, fl.slot, src.native, stream.data_len, zero_meta=True,
                                    in_place=self._in_place and fl.native.mode == "mmap" and cells is None,
                                    extents=cells.extents if cells is not None else [])
        except BaseException:
            if cells is not None:
                self._cells.end(cells, "abandoned")
            raise
        fl.job, fl.src, fl.cells = job, src, cells

    def _begin_deferred(self, fl: Flight) -> None:
        """:meth:`_begin` on the commit thread; a failure gives the slot back and ends the waits."""
        try:
            self._begin(fl)
        except BaseException:
            fl.native.release_slot(fl.slot)
            fl.live_done.set()
            with self._lock:
                if fl in self._copying:
                    self._copying.remove(fl)
            raise
        finally:
            fl.planned.set()

    def _launch(self, fl: Flight, *, copying: bool) -> None:
        """Hands ``fl`` to the commit thread (``copying``: ensure_copied must wait for it)."""
        if copying:
            with self._lock:
                self._copying.append(fl)
        fut = self._pool.submit(self._finish, fl)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)

    def _permit(self) -> bool:
        """Takes one of the N in-flight permits: waits for it, or with ``when_busy="skip"``
        returns False (counted in ``skipped``) if none is free."""
        if self.engine_options.when_busy == "skip":
            if not self._inflight.acquire(blocking=False):
                with self._lock:
                    self.skipped += 1
                return False
        else:
            self._inflight.acquire()
        return True

    def ensure_copied(self) -> float:
        """Soft copy-on-write: returns once no checkpoint in flight still reads live memory.
        Stages what nobody has claimed yet into the device reserve while it has room, copies the
        rest itself (this thread claims chunks too), and waits for the copy thread's chunk in
        progress. Returns the seconds it took."""
        with self._lock:
            pending = list(self._copying)
        if not pending:
            return 0.0
        t0 = time.perf_counter()
        for fl in pending:
            if fl.copied.is_set():
                continue
            w0 = time.perf_counter()
            fl.planned.wait()  # a deferred incremental plan: its fingerprint pass reads live memory
            if fl.job is None:  # its plan failed: nothing reads live memory any more
                fl.cow_wait += time.perf_counter() - w0
                continue
            try:
                if self.reserve is not None:
                    stage_chunks(fl, self.reserve, self.copy_engine)
                self.copy_engine.copy(fl.job, fl.src)  # what did not fit: straight from live memory
            except Exception:  # e.g. a device copy failed: the checkpoint fails, training goes on
                log.exception("pccheck: copying the checkpoint of step %d failed", fl.step)
                abandon(fl.job, errno.EIO)
            fl.live_done.wait()
            fl.check()  # the version check, before the update this call lets run
            fl.cow_wait += time.perf_counter() - w0
        return time.perf_counter() - t0

    def _acquire_slot(self, native: Any) -> int:
        # N+1 slots, at most N in flight plus the latest: a slot is free, unless a failed commit
        # barrier left one pending (freed by the next barrier that succeeds). No disk I/O here:
        # zeroing the slot's meta record, a 4 KiB write queued behind the previous checkpoint's
        # writes, held the training thread 50-188 ms on the GPU (bench/results/gpu/latest.json); the
        # job's first writer does it (start(): begin(..., zero_meta=True)).
        while True:
            try:
                slot = native.acquire_slot(1.0, zero_meta=False)  # the job zeroes it (start())
            except OSError as exc:
                raise storage_error_from_oserror(exc, "preparing a slot") from None
            if slot is not None:
                return slot
            with self._lock:
                busy = bool(self._futures)
            # else a slot frees up once verified, or once the group's global step moves on
            if not busy and not self.store.verifying and not self.retention.may_free_slots():
                slot = native.acquire_slot(0.0, zero_meta=False)  # one more look: one may be back now
                if slot is not None:
                    return slot
                raise StorageError(0, "no free slot: earlier commit barriers failed and no checkpoint "
                                      "in flight can free one; check the device, then reopen the store")

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _finish(self, fl: Flight) -> None:
        """The commit thread's part of one checkpoint: copy the rest, commit, record. A failure
        reaches ``on_error``; the record (stats, hooks, the in-flight permit) happens either way."""
        outcome = "failed"
        try:
            if fl.job is None:
                self._begin_deferred(fl)
            if not fl.copied.is_set():
                self._copy_rest(fl)
            won = self._commit(fl)
            outcome = "committed" if won else "superseded"
            if won:
                self._committed(fl)
        except PCCheckError as exc:
            self._on_error(exc)
        except Exception as exc:  # a bug or a device fault: still surface it through on_error
            log.exception("pccheck: unexpected error in a background checkpoint")
            self._on_error(PCCheckError(f"checkpoint of step {fl.step} failed: {exc!r}"))
        finally:
            self._record(fl, outcome)

    def _copy_rest(self, fl: Flight) -> None:
        """Copies what ``start`` left (after ``hold``, if any), ships the staged chunks, and runs the
        version check; raises (the slot given back) if the copy failed or the check did."""
        job, native, step = fl.job, fl.native, fl.step
        failure: Exception | None = None
        try:
            if fl.hold is not None:
                fl.hold.wait()  # the shadow is final (its replay is done)
            self.copy_engine.copy(job, fl.src)  # the rest, beside training
        except Exception as exc:
            abandon(job, errno.EIO)
            failure = exc
        fl.live_done.set()  # every chunk is claimed; those this thread claimed are copied
        failure = ship_chunks(fl, self.reserve, self.copy_engine, failure)
        job.wait_copied()
        problem = fl.check() if failure is None else None
        with self._lock:
            if fl in self._copying:
                self._copying.remove(fl)
        fl.copied_s = time.perf_counter() - fl.t0
        fl.copied.set()
        if failure is not None or problem:
            job.wait()
            native.release_slot(job.slot)
            if failure is not None:
                raise PCCheckError(f"copying checkpoint of step {step} failed: {failure}") from failure
            raise SnapshotError(f"checkpoint of step {step} discarded: {problem}")

    def _commit(self, fl: Flight) -> bool:
        """Waits for every chunk to be written, then the native commit with the manifest (FORMAT.md
        §4). True if this checkpoint became the latest, False if a newer one already had."""
        job, native, step = fl.job, fl.native, fl.step
        job.wait()
        if job.error:
            native.release_slot(job.slot)
            code = -job.error
            raise storage_error_from_oserror(OSError(code, os.strerror(code)), f"writing checkpoint of step {step}")
        cp = fl.cells
        crcs = job.crcs if cp is None else cp.crcs(job.crcs)
        # every array's crc: the writers' for the written ones, the slot's record for those left in place
        if fl.expect is not None and dict(zip((e.name for e in fl.layout.entries), crcs)) != dict(fl.expect):
            native.release_slot(job.slot)  # never committed: the bytes written are not the ones expected
            raise CorruptCheckpointError(f"checkpoint of step {step}: bytes that do not match the crc32c expected")
        manifest = build_manifest(fl.layout, step, fl.counter, crcs, fl.metadata, tree=fl.tree,
                                  epoch=fl.epoch, cells=None if cp is None else cp.manifest_cells())
        try:
            won = native.commit(job.slot, fl.counter, step, manifest, fl.layout.data_len, fl.layout.data_len)
        except OSError as exc:
            if cp is not None:  # the word may name it now: its cells stay pinned
                self._cells.end(cp, "failed-commit", crcs)
            raise storage_error_from_oserror(exc, f"committing checkpoint of step {step}") from None
        if cp is not None:
            self._cells.end(cp, "committed" if won else "superseded", crcs)
        return won

    def _committed(self, fl: Flight) -> None:
        """After a commit that won: the on_commit hook, the durable latest, older generations."""
        if self._on_commit is not None:
            try:  # e.g. history retention: it must only enqueue, and never fail the checkpoint
                self._on_commit(CommitInfo(fl.step, fl.counter, fl.job.slot, self.store.file))
            except Exception:
                log.exception("pccheck: the on_commit hook raised; the checkpoint itself is committed")
        with self._lock:
            if self._durable is None or fl.counter > self._durable[0]:
                self._durable = (fl.counter, fl.step, time.time())
        self.store.after_commit()  # a reopened store's protected fallback is not needed now
        self.retire_if_allowed()

    def _record(self, fl: Flight, outcome: str) -> None:
        """The checkpoint's end, whatever its outcome: its events set, its stats recorded and
        handed to on_finished, its in-flight permit given back."""
        job, cp = fl.job, fl.cells
        fl.planned.set()
        fl.live_done.set()
        fl.copied.set()
        if cp is not None:  # a no-op unless it ended before its commit (its cells are free again)
            self._cells.end(cp, "abandoned")
        elif self._cells is not None:  # ended before its plan
            self._cells.forget(fl.counter)
        written = sum(e.nbytes for e in fl.layout.entries) if cp is None else cp.bytes_written
        st = CheckpointStats(
            fl.step, fl.counter, fl.layout.data_len, fl.stall, fl.blocked_copy, fl.cow_wait,
            job.copy_seconds + job.backpressure_seconds if job else 0.0, job.backpressure_seconds if job else 0.0,
            time.perf_counter() - fl.t0, outcome, fl.reserve_bytes, fl.prepare, copied_s=fl.copied_s,
            slot_wait_s=fl.slot_wait, bytes_written=written, bytes_referenced=cp.bytes_referenced if cp else 0,
            fingerprint_s=cp.fingerprint_s if cp else 0.0, **fl.extra_stats)
        self.stats.append(st)
        if self._on_finished is not None:
            try:
                self._on_finished(st)
            except Exception:
                log.exception("pccheck: the on_finished hook raised; the checkpoint is unaffected")
        self._inflight.release()

    def _drain(self) -> None:
        """Waits for every in-flight checkpoint (callers hold one in-flight permit)."""
        while True:
            with self._lock:
                pending = list(self._futures)
            if not pending:
                return
            futures_wait(pending)

    def wait(self) -> None:
        """Blocks until every started checkpoint has committed or failed."""
        self._drain()

    def close(self) -> None:
        if self._closed:
            return
        self._drain()
        self._closed = True
        self._pool.shutdown(wait=True)
        try:
            self.reserve = None  # frees the device memory
            if self.engine is not None:
                self.copy_engine.detach()
            self.copy_engine.close()
            if self.engine is not None:
                self.engine.close()  # unmaps the chunk pool
            if self._cells is not None:
                self._cells.close()
        finally:
            with self._store_lock:  # retire_if_allowed (a coordinator's thread) sees _closed first
                self.store.close()  # releases the store lock
            # The callbacks are the front-end's bound methods: dropping them breaks the cycle, so
            # a closed Checkpointer (and the model it holds) is freed without the cyclic GC.
            self._on_commit = self._on_finished = None
            self._on_error = _closed_error

