"""The disk tier's kept checkpoints: copies in ``PATH/history/``, made in the background.

The store keeps only N+1 slots, so old checkpoints are overwritten within N+1 commits. For
debugging a run (the paper's second use case) it helps to keep some of them. With
``disk=pccheck.DiskOptions(keep_last=m, keep_every=k)`` the tier keeps copies of its newest m
checkpoints and of every one whose ``step % k == 0`` (the rule of every tier,
pccheck.tiers.keep): each checkpoint that becomes the durable latest and that the rule may keep
(any, with ``keep_last`` != 0; else those of a step divisible by k) is copied to (pccheck
0.1.0's ``keep_every=k, max_history=m``, counted in commits, keeps its behaviour: every k-th
commit copied, the newest m copies kept; HistoryKeeper's ``legacy``)::

    PATH/history/step-XXXXXX.safetensors   the arrays (safetensors), with step, counter and metadata
                                           in its ``__metadata__``
    PATH/history/step-XXXXXX.json          sidecar: step, counter, metadata, every array's dtype

``history/`` sits beside the store file the checkpoint was committed to, so each rank of a
distributed run (``PATH/rank-<r>/``) keeps its own history and never prunes another's.

Arrays whose dtype safetensors cannot hold as stored (big-endian, structured, strings, ...) are
stored as raw bytes (``U8``); the sidecar's ``dtypes`` gives their real dtype and shape.

Invariants (what retention must never do to the store):

* It never blocks a checkpoint: the on_commit hook only enqueues (a bounded queue; when copies
  fall behind, the oldest pending one is dropped with a warning) and one background thread copies.
* It never pins a slot: the writer may reuse the slot while it is being copied. The copy is
  validated against the manifest's crc32c array by array and discarded (with a warning) if the
  slot was overwritten meanwhile, so a history file always holds exactly one checkpoint's bytes.
* ``keep_last`` deletes only history files (the oldest by modification time, beyond the newest
  m, never one of a step divisible by ``keep_every``), never a store file or slot, and never the
  file just written.
* Each file is written to a temporary name, fsynced, renamed, and the directory fsynced
  (:func:`pccheck.persist.files.write_durably`).

The store is read with the recovery readers (:func:`read_store`, :func:`read_manifest`); the
arrays are streamed through a bounded buffer rather than loaded whole (:func:`load_slot` would
allocate the whole state), so keeping history costs no more memory for a large model.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from .. import shutdown
from ..errors import ConfigError, CorruptCheckpointError
from .export import SafetensorsEntry, safetensors_dtype, safetensors_header
from ..persist.files import HISTORY_DIR, fsync_dir, write_durably
from ..persist.reader import crc32c
from ..persist.recovery import array_bases, read_manifest, read_store
from ..tiers.keep import retained

__all__ = ["HistoryKeeper", "HistoryCounts", "HISTORY_DIR", "history_files"]

log = logging.getLogger("pccheck")

_FILE_RE = re.compile(r"^step-(-?\d+)\.safetensors$")
_COPY_BUFFER = 8 << 20
SIDECAR_FORMAT = 1


@dataclass(frozen=True)
class HistoryCounts:
    """What the keeper did so far."""

    kept: int      # history files written
    skipped: int   # checkpoints not copied: the slot was overwritten first, or the store was unreadable
    dropped: int   # checkpoints dropped from a full queue before their copy started
    deleted: int   # old history files deleted by keep_last
    failed: int    # copies that failed with an error (logged)


class _Overwritten(Exception):
    """The slot no longer holds the checkpoint being copied."""


def history_files(path: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The history files of a store directory as (step, path), oldest first (by modification time)."""
    d = Path(path) / HISTORY_DIR
    out = []
    for p in d.glob("step-*.safetensors") if d.is_dir() else ():
        m = _FILE_RE.match(p.name)
        if m:
            try:
                out.append((p.stat().st_mtime_ns, int(m.group(1)), p))
            except FileNotFoundError:
                continue
    return [(step, p) for _, step, p in sorted(out)]


