"""The pccheck exception hierarchy.

Every error pccheck raises derives from :class:`PCCheckError`. Where a built-in exception means the
same thing, the subclass also derives from it (``NoCheckpointError`` is a ``FileNotFoundError``),
so callers can catch either. Messages say what happened and what to do about it.
"""

from __future__ import annotations

import errno as _errno
import logging as _logging
import threading as _threading
from typing import Callable as _Callable

__all__ = [
    "PCCheckError",
    "NativeExtensionError",
    "ConfigError",
    "UnsupportedDtypeError",
    "PathNotWritableError",
    "StoreLockedError",
    "NoCheckpointError",
    "CorruptCheckpointError",
    "SnapshotError",
    "StorageError",
    "NoSpaceError",
    "DeviceIOError",
    "CriuError",
    "RemoteError",
    "RemoteConfigError",
    "RemoteConflictError",
    "StoppedError",
    "ReplicationError",
    "ErrorSink",
    "storage_error_from_oserror",
]


class PCCheckError(Exception):
    """Root of all pccheck errors."""


class NativeExtensionError(PCCheckError, ImportError):
    """The compiled core (pccheck.native._native) is missing or does not load."""


class ConfigError(PCCheckError, ValueError):
    """An argument is out of range or inconsistent."""


class UnsupportedDtypeError(PCCheckError, TypeError):
    """An array's dtype cannot be checkpointed (object dtypes hold pointers, not data)."""


class PathNotWritableError(PCCheckError, PermissionError):
    """The checkpoint directory cannot be created or written."""


class StoreLockedError(PCCheckError, BlockingIOError):
    """Another Checkpointer (in this or another process) is writing to the same store."""


class NoCheckpointError(PCCheckError, FileNotFoundError):
    """There is no valid checkpoint at the given path."""


class CorruptCheckpointError(PCCheckError, ValueError):
    """A store file, meta record, manifest or array failed validation."""


class SnapshotError(PCCheckError, RuntimeError):
    """A snapshot's tensors changed while they were being copied (soft copy-on-write was bypassed,
    e.g. an in-place update outside optimizer.step). That checkpoint is discarded."""


class CriuError(PCCheckError, RuntimeError):
    """Transparent mode (pccheck.transparent): CRIU is missing or unusable, or a dump or restore
    failed. The message says what to do; the last committed image is never touched."""


class StorageError(PCCheckError, OSError):
    """The storage device failed during a checkpoint. The previous checkpoint is untouched."""


class NoSpaceError(StorageError):
    """ENOSPC: the file system is full."""


class DeviceIOError(StorageError):
    """EIO: the device reported an I/O error."""


class RemoteError(PCCheckError, OSError):
    """The object store (the remote tier, pccheck.tiers.remote) failed a request. Training and
    the local store are not affected; the last remotely committed step stays loadable."""


class RemoteConfigError(RemoteError, ConfigError):
    """The object store cannot serve as the remote tier: wrong credentials, a missing bucket, or
    no conditional writes (If-None-Match / If-Match). Raised at construction."""


class RemoteConflictError(RemoteError):
    """Another writer committed this step (or a newer generation) under the same prefix first
    (a 404, 409 or 412 on a conditional write: FORMAT.md §12). This job's upload is abandoned."""


class ReplicationError(PCCheckError, ConnectionError):
    """A memory-tier replica could not be sent or received (a peer died, a timeout, damaged
    bytes). The own memory checkpoints and the disk tier are not affected; a restore falls back
    to another replica or to the disk."""


class StoppedError(PCCheckError, RuntimeError):
    """Background work (a lazy restore's loader) was stopped because the interpreter is exiting
    (pccheck.shutdown). Nothing on disk changed; load again in the next process."""


def storage_error_from_oserror(exc: OSError, doing: str) -> StorageError:
    """Maps an OSError from the native core to the matching pccheck error, keeping its errno."""
    code = exc.errno or 0
    name = _errno.errorcode.get(code, str(code))
    if code == _errno.ENOSPC:
        cls: type[StorageError] = NoSpaceError
        advice = "free space on that file system or point the Checkpointer at another path"
    elif code == _errno.EIO:
        cls = DeviceIOError
        advice = "the device reported an I/O error; check its health (dmesg) and consider another path"
    else:
        cls = StorageError
        advice = "see the OS error above"
    err = cls(code, f"{doing} failed with {name} ({exc.strerror or exc}): {advice}. "
                    "The last committed checkpoint is untouched and still loadable.")
    return err


class ErrorSink:
    """Where failures of background work go, by a Checkpointer's ``on_error`` policy: "raise"
    keeps them for the next call on the training thread (:meth:`raise_pending`), "log" logs them,
    a callable is given each (on the thread that failed). ConfigError for any other policy."""

    def __init__(self, policy: "str | _Callable[[PCCheckError], None]") -> None:
        if not (policy in ("raise", "log") or callable(policy)):
            raise ConfigError("on_error must be 'raise', 'log' or a callable taking the exception")
        self.policy = policy
        self._pending: list[PCCheckError] = []
        self._lock = _threading.Lock()

    def __call__(self, exc: PCCheckError) -> None:
        if self.policy == "raise":
            with self._lock:
                self._pending.append(exc)
        elif self.policy == "log":
            _logging.getLogger("pccheck").error("pccheck: background checkpoint failed: %s", exc)
        else:
            try:
                self.policy(exc)  # type: ignore[operator]
            except Exception:
                _logging.getLogger("pccheck").exception("pccheck: the on_error callback raised")

    def raise_pending(self) -> None:
        """Raises the oldest failure kept (and forgets the rest of them), if any."""
        with self._lock:
            if not self._pending:
                return
            first, self._pending = self._pending[0], []
        raise first

    @property
    def raises(self) -> bool:
        """Whether failures are raised on the training thread (the "raise" policy)."""
        return self.policy == "raise"
