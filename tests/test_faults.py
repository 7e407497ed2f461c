"""I/O fault injection at every call site (after SQLite's I/O-error loop).

The native core routes every pwrite / fdatasync / msync / posix_fallocate and the PMEM fence through
``pcc::io`` (native/io.h), where ``_native.set_fault(mask, n, err, persistent)`` fails the n-th call.
For n = 1, 2, 3, ... a checkpoint runs with the n-th call failing, until a checkpoint completes with
fewer than n calls (no call site left). After every n:

* the error surfaces as the matching ``StorageError`` subclass, with errno and a message saying the
  last checkpoint is still loadable, from ``maybe_checkpoint`` / ``wait`` / ``close``;
* ``load_latest`` returns the previous step or the new one, with exactly that step's bytes;
* once the fault is cleared, training goes on: the next checkpoint commits and loads bit-exact;
* nothing hangs (every call runs under a watchdog) and no thread is left behind.

EINTR and short writes must be invisible: the checkpoint succeeds and loads bit-exact.
tmp_path is on ext4 here, so the default mode is O_DIRECT; "mmap" and (in a subprocess, with
PMEM_IS_PMEM_FORCE=1) "pmem" variants run the same loop.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import pccheck
from pccheck.native import _native

# -- helpers (kept in this file on purpose: conftest.py is shared with other test files) -------------

CHUNK = 64 << 10
CALL_TIMEOUT_S = 30.0   # one checkpoint of ~256 KiB takes milliseconds; 30 s means "hung"
TEST_TIMEOUT_S = 180.0  # last resort: dump every thread's stack and exit if a test hangs anyway
KW = dict(interval=1, max_concurrent=2, writer_threads=2, chunk_size=CHUNK, on_error="raise")


@pytest.fixture(autouse=True)
def _watchdog_and_clear_fault():
    """Never leak an armed fault into the next test; never let a hung test block the suite."""
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _native.clear_fault()


def _guarded(fn: Callable[[], Any], timeout: float = CALL_TIMEOUT_S) -> BaseException | None:
    """Runs fn on a helper thread; returns the exception it raised (or None). Fails if it hangs."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            box["exc"] = exc

    t = threading.Thread(target=target, name="test-guarded", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        faulthandler.dump_traceback(all_threads=True)
        _native.clear_fault()
        pytest.fail(f"hung for {timeout} s (stacks dumped above)")
    return box.get("exc")


def _ok(fn: Callable[[], Any]) -> None:
    exc = _guarded(fn)
    if exc is not None:
        raise exc


def make_state(seed: int = 0) -> dict[str, np.ndarray]:
    """~250 KiB in 5 arrays (one non-contiguous, one structured): 4 chunks of 64 KiB."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((90, 100))
    s = np.zeros(500, dtype=[("x", "<i4"), ("y", "<f8")])
    s["x"] = rng.integers(0, 1 << 30, 500)
    s["y"] = rng.random(500)
    return {
        "w": rng.standard_normal((128, 256)).astype(np.float32),   # 128 KiB
        "b": rng.integers(-(1 << 40), 1 << 40, 5000),               # int64, 40000 B
        "t": base.T,                                                # non-contiguous view, 72000 B
        "u": rng.integers(0, 256, 3001, dtype=np.uint8),
        "s": s,
    }


def mutate(state: dict[str, np.ndarray], step: int) -> None:
    """Overwrites every byte of every array in place, differently for each step."""
    rng = np.random.default_rng(1000 + step)
    state["w"][...] = rng.standard_normal(state["w"].shape)
    state["b"][...] = rng.integers(-(1 << 40), 1 << 40, state["b"].shape)
    state["t"][...] = rng.standard_normal(state["t"].shape)
    state["u"][...] = rng.integers(0, 256, state["u"].shape)
    state["s"]["x"] = rng.integers(0, 1 << 30, state["s"].shape)
    state["s"]["y"] = rng.random(state["s"].shape)


def snapshot(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in state.items()}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(w).tobytes(), f"wrong bytes in {k!r}"


def assert_loads(path: Path, wants: dict[int, dict[str, np.ndarray]]) -> int:
    """load_latest returns one of the allowed steps, with exactly that step's bytes."""
    r = pccheck.load_latest(path)
    assert r.step in wants, f"load_latest returned step {r.step}, expected one of {sorted(wants)}"
    assert_same(r.state, wants[r.step])
    assert r.metadata.get("step") == r.step
    return r.step


def assert_storage_error(exc: BaseException | None, err: int) -> None:
    assert exc is not None
    want = {errno.ENOSPC: pccheck.NoSpaceError, errno.EIO: pccheck.DeviceIOError}[err]
    assert isinstance(exc, want), f"expected {want.__name__}, got {exc!r}"
    assert isinstance(exc, pccheck.StorageError) and isinstance(exc, pccheck.PCCheckError)
    assert isinstance(exc, OSError) and exc.errno == err, repr(exc)
    assert "still loadable" in str(exc), str(exc)
    assert ("free space" if err == errno.ENOSPC else "I/O error") in str(exc), str(exc)


def store_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.name != "LOCK")


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def assert_no_thread_left(baseline: int) -> None:
    """OS threads (native writers included) are back to the baseline. A joined thread can take a
    moment to leave /proc after Python's join() returns, so poll briefly."""
    deadline = time.monotonic() + 5.0
    while native_threads() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert native_threads() <= baseline, "native writer threads outlived their Checkpointer"


