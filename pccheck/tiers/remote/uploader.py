"""The background uploader: the local commits of steps divisible by ``RemoteOptions.every``
(or, for pccheck 0.1.0's ``remote_every=k``, every k-th one), uploaded and committed remotely.

It is a :class:`pccheck.tiers.base.Tier` after the disk (its call order; ``build_remote_tier``
builds it)::

    up = RemoteUploader(options.remote, on_error=...)   # probes the store (RemoteConfigError)
    Orchestrator(..., retention=up.retention, on_commit=...)
    up.start(orchestrator, epoch)
    up.on_commit(info)      # on the commit thread, after each local commit; only enqueues
    up.wait(timeout)        # True once every checkpoint queued so far is committed remotely
    up.close(timeout)       # waits (up to timeout), then stops; before the orchestrator closes

Invariants:

* Training never waits for the object store: ``on_commit`` does no I/O beyond giving held slots
  back (an in-memory call into the store), and the upload runs on this module's threads.
* A slot being uploaded, or queued for upload, is held from reuse (:class:`UploadRetention`:
  replaced slots are held, and given back by :meth:`RemoteUploader._settle` unless an upload
  still needs them); its store generation is not retired while it is held. One queued upload at
  most: a newer commit supersedes the queued one, whose slot is then given back.
* incremental=True (the disk's checkpoints reference unchanged arrays in other slots' cells):
  the cells of a queued or running upload are pinned too (``Incremental.hold``, taken in
  ``on_commit`` while the checkpoint is still the disk's base), and only the arrays that differ
  from the last step this uploader committed are uploaded; the rest are referenced
  (increment.py, FORMAT.md §12.8).
* A flush (:meth:`RemoteUploader.flush_from`) may upload its step from the memory tier's
  committed slot (``SlotRef.disk`` False) while the disk writes its own copy: that slot is not
  held (nothing reuses it while the flush holds the training thread; the counter and crc32c
  checks abandon the upload if it was reused), and the disk's commit of the same step queues
  no second upload of it; if the upload from the memory slot fails, the disk's slot of the step
  is uploaded instead.
* An upload given up for a flush's newer step stops taking bandwidth: its parts not sent yet are
  skipped, a part being sent is cut at its next block and not retried (objstore.py), and its
  multipart upload is aborted on a thread of its own once those parts end, so the flush's
  upload starts at once. While a flush waits, the upload threads run at normal priority (the
  training thread is held; where the process may not lower a nice value, they stay below).
* A failed request (server down, timeouts) keeps the checkpoint queued and retries with backoff
  unless a newer one supersedes it; a lost race (RemoteConflictError) stops the uploads for good
  and is reported through ``on_error``; a damaged slot is abandoned with a warning.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ... import shutdown
from ...errors import CorruptCheckpointError, PCCheckError, RemoteConflictError, RemoteError
from ...orchestrator.retention import Retention
from ...persist.files import store_generation
from .commit import advance_pointer, commit_step, next_generation
from .layout import StepManifest
from .objstore import ObjectStore
from .retention import prune
from .increment import RemoteBase, upload_changed
from .upload import BufferPool, Cancelled, SlotRef, abort_after, upload_slot

__all__ = ["RemoteUploader", "UploadRetention", "RemoteProgress"]

log = logging.getLogger("pccheck")

_BACKOFF_MAX_S = 30.0


_NICE = 10  # the upload threads yield the CPUs to training (the slot read, crc32c, HTTP, hashing)


def _background_priority() -> None:
    """Lowers this thread's scheduling priority (Linux: a thread is a task with its own nice)."""
    _set_nice(threading.get_native_id(), _NICE)


