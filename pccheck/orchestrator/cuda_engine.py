"""GPU copy engines: device memory → pinned DRAM chunks over a dedicated stream (paper §3.3).

The chunk pool is registered once with ``cudaHostRegister`` so device-to-host copies are DMA
transfers that run asynchronously on the engine's own stream, beside the training stream. If the
registration fails (e.g. a locked-memory limit), the engine logs a warning and copies into
pageable memory (``pinned`` is False; each copy then completes synchronously, more slowly).
Per chunk: enqueue the copies of every array piece it holds and record an event; with up to
``depth`` chunks queued, wait for the oldest one's event and hand that chunk to the writers.
Host-resident arrays in the same state are copied by the CPU.

In place (a job begun ``in_place``: the memory tier's tmpfs slots): the copies land in the slot's
own mapping instead of a pool chunk, and the writers only checksum them, so a snapshot crosses
host memory once. Each slot's data region is registered with ``cudaHostRegister`` the first time
a copy lands in it (tmpfs pages can be pinned like anonymous ones) and stays registered until the
store's mapping changes (:meth:`_DeviceEngine.release_host`); where registration fails the copies
still land in the slot, through the driver's staging (slower, logged once).

The torch engine also implements the reserve (``device_reserve``, :mod:`.reserve`): a staged chunk
is cloned device to device on the *training* stream, so the clone reads the bytes before the
optimizer update that is queued after it, and is shipped to the host from the clone on the
engine's stream once an event says the clone is done.

These engines run only where a GPU is present (``torch.cuda.is_available()`` /
``cupy.cuda.is_available()``); on CPU-only machines the same chunk protocol is exercised by
:class:`~pccheck.orchestrator.copy_engine.ThrottledCopyEngine`.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ConfigError
from ..persist.layout import Layout
from .copy_engine import CopyEngine, Sources, acquire_chunk_for, filling

__all__ = ["TorchCudaCopyEngine", "CupyCopyEngine"]

_CUDA_MEMCPY_D2H = 2  # cudaMemcpyDeviceToHost

log = logging.getLogger("pccheck")


def _pool_array(native_engine: Any) -> np.ndarray:
    """The whole chunk pool as a writable uint8 numpy array (no copy)."""
    buf = (ctypes.c_uint8 * native_engine.pool_bytes).from_address(native_engine.pool_address)
    return np.frombuffer(buf, dtype=np.uint8)


def _pieces(views: list, base: int, chunk: int, starts: list[int]) -> Iterator[tuple[Any, Any, int, int]]:
    """(entry, byte view, lo, hi): the stream bytes [lo, hi) of each array inside chunk [base, base+chunk).
    ``starts``: the entries' offsets, ascending (plan() places arrays in entry order), so the scan
    begins at the chunk's first array instead of at every array for every chunk."""
    i = max(0, bisect.bisect_right(starts, base) - 1)
    for e, view in itertools.islice(views, i, None):
        if e.offset >= base + chunk:
            return
        lo, hi = max(base, e.offset), min(base + chunk, e.offset + e.nbytes)
        if lo < hi:
            yield e, view, lo, hi


def _loaded_cudart() -> Any:
    """The CUDA runtime library torch already loaded (ctypes), or None. Only a library already in
    this process is used: a second copy of the runtime would not know torch's streams."""
    try:
        with open("/proc/self/maps") as f:
            loaded = {os.path.basename(line.split()[-1]) for line in f if "libcudart" in line}
    except OSError:
        return None
    for name in sorted(loaded, reverse=True):
        try:
            rt = ctypes.CDLL(name)
            fn = rt.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return rt
    return None


