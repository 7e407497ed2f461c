"""The front-end: ``Checkpointer`` for a mapping of numpy arrays.

    ck = pccheck.Checkpointer(state, path="ckpt", interval=10, max_concurrent=2)
    for step in range(1, steps + 1):
        update(state)                 # in place
        ck.maybe_checkpoint(step)     # returns once the arrays may change again
    ck.close()                        # waits for every checkpoint in flight
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Union

import numpy as np

from .errors import ConfigError, PCCheckError, StorageError
from .orchestrator.copy_engine import CopyEngine, CpuCopyEngine
from .orchestrator.orchestrator import CheckpointStats, Orchestrator
from .persist.layout import plan
from .persist.recovery import default_path
from .persist.store import STORAGE_CHOICES, SlotStore

__all__ = ["Checkpointer", "OnError"]

log = logging.getLogger("pccheck")

OnError = Union[str, Callable[[PCCheckError], None]]


class Checkpointer:
    """Persists a mapping of numpy arrays concurrently and crash-safely (PCcheck, ASPLOS'25).

    Args:
        state: name -> numpy array (any dtype but object, any shape, any strides). The mapping
            is read at every checkpoint, so arrays may be replaced or mutated in place.
        path: store directory; default ``$PCCHECK_DIR`` or ``./checkpoints``.
        interval: ``maybe_checkpoint(step)`` checkpoints when ``step % interval == 0``.
        max_concurrent: N, checkpoints in flight at once. The store holds N+1 slots, so storage
            use is (N+1) x the state size.
        writer_threads: threads persisting chunks (2 saturates a 2-core machine).
        dram_budget: bytes of DRAM staging chunks, allocated and touched once (default 2x state).
        chunk_size: bytes per chunk (pipelining unit; a multiple of 4096).
        storage: "auto" (PMEM if libpmem says the file is on PMEM, else "ssd"), "ssd" (O_DIRECT,
            or mmap+msync where O_DIRECT is unsupported), "odirect", "mmap" or "pmem".
        on_error: what happens when a background checkpoint fails: "raise" (default: the next
            ``maybe_checkpoint``/``checkpoint``/``wait``/``close`` raises it), "log" (logged,
            training goes on), or a callable given the exception (called on the writer thread).
            In every case the last committed checkpoint stays loadable.
        metadata: JSON-serialisable dict stored with every checkpoint.
        keep_every: if set, every k-th committed checkpoint is also copied, in the background, to
            ``PATH/history/step-XXXXXX.safetensors`` (+ a JSON sidecar) for debugging history.
        max_history: keep at most this many history files (oldest deleted first; never a slot).
    """

    def __init__(self, state: Mapping[str, np.ndarray], path: str | os.PathLike[str] | None = None, *,
                 interval: int = 10, max_concurrent: int = 2, writer_threads: int = 2,
                 dram_budget: int | None = None, chunk_size: int = 64 << 20, storage: str = "auto",
                 on_error: OnError = "raise", metadata: Mapping[str, Any] | None = None,
                 keep_every: int | None = None, max_history: int | None = None,
                 copy_engine: CopyEngine | None = None) -> None:
        _check_int("interval", interval, 1)
        _check_int("max_concurrent", max_concurrent, 1, 254)
        _check_int("writer_threads", writer_threads, 1, 256)
        _check_int("chunk_size", chunk_size, 4096)
        if dram_budget is not None:
            _check_int("dram_budget", dram_budget, 4096)
        if keep_every is not None:
            _check_int("keep_every", keep_every, 1)
        if max_history is not None:
            _check_int("max_history", max_history, 1)
        if storage not in STORAGE_CHOICES:
            raise ConfigError(f"storage must be one of {', '.join(STORAGE_CHOICES)}; got {storage!r}")
        if not (on_error in ("raise", "log") or callable(on_error)):
            raise ConfigError("on_error must be 'raise', 'log' or a callable taking the exception")
        if not isinstance(state, Mapping):
            raise ConfigError(f"state must be a mapping of name -> numpy array, got {type(state).__name__}")
        self.state = state
        self.interval = interval
        self.metadata = _check_metadata(metadata)
        self.path = Path(path) if path is not None else default_path()
        self._on_error_policy = on_error
        self._errors: list[PCCheckError] = []
        self._err_lock = threading.Lock()

        layout = plan(state)  # validates names and dtypes before touching the disk
        self._history = None
        if keep_every is not None:
            from .history import HistoryKeeper

            self._history = HistoryKeeper(self.path, keep_every, max_history)
        self._store = SlotStore(self.path, storage)
        try:
            self._orch = Orchestrator(self._store, layout, max_concurrent=max_concurrent,
                                      writer_threads=writer_threads, chunk_size=chunk_size,
                                      dram_budget=dram_budget, copy_engine=copy_engine or CpuCopyEngine(),
                                      on_error=self._background_error, on_commit=self._history)
            self._store.open(max_concurrent + 1, self._orch.slot_bytes(layout, self.metadata))
        except BaseException:
            if hasattr(self, "_orch"):
                self._orch.close()
            if self._history is not None:
                self._history.close()
            self._store.close()
            raise

    # -- the training loop's API -----------------------------------------------------------------

    def maybe_checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints if ``step % interval == 0``; returns whether it did.

        Returns as soon as the arrays may be mutated again (their bytes are in DRAM chunks or
        already written). Never waits for an earlier checkpoint to persist, only for a free
        in-flight permit when ``max_concurrent`` are running (recorded as ``stall_s``).
        """
        self._raise_pending()
        _check_step(step)
        if step % self.interval != 0:
            return False
        self.checkpoint(step, metadata)
        return True

    def checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> None:
        """Checkpoints now, regardless of the interval."""
        self._raise_pending()
        _check_step(step)
        meta = {**self.metadata, **_check_metadata(metadata)}
        try:
            self._orch.start(int(step), self.state, meta)
        except StorageError as exc:
            # An I/O fault while preparing the slot or a new generation: the same policy as a
            # fault in the background part of the checkpoint.
            if self._on_error_policy == "raise":
                raise
            self._background_error(exc)

    def wait(self) -> None:
        """Blocks until every checkpoint in flight has committed; raises a pending error."""
        self._orch.wait()
        self._raise_pending()

    @property
    def last_durable_step(self) -> int | None:
        """The step of the newest checkpoint known durable, or None."""
        return self._orch.last_durable_step

    @property
    def stats(self) -> list[CheckpointStats]:
        """Per-checkpoint timings (stall, copy, back-pressure, persist) of finished checkpoints."""
        return list(self._orch.stats)

    @property
    def storage(self) -> str:
        """The write mode in use: "odirect", "mmap" or "pmem"."""
        return self._store.native.mode if self._store.native else "closed"

    @property
    def generation(self) -> int:
        return self._store.generation

    def close(self) -> None:
        """Waits for checkpoints in flight, stops the writers and releases the store lock."""
        try:
            self._orch.close()
        finally:
            if self._history is not None:
                self._history.close()  # finishes copies of committed checkpoints first
            self._store.close()
        self._raise_pending()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the exception in flight with a pending checkpoint error
            try:
                self.close()
            except PCCheckError as err:
                log.error("pccheck: %s (while handling %s)", err, exc_type.__name__)

    # -- errors ----------------------------------------------------------------------------------

    def _background_error(self, exc: PCCheckError) -> None:
        policy = self._on_error_policy
        if policy == "raise":
            with self._err_lock:
                self._errors.append(exc)
        elif policy == "log":
            log.error("pccheck: background checkpoint failed: %s", exc)
        else:
            try:
                policy(exc)  # type: ignore[operator]
            except Exception:
                log.exception("pccheck: the on_error callback raised")

    def _raise_pending(self) -> None:
        with self._err_lock:
            if not self._errors:
                return
            first, self._errors = self._errors[0], []
        raise first


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be an int, got {step!r} ({type(step).__name__})")


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping (a JSON object), got {type(metadata).__name__}")
    return dict(metadata)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")
