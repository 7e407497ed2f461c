"""GPU copy engines: device memory → pinned DRAM chunks over a dedicated stream (paper §3.3).

The chunk pool is registered once with ``cudaHostRegister`` so device-to-host copies are DMA
transfers that run asynchronously on the engine's own stream, beside the training stream. If the
registration fails (e.g. a locked-memory limit), the engine logs a warning and copies into
pageable memory (``pinned`` is False; each copy then completes synchronously, more slowly).
Per chunk: enqueue the copies of every array piece it holds, record an event, wait for it, hand
the chunk to the writers. Host-resident arrays in the same state are copied by the CPU.

The torch engine also implements the reserve (``device_reserve``, :mod:`.reserve`): a staged chunk
is cloned device to device on the *training* stream, so the clone reads the bytes before the
optimizer update that is queued after it, and is shipped to the host from the clone on the
engine's stream once an event says the clone is done.

These engines run only where a GPU is present (``torch.cuda.is_available()`` /
``cupy.cuda.is_available()``); on CPU-only machines the same chunk protocol is exercised by
:class:`~pccheck.orchestrator.copy_engine.ThrottledCopyEngine`.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ConfigError
from ..persist.layout import Layout
from .copy_engine import CopyEngine, Sources, filling

__all__ = ["TorchCudaCopyEngine", "CupyCopyEngine"]

log = logging.getLogger("pccheck")


def _pool_array(native_engine: Any) -> np.ndarray:
    """The whole chunk pool as a writable uint8 numpy array (no copy)."""
    buf = (ctypes.c_uint8 * native_engine.pool_bytes).from_address(native_engine.pool_address)
    return np.frombuffer(buf, dtype=np.uint8)


def _pieces(views: list, base: int, chunk: int) -> Iterator[tuple[Any, Any, int, int]]:
    """(entry, byte view, lo, hi): the stream bytes [lo, hi) of each array inside chunk [base, base+chunk)."""
    for e, view in views:
        lo, hi = max(base, e.offset), min(base + chunk, e.offset + e.nbytes)
        if lo < hi:
            yield e, view, lo, hi


def _clear_last_error() -> None:
    """Resets the CUDA runtime's last error after a failed call whose failure is handled here."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


class _DeviceEngine(CopyEngine):
    """Shared chunk loop. Subclasses provide the byte views and the stream operations."""

    pinned: bool = False  # the chunk pool is page-locked (cudaHostRegister succeeded)

    def sources(self, arrays: Mapping[str, Any], layout: Layout) -> Sources:
        # Byte views of every array for this snapshot; non-contiguous device arrays are made
        # contiguous on the device (a device allocation, only for such arrays). The native
        # engine never reads these arrays itself.
        views = [(e, self._bytes_of(a)) for a, e in zip(arrays.values(), layout.entries)]
        # The native job still needs each array's place in the stream (its pieces per chunk and
        # their crc32c); a null pointer says it must never read the array itself.
        geometry = [(0, e.offset, e.nbytes, 1, (e.nbytes,), (1,)) for e in layout.entries]
        return Sources(geometry, (views, self._ready_event()))

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        chunk = self.native_engine.chunk_size
        last = -(-until // chunk) if until else None
        views, ready = src.private
        while True:
            k = job.claim()
            if k < 0:
                return
            with filling(job, k) as cid:
                base = k * chunk
                dst = self._pool[cid * chunk:(cid + 1) * chunk]
                filled = 0  # gaps between arrays and the tail are zeros (FORMAT §5)
                self._wait(ready)
                for e, view, lo, hi in _pieces(views, base, chunk):
                    dst[filled:lo - base] = 0
                    self._enqueue(dst, lo - base, view, lo - e.offset, hi - lo)
                    filled = hi - base
                dst[filled:] = 0
                self._sync()
            if last is not None and k + 1 >= last:
                return


class TorchCudaCopyEngine(_DeviceEngine):
    name = "cuda"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("the state holds CUDA tensors but torch.cuda.is_available() is False")
        self._torch = torch
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self._device)

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
        with self._torch.cuda.stream(self._stream):
            dst[dst_off:dst_off + n].copy_(src[src_off:src_off + n], non_blocking=True)

    def _sync(self) -> None:
        ev = self._torch.cuda.Event()
        ev.record(self._stream)
        ev.synchronize()

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
        views, _ = src.private
        chunk, n = reserve.chunk, job.chunk_len(k)
        base = k * chunk
        buf = reserve.buffer[off:off + n]
        filled = 0
        for e, view, lo, hi in _pieces(views, base, chunk):
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

    def _sync(self) -> None:
        self._stream.synchronize()