def pccheck_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pccheck")}


def ckpt(ck: pccheck.Checkpointer, step: int) -> None:
    ck.maybe_checkpoint(step, metadata={"step": step})
    ck.wait()


# -- the I/O-error loop ---------------------------------------------------------------------------


def fault_loop(root: Path, *, storage: str, err: int, persistent: bool, mask: int = _native.OP_ALL,
               grow: bool = False) -> list[int]:
    """Runs the loop; returns the n values whose fault produced an error."""
    threads0, py0 = native_threads(), pccheck_threads()
    hit: list[int] = []
    for n in range(1, 200):
        d = root / f"n{n}"
        state = make_state(n)
        ck = pccheck.Checkpointer(state, d, storage=storage, **KW)
        try:
            if storage == "auto":
                assert ck.storage == "odirect"  # tmp_path is ext4: the default mode must be O_DIRECT
            _ok(lambda: ckpt(ck, 1))
            wants = {1: snapshot(state)}
            mutate(state, 2)
            if grow:  # the state outgrows the slots: step 2 also creates store generation 2
                state["g"] = np.arange(60000, dtype=np.float32)
            wants[2] = snapshot(state)

            _native.set_fault(mask, n, err, persistent)
            try:
                exc = _guarded(lambda: ckpt(ck, 2))
            finally:
                calls = _native.fault_calls()
                _native.clear_fault()

            if exc is None:
                # Success is only allowed if the n-th call never happened: else an error was swallowed.
                assert calls < n, f"n={n}: the injected fault fired ({calls} calls) but step 2 reported success"
                assert ck.last_durable_step == 2
                assert_loads(d, {2: wants[2]})
                break
            assert_storage_error(exc, err)
            hit.append(n)
            assert ck.last_durable_step == 1, f"n={n}: a failed checkpoint must not be reported durable"
            # Right after the fault: the last checkpoint, or the new one if it got all the way to the
            # commit word, with exactly its bytes. Never anything else.
            assert_loads(d, wants)
            assert not [f for f in store_files(d) if not f.endswith(".pcc")], store_files(d)

            # Training continues with the same Checkpointer, and no stale error comes back.
            mutate(state, 3)
            wants = {3: snapshot(state)}
            _ok(lambda: ckpt(ck, 3))
            assert ck.last_durable_step == 3
            assert_loads(d, wants)
            if grow:  # generation 2 has a commit: generation 1 is retired
                assert store_files(d) == ["store-000002.pcc"], store_files(d)
        finally:
            _native.clear_fault()
            _ok(ck.close)
        # Reopening after the fault continues from step 3.
        if hit and hit[-1] == n:
            assert_loads(d, wants)
            ck2 = pccheck.Checkpointer(state, d, storage=storage, **KW)
            try:
                mutate(state, 4)
                wants4 = {4: snapshot(state)}
                _ok(lambda: ckpt(ck2, 4))
                assert_loads(d, wants4)
            finally:
                _ok(ck2.close)
    else:
        pytest.fail("the loop never ran out of call sites")
    assert pccheck_threads() <= py0, "a pccheck Python thread outlived its Checkpointer"
    assert_no_thread_left(threads0)
    return hit


