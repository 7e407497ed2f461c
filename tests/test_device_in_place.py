"""In-place device copies (pccheck/orchestrator/cuda_engine.py, "In place") on a
machine without a GPU: host arrays stand in for device memory and a memmove for the DMA, so the
loop's chunk protocol runs for real against the native engine and a real tmpfs-style store
(mmap mode). tests/test_gpu.py runs the same paths on a CUDA device.

- In place (the memory tier's slots): every chunk lands in the slot's own mapping, the pool is
  never touched, the slot is registered once before its first copy, the last chunk's copy stops
  at the data region's end (the manifest after it survives), and the bytes load back exactly.
- A copy that fails midway fails that checkpoint only, gives every writer task back (the next
  checkpoint runs), and the previous checkpoint stays the newest.
- A new store generation and close unregister every slot first.
"""

from __future__ import annotations

import numpy as np
import pytest

from pccheck.errors import ConfigError
from pccheck.orchestrator.args import StartArgs
from pccheck.orchestrator.cuda_engine import _DeviceEngine
from pccheck.orchestrator.options import EngineOptions
from pccheck.orchestrator.orchestrator import Orchestrator
from pccheck.persist.layout import plan
from pccheck.persist.recovery import latest_in_store, store_files


class HostStandIn(_DeviceEngine):
    """_DeviceEngine's loop with host arrays for device memory: queued copies are done at once."""

    name = "host-stand-in"

    def __init__(self, register_ok: bool = True, fail_at: int | None = None) -> None:
        self.register_ok, self.fail_at = register_ok, fail_at
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []
        self.pool_writes = 0
        self.copies = 0

    def _bytes_of(self, a):
        return np.ascontiguousarray(a).reshape(-1).view(np.uint8)

    def _ready_event(self):
        return None

    def _wait(self, ready) -> None:
        pass

    def _enqueue(self, dst, dst_off, src, src_off, n) -> None:
        self.copies += 1
        if self.fail_at is not None and self.copies == self.fail_at:
            raise RuntimeError("the stand-in device failed this copy")
        pool = self.native_engine.pool_address
        if pool <= dst.ctypes.data < pool + self.native_engine.pool_bytes:
            self.pool_writes += 1
        dst[dst_off:dst_off + n] = src[src_off:src_off + n]

    def _record(self):
        return None

    def _synchronize(self, ev) -> None:
        pass

    def _sync(self) -> None:
        pass

    def _register(self, addr: int, n: int) -> bool:
        self.registered.append((addr, n))
        return self.register_ok

    def _unregister(self, addr: int) -> None:
        self.unregistered.append(addr)


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"big": rng.standard_normal((3 << 16) + 5).astype(np.float32),  # ~3 chunks of 256 KiB
            "odd": rng.integers(0, 255, 12345, dtype=np.uint8),
            "i64": rng.integers(-2**62, 2**62, 7001, dtype=np.int64)}


def _orchestrator(path, arrays, engine, errors):
    opts = EngineOptions(max_concurrent=1, writer_threads=2, chunk_size=1 << 18, dram_budget=1 << 18,
                         storage="mmap")
    return Orchestrator(path, plan(arrays), opts, copy_engine=engine, on_error=errors.append,
                        populate_store=True)


def _newest(path):
    (_, file), = store_files(path)
    return latest_in_store(file)


@pytest.mark.parametrize("register_ok", [True, False])
def test_in_place_device_copies_land_in_the_slot_and_load_back(tmp_path, register_ok):
    eng, errors = HostStandIn(register_ok=register_ok), []
    orch = _orchestrator(tmp_path / "s", _arrays(0), eng, errors)
    try:
        for step in (1, 2, 3):  # three slots in turn (N + 1 = 2: the first is reused)
            arrays = _arrays(step)
            assert orch.start(step, arrays, {}, StartArgs())
            orch.wait()
            got = _newest(tmp_path / "s")
            assert got.step == step
            for k, v in arrays.items():
                assert np.array_equal(np.asarray(got.state[k]), v), k
        assert not errors
        assert eng.pool_writes == 0, "an in-place job copied into the chunk pool"
        bases = {b for b, _ in eng.registered}
        assert len(bases) == 2 and len(eng.registered) == 2, eng.registered  # once per slot
        assert eng.pinned_slots == (2 if register_ok else 0)
    finally:
        orch.close()
    assert sorted(eng.unregistered) == (sorted(bases) if register_ok else [])


def test_a_failed_device_copy_fails_that_checkpoint_only(tmp_path):
    eng, errors = HostStandIn(), []
    orch = _orchestrator(tmp_path / "s", _arrays(0), eng, errors)
    try:
        first = _arrays(1)
        assert orch.start(1, first, {}, StartArgs())
        orch.wait()
        copies = eng.copies
        eng.fail_at = copies + 2  # the second checkpoint fails in its second copy
        with pytest.raises(ConfigError, match="copying chunk .* failed: the stand-in device failed"):
            orch.start(2, _arrays(2), {}, StartArgs())
        orch.wait()
        got = _newest(tmp_path / "s")
        assert got.step == 1 and np.array_equal(np.asarray(got.state["big"]), first["big"])
        eng.fail_at, third = None, _arrays(3)
        assert orch.start(3, third, {}, StartArgs())  # every writer task came back
        orch.wait()
        got = _newest(tmp_path / "s")
        assert got.step == 3 and np.array_equal(np.asarray(got.state["i64"]), third["i64"])
    finally:
        orch.close()


def test_a_new_generation_unregisters_the_old_slots_first(tmp_path):
    eng, errors = HostStandIn(), []
    small = {"w": np.arange(70_000, dtype=np.float32)}
    orch = _orchestrator(tmp_path / "s", small, eng, errors)
    try:
        orch.start(1, small, {}, StartArgs())
        orch.wait()
        old = {b for b, _ in eng.registered}
        grown = {"w": np.arange(900_000, dtype=np.float32)}  # outgrows the slots: a new generation
        orch.start(2, grown, {}, StartArgs())
        orch.wait()
        assert old and old <= set(eng.unregistered)
        assert eng.pinned_slots == 1 and not errors
        got = _newest(tmp_path / "s")
        assert got.step == 2 and np.array_equal(np.asarray(got.state["w"]), grown["w"])
    finally:
        orch.close()
