"""Copy engines: move one snapshot's bytes from live arrays into DRAM chunks.

Call protocol::

    engine.attach(native_engine)                  # once: e.g. pin the chunk pool for DMA
    # per checkpoint, on the training thread, right after the snapshot is taken:
    src = engine.sources(arrays, layout)          # describe the arrays; no copying
    job = native_engine.begin(store, slot, src.native, layout.data_len)
    engine.copy(job, src, until)                  # fill chunks up to stream byte `until` (0: all)
    # ... possibly on another thread, possibly several threads at once:
    engine.copy(job, src)                         # the rest; returns when no chunk is left to claim
    engine.detach()                               # the pool goes (at close, or remade for a grown state)
    engine.close()                                # at close: the engine's own threads stop

Chunks go to the writer threads as soon as each is filled, so persisting overlaps copying
(the paper's pipelining, §4.1). Engines claim chunks from the job one at a time, so the training
thread can help a background copy finish (soft copy-on-write). Implementations must not
allocate host memory per checkpoint.

Engines that support a reserve (``device_reserve``, see :mod:`.reserve`) also implement::

    buf = engine.alloc_reserve(nbytes)            # once, when the pool is made
    token = engine.stage(job, src, k, reserve, off)   # training thread: clone claimed chunk k
    engine.ship(job, k, reserve, off, token)      # copy thread: reserve slot -> host chunk, submit
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait as futures_wait
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from ..arrays import describe
from ..errors import ConfigError
from ..native import _native
from ..persist.layout import Layout
from .threads import started_pool

__all__ = ["CopyEngine", "CpuCopyEngine", "Sources", "ThrottledCopyEngine", "abandon", "acquire_chunk_for",
           "default_copy_threads", "filling"]


@dataclass
class Sources:
    """One snapshot's arrays as an engine sees them. ``native``: descriptors the native engine
    copies from itself, ``(ptr, offset, nbytes, itemsize, shape, strides)``; ``private``: what a
    device engine needs (byte views, a ready event)."""

    native: list[tuple]
    private: Any = None


class CopyEngine(ABC):
    """Moves array bytes into the chunk pool."""

    name: str = "abstract"
    native_engine: Any = None
    # Whether it copies an incremental checkpoint's changed arrays alone into their cells (the host
    # engines); the device engines copy whole layouts (incremental checkpoints refuse them).
    incremental: bool = False

    def attach(self, native_engine: Any) -> None:
        """Called once with the native engine whose chunk pool this engine fills."""
        self.native_engine = native_engine

    def detach(self) -> None:
        """Called once when the pool goes away (the Checkpointer closes, or the pool is remade);
        the pool's memory must not be used afterwards."""
        self.native_engine = None

    def close(self) -> None:
        """Called when the orchestrator that used this engine closes (after :meth:`detach`):
        release what the engine holds for itself (threads). A later :meth:`attach` may reuse it."""

    def release_host(self) -> None:
        """Called before the store's mapping changes (a new generation): forget any hold on
        the store's memory (a device engine's DMA registration of slots filled in place)."""

    def sources(self, arrays: Mapping[str, Any], layout: Layout) -> Sources:
        """Describes the arrays of one snapshot, on the training thread."""
        infos = layout.infos or tuple(describe(name, a) for name, a in arrays.items())
        return Sources([(info.ptr, e.offset, e.nbytes, info.itemsize, info.shape, info.strides)
                        for info, e in zip(infos, layout.entries)])

    @abstractmethod
    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        """Claims and fills chunks (up to stream byte ``until`` if > 0) and hands them to the writers."""

    # -- the reserve (device-side soft copy-on-write); engines without one refuse it ---------------

    def auto_reserve_bytes(self, state_bytes: int, chunk: int) -> int:
        """Reserve size for ``device_reserve="auto"``: none unless the engine copies from a device."""
        return 0

    def alloc_reserve(self, nbytes: int) -> Any:
        """The reserve's buffer, allocated once."""
        raise ConfigError(f"the {self.name} copy engine has no device reserve; use device_reserve=None")

    def stage(self, job: Any, src: Sources, k: int, reserve: Any, off: int) -> Any:
        """Clones the live bytes of claimed chunk ``k`` into ``reserve.buffer[off:]``; returns what
        :meth:`ship` must wait for."""
        raise ConfigError(f"the {self.name} copy engine has no device reserve")

    def ship(self, job: Any, k: int, reserve: Any, off: int, token: Any) -> None:
        """Copies staged chunk ``k`` from the reserve into a host chunk and submits it; returns once
        the reserve slot may be reused."""
        raise ConfigError(f"the {self.name} copy engine has no device reserve")


def default_copy_threads() -> int:
    """Threads the CPU engine copies with by default: 2 where the process may run on 2 CPUs or
    more (memcpy of touched pages: about 11 GB/s on one thread here, about 20 GB/s on two), else 1."""
    return min(MAX_DEFAULT_COPY_THREADS, len(os.sched_getaffinity(0)))


MAX_DEFAULT_COPY_THREADS = 2  # beyond 2, memory bandwidth, not threads, bounds the copy on most hosts