@pytest.mark.parametrize("storage", ["auto", "mmap"])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_transient_fault_at_every_call_site(tmp_path, storage, err):
    hit = fault_loop(tmp_path, storage=storage, err=err, persistent=False)
    # O_DIRECT: slot prep, 4 chunks, manifest, meta, fdatasync, CHECK_ADDR msync.
    # mmap: 4 chunk msyncs, fdatasync, CHECK_ADDR msync.
    assert len(hit) >= (9 if storage == "auto" else 6), hit
    assert hit == list(range(1, len(hit) + 1))


@pytest.mark.parametrize("storage", ["auto", "mmap"])
def test_persistent_eio_from_every_call_site(tmp_path, storage):
    hit = fault_loop(tmp_path, storage=storage, err=errno.EIO, persistent=True)
    assert len(hit) >= (9 if storage == "auto" else 6), hit


def test_fault_while_creating_a_new_generation(tmp_path):
    """The state grows, so step 2 creates store generation 2 (fallocate, header, fdatasync) first."""
    hit = fault_loop(tmp_path, storage="auto", err=errno.EIO, persistent=False, grow=True)
    assert len(hit) >= 12, hit  # 3 creation calls + slot prep + >= 4 chunks + 4 commit calls


def test_persistent_fault_while_creating_a_new_generation(tmp_path):
    hit = fault_loop(tmp_path, storage="auto", err=errno.ENOSPC, persistent=True, grow=True)
    assert len(hit) >= 12, hit


def test_fault_with_two_checkpoints_in_flight(tmp_path):
    """max_concurrent=2 with both in flight: any of steps 1..3 may be latest, never wrong bytes."""
    hit = 0
    for n in range(1, 200):
        d = tmp_path / f"n{n}"
        state = make_state(n)
        ck = pccheck.Checkpointer(state, d, **KW)
        try:
            _ok(lambda: ckpt(ck, 1))
            wants = {1: snapshot(state)}
            _native.set_fault(_native.OP_ALL, n, errno.EIO)
            try:
                def two() -> None:
                    for step in (2, 3):
                        mutate(state, step)
                        wants[step] = snapshot(state)  # the arrays are free again once this returns
                        ck.maybe_checkpoint(step, metadata={"step": step})
                    ck.wait()
                exc = _guarded(two)
            finally:
                calls = _native.fault_calls()
                _native.clear_fault()
            if exc is None:
                assert calls < n, f"n={n}: the injected fault fired but no error surfaced"
                assert_loads(d, {3: wants[3]})
                break
            assert_storage_error(exc, errno.EIO)
            hit += 1
            assert_loads(d, wants)
            mutate(state, 4)
            w4 = {4: snapshot(state)}
            _ok(lambda: ckpt(ck, 4))
            assert_loads(d, w4)
        finally:
            _native.clear_fault()
            _ok(ck.close)
    assert hit >= 15, hit


# -- EINTR and short writes: retried, never visible ---------------------------------------------------


def _baseline_calls(ck: pccheck.Checkpointer, state: dict, mask: int, step: int) -> int:
    _native.set_fault(mask, 1 << 62, errno.EIO)  # counts calls, never fires
    try:
        mutate(state, step)
        _ok(lambda: ckpt(ck, step))
        return _native.fault_calls()
    finally:
        _native.clear_fault()


@pytest.mark.parametrize("storage", ["auto", "mmap"])
def test_eintr_at_every_call_site_is_retried(tmp_path, storage):
    state = make_state()
    with pccheck.Checkpointer(state, tmp_path / "c", storage=storage, **KW) as ck:
        _ok(lambda: ckpt(ck, 1))
        base = _baseline_calls(ck, state, _native.OP_ALL, 2)
        assert base >= (9 if storage == "auto" else 6)
        step = 2
        for n in range(1, base + 2):
            step += 1
            mutate(state, step)
            want = {step: snapshot(state)}
            _native.set_fault(_native.OP_ALL, n, errno.EINTR)
            try:
                _ok(lambda: ckpt(ck, step))
                calls = _native.fault_calls()
            finally:
                _native.clear_fault()
            # The interrupted call was retried: exactly one call more than without the fault.
            assert calls == (base + 1 if n <= base else base), (n, calls, base)
            assert ck.last_durable_step == step
            assert_loads(tmp_path / "c", want)


