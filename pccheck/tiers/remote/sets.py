"""The remote tier for saves whose ranks the caller pairs into sets (``pccheck.dcp.Writer``):
FORMAT.md §12.7's parts and commit, the pairing left to the caller's own coordinator.

A torch.distributed job of Checkpointers agrees on its global steps through its
GroupCoordinator, and its remote tier (:mod:`.group`) announces and commits them itself. A DCP
save is paired by DCP's planner instead: the coordinator's plan gives every rank the save's
step and the remote generation, and its ``finish`` runs once every rank's ``write_data``
returned. So the tier comes in two halves over one :class:`pccheck.RemoteOptions`:

- :class:`SetUploader`, one rank's tier in its TierStack (after the disk, its call order
  unchanged). The caller says which steps go up (:meth:`SetUploader.expect`, with the
  generation); at each such local commit (``on_commit``, no I/O) the tier's thread uploads the
  committed slot as the rank's data object and PUTs its part create-only; the future
  ``expect`` returned holds the outcome.
- :class:`SetCommitter`, the caller's coordinator: probes the store, takes the generation (one
  per URL per process), commits a step once every rank's part is up, then applies
  ``keep_last``/``keep_every`` (§12.6).

incremental=True (the disk's checkpoints reference unchanged arrays in other slots' cells,
FORMAT.md §14; §12.8 remotely): each save's plan carries a *base*, the newest step the
coordinator committed under this URL in this process (:meth:`SetCommitter.lease`). Each rank
uploads only the arrays of its checkpoint that differ from its own part of that base, read from
the cells its manifest names, and its part references the rest (increment.py, as a group's ranks
do). Invariants: a part references only its base's objects, and the base is committed (a rank
keeps the place of each part it uploaded and uses it only once the coordinator hands that step
out as a base, which it does only after committing it); the base is *leased* from the plan until
the save's ``finish`` ends it (:meth:`SetCommitter.release`), and retention keeps every leased
step and all it names, so no object a part in flight references is deleted before the step that
references it is committed (and from then on that step names it, §12.6).

Invariants: the slot a part is read from is held by the caller's retention (a DCP rank never
reuses the slot of a save newer than the newest finished one), so this tier holds no slot and
returns none; a failed request is retried ``_ATTEMPTS`` times, then the save's future fails
(the caller waits for it: a DCP save is never reported done without its part); every future
``expect`` returned ends, with a result or an error, by :meth:`SetUploader.close` at the latest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from ...errors import ConfigError, PCCheckError, RemoteConflictError, RemoteError
from .commit import next_generation
from .objstore import ObjectStore
from .increment import RemoteBase
from .parts import commit_parts, put_changed_part, put_part
from .retention import prune
from .upload import Cancelled, SlotRef
from .uploader import RemoteUploader, _background_priority

__all__ = ["SetUploader", "SetCommitter", "check_set_options"]

log = logging.getLogger("pccheck")

_ATTEMPTS = 3  # a part's upload: tries before the save fails (backoff 0.5 s, then 1 s)
_generations: dict[str, int] = {}  # the coordinator process's generation per URL
_generations_lock = threading.Lock()
_committed: dict[str, int] = {}  # the coordinator process's newest committed step per URL (incremental bases)
_leases: dict[str, dict[int, int]] = {}  # URL -> base step -> saves planned on it whose finish has not run


def check_set_options(options: Any) -> None:
    """ConfigError for RemoteOptions a set cannot follow: every save its caller hands over goes
    up (the caller numbers the steps, so ``every`` would select by a number the user never saw)."""
    if options.every != 1 or options.legacy_every is not None:
        raise ConfigError("a pccheck.dcp save is committed remotely whole, every one: remote.every must be 1 "
                          "(and remote_every unset); to upload fewer, save to s3:// less often")


class SetUploader(RemoteUploader):
    """One rank's remote tier for sets its caller pairs (see the module docstring)."""

    uploads_from_memory = False  # no memory tier on a set's rank store

    def __init__(self, options: Any, *, on_error: Callable[[PCCheckError], None], rank: int = 0) -> None:
        check_set_options(options)
        self._expected: dict[int, tuple[int, int | None, Future]] = {}  # step -> (generation, base, future)
        self._queue: deque[tuple[SlotRef, int, int | None, Future]] = deque()
        # incremental: (generation, step) -> where this rank's part of that step put each array;
        # used as a base only once the coordinator hands the step out (it committed it)
        self._uploaded: dict[tuple[int, int], RemoteBase] = {}
        super().__init__(options, on_error=on_error, rank=rank)

    def _take_generation(self) -> None:
        return None  # the caller's coordinator takes it; each step's comes with expect()

    def expect(self, step: int, generation: int, base: int | None = None) -> Future:
        """Uploads this rank's part of ``step`` (of ``generation``) once it commits locally;
        incremental, only the arrays that differ from this rank's part of ``base`` (a step the
        coordinator committed, :meth:`SetCommitter.lease`), the rest referenced. Call before the
        disk checkpoint starts; returns the future of its RankPart."""
        fut: Future = Future()
        with self._cv:
            if self._closing:
                raise PCCheckError(f"the remote tier of rank {self.rank} is closed: step {step} cannot go up")
            self._expected[step] = (generation, base, fut)
        return fut

    def forget(self, step: int) -> None:
        """``step`` will not commit locally (superseded, or failed): nothing to upload."""
        with self._cv:
            got = self._expected.pop(step, None)
        if got is not None and not got[2].done():
            got[2].cancel()

    def on_commit(self, info: Any) -> None:
        """A local commit: queued for upload if its step was expected. No I/O."""
        with self._cv:
            got = self._expected.pop(info.step, None)
            if got is None:
                return
            self._queue.append((SlotRef(info.store_file, info.slot, info.counter, info.step), *got))
            if self.progress.behind_since is None:
                self.progress.behind_since = time.time()
            self._cv.notify_all()

    def _settle(self) -> None:
        """The caller's retention holds the slots a part is read from (module invariant)."""

    def oldest_held_generation(self) -> int:
        return 1 << 62  # holds none

    def wait(self, timeout: float | None = None) -> bool:
        """True once every part queued so far is up (or failed)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and self._running is None, timeout)

    def close(self, timeout: float | None) -> bool:
        caught_up = super().close(timeout)
        with self._cv:  # never committed locally, or queued after the thread stopped: they end here
            left = [fut for _, _, fut in self._expected.values()] + [fut for _, _, _, fut in self._queue]
            self._expected.clear()
            self._queue.clear()
        for fut in left:
            if not fut.done():
                fut.set_exception(PCCheckError(f"rank {self.rank}'s remote tier closed before its part was uploaded"))
        return caught_up

    # -- the upload thread -----------------------------------------------------------------------

    def _run(self) -> None:
        _background_priority()
        self._warm_pool()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or bool(self._queue))
                if self._closing:
                    return
                ref, generation, base, fut = self._queue.popleft()
                self._running = ref
            try:
                fut.set_result(self._send(ref, generation, base))
            except BaseException as exc:  # noqa: BLE001 - the caller's future reports every failure
                fut.set_exception(exc if isinstance(exc, PCCheckError)
                                  else PCCheckError(f"rank {self.rank}'s part of step {ref.step}: {exc!r}"))
            with self._cv:
                self._running = None
                if not self._queue:
                    self.progress.behind_since = None
                self._cv.notify_all()

    def _send(self, ref: SlotRef, generation: int, base: int | None) -> Any:
        """This rank's part of ``ref.step``, retried on a failed request (module invariant)."""
        backoff, attempt = 0.5, 1
        while True:
            t0 = time.perf_counter()
            referenced = 0
            try:
                if self._incremental:
                    inc = put_changed_part(self.store, ref, generation, self.rank, self.options.part_size,
                                           self._take_pool(), self._senders, lambda: self._closing,
                                           self._base_of(generation, base))
                    part, referenced = inc.part, inc.referenced
                    self._keep_uploaded(generation, inc.base, base)
                else:
                    part = put_part(self.store, ref, generation, self.rank, self.options.part_size,
                                    self._take_pool(), self._senders, lambda: self._closing)
            except Cancelled:
                raise PCCheckError(f"rank {self.rank}'s remote tier closed while uploading step {ref.step}") from None
            except RemoteConflictError:
                raise
            except (RemoteError, OSError) as exc:
                if attempt == _ATTEMPTS:
                    raise RemoteError(f"rank {self.rank}'s part of step {ref.step} could not be uploaded to "
                                      f"{self.store.url} ({_ATTEMPTS} tries): {exc}") from exc
                self.progress.retries += 1
                log.warning("pccheck: rank %d: uploading step %d failed (%s); retrying in %.1f s", self.rank,
                            ref.step, exc, backoff)
                with self._cv:
                    self._cv.wait_for(lambda: self._closing, backoff)
                backoff, attempt = backoff * 2, attempt + 1
                continue
            with self._cv:
                p = self.progress
                p.bytes += part.size
                p.bytes_referenced += referenced
                p.last_bytes, p.last_referenced = part.size, referenced
                p.upload_s += time.perf_counter() - t0
            return part

    def _base_of(self, generation: int, base: int | None) -> RemoteBase | None:
        """This rank's part of the committed step ``base``, if it uploaded one (else None: every
        array is uploaded, as at a job's first step)."""
        if base is None:
            return None
        with self._cv:
            return self._uploaded.get((generation, base))

    def _keep_uploaded(self, generation: int, made: RemoteBase, base: int | None) -> None:
        """Records where this part put each array, and forgets the parts older than every base a
        save still to upload may name (the coordinator's bases only move forward)."""
        with self._cv:
            self._uploaded[(generation, made.step)] = made
            pending = [b for _, b, _ in self._expected.values()] + [b for _, _, b, _ in self._queue]
            floor = min([b for b in (base, *pending) if b is not None], default=None)
            if floor is not None:
                for key in [k for k in self._uploaded if k[0] != generation or k[1] < floor]:
                    del self._uploaded[key]


