"""The background reader of a lazy restore: the arrays of one slot, in a given order.

Each array is read (buffered ``preadv``), its crc32c checked against the manifest, and handed to
``deliver(name, array)`` on the loader thread; then its event is set. A mismatch or an I/O error
stops the loader: the error is kept and every event is set, so each waiter wakes up and raises it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np

from .. import shutdown
from ..errors import CorruptCheckpointError, PCCheckError, StoppedError
from ..persist.layout import ArrayEntry
from ..persist.reader import read_entry

__all__ = ["Loader", "read_entry"]  # read_entry: persist.reader's, looked up here (tests patch it)

log = logging.getLogger("pccheck")


class Loader:
    """Reads ``order`` (array names of ``entries``) from ``path`` at slot offset ``base``."""

    def __init__(self, path: Path, base: int, entries: Mapping[str, tuple[ArrayEntry, int]],
                 order: Iterable[str], deliver: Callable[[str, np.ndarray, bool], None], what: str,
                 target: Callable[[str], np.ndarray | None] = lambda name: None,
                 on_success: Callable[[], None] = lambda: None,
                 read: Callable[[ArrayEntry, int, np.ndarray | None], np.ndarray] | None = None) -> None:
        self.path, self.base, self.entries = path, base, entries
        self.order = list(order)
        self.deliver = deliver  # (name, array, read straight into the target?)
        self.target = target    # where to read an array directly (its destination's bytes), or None
        self.on_success = on_success  # every array read and checked (before waiters are woken)
        self.what = what  # names the checkpoint in error messages
        # reads one array, checked (entry, crc32c, into); None: from ``path`` at ``base`` (the
        # remote tier gives its ranged GETs, pccheck/tiers/remote/load.py)
        self.read = read
        self.events = {name: threading.Event() for name in self.order}
        self.error: PCCheckError | None = None
        self.finished = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._forget: Callable[[], None] = lambda: None

    def start(self) -> None:
        self._forget = shutdown.on_exit(self.stop)
        self._thread = shutdown.thread(self._run, "pccheck-lazy-load")

    def stop(self) -> None:
        """Stops loading after the array being read (at interpreter exit: nothing will use the
        model any more) and returns once the thread has ended; waiters raise StoppedError."""
        self._stopping = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            f = open(self.path, "rb", buffering=0) if self.read is None else None
            try:
                for name in self.order:
                    if self._stopping:
                        raise StoppedError(f"{self.what}: the lazy restore was stopped before {name!r} was read "
                                           "(the interpreter is exiting)")
                    into = self.target(name)
                    arr = (self.read(*self.entries[name], into) if f is None
                           else read_entry(f.fileno(), self.base, *self.entries[name], into=into))
                    self.deliver(name, arr, into is not None)
                    self.events[name].set()
            finally:
                if f is not None:
                    f.close()
            self.on_success()
        except StoppedError as exc:
            self.error = exc
            log.debug("pccheck: %s", exc)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the waiters
            self.error = self._explain(exc)
            log.error("pccheck: %s", self.error)
        finally:
            for ev in self.events.values():
                ev.set()  # waiters wake up and see `error`
            self.finished.set()
            self._forget()

    def _explain(self, exc: Exception) -> PCCheckError:
        why = str(exc) if isinstance(exc, PCCheckError) else f"{type(exc).__name__}: {exc}"
        return CorruptCheckpointError(
            f"{self.what}: {why} while restoring lazily. The model and optimizer are only partly "
            "restored: do not train on them. Load again with pccheck.load_latest(..., lazy=False), "
            "which validates every array first and falls back to the previous valid checkpoint.")

    def wait(self, names: Iterable[str]) -> None:
        """Returns once every name is in; raises the loader's error if it failed."""
        for name in names:
            self.events[name].wait()
        if self.error is not None:
            raise self.error

    def wait_all(self) -> None:
        self.finished.wait()
        if self.error is not None:
            raise self.error
