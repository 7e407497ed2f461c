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
from .parts import commit_parts, put_part
from .retention import prune
from .upload import Cancelled, SlotRef
from .uploader import RemoteUploader, _background_priority

__all__ = ["SetUploader", "SetCommitter", "check_set_options"]

log = logging.getLogger("pccheck")

_ATTEMPTS = 3  # a part's upload: tries before the save fails (backoff 0.5 s, then 1 s)
_generations: dict[str, int] = {}  # the coordinator process's generation per URL
_generations_lock = threading.Lock()


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
        self._expected: dict[int, tuple[int, Future]] = {}  # step -> (generation, its part's future)
        self._queue: deque[tuple[SlotRef, int, Future]] = deque()
        super().__init__(options, on_error=on_error, rank=rank)

    def _take_generation(self) -> None:
        return None  # the caller's coordinator takes it; each step's comes with expect()

    def expect(self, step: int, generation: int) -> Future:
        """Uploads this rank's part of ``step`` (of ``generation``) once it commits locally.
        Call before the disk checkpoint starts; returns the future of its RankPart."""
        fut: Future = Future()
        with self._cv:
            if self._closing:
                raise PCCheckError(f"the remote tier of rank {self.rank} is closed: step {step} cannot go up")
            self._expected[step] = (generation, fut)
        return fut

    def forget(self, step: int) -> None:
        """``step`` will not commit locally (superseded, or failed): nothing to upload."""
        with self._cv:
            got = self._expected.pop(step, None)
        if got is not None and not got[1].done():
            got[1].cancel()

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
            left = [fut for _, fut in self._expected.values()] + [fut for _, _, fut in self._queue]
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
                ref, generation, fut = self._queue.popleft()
                self._running = ref
            try:
                fut.set_result(self._send(ref, generation))
            except BaseException as exc:  # noqa: BLE001 - the caller's future reports every failure
                fut.set_exception(exc if isinstance(exc, PCCheckError)
                                  else PCCheckError(f"rank {self.rank}'s part of step {ref.step}: {exc!r}"))
            with self._cv:
                self._running = None
                if not self._queue:
                    self.progress.behind_since = None
                self._cv.notify_all()

    def _send(self, ref: SlotRef, generation: int) -> Any:
        """This rank's part of ``ref.step``, retried on a failed request (module invariant)."""
        backoff, attempt = 0.5, 1
        while True:
            t0 = time.perf_counter()
            try:
                part = put_part(self.store, ref, generation, self.rank, self.options.part_size, self._take_pool(),
                                self._senders, lambda: self._closing)
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
                self.progress.bytes += part.size
                self.progress.upload_s += time.perf_counter() - t0
            return part


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

    def commit(self, generation: int, step: int, world_size: int) -> None:
        """Once every rank's part of ``step`` is up: the commit (§12.7), then the retention of
        ``keep_last``/``keep_every`` (a failed pass is logged; the next commit runs another)."""
        commit_parts(self.store, generation, step, world_size)
        log.info("pccheck: save of step %d committed under %s by %d ranks (generation %d)", step, self.url,
                 world_size, generation)
        o = self.options
        if o.keep_last is not None or o.keep_every is not None:
            try:
                prune(self.store, generation, o.keep_last, o.keep_every)
            except (RemoteError, OSError) as exc:
                log.warning("pccheck: remote retention failed (%s); it runs again after the next commit", exc)
