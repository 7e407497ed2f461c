"""GPU copy engines: device memory → pinned DRAM chunks over a dedicated stream (paper §3.3).

The chunk pool is registered once with ``cudaHostRegister`` so device-to-host copies are DMA
transfers that run asynchronously on the engine's own stream, beside the training stream.
Per chunk: enqueue the copies of every array piece it holds, record an event, wait for it, hand
the chunk to the writers. Host-resident arrays in the same state are copied by the CPU.

These engines run only where a GPU is present (``torch.cuda.is_available()`` /
``cupy.cuda.is_available()``); on CPU-only machines the same chunk protocol is exercised by
:class:`~pccheck.orchestrator.copy_engine.ThrottledCopyEngine`.
"""

from __future__ import annotations

import ctypes
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError
from ..persist.layout import Layout
from .copy_engine import CopyEngine, Sources

__all__ = ["TorchCudaCopyEngine", "CupyCopyEngine"]


def _pool_array(native_engine: Any) -> np.ndarray:
    """The whole chunk pool as a writable uint8 numpy array (no copy)."""
    buf = (ctypes.c_uint8 * native_engine.pool_bytes).from_address(native_engine.pool_address)
    return np.frombuffer(buf, dtype=np.uint8)


class _DeviceEngine(CopyEngine):
    """Shared chunk loop. Subclasses provide the byte views and the stream operations."""

    def sources(self, arrays: Mapping[str, Any], layout: Layout) -> Sources:
        # Byte views of every array for this snapshot; non-contiguous device arrays are made
        # contiguous on the device (a device allocation, only for such arrays). The native
        # engine never reads these arrays itself.
        views = [(e, self._bytes_of(a)) for a, e in zip(arrays.values(), layout.entries)]
        return Sources([], (views, self._ready_event()))

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        chunk = self.native_engine.chunk_size
        last = -(-until // chunk) if until else None
        views, ready = src.private
        while True:
            k = job.claim()
            if k < 0:
                return
            cid = job.acquire_chunk()
            try:
                base = k * chunk
                dst = self._pool[cid * chunk:(cid + 1) * chunk]
                filled = 0  # gaps between arrays and the tail are zeros (FORMAT §5)
                for e, view in views:
                    lo, hi = max(base, e.offset), min(base + chunk, e.offset + e.nbytes)
                    if lo < hi:
                        dst[filled:lo - base] = 0
                        self._enqueue(dst, lo - base, view, lo - e.offset, hi - lo, ready)
                        filled = hi - base
                dst[filled:] = 0
                self._sync()
            except Exception as exc:
                job.skip(k, 5)  # EIO: the checkpoint fails; the previous one stays
                raise ConfigError(f"device copy failed: {exc}") from exc
            job.submit(k, cid)
            if last is not None and k + 1 >= last:
                return


class TorchCudaCopyEngine(_DeviceEngine):
    name = "cuda"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("the state holds CUDA tensors but torch.cuda.is_available() is False")
        self._torch = torch
        self._stream = torch.cuda.Stream()

    def attach(self, native_engine: Any) -> None:
        super().attach(native_engine)
        rc = self._torch.cuda.cudart().cudaHostRegister(native_engine.pool_address, native_engine.pool_bytes, 0)
        if int(rc) != 0:
            raise ConfigError(f"cudaHostRegister of the chunk pool failed ({rc}); lower dram_budget")
        self._pool = self._torch.from_numpy(_pool_array(native_engine))

    def detach(self) -> None:
        self._torch.cuda.cudart().cudaHostUnregister(self.native_engine.pool_address)

    def _ready_event(self) -> Any:
        # On the training thread: the copy stream must see everything queued so far (the update).
        ev = self._torch.cuda.Event()
        ev.record(self._torch.cuda.current_stream())
        return ev

    def _bytes_of(self, t: Any) -> Any:
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return t.reshape(-1).view(self._torch.uint8) if t.numel() else t.new_empty(0, dtype=self._torch.uint8)

    def _enqueue(self, dst: Any, dst_off: int, src: Any, src_off: int, n: int, ready: Any) -> None:
        with self._torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            dst[dst_off:dst_off + n].copy_(src[src_off:src_off + n], non_blocking=True)

    def _sync(self) -> None:
        ev = self._torch.cuda.Event()
        ev.record(self._stream)
        ev.synchronize()


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
        self._cupy.cuda.runtime.hostRegister(native_engine.pool_address, native_engine.pool_bytes, 0)
        self._pool = _pool_array(native_engine)

    def detach(self) -> None:
        self._cupy.cuda.runtime.hostUnregister(self.native_engine.pool_address)

    def _ready_event(self) -> Any:
        return self._cupy.cuda.get_current_stream().record()

    def _bytes_of(self, a: Any) -> Any:
        if isinstance(a, np.ndarray):
            return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return self._cupy.ascontiguousarray(a).reshape(-1).view(self._cupy.uint8)

    def _enqueue(self, dst: np.ndarray, dst_off: int, src: Any, src_off: int, n: int, ready: Any) -> None:
        self._stream.wait_event(ready)
        if isinstance(src, np.ndarray):
            dst[dst_off:dst_off + n] = src[src_off:src_off + n]
            return
        rt = self._cupy.cuda.runtime
        rt.memcpyAsync(dst.ctypes.data + dst_off, src.data.ptr + src_off, n, rt.memcpyDeviceToHost,
                       self._stream.ptr)

    def _sync(self) -> None:
        self._stream.synchronize()
