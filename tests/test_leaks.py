"""Open-checkpoint-close cycles leak nothing (the long version is ``python -m bench.soak``).

Each test opens a ``Checkpointer`` on one store, takes one checkpoint and closes it, ``CYCLES`` times
after ``WARMUP`` cycles not counted (lazy imports, torch's intra-op threads and other things that start
once). Open file descriptors (``/proc/self/fd``), OS threads (``/proc/self/status``) and Python
threads must not grow from before to after: a single fd or thread left behind per cycle shows as 200
(a count may only drop, when something an earlier test started ends meanwhile).
The counts are read after ``close()`` returned, with no collection forced between them, so a
descriptor or thread that waits for the garbage collector (which runs only now and then) shows too. The arrays test
writes to the disk under tmp_path (O_DIRECT, its own fd and the writers' AIO contexts), the torch
test to tmpfs (the mmap writer) to stay fast.
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import pccheck

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is not installed: import it from the checkout, after site-packages
    sys.path.append(str(ROOT))

from bench.training.soak import resources  # noqa: E402  (RSS, fds, OS and Python threads of this process)

CYCLES = 100  # fds and threads are counted exactly: one left per cycle shows after any number
WARMUP = 5
MIB = 1 << 20


@pytest.fixture
def shm_dir(tmp_path) -> Iterator[Path]:
    """A store directory on tmpfs (the mmap writer; no disk flushes, so the cycles stay fast), else
    under tmp_path."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path / "ckpt"
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d) / "ckpt"


def _counts() -> dict[str, int]:
    r = resources()
    return {k: r[k] for k in ("fds", "threads_os", "threads_py")}


def _cycle(one: Callable[[int], None]) -> tuple[dict[str, int], dict[str, int]]:
    """Counts after ``WARMUP`` cycles and after ``CYCLES`` more; ``one(step)`` is one cycle. What earlier
    tests left to the garbage collector is collected first, so it cannot change the counts midway."""
    gc.collect()
    for step in range(1, WARMUP + 1):
        one(step)
    before = _counts()
    for step in range(WARMUP + 1, WARMUP + CYCLES + 1):
        one(step)
    return before, _settled(before)


def _settled(before: dict[str, int], timeout: float = 5.0) -> dict[str, int]:
    """The counts once no more than ``before`` (or at ``timeout``): a joined thread can take a moment
    to leave /proc/self/status after join() returns; a leaked one never does."""
    deadline = time.monotonic() + timeout
    after = _counts()
    while any(after[k] > before[k] for k in before) and time.monotonic() < deadline:
        time.sleep(0.01)
        after = _counts()
    return after


def _assert_no_growth(before: dict[str, int], after: dict[str, int]) -> None:
    grown = {k: (before[k], after[k]) for k in before if after[k] > before[k]}
    assert not grown, f"{CYCLES} cycles left behind (before, after): {grown}"


def test_arrays_cycles_leave_no_fd_or_thread(store_dir):
    rng = np.random.default_rng(0)
    state = {"w": rng.standard_normal(MIB // 8).astype(np.float32), "i": np.arange(MIB // 16, dtype=np.int64)}

    def one(step: int) -> None:
        with pccheck.Checkpointer(state, store_dir, interval=1, max_concurrent=4) as ck:
            assert ck.checkpoint(step)
        state["w"] += 1  # the training that would run between two cycles

    before, after = _cycle(one)
    _assert_no_growth(before, after)
    r = pccheck.load_latest(store_dir)
    assert r.step == WARMUP + CYCLES
    np.testing.assert_array_equal(r.state["w"], state["w"] - 1)


def test_torch_soft_cow_cycles_leave_no_fd_thread_or_hook(shm_dir):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 128), torch.randint(0, 10, (16,))

    def train() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    train()  # AdamW's state exists before the first Checkpointer sees it

    def one(step: int) -> None:
        ck = pccheck.Checkpointer(model, opt, path=shm_dir, interval=1, max_concurrent=4, soft_cow=True)
        try:
            assert ck.maybe_checkpoint(step)
            train()  # the step pre-hook waits for whatever the copy has not read yet
        finally:
            ck.close()

    before, after = _cycle(one)
    _assert_no_growth(before, after)
    assert not getattr(opt, "_optimizer_step_pre_hooks", {}), "close() left the copy-on-write pre-hook behind"
    assert pccheck.load_latest(shm_dir).step == WARMUP + CYCLES


def test_close_releases_the_dram_pool_without_a_collection(store_dir):
    state = {"w": np.ones(8 * MIB, np.float32)}  # 32 MiB: a pool of 2 x 32 MiB, faulted in at open
    gc.collect()
    gc.disable()
    try:
        ck = pccheck.Checkpointer(state, store_dir, interval=1)
        assert ck.checkpoint(1)
        ck.wait()
        open_rss = resources()["rss_bytes"]
        ck.close()
        del ck
        closed_rss = resources()["rss_bytes"]
    finally:
        gc.enable()
    assert open_rss - closed_rss >= 32 * MIB, (
        f"RSS {open_rss / MIB:.0f} MiB open, {closed_rss / MIB:.0f} MiB after close() and del")
