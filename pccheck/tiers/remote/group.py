"""The remote tier in a torch.distributed group: each rank uploads its part, rank 0 commits the step.

It rides on the group's global-step agreement (pccheck/distributed.py) and its key-value store,
never on the training collectives. Keys, under ``remote/i<n>/`` (n: the how-many-th remote
Checkpointer of this process group, the same on every rank since all construct together):

    gen          the remote generation (rank 0 takes it when the Checkpointer is built)
    a/<S>        step S is announced: every rank uploads its part of S
    up, up/<i>   the announcement log (its i-th step)
    done/<S>     how many ranks uploaded their part of S;  fail/<S>: how many could not

Protocol (FORMAT.md §12.2 with world_size W > 1):

1. Rank 0 announces a globally committed step S only while S is the newest global step it has
   published: at publication, in the coordinator's publishing thread before S enters the global
   log, or later under the coordinator's publish lock if S is still the newest. So ``a/<S>``
   exists before any rank can learn of a global step newer than S.
2. A rank gives a held slot back only if its step is not announced-and-not-yet-uploaded here
   (:meth:`GroupUploader.pinned`, asked by the coordinator): by 1, the slot of an announced step
   is still held on every rank when it is announced. Each rank uploads its data object from that
   slot, PUTs its part ``parts/g<G>/s<S>/rank-<r>.json`` create-only, and adds 1 to ``done/<S>``
   (or to ``fail/<S>``).
3. Rank 0 waits for W parts (or a failure), reads them, writes the step manifest (create-only:
   the commit), then moves the pointer, and sets ``committed``. One announced step is in progress
   at a time; selected global steps published meanwhile are superseded by the newest one.

incremental=True (FORMAT.md §12.8): each rank uploads only the arrays that differ from its own
part of its *base*, the newest step the group committed, and its part references the rest
(increment.py, the single-process code). Invariant (a part references only committed data): a
rank's upload of S makes a *candidate* base, adopted when the next announcement is taken only if
``committed`` names S. Rank 0 sets ``committed`` before it announces anything newer, so a rank
never references a step the group abandoned (a rank's part missing, or a commit lost), and its
base is always the newest step the group committed, which retention keeps with all it names.
Each local commit's cells are pinned (``Incremental.hold``, by the coordinator's ``on_commit``,
while it is still the disk's base) for as long as the coordinator keeps its slot: released before
it gives slots back, on the same rule (older than the global step, and not
announced-and-not-uploaded). So a held commit
pins cells only while it occupies a slot, the store's one-free-cell count holds, and an announced
step's upload reads the bytes its manifest names (the crc32c check stays: a commit the hold came
too late for is abandoned if a cell was rewritten, never uploaded torn).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Callable

from ...errors import CorruptCheckpointError, PCCheckError, RemoteError
from ...group.keys import wait_key
from ...persist.recovery import read_store
from .commit import next_generation
from .increment import RemoteBase
from .layout import MAX_MANIFEST_BYTES, manifest_key
from .objstore import NotFound
from .parts import commit_parts, part_key, put_changed_part, put_part
from .sets import SetUploader
from .upload import Cancelled, SlotRef
from .uploader import RemoteUploader, _background_priority

__all__ = ["GroupUploader", "part_key"]

log = logging.getLogger("pccheck")

_BACKOFF_MAX_S = 30.0


class GroupUploader(RemoteUploader):
    """One rank's uploader in a group. Its coordinator (``GroupCoordinator.remote``) calls
    :meth:`on_global_published` (rank 0, before publishing a global step), :meth:`pinned`
    (before giving a held slot back); the uploader calls the coordinator's
    ``announce_if_newest`` (rank 0) once an upload ends."""

    uploads_from_memory = False  # rank 0 announces what every rank uploads: the disk's committed slots

    def __init__(self, options: Any, *, on_error: Callable[[PCCheckError], None], group: Any, coord: Any) -> None:
        self.group, self._kv, self._coord = group, group.store, coord
        # the same n on every rank: each counts its own constructions (all construct together)
        self._ns = f"remote/i{group.store.add(f'remote/instances/{group.rank}', 1)}/"
        self._globals = 0                 # rank 0: global steps published so far (legacy_every)
        self._wanted: int | None = None   # rank 0: the newest selected global step not announced
        self._busy = False                # rank 0: an announced step is in progress
        self._done_steps: set[int] = set()
        self._announced: set[int] = set()  # rank 0: steps announced so far
        self._seen = 0                    # announcements this rank has taken
        self._candidate: RemoteBase | None = None  # incremental: this rank's last part, not known committed
        super().__init__(options, on_error=on_error, rank=group.rank)

    def _take_generation(self) -> int:
        key = self._ns + "gen"
        if self.group.rank == 0:
            gen = next_generation(self.store)
            self._kv.set(key, str(gen))
            return gen
        self._kv.wait([key], timedelta(seconds=600))
        return int(self._kv.get(key).decode())

    # -- the coordinator's side (rank 0 announces; every rank pins) ------------------------------

    def on_global_published(self, step: int) -> None:
        """Rank 0, in the publishing thread before ``step`` enters the global log."""
        self._globals += 1
        log.debug("pccheck: global step %d published (busy %s)", step, self._busy)
        if self._selected(step, self._globals):
            self._wanted = step
            if not self._busy:
                self._announce(step)
        self._mark_idle(step)

    def announce_newest(self, newest: int | None) -> None:
        """Rank 0, under the coordinator's publish lock: announces the wanted step if it is
        still the newest published global step (else some rank may have given its slot back).
        A step a flush forced (:meth:`flush`) is wanted once it is the newest, even if it was
        published before the flush asked for it."""
        if newest is not None and newest in self._forced and newest not in self._announced:
            self._wanted = newest
        if self._wanted is not None and not self._busy:
            if self._wanted == newest:
                self._announce(self._wanted)
            else:  # a newer (unselected) global step was published: its slot may be gone
                self._wanted = None
        self._mark_idle(newest)

    def _mark_idle(self, newest: int | None) -> None:
        """Rank 0: with nothing announced in progress, publishes that every global step up to
        ``newest`` is handled (uploaded or passed over), so the other ranks' waits may end."""
        if not self._busy and self._wanted is None and newest is not None:
            self._kv.set(self._ns + "idle", str(newest))

    def _announce(self, step: int) -> None:
        if self._stopped or self._closing:
            return
        self._busy, self._wanted = True, None
        self._announced.add(step)
        log.debug("pccheck: announcing step %d", step)
        self._kv.set(self._ns + f"a/{step}", "1")
        i = self._kv.add(self._ns + "up", 1)
        self._kv.set(self._ns + f"up/{i}", str(step))
        with self._cv:
            if self.progress.behind_since is None:
                self.progress.behind_since = time.time()

    def flush(self, deadline: float, step: int | None) -> int | None:
        """A preemption (every rank, the same ``step``): rank 0 announces ``step`` whatever
        ``every`` says, as soon as it is the newest global step (at its publication, or now if it
        is already, under the coordinator's publish lock); every rank uploads its part as for any
        announced step. Waits until rank 0 committed it or ``deadline`` (time.monotonic());
        returns the newest step committed remotely that this rank knows of."""
        if step is None:
            return self.progress.step
        with self._cv:
            self._forced.add(step)
            if self._upload_fits(deadline):
                # this rank's part of an older announced step (running, or not taken yet) would
                # delay the flush's by a whole upload: it stops at its next part and counts as
                # failed, so rank 0 abandons that step (a step lacking a part is never
                # committed) and announces the flush's; not fitting, the older one finishes
                self._supersede_below = step
        if self.group.rank == 0:
            self._coord.announce_newest()
        store_gone = False
        while True:
            if self.group.rank != 0:
                store_gone = store_gone or not self._learn_committed_or_gone()
                if store_gone:  # the job's key-value store ended with rank 0's node: ask the object store
                    self._learn_committed_remotely(step)
            with self._cv:
                p = self.progress
                if self._stopped or self._closing or (p.step is not None and p.step >= step):
                    return p.step
            if time.monotonic() >= deadline:
                return self.progress.step
            time.sleep(0.05)

    def drain(self, deadline: float) -> int | None:
        """In a group an older step commits only with every rank's part: nothing is waited for
        here (the newest step committed remotely that this rank knows of)."""
        return self.progress.step

    def pinned(self, step: int) -> bool:
        """Whether this rank must keep the slot of ``step``: announced, its part not uploaded."""
        return step not in self._done_steps and self._kv.check([self._ns + f"a/{step}"])

    def on_commit(self, info: Any) -> None:
        """Local commits queue nothing here: the announcements say what to upload (incremental:
        the coordinator pins each commit's cells while it keeps its slot)."""

    def _settle(self) -> None:
        """The coordinator owns the held slots in a group (its _settle_locked asks pinned)."""

    # -- waiting ---------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """True once every announcement so far is handled here (rank 0: and committed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cv:
                idle = self._stopped or (self._running is None and self._seen >= self._kv.add(self._ns + "up", 0)
                                         and (self.group.rank != 0 or not (self._busy or self._wanted is not None))
                                         and self._globally_published())
            if idle and self.group.rank != 0:
                self._learn_committed()
            if idle or self._closing:
                log.debug("pccheck: remote wait: idle %s (seen %d, busy %s, wanted %s, global %s, closing %s)", idle,
                          self._seen, self._busy, self._wanted, self._coord.global_step, self._closing)
                return idle
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def _learn_committed_or_gone(self) -> bool:
        """:meth:`_learn_committed`; False when the key-value store no longer answers. Under
        torchrun it lives in the node-0 agent, which exits once rank 0 has ended (after a flush,
        as soon as rank 0 committed): a rank that polls a moment later must not fail then."""
        try:
            self._learn_committed()
            return True
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            log.info("pccheck: the job's key-value store stopped answering (%s); reading the commit from the "
                     "object store", exc)
            return False

    def _learn_committed_remotely(self, step: int) -> None:
        """A rank other than 0 without the key-value store: ``step`` is committed once its step
        manifest exists in this generation (rank 0 writes it create-only: the commit, §12.2)."""
        try:
            self.store.get(manifest_key(self.generation, step), MAX_MANIFEST_BYTES)
        except (NotFound, RemoteError, OSError):  # not there (yet), or the server did not answer: not known
            return
        with self._cv:
            if self.progress.step is None or step > self.progress.step:
                self.progress.step, self.progress.time, self.progress.behind_since = step, time.time(), None

    def _learn_committed(self) -> None:
        """A rank other than 0: the newest step rank 0 committed remotely, for stats()."""
        key = self._ns + "committed"
        if self._kv.check([key]):
            step = int(self._kv.get(key).decode())
            with self._cv:
                if self.progress.step is None or step > self.progress.step:
                    self.progress.step, self.progress.time, self.progress.behind_since = step, time.time(), None

    def _globally_published(self) -> bool:
        """Whether this rank's newest local commit is known globally committed, and rank 0 has
        finished with every global step up to it (announced and handled, or passed over)."""
        mine = self._orch.last_durable_step if self._orch is not None else None
        if mine is None:
            return True
        known = self._coord.global_step
        if known is None or known < mine:
            return False
        key = self._ns + "idle"
        return self._kv.check([key]) and int(self._kv.get(key).decode()) >= mine

    # -- the upload thread -----------------------------------------------------------------------

    def _run(self) -> None:
        _background_priority()
        self._warm_pool()
        # polls (non-blocking) on the job store's shared connection, as group/distributed.py does
        while (announced := wait_key(self._kv, self._ns + f"up/{self._seen + 1}", lambda: self._closing,
                                     blocking=False)) is not None:
            step = int(announced)
            with self._cv:
                self._seen += 1
                self._running = SlotRef(self._orch.store.file, 0, 0, step)
            ok = self._upload_part(step)
            self._kv.add(self._ns + (f"done/{step}" if ok else f"fail/{step}"), 1)
            with self._cv:
                self._done_steps.add(step)
            self._coord.release_unpinned()  # this rank's slot of the step may go now
            if self.group.rank == 0:
                self._commit_group(step, ok)
            if self.group.rank != 0:
                self._learn_committed()
            with self._cv:
                self._running = None
                self._cv.notify_all()

    def _slot_of(self, step: int) -> SlotRef | None:
        """This rank's committed slot holding ``step`` (the coordinator's record), with its counter."""
        slot = self._coord.slot_of(step)
        if slot is None:
            return None
        file = self._orch.store.file
        meta = read_store(file).slots[slot].meta
        if meta is None or meta["step"] != step:
            return None
        return SlotRef(file, slot, meta["counter"], step)

    def _upload_part(self, step: int) -> bool:
        ref = self._slot_of(step)
        if ref is None:
            log.warning("pccheck: rank %d holds no slot of step %d; its remote upload is abandoned", self.rank, step)
            return False
        self._adopt_base()
        backoff = 0.5
        while not self._closing:
            try:
                t0 = time.perf_counter()
                referenced = 0
                def stop() -> bool:
                    return self._closing or self._superseded_by_flush(ref)

                if self._incremental:
                    inc = put_changed_part(self.store, ref, self.generation, self.rank, self.options.part_size,
                                           self._take_pool(), self._senders, stop, self._base, self._abort_later)
                    part, referenced, self._candidate = inc.part, inc.referenced, inc.base
                else:
                    part = put_part(self.store, ref, self.generation, self.rank, self.options.part_size,
                                    self._take_pool(), self._senders, stop, self._abort_later)
                with self._cv:
                    p = self.progress
                    p.bytes += part.size
                    p.bytes_referenced += referenced
                    p.last_bytes, p.last_referenced = part.size, referenced
                    p.upload_s += time.perf_counter() - t0
                return True
            except Cancelled:
                log.info("pccheck: rank %d: the upload of step %d gave way to a flush's newer step", self.rank, step)
                return False
            except CorruptCheckpointError as exc:
                log.warning("pccheck: rank %d: not uploading step %d: %s", self.rank, step, exc)
                return False
            except (RemoteError, OSError) as exc:
                self.progress.retries += 1
                log.warning("pccheck: rank %d: uploading step %d failed (%s); retrying in %.1f s",
                            self.rank, step, exc, backoff)
                with self._cv:
                    self._cv.wait_for(lambda: self._closing, backoff)
                backoff = min(_BACKOFF_MAX_S, backoff * 2)
            except Exception:  # a bug: the step is abandoned, training goes on
                log.exception("pccheck: rank %d: the upload of step %d failed", self.rank, step)
                return False
        return False

    def _adopt_base(self) -> None:
        """incremental: this rank's last part becomes its base if the group committed its step
        (rank 0 set ``committed`` before announcing the step this rank is about to upload); else
        the base stays the older committed step it was."""
        cand, self._candidate = self._candidate, None
        key = self._ns + "committed"
        if cand is not None and self._kv.check([key]) and int(self._kv.get(key).decode()) == cand.step:
            self._base = cand

    def _commit_group(self, step: int, mine_ok: bool) -> None:
        """Rank 0: waits for every rank's part, then writes the step manifest and the pointer."""
        w, ok = self.group.world_size, mine_ok
        while ok and not self._closing:
            if self._kv.add(self._ns + f"fail/{step}", 0):
                ok = False
            elif self._kv.add(self._ns + f"done/{step}", 0) >= w:
                break
            else:
                time.sleep(0.05)
        try:
            if ok and not self._closing:
                commit_parts(self.store, self.generation, step, w)
                self._kv.set(self._ns + "committed", str(step))  # the other ranks' stats()
                with self._cv:
                    p = self.progress
                    p.step, p.time, p.uploads, p.error = step, time.time(), p.uploads + 1, None
                    p.behind_since = None
                log.info("pccheck: step %d committed remotely by %d ranks (generation %d)", step, w, self.generation)
                if self.options.keep_last is not None or self.options.keep_every is not None:
                    self._schedule_prune()  # every rank's part is read: what any kept step names stays
            else:
                self.progress.abandoned += 1
                log.warning("pccheck: the remote upload of step %d is abandoned (a rank could not upload its part)",
                            step)
        except PCCheckError as exc:
            log.error("pccheck: %s", exc)
            with self._cv:
                self._stopped, self.progress.error = True, str(exc)
            self._on_error(exc)
        finally:
            self._busy = False
            self._coord.announce_newest()  # a selected global step published meanwhile goes next


def build_remote_tier(ctx: Any, writes: bool, member: Any = None) -> RemoteUploader | None:
    """The remote tier of ``ctx`` (a TierContext): None without a URL (or on a rank that
    writes nothing); for one rank of a set its caller pairs (``member``, pccheck.dcp), a
    SetUploader (this rank's parts; the caller's coordinator commits with a SetCommitter); in a
    group with a coordinator, a GroupUploader (each rank uploads its part, rank 0 commits the
    step; the coordinator keeps one more slot, the one uploading); else a RemoteUploader. Each
    probes the object store first (RemoteConfigError)."""
    opts = ctx.options.remote
    if opts.url is None or not writes:
        return None
    if member is not None:
        return SetUploader(opts, on_error=ctx.on_error, rank=member.rank)
    if ctx.coord is not None:
        up = GroupUploader(opts, on_error=ctx.on_error, group=ctx.group, coord=ctx.coord)
        ctx.coord.attach_remote(up)
        return up
    return RemoteUploader(opts, on_error=ctx.on_error)