def _clear_last_error() -> None:
    """Resets the CUDA runtime's last error after a failed call whose failure is handled here."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class _DeviceEngine(CopyEngine):
    """Shared chunk loop. Subclasses provide the byte views and the stream operations.

    The loop keeps up to ``depth`` chunks queued on the engine's stream: it enqueues chunk k+1's
    copies before it waits for chunk k's, so the DMA engine never idles while this thread waits,
    hands a chunk to the writers and claims the next (one chunk at a time, those gaps cost about
    10% of the link: 0.898 of the pinned peak on an H100, bench/results/gpu/).
    Invariant: a chunk is submitted only after the event recorded behind its copies has completed,
    and chunks are submitted in the order they were claimed by this thread.
    """

    pinned: bool = False  # the chunk pool is page-locked (cudaHostRegister succeeded)
    depth: int = 2  # chunks queued per copying thread; 1 = copy, wait, submit, claim the next
    # in place: slot data regions registered for DMA, base address -> bytes (None: registration
    # failed, copies go through the driver's staging); guarded by _host_lock (copy() runs on
    # several threads). Invariant: every range here lies inside the store's current mapping, since
    # the orchestrator calls release_host() before that mapping goes (a new generation, close).
    _slots: dict[int, int | None]
    _host_lock: threading.Lock

    def sources(self, arrays: Mapping[str, Any], layout: Layout) -> Sources:
        # Byte views of every array for this snapshot; non-contiguous device arrays are made
        # contiguous on the device (a device allocation, only for such arrays). The native
        # engine never reads these arrays itself.
        views = [(e, self._bytes_of(a)) for a, e in zip(arrays.values(), layout.entries)]
        # The native job still needs each array's place in the stream (its pieces per chunk and
        # their crc32c); a null pointer says it must never read the array itself.
        geometry = [(0, e.offset, e.nbytes, 1, (e.nbytes,), (1,)) for e in layout.entries]
        return Sources(geometry, (views, self._ready_event(), [e.offset for e in layout.entries]))

    def attach(self, native_engine: Any) -> None:
        super().attach(native_engine)
        if not hasattr(self, "_slots"):
            self._slots, self._host_lock = {}, threading.Lock()

    def detach(self) -> None:
        self.release_host()
        super().detach()

    def release_host(self) -> None:
        """Unregisters every slot region registered for in-place copies; called before the
        store's mapping changes (a new generation, close) and when the pool goes."""
        if not hasattr(self, "_slots"):
            return
        with self._host_lock:
            for base, n in list(self._slots.items()):
                if n is not None:
                    self._unregister(base)
            self._slots.clear()

    @property
    def pinned_slots(self) -> int:
        """Slot data regions currently registered for in-place device copies."""
        return sum(n is not None for n in getattr(self, "_slots", {}).values())

    def _pin_slot(self, base: int, nbytes: int) -> None:
        """Registers the slot data region [base, base + nbytes) once, before the first copy lands in it."""
        with self._host_lock:
            if base in self._slots:
                return
            t0 = time.perf_counter()
            ok = self._register(base, nbytes)
            self._slots[base] = nbytes if ok else None
            if ok:
                log.debug("pccheck: registered a %d-byte slot for in-place device copies in %.3f s",
                          nbytes, time.perf_counter() - t0)
            elif len(self._slots) == 1:
                log.warning("pccheck: cudaHostRegister of a %d-byte memory-tier slot failed; device copies "
                            "into it go through the driver's staging, more slowly (raise the locked-memory "
                            "limit, ulimit -l)", nbytes)

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        chunk = self.native_engine.chunk_size
        last = -(-until // chunk) if until else None
        views, ready, starts = src.private
        depth = max(1, int(self.depth))
        in_place = bool(job.in_place)
        # (k, pool chunk or None when in place, t0, done event)
        queued: deque[tuple[int, int | None, float, Any]] = deque()
        waited, enough, prev_end = False, False, 0.0
        try:
            while True:
                k = -1
                if len(queued) < depth and not enough:
                    k = job.claim()
                    enough = k < 0 or (last is not None and k + 1 >= last)  # claim no more
                if k >= 0:
                    cid, n = None, job.chunk_len(k)
                    if in_place:  # the slot's own bytes
                        try:
                            addr = job.in_place_chunk(k)
                        except OSError as exc:  # the engine closed, or zeroing the meta record failed: k skipped
                            raise ConfigError(f"chunk {k} has no place in the slot: {exc}") from exc
                        try:
                            self._pin_slot(addr - k * chunk, (job.num_chunks - 1) * chunk
                                           + job.chunk_len(job.num_chunks - 1))
                        except BaseException:
                            job.skip(k, errno.EIO)
                            job.release_in_place()
                            raise
                    else:
                        cid = acquire_chunk_for(job, k)
                        addr = self.native_engine.pool_address + cid * chunk
                    t0 = time.perf_counter()
                    try:
                        if not waited:
                            self._wait(ready)
                            waited = True
                        self._fill(addr, n, views, starts, k * chunk)
                        queued.append((k, cid, t0, self._record()))
                    except BaseException as exc:
                        self._give_back(job, k, cid)
                        raise ConfigError(f"copying chunk {k} into host memory failed: {exc}") from exc
                    continue
                if not queued:
                    return
                k, cid, t0, done = queued[0]
                try:
                    self._synchronize(done)
                except BaseException as exc:
                    raise ConfigError(f"copying chunk {k} into host memory failed: {exc}") from exc
                queued.popleft()
                # The stats sum copy time over chunks: count each instant once, from this
                # chunk's start or the previous chunk's end, whichever is later.
                now = time.perf_counter()
                job.add_copy_seconds(now - max(t0, prev_end))
                prev_end = now
                if cid is None:
                    job.submit_in_place(k)
                else:
                    job.submit(k, cid)
        finally:
            if queued:  # an error: let the queued copies land, then give their chunks back
                with contextlib.suppress(Exception):
                    self._synchronize(queued[-1][3])
            for k, cid, _, _ in queued:
                self._give_back(job, k, cid)

    @staticmethod
    def _give_back(job: Any, k: int, cid: int | None) -> None:
        """Chunk ``k`` will not be submitted: its pool chunk (or in-place writer task) goes back
        and ``k`` is skipped, failing this checkpoint only."""
        if cid is None:
            job.skip(k, errno.EIO)
            job.release_in_place()
        else:
            job.release_chunk(cid)
            job.skip(k, errno.EIO)

    def _host(self, addr: int, n: int) -> Any:
        """A writable view of the n host bytes at ``addr`` (a pool chunk, or a slot's mapping)."""
        return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=np.uint8)

    def _fill(self, addr: int, n: int, views: list, starts: list[int], base: int) -> None:
        """Queues the copies of the stream bytes [base, base + n) into the n host bytes at
        ``addr``; the gaps between arrays and the tail are zeros (FORMAT §5). Nothing past n is
        written: in place, the slot's next bytes belong to the manifest."""
        dst = self._host(addr, n)
        filled = 0
        for e, view, lo, hi in _pieces(views, base, n, starts):
            if lo - base > filled:
                dst[filled:lo - base] = 0
            self._enqueue(dst, lo - base, view, lo - e.offset, hi - lo)
            filled = hi - base
        if filled < n:
            dst[filled:] = 0

    def _register(self, addr: int, n: int) -> bool:
        """Page-locks the host range for DMA; False (the runtime's error cleared) if it cannot."""
        raise NotImplementedError

    def _unregister(self, addr: int) -> None:
        raise NotImplementedError


