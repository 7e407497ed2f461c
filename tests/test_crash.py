"""Crash torture: SIGKILL a checkpointing child at random moments, then recover in this process.

Every time, ``load_latest`` must return a step >= the last step the child reported durable, with
every array byte-for-byte equal to that step's contents (``_crash_child.state_for``). The child
resumes from the recovered step, so reopening a crashed store is exercised on every round too.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

import pccheck
from _crash_child import state_for
from conftest import assert_state_equal

CHILD = Path(__file__).with_name("_crash_child.py")


def _run_and_kill(path: Path, storage: str, rng: random.Random, env: dict | None = None,
                  extra: tuple[str, ...] = ()) -> int | None:
    """Starts the child, SIGKILLs it at a random moment, returns the last step it saw durable."""
    proc = subprocess.Popen([sys.executable, str(CHILD), str(path), storage, *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    durable: list[int] = []
    ready = threading.Event()

    def reader() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY"):
                ready.set()
            elif line.startswith("DURABLE") and line.split()[1] != "None":
                durable.append(int(line.split()[1]))

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    if rng.random() < 0.25:
        time.sleep(rng.uniform(0.0, 0.6))  # anywhere from start-up (open, recovery) on
    else:
        assert ready.wait(30), proc.stderr.read() if proc.poll() is not None else "child not ready"
        time.sleep(rng.uniform(0.0, 0.3))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    t.join(10)
    err = proc.stderr.read()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL, f"child died on its own: {err}"
    return max(durable) if durable else None


def _torture(path: Path, storage: str, kills: int, seed: int, env: dict | None = None,
             extra: tuple[str, ...] = (), on_recovered=None) -> int:
    rng = random.Random(seed)
    last_durable = None
    recovered = 0
    for _ in range(kills):
        d = _run_and_kill(path, storage, rng, env, extra)
        if d is not None:
            last_durable = max(d, last_durable or d)
        try:
            r = pccheck.load_latest(path)
        except pccheck.NoCheckpointError:
            assert last_durable is None, "a checkpoint reported durable was lost"
            continue
        if last_durable is not None:
            assert r.step >= last_durable, f"recovered step {r.step} < reported durable {last_durable}"
        assert_state_equal(r.state, state_for(r.step))
        if on_recovered is not None:
            on_recovered(r)  # before the next child reopens (and rewrites) the store
        recovered += 1
    return recovered


# `make test` kills the O_DIRECT writer 20 times; the slow round 50 times, and the mmap writer 50 times
@pytest.mark.parametrize("storage,kills", [("odirect", 20), pytest.param("odirect", 50, marks=pytest.mark.slow),
                                           pytest.param("mmap", 50, marks=pytest.mark.slow)])
def test_sigkill_torture(tmp_path, storage, kills):
    # (the seed: the same kill schedule every run, so that a failure replays)
    recovered = _torture(tmp_path / "ckpt", storage, kills=kills, seed=zlib.crc32(storage.encode()) & 0xFFFF)
    assert recovered >= kills * 4 // 5  # nearly every round got far enough to commit something


def test_sigkill_torture_pmem():
    """The PMEM writer (non-temporal copies + per-thread drain), forced on a /dev/shm file."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    import tempfile

    env = dict(os.environ, PMEM_IS_PMEM_FORCE="1")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        recovered = _torture(Path(d) / "ckpt", "pmem", kills=20, seed=7, env=env)
    assert recovered >= 16


@pytest.mark.parametrize("storage", ["odirect", pytest.param("mmap", marks=pytest.mark.slow)])
def test_sigkill_torture_incremental(tmp_path, storage):
    """incremental=True: checkpoints reference the cells of earlier ones (arrays that change
    every 4 steps or never); a kill at any moment still leaves the newest committed one whole,
    and every reopen continues referencing the recovered one's cells."""
    refs: list[bool] = []

    def references(r) -> None:  # noqa: ANN001 - whether the recovered checkpoint references other slots
        image = pccheck.persist.recovery.read_store(r.path)
        with open(r.path, "rb", buffering=0) as f:
            refs.append(pccheck.persist.recovery.read_manifest(image, r.slot, f.fileno()).references(r.slot))

    recovered = _torture(tmp_path / "ckpt", storage, kills=25, seed=zlib.crc32(b"incr" + storage.encode()) & 0xFFFF,
                         extra=("incremental",), on_recovered=references)
    assert recovered >= 20
    assert any(refs), "no recovered checkpoint referenced another's cells"