def test_short_write_at_every_pwrite_is_continued(tmp_path):
    state = make_state()
    with pccheck.Checkpointer(state, tmp_path / "c", **KW) as ck:
        assert ck.storage == "odirect"
        _ok(lambda: ckpt(ck, 1))
        base = _baseline_calls(ck, state, _native.OP_PWRITE, 2)
        shortened = []
        step = 2
        for n in range(1, base + 2):
            step += 1
            mutate(state, step)
            want = {step: snapshot(state)}
            _native.set_fault(_native.OP_PWRITE, n, _native.SHORT_WRITE)
            try:
                _ok(lambda: ckpt(ck, step))
                calls = _native.fault_calls()
            finally:
                _native.clear_fault()
            assert calls in (base, base + 1), (n, calls, base)
            if calls == base + 1:  # the n-th pwrite (a chunk) wrote half; the rest was written after
                shortened.append(n)
            assert_loads(tmp_path / "c", want)
        assert len(shortened) >= 4, (shortened, base)  # every 64 KiB chunk write was shortened once


def test_eintr_during_store_creation_is_retried(tmp_path):
    for n in range(1, 10):
        d = tmp_path / f"n{n}"
        _native.set_fault(_native.OP_ALL, n, errno.EINTR)
        try:
            ck = pccheck.Checkpointer(make_state(), d, **KW)
            calls = _native.fault_calls()
        finally:
            _native.clear_fault()
        with ck:
            _ok(lambda: ckpt(ck, 1))
        assert pccheck.load_latest(d).step == 1
        if calls < n:
            break
    else:
        pytest.fail("the loop never ran out of call sites")


# -- store creation -------------------------------------------------------------------------------


def _assert_no_store_file(d: Path) -> None:
    left = [p.name for p in d.glob("store-*")] + [p.name for p in d.glob("*.tmp")]
    assert not left, f"half-created store file left behind: {left}"


def test_enospc_at_store_creation(tmp_path):
    d = tmp_path / "c"
    _native.set_fault(_native.OP_FALLOCATE, 1, errno.ENOSPC)
    try:
        with pytest.raises(pccheck.NoSpaceError) as ei:
            pccheck.Checkpointer(make_state(), d, **KW)
        assert _native.fault_calls() == 1
    finally:
        _native.clear_fault()
    assert ei.value.errno == errno.ENOSPC
    assert "free space" in str(ei.value) and "store-000001.pcc" in str(ei.value)
    _assert_no_store_file(d)
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(d)
    # The failed constructor released the lock: a new Checkpointer opens and works.
    state = make_state()
    with pccheck.Checkpointer(state, d, **KW) as ck:
        _ok(lambda: ckpt(ck, 1))
    assert_loads(d, {1: state})


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])
def test_fault_at_every_call_of_store_creation(tmp_path, err):
    hit = []
    for n in range(1, 20):
        d = tmp_path / f"n{n}"
        _native.set_fault(_native.OP_ALL, n, err)
        box: dict[str, pccheck.Checkpointer] = {}
        try:
            exc = _guarded(lambda: box.setdefault("ck", pccheck.Checkpointer(make_state(), d, **KW)))
            calls = _native.fault_calls()
        finally:
            _native.clear_fault()
        if exc is None:
            ck = box["ck"]
            assert calls < n, f"n={n}: the fault fired but the constructor succeeded"
            with ck:
                _ok(lambda: ckpt(ck, 1))
            break
        assert_storage_error(exc, err)
        hit.append(n)
        _assert_no_store_file(d)
        with pccheck.Checkpointer(make_state(), d, **KW) as ck:  # the lock was released
            _ok(lambda: ckpt(ck, 1))
    else:
        pytest.fail("the loop never ran out of call sites")
    assert len(hit) >= 3, hit  # fallocate, header pwrite, fdatasync


# -- where the error surfaces -----------------------------------------------------------------------