class CpuCopyEngine(CopyEngine):
    """Host memory → chunks with memcpy in native code, the GIL released.

    Non-contiguous arrays (any strides, including negative and 0) are copied run by run in C
    order; nothing is made contiguous in Python first.

    ``threads``: how many threads copy a snapshot's background rest (``copy(job, src)``): the
    calling thread and ``threads - 1`` helpers, all claiming chunks of the same job (default:
    :func:`default_copy_threads`). A bounded copy (``until``, the eager part on the training
    thread) runs on the calling thread alone.
    """

    name = "cpu"
    incremental = True

    def __init__(self, threads: int | None = None) -> None:
        threads = default_copy_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ConfigError(f"CpuCopyEngine threads must be an integer in [1, 64], got {threads!r}")
        self.threads = threads
        # Started now, before any chunk pool exists (threads.py says why); stopped at detach.
        self._crew = self._start_crew()

    def _start_crew(self) -> ThreadPoolExecutor | None:
        return started_pool(self.threads - 1, "pccheck-copy") if self.threads > 1 else None

    def attach(self, native_engine: Any) -> None:
        super().attach(native_engine)
        if self._crew is None:  # closed before and reused by another orchestrator: restart
            self._crew = self._start_crew()

    def close(self) -> None:
        # The helpers outlive a pool remade by a growing state (detach + attach): restarting them
        # then would wait for the new pool's prefaulter (threads.py). They stop here.
        crew, self._crew = self._crew, None
        if crew is not None:
            crew.shutdown(wait=True)

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        crew = self._crew
        if until or crew is None:
            job.copy(until)
            return
        # Invariant (soft copy-on-write): copy() returns only once no helper still reads the
        # job's source memory: every helper has run to the end, or was cancelled unstarted.
        helpers = [crew.submit(job.copy, 0) for _ in range(self.threads - 1)]
        try:
            job.copy(0)
        finally:
            started = [f for f in helpers if not f.cancel()]
            futures_wait(started)
        for f in started:
            f.result()  # a helper's error, once all have stopped (the caller's own comes first)

    # The reserve stand-in: host memory plays the device's spare memory, so the staging protocol
    # runs (and is tested) without a GPU. It only pays off where shipping is slower than staging
    # (ThrottledCopyEngine, as over PCIe).
    def alloc_reserve(self, nbytes: int) -> Any:
        buf = np.empty(nbytes, dtype=np.uint8)
        _native.prefault(buf)  # first touch now, not while the optimizer step waits
        return buf

    def stage(self, job: Any, src: Sources, k: int, reserve: Any, off: int) -> Any:
        job.fill_to(k, reserve.buffer.ctypes.data + off, reserve.chunk)
        return None

    def ship(self, job: Any, k: int, reserve: Any, off: int, token: Any) -> None:
        with filling(job, k) as cid:
            t0, n = time.perf_counter(), job.chunk_len(k)
            ctypes.memmove(self.native_engine.chunk_address(cid), reserve.buffer.ctypes.data + off, n)
            self.pace(n, t0)

    def pace(self, nbytes: int, t0: float) -> None:
        """Called after each chunk's copy began at ``t0`` (ThrottledCopyEngine sleeps here to hold
        its rate; a spread checkpoint's part and gradient copies go through it too)."""


class ThrottledCopyEngine(CpuCopyEngine):
    """The CPU engine held to ``bytes_per_s``, to emulate a PCIe link (tests and benchmarks).

    It drives the same step-by-step protocol (claim → acquire → fill → submit) that the CUDA and
    cupy engines use. The link is one: copies on several threads (the commit thread and the
    optimizer pre-hook, a spread checkpoint's copy threads) share ``bytes_per_s`` between them.
    """

    name = "cpu-throttled"

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("bytes_per_s must be positive")
        super().__init__(threads=1)  # the link is one: its copy paces chunk by chunk itself
        self.bytes_per_s = float(bytes_per_s)
        self._link = threading.Lock()
        self._busy_until = 0.0  # perf_counter time at which the link is free (guarded by _link)

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        chunk = self.native_engine.chunk_size
        last = -(-until // chunk) if until else None
        while True:
            k = job.claim()
            if k < 0:
                return
            cid = job.acquire_chunk()
            t0 = time.perf_counter()
            job.fill(k, cid)
            self.pace(job.chunk_len(k), t0)
            job.submit(k, cid)
            if last is not None and k + 1 >= last:
                return

    def pace(self, nbytes: int, t0: float) -> None:
        # A transfer begun at t0 holds the link for nbytes / rate after whatever holds it already.
        with self._link:
            begin = max(t0, self._busy_until)
            self._busy_until = until = begin + nbytes / self.bytes_per_s
        time.sleep(max(0.0, until - time.perf_counter()))


def acquire_chunk_for(job: Any, k: int) -> int:
    """A free pool chunk for claimed chunk ``k`` (waits: back-pressure). If the engine was closed
    under the copy, ``k`` is skipped (the job fails, nothing waits for it) and ConfigError raised."""
    cid = job.acquire_chunk()
    if cid < 0:
        job.skip(k, errno.ECANCELED)
        raise ConfigError("the chunk pool was closed during a copy")
    return cid


@contextlib.contextmanager
def filling(job: Any, k: int) -> Iterator[int]:
    """A pool chunk for claimed chunk ``k``: filled inside the block, then submitted. If the block
    raises, the chunk goes back to the pool and ``k`` is skipped, failing this checkpoint only
    (the previous one stays) and never leaving the job waiting for a chunk nobody will submit."""
    cid = acquire_chunk_for(job, k)
    t0 = time.perf_counter()
    try:
        yield cid
    except BaseException as exc:
        job.release_chunk(cid)
        job.skip(k, errno.EIO)
        raise ConfigError(f"copying chunk {k} into host memory failed: {exc}") from exc
    job.add_copy_seconds(time.perf_counter() - t0)
    job.submit(k, cid)


def abandon(job: Any, err: int) -> None:
    """Fails a job whose copy cannot go on: every unclaimed chunk is skipped, so the job still
    finishes (with the error) and nothing waits for it forever."""
    while (k := job.claim()) >= 0:
        job.skip(k, err)
