"""Waiting for a key of the job's key-value store (torch.distributed's TCPStore, FileStore, ...):
the one loop every background thread of pccheck's uses (the global-commit followers, the memory
tier's replication log, the remote tier's announcements)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

__all__ = ["wait_key"]

POLL_S = 0.01  # between two non-blocking checks, and after a wait that failed at once


def wait_key(store: Any, key: str, stopped: Callable[[], bool], *, blocking: bool = True,
             slice_s: float = 0.2) -> str | None:
    """The value of ``key`` once it is set, or None once ``stopped()`` is true.

    ``blocking``: waits in the store's server, ``slice_s`` at a time (so a stop is seen within
    one slice): the key is seen as soon as it is set, at a few requests a second. Use it on a
    connection that nobody else needs meanwhile: a TCPStore client serialises its operations.
    Else it polls with non-blocking checks ``POLL_S`` apart, never holding the connection.
    Invariant: a store that went away (every call fails at once) is retried ``POLL_S`` apart,
    never in a busy loop, until ``stopped()``."""
    if not blocking:
        while not stopped():
            try:
                if store.check([key]):
                    return store.get(key).decode()
            except Exception:  # noqa: BLE001 - a store that went away: keep looking until stopped
                pass
            time.sleep(POLL_S)
        return None
    wait = timedelta(seconds=slice_s)
    while not stopped():
        t0 = time.monotonic()
        try:
            store.wait([key], wait)
            return store.get(key).decode()
        except Exception:  # noqa: BLE001 - the slice ran out (the store raises on it), or the store went away
            if time.monotonic() - t0 < slice_s / 2:
                time.sleep(POLL_S)  # not a timeout: do not spin on a store that went away
    return None