def test_background_error_surfaces_from_close(tmp_path):
    d = tmp_path / "c"
    state = make_state()
    ck = pccheck.Checkpointer(state, d, **KW)
    _ok(lambda: ckpt(ck, 1))
    want1 = snapshot(state)
    mutate(state, 2)
    _native.set_fault(_native.OP_PWRITE, 3, errno.EIO)  # a chunk write
    try:
        _ok(lambda: ck.maybe_checkpoint(2, metadata={"step": 2}))
        exc = _guarded(ck.close)  # no wait(): close waits, then raises the pending error
    finally:
        _native.clear_fault()
    assert_storage_error(exc, errno.EIO)
    assert_loads(d, {1: want1})
    with pccheck.Checkpointer(state, d, **KW) as ck2:  # close released the lock despite raising
        _ok(lambda: ckpt(ck2, 3))
    assert_loads(d, {3: state})


# -- on_error -----------------------------------------------------------------------------------


def _on_error_loop(root: Path, storage: str, caplog) -> int:
    errors = 0
    for n in range(1, 50):
        d = root / f"n{n}"
        state = make_state(n)
        with pccheck.Checkpointer(state, d, storage=storage, **{**KW, "on_error": "log"}) as ck:
            _ok(lambda: ckpt(ck, 1))
            wants = {1: snapshot(state)}
            mutate(state, 2)
            wants[2] = snapshot(state)
            caplog.clear()
            _native.set_fault(_native.OP_ALL, n, errno.ENOSPC)
            try:
                exc = _guarded(lambda: ckpt(ck, 2))
                calls = _native.fault_calls()
            finally:
                _native.clear_fault()
            assert exc is None, f"n={n}: on_error='log' must not raise, got {exc!r}"
            logged = [r for r in caplog.records if r.name == "pccheck" and r.levelno >= logging.ERROR]
            if calls < n:
                assert not logged
                break
            assert len(logged) == 1, [r.getMessage() for r in logged]
            assert "ENOSPC" in logged[0].getMessage() and "still loadable" in logged[0].getMessage()
            errors += 1
            assert_loads(d, wants)
            mutate(state, 3)
            w3 = {3: snapshot(state)}
            _ok(lambda: ckpt(ck, 3))
            assert_loads(d, w3)
        # close (by the with) must not raise either
    return errors


def test_on_error_log_logs_and_goes_on(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="pccheck")
    assert _on_error_loop(tmp_path, "mmap", caplog) >= 6


def test_on_error_log_covers_slot_preparation(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="pccheck")
    state = make_state()
    with pccheck.Checkpointer(state, tmp_path / "c", **{**KW, "on_error": "log"}) as ck:
        _ok(lambda: ckpt(ck, 1))
        _native.set_fault(_native.OP_PWRITE, 1, errno.ENOSPC)  # the first pwrite: slot preparation
        try:
            exc = _guarded(lambda: ckpt(ck, 2))
        finally:
            _native.clear_fault()
        if exc is not None:
            raise exc
        assert any("ENOSPC" in r.getMessage() for r in caplog.records if r.name == "pccheck")


def test_on_error_callable_receives_the_exception(tmp_path):
    got: list[tuple[BaseException, str]] = []
    state = make_state()
    d = tmp_path / "c"
    with pccheck.Checkpointer(state, d, **{**KW, "on_error": lambda e: got.append((e, threading.current_thread().name))}) as ck:
        _ok(lambda: ckpt(ck, 1))
        want1 = snapshot(state)
        mutate(state, 2)
        _native.set_fault(_native.OP_FDATASYNC, 1, errno.EIO)  # the commit's barrier
        try:
            assert _guarded(lambda: ckpt(ck, 2)) is None
        finally:
            _native.clear_fault()
        assert len(got) == 1
        exc, thread = got[0]
        assert_storage_error(exc, errno.EIO)
        assert "step 2" in str(exc)
        assert thread != threading.main_thread().name
        assert_loads(d, {1: want1})
        mutate(state, 3)
        _ok(lambda: ckpt(ck, 3))
    assert len(got) == 1
    assert_loads(d, {3: state})