class SetCommitter:
    """The caller's coordinator's half: probed at construction (RemoteConfigError: bucket,
    credentials, conditional writes), then the generation and each set's commit."""

    def __init__(self, options: Any) -> None:
        check_set_options(options)
        self.options = options
        self.url: str = options.url
        self.store = ObjectStore(options.url)
        self.store.probe()

    def generation(self) -> int:
        """The coordinator's generation for this URL in this process (taken at its first save)."""
        with _generations_lock:
            if self.url not in _generations:
                _generations[self.url] = next_generation(self.store)
            return _generations[self.url]

    def lease(self) -> int | None:
        """incremental: the base of the save being planned (the newest step committed under this
        URL in this process, None before the first), kept by retention until :meth:`release`."""
        with _generations_lock:
            base = _committed.get(self.url)
            if base is not None:
                held = _leases.setdefault(self.url, {})
                held[base] = held.get(base, 0) + 1
            return base

    def release(self, base: int | None) -> None:
        """The save planned on ``base`` ended (its ``finish`` ran): the lease ends."""
        if base is None:
            return
        with _generations_lock:
            held = _leases.get(self.url, {})
            if held.get(base, 0) <= 1:
                held.pop(base, None)
            else:
                held[base] -= 1

    def commit(self, generation: int, step: int, world_size: int, base: int | None = None) -> None:
        """Once every rank's part of ``step`` is up: the commit (§12.7), then the retention of
        ``keep_last``/``keep_every`` (a failed pass is logged; the next commit runs another), which
        keeps every leased base too. ``base``: the lease of this save's plan, ended once the step
        is committed (it names what it references) or its commit failed."""
        try:
            commit_parts(self.store, generation, step, world_size)
        finally:
            self.release(base)
        with _generations_lock:
            if _committed.get(self.url, -1) < step:
                _committed[self.url] = step
            leased = tuple(_leases.get(self.url, {}))
        log.info("pccheck: save of step %d committed under %s by %d ranks (generation %d)", step, self.url,
                 world_size, generation)
        o = self.options
        if o.keep_last is not None or o.keep_every is not None:
            try:
                prune(self.store, generation, o.keep_last, o.keep_every, also_keep=leased)
            except (RemoteError, OSError) as exc:
                log.warning("pccheck: remote retention failed (%s); it runs again after the next commit", exc)