class HistoryKeeper:
    """Copies committed checkpoints to ``path/history`` in the background and prunes the copies.

    Call protocol (a :class:`pccheck.tiers.base.Tier` after the disk; the tier stack follows it)::

        keeper = HistoryKeeper(path, keep_last=m, keep_every=k)
        keeper(info)      # (= on_commit) on a commit thread, after each checkpoint that became the
                          # durable latest (a CommitInfo); only enqueues, returns at once, never raises
        keeper.close()    # on Checkpointer.close: finishes pending copies, joins the thread

    Args:
        path: the store directory; history goes to ``path/history`` (created on first copy), or
            rather beside the store file each commit names (``CommitInfo.store_file``).
        keep_last: keep copies of the newest m committed checkpoints (each one is copied); 0: none
            by this rule; None: a copy of every one, none deleted.
        keep_every: also keep a copy of every committed checkpoint whose ``step % k == 0``, never
            deleted; None: none by this rule.
        max_pending: copies queued at most; beyond it the oldest queued one is dropped.
        legacy: pccheck 0.1.0's ``(keep_every, max_history)``, counted in commits, instead of
            keep_last/keep_every (``DiskOptions.legacy_history``): every k-th call copies (the
            keeper counts the commits it is told of, whatever their step) and beyond m copies the
            oldest by modification time are deleted (None: none), never the file just written.
            This is what ``keep_every=k, max_history=m`` did in 0.1.0, kept exactly for that spelling.
    """

    name = "history"
    after_disk = True  # fed by the disk's durable commits

    def __init__(self, path: Path, *, keep_last: int | None = 0, keep_every: int | None = None,
                 max_pending: int = 8, legacy: tuple[int, int | None] | None = None) -> None:
        if legacy is not None:
            every_kth, most = legacy
            if every_kth < 1 or (most is not None and most < 1) or keep_last != 0 or keep_every is not None \
                    or max_pending < 1:
                raise ConfigError(f"HistoryKeeper: legacy (keep_every, max_history) must be (>= 1, >= 1 or None) "
                                  f"without keep_last/keep_every, got {legacy!r}, {keep_last!r}, {keep_every!r}")
        elif (keep_last is not None and keep_last < 0) or (keep_every is not None and keep_every < 1) \
                or max_pending < 1 or (keep_last == 0 and keep_every is None):
            raise ConfigError(f"HistoryKeeper keeps nothing or got a bad value: keep_last {keep_last!r} (>= 0 or "
                              f"None), keep_every {keep_every!r} (>= 1 or None; one of them must keep something), "
                              f"max_pending {max_pending!r} (>= 1)")
        self.path = Path(path)
        self.directory = self.path / HISTORY_DIR
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.legacy = legacy
        self._commits = 0  # legacy mode: the commits told of so far
        self._max_pending = max_pending
        self._cv = threading.Condition()
        self._pending: collections.deque[Any] = collections.deque()
        self._paused = 0
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._counts = dict(kept=0, skipped=0, dropped=0, deleted=0, failed=0)
        self._newest: int | None = None  # the newest step kept

    # -- the tier's life (pccheck.tiers.base) ---------------------------------------------------

    def start(self, disk: Any, epoch: int | None) -> None:
        """Nothing to start: the copy thread starts with the first copy."""

    def prepare(self, layout: Any, metadata: Any, tree: Any) -> None:
        """Nothing to size: each copy is written as it is read."""

    def on_step(self, step: int, snapshot: Any, metadata: Any, soft_cow: bool) -> None:
        """Nothing: the history copies the disk's durable commits (on_commit), not steps."""

    def on_commit(self, info: Any) -> None:
        self(info)

    def ensure_copied(self) -> None:
        """Nothing: copies read committed slots, never live tensors."""

    def wait(self, timeout: float | None = None) -> bool:
        return self.wait_idle(timeout)

    def flush(self, deadline: float, step: int | None) -> int | None:
        """A preemption: the copies queued (the flushed step's among them, if the rule keeps
        it) finish until ``deadline`` (time.monotonic()); returns the newest step kept."""
        self.wait_idle(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
        with self._cv:
            return self._newest

    def newest(self) -> dict[str, Any]:
        with self._cv:
            return {"history": self._newest}

    # -- the hook -------------------------------------------------------------------------------

    def __call__(self, info: Any) -> None:
        """Notes one committed checkpoint (a ``CommitInfo``); queues a copy if the rule may keep it
        (``keep_last`` != 0, or its step divisible by ``keep_every``). No I/O."""
        with self._cv:
            if self._closed:
                return
            if self.legacy is not None:
                self._commits += 1
                if self._commits % self.legacy[0]:
                    return
            elif self.keep_last == 0 and info.step % self.keep_every:
                return
            if len(self._pending) >= self._max_pending:
                old = self._pending.popleft()
                self._counts["dropped"] += 1
                log.warning("pccheck: history copies are falling behind; not keeping step %d", old.step)
            # In commit order: two commit threads may call this hook out of order (the later
            # commit's first), and the copies, their files' order and the newest kept follow the queue.
            i = len(self._pending)
            while i and self._pending[i - 1].counter > info.counter:
                i -= 1
            self._pending.insert(i, info)
            if self._thread is None:
                self._thread = shutdown.thread(self._run, "pccheck-history")
            self._cv.notify_all()

    @property
    def counts(self) -> HistoryCounts:
        with self._cv:
            return HistoryCounts(**self._counts)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Holds back copies (they queue up) for the duration, e.g. during a bandwidth-critical
        phase. Checkpoints are never affected; ``close`` resumes and drains."""
        with self._cv:
            self._paused += 1
        try:
            yield
        finally:
            with self._cv:
                self._paused = max(0, self._paused - 1)
                self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Blocks until no copy is queued or running; returns False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finishes the queued copies (even if paused) and joins the thread. Idempotent. The
        copies are local and bounded by their size: ``timeout`` is not used."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._paused = 0
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join()

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._pending and not self._paused) or (self._closed and not self._pending))
                if not self._pending:
                    return  # closed and drained
                info = self._pending.popleft()
                self._busy = True
            outcome = "failed"
            try:
                outcome = self._keep(info)
            except OSError as exc:
                log.error("pccheck: copying step %d to %s failed (%s); training is not affected. Make sure "
                          "it is a writable directory with free space.", info.step, self.directory, exc)
            except Exception:
                log.exception("pccheck: copying step %d to %s failed; training is not affected",
                              getattr(info, "step", -1), self.directory)
            finally:
                with self._cv:
                    self._counts[outcome] += 1
                    if outcome == "kept" and (self._newest is None or info.step > self._newest):
                        self._newest = info.step
                    self._busy = False
                    self._cv.notify_all()

    def _keep(self, info: Any) -> str:
        """Copies one checkpoint; returns "kept" or "skipped"."""
        store = Path(info.store_file)
        self.directory = store.parent / HISTORY_DIR
        try:
            self._copy(info, store)
        except (_Overwritten, CorruptCheckpointError, FileNotFoundError) as exc:
            log.warning("pccheck: not keeping step %d in history: %s", info.step, exc)
            return "skipped"
        self._prune(keep=self._file(info.step))
        return "kept"

    def _file(self, step: int) -> Path:
        return self.directory / f"step-{step:06d}.safetensors"

    def _copy(self, info: Any, store: Path) -> None:
        created = not self.directory.is_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_dir(self.directory.parent)  # the new directory's entry is durable
        image = read_store(store)
        meta = image.slots[info.slot].meta if info.slot < len(image.slots) else None
        if meta is None or meta["counter"] != info.counter:
            raise _Overwritten(f"slot {info.slot} of {store.name} was reused before it could be copied")
        with open(store, "rb", buffering=0) as f:
            man = read_manifest(image, info.slot, f.fileno())  # checks its crc and the meta's counter
            # each array from the cell holding it: the slot's own, or one an incremental
            # checkpoint references (FORMAT.md §14); the crc32c check below covers both
            bases = dict(zip((e.name for e in man.arrays), array_bases(image, info.slot, man)))
            entries, dtypes = [], {}
            for e in man.arrays:
                tdt = getattr(e, "torch_dtype", None)
                # Stored bytes as they are: a safetensors type only if they already are one (LE).
                st = safetensors_dtype(e.dtype, tdt) if e.dtype.byteorder != ">" else None
                shape = e.shape if st else (e.nbytes,)
                entries.append(SafetensorsEntry(e.name, st or "U8", shape, e.nbytes))
                dtypes[e.name] = {"dtype": np.lib.format.dtype_to_descr(e.dtype), "shape": list(e.shape),
                                  "stored_as": st or "U8", **({"torch_dtype": tdt} if tdt else {})}
            metadata = {"pccheck.step": str(man.step), "pccheck.counter": str(man.counter),
                        "pccheck.metadata": json.dumps(man.metadata, separators=(",", ":")),
                        "pccheck.dtypes": json.dumps(dtypes, separators=(",", ":"))}
            header, order = safetensors_header(entries, metadata)
            by_name = {e.name: (e, crc) for e, crc in zip(man.arrays, man.crcs)}

            def write(out: BinaryIO) -> None:
                out.write(header)
                for ent in order:
                    arr, want = by_name[ent.name]
                    if _stream(f.fileno(), bases[arr.name] + arr.offset, arr.nbytes, out) != want:
                        raise _Overwritten(f"array {arr.name!r} changed while it was copied "
                                           f"(slot {info.slot} was reused)")

            write_durably(self._file(man.step), write)
        sidecar = {"format": SIDECAR_FORMAT, "step": man.step, "counter": man.counter, "metadata": man.metadata,
                   "dtypes": dtypes, "source": {"store": store.name, "generation": image.generation,
                                                "slot": info.slot}}
        blob = json.dumps(sidecar, indent=1).encode("utf-8")
        write_durably(self._file(man.step).with_suffix(".json"), lambda out: out.write(blob))
        log.info("pccheck: kept step %d in %s", man.step, self._file(man.step))

    def _prune(self, keep: Path) -> None:
        most = self.legacy[1] if self.legacy is not None else self.keep_last
        if most is None:
            return
        files = history_files(self.directory.parent)[::-1]  # newest first; only history files
        if self.legacy is not None:  # 0.1.0: the oldest files beyond m go, whatever their step
            doomed = [f for f in files[::-1] if f[1] != keep][:max(0, len(files) - most)]
        else:
            stay = retained(files, lambda f: f[0], self.keep_last, self.keep_every)
            doomed = [f for f in files if f not in stay and f[1] != keep]
        removed = 0
        for f in doomed:
            f[1].unlink(missing_ok=True)
            f[1].with_suffix(".json").unlink(missing_ok=True)
            removed += 1
        if removed:
            fsync_dir(self.directory)
            with self._cv:
                self._counts["deleted"] += removed


def _stream(fd: int, off: int, n: int, out: BinaryIO) -> int:
    """Copies n bytes at off from fd to out; returns their crc32c. A short read means the file
    was truncated under us."""
    crc = 0
    buf = bytearray(min(n, _COPY_BUFFER))
    view = memoryview(buf)
    done = 0
    while done < n:
        want = min(len(buf), n - done)
        got = os.preadv(fd, [view[:want]], off + done)
        if got <= 0:
            raise CorruptCheckpointError(f"short read at offset {off + done}: the store file is truncated")
        crc = crc32c(view[:got], crc)
        out.write(view[:got])
        done += got
    return crc