class TorchCudaCopyEngine(_DeviceEngine):
    """``raw`` (default, where torch's CUDA runtime library is found): a chunk's copies are queued by
    ``cudaMemcpyAsync`` itself, through ctypes, which lets the GIL go during each call; a piece costs
    about a microsecond of Python. Else ``Tensor.copy_``: tens of microseconds a piece, the GIL held,
    which the training thread, queuing its kernels, waits for."""

    name = "cuda"
    raw: bool = True

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("the state holds CUDA tensors but torch.cuda.is_available() is False")
        self._torch = torch
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)
        self._rt = _loaded_cudart()  # after the stream: CUDA (and its runtime library) is loaded
        if self._rt is None:
            self.raw = False
            log.info("pccheck: torch's CUDA runtime library was not found; device copies use Tensor.copy_")

    def _host(self, addr: int, n: int) -> Any:
        return self._torch.from_numpy(super()._host(addr, n))

    def _fill(self, addr: int, n: int, views: list, starts: list[int], base: int) -> None:
        if not self.raw:
            with self._torch.cuda.stream(self._stream):
                return super()._fill(addr, n, views, starts, base)
        filled, stream = 0, self._stream.cuda_stream
        with self._torch.cuda.device(self._device):  # the runtime call runs on the stream's device
            for e, view, lo, hi in _pieces(views, base, n, starts):
                if lo - base > filled:
                    ctypes.memset(addr + filled, 0, lo - base - filled)
                dst, src, n = addr + lo - base, view.data_ptr() + lo - e.offset, hi - lo
                if view.is_cuda:
                    rc = self._rt.cudaMemcpyAsync(dst, src, n, _CUDA_MEMCPY_D2H, stream)
                    if rc:
                        _clear_last_error()
                        raise RuntimeError(f"cudaMemcpyAsync of {n} bytes failed with CUDA error {rc}")
                else:  # a host array in the state (numpy's RNG state)
                    ctypes.memmove(dst, src, n)
                filled = hi - base
        if filled < n:
            ctypes.memset(addr + filled, 0, n - filled)

    def _register(self, addr: int, n: int) -> bool:
        with self._torch.cuda.device(self._device):
            ok = int(self._torch.cuda.cudart().cudaHostRegister(addr, n, 0)) == 0
        if not ok:
            _clear_last_error()  # else torch's next kernel-launch check reports this error
        return ok

    def _unregister(self, addr: int) -> None:
        if int(self._torch.cuda.cudart().cudaHostUnregister(addr)) != 0:
            _clear_last_error()

    def attach(self, native_engine: Any) -> None:
        super().attach(native_engine)
        rc = self._torch.cuda.cudart().cudaHostRegister(native_engine.pool_address, native_engine.pool_bytes, 0)
        self.pinned = int(rc) == 0
        if not self.pinned:
            _clear_last_error()  # else torch's next kernel-launch check reports this error
            log.warning("pccheck: cudaHostRegister of the %d-byte chunk pool failed (%s); copying into "
                        "pageable memory, synchronously and more slowly (raise the locked-memory limit, "
                        "ulimit -l, or lower dram_budget)", native_engine.pool_bytes, rc)
        self._pool = self._torch.from_numpy(_pool_array(native_engine))

    def detach(self) -> None:
        if self.pinned:
            self._torch.cuda.cudart().cudaHostUnregister(self.native_engine.pool_address)
            self.pinned = False
        self._pool = None  # a view of the pool, which the native engine unmaps at close
        super().detach()

    def _ready_event(self) -> Any:
        # On the training thread: the copy stream must see everything queued so far (the update).
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream())
        return ev

    def _bytes_of(self, t: Any) -> Any:
        if isinstance(t, np.ndarray):  # host arrays in a model's state (numpy's RNG state)
            return self._torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(self._torch.uint8) if t.numel() else t.new_empty(0, dtype=self._torch.uint8)

    def _wait(self, ready: Any) -> None:
        self._stream.wait_event(ready)

    def _enqueue(self, dst: Any, dst_off: int, src: Any, src_off: int, n: int) -> None:
        with self._torch.cuda.stream(self._stream):  # re-entered under _fill's: cheap, and ship needs it
            dst[dst_off:dst_off + n].copy_(src[src_off:src_off + n], non_blocking=True)

    def _record(self) -> Any:
        ev = self._torch.cuda.Event()
        ev.record(self._stream)
        return ev

    def _synchronize(self, ev: Any) -> None:
        ev.synchronize()  # torch releases the GIL while it waits

    def _sync(self) -> None:
        self._synchronize(self._record())

    # -- the reserve --------------------------------------------------------------------------------

    def auto_reserve_bytes(self, state_bytes: int, chunk: int) -> int:
        # The whole state rounded up to chunks, within a quarter of the free device memory and an
        # eighth of the card, so the reserve never crowds out activations.
        free, total = self._torch.cuda.mem_get_info(self._device)
        return min(-(-state_bytes // chunk) * chunk, free // 4, total // 8)

    def alloc_reserve(self, nbytes: int) -> Any:
        try:
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self._device)
        except self._torch.cuda.OutOfMemoryError:
            raise ConfigError(f"cannot allocate a device reserve of {nbytes} bytes on {self._device}; "
                              "lower device_reserve") from None

    def stage(self, job: Any, src: Sources, k: int, reserve: Any, off: int) -> Any:
        # On the training thread, in the optimizer pre-hook: the clone is queued on the current
        # (training) stream, so it reads the bytes before the update queued after it.
        views, _, starts = src.private
        chunk, n = reserve.chunk, job.chunk_len(k)
        base = k * chunk
        buf = reserve.buffer[off:off + n]
        filled = 0
        for e, view, lo, hi in _pieces(views, base, chunk, starts):
            if lo - base > filled:
                buf[filled:lo - base].zero_()
            buf[lo - base:hi - base].copy_(view[lo - e.offset:hi - e.offset])
            filled = hi - base
        if n > filled:
            buf[filled:n].zero_()
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream(self._device))
        return ev

    def ship(self, job: Any, k: int, reserve: Any, off: int, token: Any) -> None:
        with filling(job, k) as cid:
            n = job.chunk_len(k)
            self._wait(token)
            self._enqueue(self._pool[cid * reserve.chunk:cid * reserve.chunk + n], 0, reserve.buffer, off, n)
            self._sync()  # the slot may be reused once this returns


