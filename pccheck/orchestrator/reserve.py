"""Device-side soft copy-on-write: a bounded reserve beside the live arrays (PhoenixOS §4.2).

Soft copy-on-write copies a snapshot while the next forward/backward runs; the optimizer step's
pre-hook finishes whatever is left before the update mutates it. Over PCIe that wait can exceed an
iteration. With a reserve, the pre-hook instead *stages* the chunks nobody has claimed yet: it
clones their bytes into reserve slots (device to device on a GPU, at memory bandwidth, enqueued on
the training stream before the update), and the checkpoint's copy thread ships them to host chunks
from the clones while the step runs. Only what does not fit in the free slots is copied before the
step (the pre-hook waits for that part alone).

Invariants, kept by :class:`Reserve` and ``Orchestrator.ensure_copied`` / ``_finish``:

- A reserve slot holds one staged chunk from its clone until that chunk's bytes are in a host
  chunk. It is given back only after the device-to-host copy of it completed, so the next clone
  never overwrites bytes still being shipped.
- A staged chunk is claimed (``job.claim()``) before it is cloned, so no other thread copies it
  from live memory; the flight's copy thread submits (or skips) it exactly once.
- The slots are fixed when the reserve is made: staging never allocates device memory.
"""

from __future__ import annotations

import errno
import logging
import threading
from typing import Any

from ..errors import ConfigError

__all__ = ["Reserve", "resolve_reserve", "stage_chunks", "ship_chunks"]

log = logging.getLogger("pccheck")


class Reserve:
    """``slots`` chunk-sized slots of one preallocated buffer made by the copy engine."""

    def __init__(self, engine: Any, slots: int, chunk: int) -> None:
        if slots < 1:
            raise ConfigError("a device reserve needs at least one chunk-sized slot")
        self.chunk = chunk
        self.slots = slots
        self.buffer = engine.alloc_reserve(slots * chunk)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """A free slot's byte offset in :attr:`buffer`, or None when every slot holds a chunk."""
        with self._lock:
            return self._free.pop() * self.chunk if self._free else None

    def give(self, offset: int) -> None:
        """Returns a slot once its chunk's bytes are in a host chunk (see the module invariants)."""
        with self._lock:
            self._free.append(offset // self.chunk)

    def free_slots(self) -> int:
        with self._lock:
            return len(self._free)


def resolve_reserve(request: int | str | None, engine: Any, state_bytes: int, chunk: int) -> int:
    """The number of reserve slots for ``device_reserve=request``: an int is bytes (rounded down to
    whole chunks), "auto" asks the engine (a GPU engine: up to the state size, within the device's
    free memory; the CPU engine: none), None or 0 means no reserve."""
    if request is None or request == 0:
        return 0
    if request == "auto":
        nbytes = engine.auto_reserve_bytes(state_bytes, chunk)
    else:
        nbytes = int(request)
    slots = nbytes // chunk
    if slots == 0:
        log.info("pccheck: device_reserve=%r holds no whole %d-byte chunk: no reserve", request, chunk)
    else:
        log.info("pccheck: device reserve of %d chunks x %d bytes (%s engine)", slots, chunk, engine.name)
    return slots


def stage_chunks(fl: Any, reserve: Reserve, engine: Any) -> None:
    """Claims unclaimed chunks of ``fl`` and clones each into a free reserve slot, until the
    chunks or the slots run out. Runs under ``fl.lock``: the copy thread takes the staged list
    under it once every chunk is claimed, so it sees every staged chunk (the module docstring)."""
    with fl.lock:
        while (off := reserve.take()) is not None:
            k = fl.job.claim()
            if k < 0:
                reserve.give(off)
                return
            try:
                token = engine.stage(fl.job, fl.src, k, reserve, off)
            except BaseException:
                reserve.give(off)
                fl.job.skip(k, errno.EIO)
                raise
            fl.staged.append((k, off, token))
            fl.reserve_bytes += fl.job.chunk_len(k)


def ship_chunks(fl: Any, reserve: Reserve, engine: Any, failure: Exception | None) -> Exception | None:
    """Copies the chunks ensure_copied staged into the reserve to host chunks, giving each
    reserve slot back once its bytes are out; after a failure, skips them instead. Returns the
    first failure."""
    with fl.lock:  # staging holds it: once taken here, every staged chunk is listed
        staged, fl.staged = fl.staged, []
    for k, off, token in staged:
        try:
            if failure is None:
                engine.ship(fl.job, k, reserve, off, token)
            else:
                fl.job.skip(k, errno.EIO)
        except Exception as exc:  # ship skipped the chunk itself
            failure = exc
        finally:
            reserve.give(off)
    return failure