def test_on_error_callable_that_raises_is_logged(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="pccheck")

    def bad(exc: BaseException) -> None:
        raise RuntimeError("callback broke")

    state = make_state()
    with pccheck.Checkpointer(state, tmp_path / "c", **{**KW, "on_error": bad}) as ck:
        _ok(lambda: ckpt(ck, 1))
        _native.set_fault(_native.OP_FDATASYNC, 1, errno.EIO)
        try:
            assert _guarded(lambda: ckpt(ck, 2)) is None
        finally:
            _native.clear_fault()
        assert any("on_error callback raised" in r.getMessage() for r in caplog.records)
        _ok(lambda: ckpt(ck, 3))
    assert pccheck.load_latest(tmp_path / "c").step == 3


# -- a failed commit barrier that is never retried ----------------------------------------------------


@pytest.mark.parametrize("incremental", [True, False])
@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_checkpointer_recovers_after_failed_barriers(tmp_path, max_concurrent, incremental):
    """Incremental: each failed commit pins its cells; persisting the word again makes the newest
    the base (else N failures would pin every cell and nothing could commit again)."""
    d = tmp_path / "c"
    state = make_state()
    with pccheck.Checkpointer(state, d, **{**KW, "max_concurrent": max_concurrent}, incremental=incremental) as ck:
        _ok(lambda: ckpt(ck, 1))
        # In O_DIRECT mode the only msync is the CHECK_ADDR barrier.
        _native.set_fault(_native.OP_MSYNC, 1, errno.EIO, persistent=True)
        try:
            for step in range(2, 2 + max_concurrent):
                mutate(state, step)
                want = {step: snapshot(state)}
                assert_storage_error(_guarded(lambda: ckpt(ck, step)), errno.EIO)
                assert_loads(d, want)  # the word is in the page cache: complete data, right bytes
        finally:
            _native.clear_fault()
        # The device is healthy again: training must go on with this Checkpointer.
        mutate(state, 9)
        want = {9: snapshot(state)}
        exc = _guarded(lambda: ckpt(ck, 9))
        if exc is not None:
            raise exc
        assert_loads(d, want)


# -- PMEM (forced on an ext4 file, in a subprocess so the force cannot leak into this process) ------

_PMEM_CHILD = textwrap.dedent(r"""
    import errno, json, sys
    import numpy as np, pccheck
    from pccheck.native import _native
    root = sys.argv[1]
    out = []
    for n in range(1, 60):
        d = f"{root}/n{n}"
        st = {"a": np.arange(70000, dtype=np.float32), "b": np.arange(9000, dtype=np.int64)}
        ck = pccheck.Checkpointer(st, d, interval=1, chunk_size=64 << 10, storage="pmem")
        assert ck.storage == "pmem"
        ck.checkpoint(1); ck.wait()
        st["a"] += 1; st["b"] *= 3
        _native.set_fault(_native.OP_ALL, n, errno.EIO, n % 2 == 0)
        err = None
        try:
            ck.checkpoint(2); ck.wait()
        except pccheck.PCCheckError as e:
            err = [type(e).__name__, e.errno, str(e)]
        calls = _native.fault_calls()
        _native.clear_fault()
        r = pccheck.load_latest(d)
        exact = (r.state["a"] == np.arange(70000, dtype=np.float32) + (r.step == 2)).all() and \
                (r.state["b"] == np.arange(9000, dtype=np.int64) * (3 if r.step == 2 else 1)).all()
        st["a"] += 1
        ck.checkpoint(3); ck.wait()
        r3 = pccheck.load_latest(d)
        after = r3.step == 3 and bool((r3.state["a"] == st["a"]).all())
        ck.close()
        out.append({"n": n, "calls": calls, "err": err, "loaded": r.step, "exact": bool(exact), "after": after})
        if err is None:
            break
    print(json.dumps(out))
""")


def test_pmem_fence_faults(tmp_path):
    env = {**os.environ, "PMEM_IS_PMEM_FORCE": "1"}
    p = subprocess.run([sys.executable, "-c", _PMEM_CHILD, str(tmp_path)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout.strip().splitlines()[-1])
    *failed, last = rows
    assert last["err"] is None and last["calls"] < last["n"], last
    assert len(failed) >= 5, rows  # per-chunk fences, records fence, CHECK_ADDR fence
    for row in failed:
        name, code, msg = row["err"]
        assert name == "DeviceIOError" and code == errno.EIO and "still loadable" in msg, row
        assert row["loaded"] in (1, 2) and row["exact"] and row["after"], row