def _set_nice(tid: int, nice: int) -> None:
    """Sets thread ``tid``'s nice value; a lower one than it has needs the privilege to (else
    it stays as it is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError):  # not Linux, not permitted, or the thread ended
        pass


class UploadRetention(Retention):
    """The orchestrator's policy while a remote tier uploads: replaced slots are held (the
    uploader gives back those it does not need), one more slot per held upload (the running
    one; and the queued one when ``every`` > 1, since a commit not uploaded can replace
    it), and no generation retired while an upload reads an older one."""

    hold_replaced = True

    def __init__(self, uploader: "RemoteUploader", every: int) -> None:
        self._up = uploader
        self.extra_slots = 1 if every == 1 else 2

    def may_free_slots(self) -> bool:
        return True  # the uploader gives its slots back when their upload ends

    def may_retire(self, generation: int) -> bool:
        return self._up.oldest_held_generation() >= generation


class RemoteProgress:
    """What the remote tier reached (``Checkpointer.stats()`` reports it)."""

    def __init__(self) -> None:
        self.step: int | None = None       # newest step committed remotely by this job
        self.time: float | None = None     # time.time() of that remote commit
        self.behind_since: float | None = None  # time of the oldest local commit not remote yet
        self.uploads = self.superseded = self.abandoned = self.retries = 0
        self.bytes = 0
        self.bytes_referenced = 0  # incremental: array bytes referenced in earlier steps' objects
        self.last_bytes: int | None = None       # the last remote commit's uploaded data bytes
        self.last_referenced: int | None = None  # and the array bytes it referenced
        self.upload_s = 0.0
        self.error: str | None = None
        # (step, local commit time, remote commit time, bytes uploaded, upload seconds, bytes
        # referenced) of the last 1000 remote commits, time.time() clocks (bench/resilience/remote.py)
        self.history: deque[tuple[int, float, float, int, float, int]] = deque(maxlen=1000)

    def as_dict(self) -> dict[str, Any]:
        return {"remote_step": self.step, "remote_lag_s": (time.time() - self.behind_since)
                if self.behind_since is not None else 0.0, "remote_uploads": self.uploads,
                "remote_superseded": self.superseded, "remote_abandoned": self.abandoned,
                "remote_retries": self.retries, "remote_bytes": self.bytes,
                "remote_bytes_referenced": self.bytes_referenced, "remote_last_bytes": self.last_bytes,
                "remote_last_referenced": self.last_referenced,
                "remote_gbps": self.bytes / self.upload_s / 1e9 if self.upload_s else None,
                "remote_error": self.error}


class RemoteUploader:
    """Uploads committed local checkpoints to ``options.url`` (a RemoteOptions)."""

    name = "remote"
    after_disk = True  # fed by the disk's durable commits
    uploads_from_memory = True  # a flush may upload its step from the memory tier's slot (flush_from)

    def __init__(self, options: Any, *, on_error: Callable[[PCCheckError], None], rank: int = 0) -> None:
        self.options = options
        self.store = ObjectStore(options.url, connections=options.concurrency + 4)
        self.store.probe()  # RemoteConfigError: wrong credentials, no bucket, no conditional writes
        self.generation = self._take_generation()
        self.rank = rank
        self.retention = UploadRetention(self, options.legacy_every or options.every)
        self.progress = RemoteProgress()
        self._on_error = on_error
        self._orch: Any = None
        self._cv = threading.Condition()
        self._pending: tuple[SlotRef, float] | None = None
        self._running: SlotRef | None = None
        self._held: set[int] = set()  # replaced slots of generation _held_gen, held for us
        self._held_gen = 0
        self._newest_counter = 0  # the highest local commit counter seen by on_commit
        self._commits = 0  # legacy_every (pccheck 0.1.0's remote_every): the local commits told of so far
        self._newest_ref: SlotRef | None = None  # the durable latest local commit (flush() uploads it)
        self._forced: set[int] = set()  # steps a flush uploads whatever `every` says
        self._supersede_below: int | None = None  # a flush gave up the uploads of older steps
        self._stopped = False   # a lost race: nothing more is uploaded
        self._closing = False
        self._kick = False      # retry now instead of waiting out the backoff
        self._pool: BufferPool | None = None
        self._incremental = False  # the disk writes incremental checkpoints (start())
        self._base: RemoteBase | None = None  # incremental: the last step committed, its arrays' places
        self._cell_holds: set[int] = set()  # incremental: counters whose cells the disk keeps for us
        self._tids: set[int] = set()  # the upload thread's and the senders' (native ids)
        self._senders = ThreadPoolExecutor(options.concurrency, thread_name_prefix="pccheck-remote-part",
                                           initializer=self._background)
        # retention runs beside the uploads, not before the next one starts; one pass at a time,
        # requests made meanwhile coalesce into one more pass (_prune_queued)
        self._pruner = ThreadPoolExecutor(1, thread_name_prefix="pccheck-remote-prune",
                                          initializer=_background_priority)
        # a given-up upload's abort waits for its parts in flight here, not on the upload thread
        self._aborts = ThreadPoolExecutor(1, thread_name_prefix="pccheck-remote-abort",
                                          initializer=_background_priority)
        self._started: dict[int, float] = {}  # forced steps: time.monotonic() their upload began
        self._prune_queued = False
        self._pruning = 0  # passes submitted and not finished (wait() waits for them)
        self._thread = shutdown.thread(self._run, "pccheck-remote")
        log.info("pccheck: remote tier %s (generation %s)", options.url, self.generation)

    def _take_generation(self) -> int | None:
        """This job's generation (§12), taken before the first upload (None: given per step)."""
        return next_generation(self.store)

    def start(self, disk: Any, epoch: int | None) -> None:
        """Uploads from the slots of ``disk`` (the orchestrator whose commits it is given)."""
        self._orch = disk
        self._incremental = getattr(disk, "cells", None) is not None

    def prepare(self, layout: Any, metadata: Any, tree: Any) -> None:
        """Nothing to size: the part buffers are made (and faulted in) by the upload thread."""

    def on_step(self, step: int, snapshot: Any, metadata: Any, soft_cow: bool) -> None:
        """Nothing: the remote tier takes the disk's durable commits (on_commit), not steps."""

    def ensure_copied(self) -> None:
        """Nothing: uploads read the disk's committed slots, never live tensors."""

    def newest(self) -> dict[str, Any]:
        return {"remote": self.progress.step}

    # -- the commit thread's side ------------------------------------------------------------------

    def on_commit(self, info: Any) -> None:
        """A local commit (CommitInfo) became the durable latest: queued if its step is divisible
        by ``every`` (superseding the one queued). No I/O."""
        with self._cv:
            self._commits += 1
            # Two commit threads may call in either order after their CASes: a commit older than
            # one already seen (by counter) is no longer the durable latest and must not
            # supersede the newer one queued (its slot is already replaced).
            newer = info.counter > self._newest_counter
            self._newest_counter = max(self._newest_counter, info.counter)
            if newer:
                self._newest_ref = SlotRef(info.store_file, info.slot, info.counter, info.step)
            if newer and not self._stopped and not self._closing and self._selected(info.step, self._commits) \
                    and not self._has_step(info.step):
                if self._pending is not None:
                    self.progress.superseded += 1
                    log.info("pccheck: remote upload of step %d superseded by step %d", self._pending[0].step, info.step)
                self._pending = (SlotRef(info.store_file, info.slot, info.counter, info.step), time.time())
                self._hold_cells(info.counter)
                self._kick = True
                if self.progress.behind_since is None:
                    self.progress.behind_since = self._pending[1]
                self._cv.notify_all()
            self._settle()

    def _has_step(self, step: int) -> bool:
        """Whether ``step`` is committed remotely, or uploading or queued from another tier's
        slot (a flush's, :meth:`flush_from`): the disk's commit of it queues no second upload,
        whose create-only commit would lose to the first (lock held)."""
        p = self.progress
        if p.step is not None and p.step >= step:
            return True
        return any(r is not None and r.step == step and not r.disk
                   for r in (self._running, self._pending[0] if self._pending else None))

    def _selected(self, step: int, count: int) -> bool:
        """Whether the durable checkpoint of ``step``, the ``count``-th told of, is uploaded: its
        step divisible by ``every``; with ``legacy_every`` (pccheck 0.1.0's ``remote_every=k``,
        kept exactly for that spelling) every k-th one counted, whatever its step."""
        if step in self._forced:
            return True
        k = self.options.legacy_every
        return count % k == 0 if k is not None else step % self.options.every == 0

    def _hold_cells(self, counter: int) -> None:
        """incremental: keeps the cells of commit ``counter`` from reuse until its upload ends
        (lock held). Not possible once a newer commit replaced it: the upload then checks every
        array's crc32c as it reads, and abandons the step if a cell was rewritten."""
        if self._incremental and self._orch is not None and self._orch.cells.hold(counter):
            self._cell_holds.add(counter)

    def _settle(self) -> None:
        """Gives back the held slots and cells no upload needs (called with the lock held)."""
        orch = self._orch
        if orch is None:
            return
        need = {r.counter for r in (self._running, self._pending[0] if self._pending else None)
                if r is not None and r.disk}
        for c in sorted(self._cell_holds - need):
            self._cell_holds.discard(c)
            orch.cells.release(c)
        gen = orch.generation
        if gen != self._held_gen:  # a new generation: slot numbers start over
            self._held, self._held_gen = set(), gen
        self._held.update(orch.take_held(gen))
        keep = {r.slot for r in (self._running, self._pending[0] if self._pending else None)
                if r is not None and r.disk and store_generation(r.store_file.name) == gen}
        for s in sorted(self._held - keep):
            self._held.discard(s)
            orch.release_slot(s, gen)

    def oldest_held_generation(self) -> int:
        refs = [r for r in (self._running, self._pending[0] if self._pending else None) if r is not None and r.disk]
        gens = [store_generation(r.store_file.name) or 0 for r in refs]
        return min(gens, default=1 << 62)

    # -- waiting -----------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """True once nothing is queued or uploading (or the uploads stopped on a lost race). A
        failed upload waiting out its backoff is retried at once."""
        with self._cv:
            self._kick = True
            self._cv.notify_all()
            return self._cv.wait_for(lambda: self._stopped or (self._pending is None and self._running is None
                                                               and not self._pruning), timeout)

    def flush(self, deadline: float, step: int | None) -> int | None:
        """A preemption: the disk's durable commit of ``step`` is uploaded whatever ``every``
        says (queued now unless it is queued, uploading or committed already; its slot stays, as
        no newer commit replaces it during a flush), and waited for until ``deadline``
        (time.monotonic()). Returns the newest step committed remotely. The upload threads run at
        normal priority meanwhile (the training thread is held)."""
        self._urgent(step is not None)
        try:
            return self._flush_wait(deadline, step)
        finally:
            self._urgent(False)

    def _flush_wait(self, deadline: float, step: int | None) -> int | None:
        with self._cv:
            if step is not None:
                self._supersede_older(step, deadline)
                ref = self._newest_ref
                if ref is not None and ref.step == step:
                    self._queue_forced(ref)
            left = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            self._cv.wait_for(lambda: self._stopped or self._closing or step is None or (
                self.progress.step is not None and self.progress.step >= step) or (
                self._pending is None and self._running is None), left)
            return self.progress.step

    def flush_from(self, ref: SlotRef, deadline: float) -> None:
        """A preemption whose step ``ref.step`` lies committed in another tier's slot (the
        memory tier's, ``ref.disk`` False) before the disk holds it: its upload is queued now,
        from there, while the disk writes its own copy (:meth:`flush` then waits for it). An
        older step's upload in progress is given up if this one is expected to fit."""
        self._urgent(True)
        with self._cv:
            self._supersede_older(ref.step, deadline)
            self._queue_forced(ref)

    def upload_started(self, step: int) -> float | None:
        """time.monotonic() when the upload of ``step``, a step a flush forced, began (None: not yet)."""
        with self._cv:
            return self._started.get(step)

    def _supersede_older(self, step: int, deadline: float) -> None:
        """Marks ``step`` forced; gives up the upload in progress if it is of an older step and
        one more upload is expected to fit before ``deadline`` (else it is left to finish: the
        remote then holds a newer step than before, if not the flush's). Lock held."""
        self._forced.add(step)
        run = self._running
        if run is not None and run.step < step and self._upload_fits(deadline):
            # an older step's upload in progress would delay the flush's by a whole upload: it
            # stops reading at its next part, its abort waits for its parts in flight on the
            # abort thread, and the flush's upload starts at once
            self._supersede_below = step
            log.info("pccheck: the remote upload of step %d gives way to the flush of step %d", run.step, step)

    def _queue_forced(self, ref: SlotRef) -> None:
        """Queues the upload of ``ref`` (a flush's step) unless its step is committed, uploading
        or queued already (lock held)."""
        p = self.progress
        have = {r.step for r in (self._running, self._pending[0] if self._pending else None) if r is not None}
        if ref.step in have or (p.step is not None and p.step >= ref.step) or self._stopped or self._closing:
            return
        if self._pending is not None:
            self.progress.superseded += 1
        self._pending, self._kick = (ref, time.time()), True
        if ref.disk:
            self._hold_cells(ref.counter)
        if p.behind_since is None:
            p.behind_since = self._pending[1]
        self._settle()
        self._cv.notify_all()

    def drain(self, deadline: float) -> int | None:
        """A flush whose own step does not fit here: the upload in progress (an older step's)
        and the one queued are waited for until ``deadline`` (time.monotonic()), since they may
        still land before the machine goes. Returns the newest step committed remotely."""
        with self._cv:
            left = None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
            self._cv.wait_for(lambda: self._stopped or self._closing or (
                self._pending is None and self._running is None), left)
            return self.progress.step

    def _superseded_by_flush(self, ref: SlotRef) -> bool:
        """Whether a flush gave up ``ref``'s upload, the one in progress, for its newer step
        (the remote keeps its newest commit, as after any cut-short upload)."""
        return self._supersede_below is not None and ref.step < self._supersede_below

    def _upload_fits(self, deadline: float) -> bool:
        """Whether one more upload is expected to end before ``deadline``: the mean time of the
        uploads so far, times the flush planner's margin (preemption/planner.py, 1.25); False
        with none measured yet (giving up the upload in progress would then be a gamble)."""
        p = self.progress
        if p.bytes <= 0 or p.upload_s <= 0 or not p.last_bytes:
            return False
        return time.monotonic() + p.last_bytes / (p.bytes / p.upload_s) * 1.25 < deadline

    def close(self, timeout: float | None) -> bool:
        """Waits up to ``timeout`` for the queued upload, then stops the threads; returns whether
        everything queued was committed remotely. Idempotent."""
        caught_up = self.wait(timeout)
        if not caught_up:
            log.error("pccheck: the remote upload did not finish within %s s; the newest remotely committed step "
                      "is %s", timeout, self.progress.step)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        self._senders.shutdown(wait=True)
        self._aborts.shutdown(wait=True)  # after the senders: an abort waits for their parts
        self._pruner.shutdown(wait=True)
        with self._cv:
            self._pending = None
            self._settle()
        self._pool = None
        return caught_up

    # -- the upload thread -------------------------------------------------------------------------

    def _take_pool(self) -> BufferPool:
        """The part buffers, allocated once (first touch: about 0.6 s per 160 MiB here), on the
        upload thread when it starts, so the first upload does not wait for them."""
        if self._pool is None:
            self._pool = BufferPool(self.options.concurrency + 1, self.options.part_size)
        return self._pool

    def _warm_pool(self) -> None:
        """Allocates the part buffers ahead of the first upload; a failure here is left to that
        upload, which reports it."""
        try:
            self._take_pool()
        except MemoryError:
            log.warning("pccheck: the remote tier's part buffers could not be allocated yet")

    def _background(self) -> None:
        """The upload threads' priority: below training's (recorded, so a flush can lift it)."""
        _background_priority()
        with self._cv:
            self._tids.add(threading.get_native_id())

    def _urgent(self, on: bool) -> None:
        """During a flush the training thread is held: the upload threads take normal priority
        (where the process may lower a nice value again), and go back below training's after."""
        with self._cv:
            tids = list(self._tids)
        for tid in tids:
            _set_nice(tid, 0 if on else _NICE)

    def _run(self) -> None:
        self._background()
        self._warm_pool()
        backoff = 0.0
        while True:
            with self._cv:
                if backoff:  # cut short by a newer checkpoint, a waiter, or close
                    self._kick = False
                    self._cv.wait_for(lambda: self._closing or self._kick, backoff)
                self._cv.wait_for(lambda: self._closing or (self._pending is not None and not self._stopped))
                if self._closing or self._pending is None:
                    return
                ref, t_commit = self._pending
                self._pending, self._running = None, ref
            retry = False
            try:
                self._upload(ref, t_commit)
                backoff = 0.0
            except Cancelled:
                pass
            except RemoteConflictError as exc:
                log.error("pccheck: %s", exc)
                with self._cv:
                    self._stopped, self.progress.error = True, str(exc)
                self._on_error(exc)
            except CorruptCheckpointError as exc:
                log.warning("pccheck: not uploading step %d: %s", ref.step, exc)
                self.progress.abandoned += 1
            except (RemoteError, OSError) as exc:
                self.progress.retries += 1
                self.progress.error = str(exc)
                backoff = min(_BACKOFF_MAX_S, max(0.5, backoff * 2))
                log.warning("pccheck: uploading step %d failed (%s); retrying in %.1f s unless a newer checkpoint "
                            "supersedes it", ref.step, exc, backoff)
                retry = True
            except Exception as exc:  # a bug: report it, training goes on
                log.exception("pccheck: the remote upload of step %d failed", ref.step)
                self._on_error(PCCheckError(f"remote upload of step {ref.step} failed: {exc!r}"))
            with self._cv:
                self._running = None
                disk_ref = self._newest_ref if not ref.disk else None
                if disk_ref is not None and (disk_ref.step != ref.step or self._has_step(ref.step)):
                    disk_ref = None
                if retry and self._pending is None and not self._closing:
                    # still the newest: try it again (from the disk's slot once it holds the step)
                    self._pending = (disk_ref or ref, t_commit)
                    if disk_ref is not None:
                        self._hold_cells(disk_ref.counter)
                elif disk_ref is not None and self._pending is None and not self._closing and not self._stopped:
                    self._pending = (disk_ref, t_commit)  # the memory slot failed: the disk's copy of the step
                    self._hold_cells(disk_ref.counter)
                elif not retry:
                    self.progress.behind_since = self._pending[1] if self._pending is not None else None
                self._settle()
                self._cv.notify_all()
            if self._orch is not None:
                self._orch.retire_if_allowed()

    def _abort_later(self, store: ObjectStore, key: str, upload_id: str, futures: list[Any]) -> None:
        """upload_slot's aborter: the abort waits for the parts in flight on the abort thread,
        so the upload thread takes the next upload (a flush's) at once."""
        try:
            self._aborts.submit(abort_after, store, key, upload_id, futures)
        except RuntimeError:  # shut down (closing): abort here
            abort_after(store, key, upload_id, futures)

    def _upload(self, ref: SlotRef, t_commit: float) -> None:
        opts = self.options
        t0 = time.perf_counter()
        referenced = 0
        with self._cv:
            if ref.step in self._forced:
                self._started.setdefault(ref.step, time.monotonic())

        def stop() -> bool:
            return self._closing or self._superseded_by_flush(ref)

        if self._incremental:
            # a step read from the memory tier's slot has no cells (FORMAT.md §14): every array is
            # uploaded, and the next step references only what this one's object holds
            inc = upload_changed(self.store, ref, self.generation, self.rank, opts.part_size, self._take_pool(),
                                 self._senders, stop, self._base, self._abort_later)
            part, referenced = inc.part, inc.referenced
        else:
            part = upload_slot(self.store, ref, self.generation, self.rank, opts.part_size, self._take_pool(),
                               self._senders, stop, self._abort_later)
        commit_step(self.store, StepManifest(self.generation, ref.step, 1, time.time(), (part,)))
        if self._incremental:
            self._base = inc.base  # committed: the next step may reference what it names
        advance_pointer(self.store, self.generation, ref.step)
        with self._cv:
            p = self.progress
            p.step, p.time, p.uploads, p.error = ref.step, time.time(), p.uploads + 1, None
            p.bytes += part.size
            p.bytes_referenced += referenced
            p.last_bytes, p.last_referenced = part.size, referenced
            p.upload_s += time.perf_counter() - t0
            p.history.append((ref.step, t_commit, p.time, part.size, time.perf_counter() - t0, referenced))
        log.info("pccheck: step %d committed remotely (%s, generation %d)", ref.step, self.store.url, self.generation)
        if opts.keep_last is not None or opts.keep_every is not None:
            self._schedule_prune()

    def _schedule_prune(self) -> None:
        """Queues one retention pass on the pruner thread, unless one is already queued."""
        with self._cv:
            if self._prune_queued:
                return
            self._prune_queued = True
            self._pruning += 1
        self._pruner.submit(self._prune)

    def _prune(self) -> None:
        with self._cv:
            self._prune_queued = False  # a commit from now on queues another pass
        try:
            prune(self.store, self.generation, self.options.keep_last, self.options.keep_every)
        except (RemoteError, OSError) as exc:  # the next pass tries again; the commit stands
            log.warning("pccheck: remote retention failed (%s); it runs again after the next commit", exc)
        except Exception:  # a bug: retention stops for this pass, uploads go on
            log.exception("pccheck: remote retention failed")
        finally:
            with self._cv:
                self._pruning -= 1
                self._cv.notify_all()