class CupyCopyEngine(_DeviceEngine):
    name = "cupy"

    def __init__(self) -> None:
        import cupy

        if not cupy.cuda.is_available():
            raise ConfigError("the state holds cupy arrays but cupy.cuda.is_available() is False")
        self._cupy = cupy
        self._stream = cupy.cuda.Stream(non_blocking=True)

    def attach(self, native_engine: Any) -> None:
        super().attach(native_engine)
        try:
            self._cupy.cuda.runtime.hostRegister(native_engine.pool_address, native_engine.pool_bytes, 0)
            self.pinned = True
        except self._cupy.cuda.runtime.CUDARuntimeError as exc:
            self.pinned = False
            log.warning("pccheck: cudaHostRegister of the %d-byte chunk pool failed (%s); copying into "
                        "pageable memory, synchronously and more slowly (raise the locked-memory limit, "
                        "ulimit -l, or lower dram_budget)", native_engine.pool_bytes, exc)
        self._pool = _pool_array(native_engine)

    def _register(self, addr: int, n: int) -> bool:
        try:
            self._cupy.cuda.runtime.hostRegister(addr, n, 0)
            return True
        except self._cupy.cuda.runtime.CUDARuntimeError:
            return False

    def _unregister(self, addr: int) -> None:
        with contextlib.suppress(self._cupy.cuda.runtime.CUDARuntimeError):
            self._cupy.cuda.runtime.hostUnregister(addr)

    def detach(self) -> None:
        if self.pinned:
            self._cupy.cuda.runtime.hostUnregister(self.native_engine.pool_address)
            self.pinned = False
        self._pool = None  # a view of the pool, which the native engine unmaps at close
        super().detach()

    def _ready_event(self) -> Any:
        return self._cupy.cuda.get_current_stream().record()

    def _bytes_of(self, a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return self._cupy.ascontiguousarray(a).reshape(-1).view(self._cupy.uint8)

    def _wait(self, ready: Any) -> None:
        self._stream.wait_event(ready)

    def _enqueue(self, dst: np.ndarray, dst_off: int, src: Any, src_off: int, n: int) -> None:
        if isinstance(src, np.ndarray):
            dst[dst_off:dst_off + n] = src[src_off:src_off + n]
            return
        rt = self._cupy.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data + dst_off, src.data.ptr + src_off, n, rt.memcpyDeviceToHost,
                       self._stream.ptr)

    def _record(self) -> Any:
        return self._stream.record()

    def _synchronize(self, ev: Any) -> None:
        ev.synchronize()

    def _sync(self) -> None:
        self._stream.synchronize()
