"""The device copy engines' chunk loop (orchestrator/cuda_engine.py), run on the CPU: a stand-in
engine whose "device" is host memory and whose stream operations complete at once. The loop's own
logic is what is tested here: ``depth`` chunks queued per thread, the bounded copy of soft
copy-on-write (``until``), the torch engine's ``cudaMemcpyAsync`` path (a fake runtime that
copies), and what a failed copy leaves behind. tests/test_gpu.py runs the real engines."""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy as np
import pytest
import torch

import pccheck
from pccheck.orchestrator.cuda_engine import TorchCudaCopyEngine, _DeviceEngine, _pool_array

CHUNK = 1 << 16  # small chunks: arrays straddle them and one array spans several


class _HostDevice(_DeviceEngine):
    """The shared loop over host tensors: copies run at once, events are plain objects."""

    name = "host-device"

    def __init__(self, depth: int, fail_at: int | None = None) -> None:
        self.depth, self.fail_at, self.synced = depth, fail_at, 0
        self.in_flight_max = 0
        self._queued = 0

    def attach(self, native_engine):
        super().attach(native_engine)
        self._pool = torch.from_numpy(_pool_array(native_engine))

    def detach(self):
        self._pool = None
        super().detach()

    def _host(self, addr, n):  # torch views of host bytes, as the torch engine's
        return torch.from_numpy(super()._host(addr, n))

    def _ready_event(self):
        return None

    def _bytes_of(self, t):
        if isinstance(t, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    def _wait(self, ready):
        pass

    def _enqueue(self, dst, dst_off, src, src_off, n):
        dst[dst_off:dst_off + n].copy_(src[src_off:src_off + n])

    def _record(self):
        self._queued += 1
        self.in_flight_max = max(self.in_flight_max, self._queued)
        return object()

    def _synchronize(self, ev):
        self.synced += 1
        if self.fail_at is not None and self.synced == self.fail_at:
            raise RuntimeError("injected device fault")
        self._queued -= 1


class _FakeRuntime:
    """cudaMemcpyAsync as a memmove: the raw path's pointer arithmetic, checked byte for byte."""

    def __init__(self) -> None:
        self.calls = 0

    def cudaMemcpyAsync(self, dst, src, n, kind, stream):  # noqa: N802 (the runtime's name)
        assert kind == 2 and stream == 1234  # device to host, on the engine's stream
        self.calls += 1
        ctypes.memmove(dst, src, n)
        return 0


class _DevView:
    """A byte view that says it lives on the device, so the raw path copies it with the runtime."""

    is_cuda = True

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def data_ptr(self) -> int:
        return self.t.data_ptr()


class _RawHostDevice(TorchCudaCopyEngine):
    """The torch engine's raw path over host memory (the runtime and the stream faked)."""

    def __init__(self, depth: int) -> None:  # no CUDA: set up what _fill uses
        self.depth, self.raw, self._rt = depth, True, _FakeRuntime()
        self._device, self._stream = None, types.SimpleNamespace(cuda_stream=1234)
        self._torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device=lambda d: contextlib.nullcontext()))

    def attach(self, native_engine):
        _DeviceEngine.attach(self, native_engine)
        self._pool = torch.from_numpy(_pool_array(native_engine))

    def detach(self):
        self._pool = None
        _DeviceEngine.detach(self)

    def _ready_event(self):
        return None

    def _bytes_of(self, t):
        if isinstance(t, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
        return _DevView(t.detach().contiguous().reshape(-1).view(torch.uint8))

    def _wait(self, ready):
        pass

    def _record(self):
        return object()

    def _synchronize(self, ev):
        pass


def _arrays(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(5 * CHUNK // 4 + 3, generator=g),   # spans several chunks
            "odd": torch.randint(0, 255, (1234,), generator=g, dtype=torch.uint8),
            "view": torch.randn(300, 90, generator=g)[::3, 1::2],  # made contiguous per snapshot
            "host": np.arange(777, dtype=np.int64)}


def _round_trips(engine, tmp_path, steps: int = 3) -> None:
    arrays = _arrays(engine.depth)
    with pccheck.Checkpointer(arrays, tmp_path / "ckpt", interval=1, max_concurrent=2, chunk_size=CHUNK,
                              copy_engine=engine) as ck:
        for step in range(1, steps + 1):
            want = {k: v.copy() if isinstance(v, np.ndarray) else v.contiguous().numpy().copy()
                    for k, v in arrays.items()}
            ck.checkpoint(step)
            ck.wait()
            r = pccheck.load_latest(tmp_path / "ckpt")
            assert r.step == step
            for k, w in want.items():
                assert np.array_equal(r.state[k], w), k
            for v in arrays.values():
                v += 1  # a torch tensor or a numpy array, in place


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_loop_writes_every_byte_at_any_depth(tmp_path, depth):
    engine = _HostDevice(depth)
    _round_trips(engine, tmp_path)
    assert 1 <= engine.in_flight_max <= depth


@pytest.mark.parametrize("depth", [1, 2])
def test_the_raw_path_queues_each_piece_with_the_runtime(tmp_path, depth):
    engine = _RawHostDevice(depth)
    _round_trips(engine, tmp_path)
    assert engine._rt.calls >= 3 * 6  # every checkpoint: the big array's chunks, odd, view


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_soft_cow_of_a_model_through_the_loop_is_exact(tmp_path, depth):
    """The bounded copy (``until``: the eager buffers, on the training thread) and the background
    rest: the checkpoint of step s holds step s's state, while the next step runs."""
    torch.manual_seed(depth)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
                                  for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = _HostDevice(depth)
    with pccheck.Checkpointer(model, opt, path=tmp_path / "ckpt", interval=1, chunk_size=CHUNK,
                              copy_engine=engine) as ck:
        for step in range(1, 6):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            want = {k: v.clone() for k, v in model.state_dict().items()}
            ck.maybe_checkpoint(step)
        ck.wait()
    model2 = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
                                   for _ in range(6)])
    r = pccheck.load_latest(tmp_path / "ckpt", model=model2, optimizer=torch.optim.AdamW(model2.parameters()))
    assert r.step == 5
    assert all(torch.equal(want[k], v) for k, v in model2.state_dict().items())


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_failed_device_copy_fails_that_checkpoint_only(tmp_path, fail_at):
    """A copy that fails with chunks still queued (a mapping of arrays is copied in the call, so the
    call raises): every pool chunk comes back, the previous checkpoint still loads, and the next
    checkpoint commits."""
    arrays = _arrays(7)
    engine = _HostDevice(depth=3)
    with pccheck.Checkpointer(arrays, tmp_path / "ckpt", interval=1, max_concurrent=1, chunk_size=CHUNK,
                              copy_engine=engine) as ck:
        ck.checkpoint(1)
        ck.wait()
        good = {k: v.copy() if isinstance(v, np.ndarray) else v.contiguous().numpy().copy() for k, v in arrays.items()}
        engine.fail_at, engine.synced, engine._queued = fail_at, 0, 0
        arrays["big"] += 1
        with pytest.raises(pccheck.PCCheckError, match="injected device fault"):
            ck.checkpoint(2)
        assert engine.in_flight_max == 3  # the fault came with chunks queued behind it
        engine.fail_at = None
        r = pccheck.load_latest(tmp_path / "ckpt")
        assert r.step == 1 and all(np.array_equal(r.state[k], w) for k, w in good.items())
        native = ck.copy_engine.native_engine
        assert native.free_chunks() == native.num_chunks
        ck.checkpoint(3)  # the pool is whole again: the next checkpoint commits
        ck.wait()
    assert pccheck.load_latest(tmp_path / "ckpt").step == 3


def test_a_device_engine_is_never_incremental(tmp_path):
    """A device copy engine copies whole layouts: left to its default, incremental is off for it
    (every checkpoint writes every array, though the state is host memory); asked for, refused."""
    arrays = _arrays(1)
    with pccheck.Checkpointer(arrays, tmp_path / "ckpt", interval=1, chunk_size=CHUNK, copy_engine=_HostDevice(1)) as ck:
        for step in (1, 2):
            ck.checkpoint(step)
            ck.wait()
        assert all(c.bytes_referenced == 0 for c in ck.stats().checkpoints)
    with pytest.raises(pccheck.ConfigError, match="copy_engine='host-device'"):
        pccheck.Checkpointer(arrays, tmp_path / "other", interval=1, copy_engine=_HostDevice(1), incremental=True)
