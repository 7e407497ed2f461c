"""Kernel write tracking for incremental fingerprints (pccheck/orchestrator/write_watch.py).

A frozen array is read once it is armed only if the kernel reports a write: every way of writing
host memory must be reported (numpy, torch ``.data``, ``copy_``, an EMA update under ``no_grad``,
ctypes, an ``os.readv`` into it, pages zapped by ``MADV_DONTNEED``), a write to a page two arrays
share must reach both, and memory another mapping can write (a shared mapping) is never trusted.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import pccheck
from pccheck.arrays import describe
from pccheck.orchestrator import incremental, write_watch



@pytest.fixture(autouse=True)
def _watch_here():  # type: ignore[no-untyped-def]
    """Checked at run time: a test before may have initialized CUDA, which turns the watch off."""
    if not write_watch.watch_active() or write_watch._device_dma_possible():
        pytest.skip("no kernel write tracking in this process (userfaultfd WP_ASYNC and PAGEMAP_SCAN: "
                    "Linux >= 6.7; off where a device runtime is initialized)")
    # an earlier test's records describe memory since freed; one at the same address and geometry
    # (a refused shared mapping) would otherwise decide how this test's array is watched
    write_watch._watch()._records.clear()

KEYS = incremental.new_keys()
POOL = ThreadPoolExecutor(2)
MiB = 1 << 20


class Counting:
    """The real fingerprint, counting the arrays it reads."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, info, keys):  # type: ignore[no-untyped-def]
        self.reads += 1
        return incremental._fingerprint(info, keys)


def fps(arrays: list, fp: Counting) -> list:
    infos = [describe(f"a{i}", a) for i, a in enumerate(arrays)]
    return write_watch.fingerprints(infos, KEYS, [False] * len(infos), POOL, fp)


def armed(arrays: list, fp: Counting) -> list:
    """Fingerprints ``arrays`` until they are armed and kept (the third pass arms, the fourth
    reads nothing); returns their fingerprints."""
    for _ in range(3):
        first = fps(arrays, fp)
    before = fp.reads
    assert fps(arrays, fp) == first and fp.reads == before, "an unchanged armed array is read again"
    return first


def true_fp(a) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    return incremental._fingerprint(describe("x", a), KEYS)


WRITES = {
    "numpy": lambda t: t.numpy().__setitem__(12345, 7.0),
    "data": lambda t: t.data.__setitem__(777, 1.5),
    "copy_": lambda t: t[: 1024].copy_(torch.ones(1024)),
    "ema": lambda t: torch.no_grad()(lambda: t.mul_(0.999).add_(torch.ones_like(t), alpha=0.001))(),
    "ctypes": lambda t: ctypes.memset(t.data_ptr() + 3 * MiB, 0x41, 16),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_kind_of_write_to_an_armed_array_is_seen(how):
    frozen = torch.randn(4 * MiB // 4)
    other = torch.randn(2 * MiB // 4)
    fp = Counting()
    armed([frozen, other], fp)
    WRITES[how](frozen)
    got = fps([frozen, other], fp)
    assert got[0] == true_fp(frozen) and got[1] == true_fp(other)
    assert fp.reads > 0


def test_a_read_from_a_file_into_an_armed_array_is_seen(tmp_path):
    frozen = np.random.default_rng(0).random(MiB // 8 * 3)
    fp = Counting()
    armed([frozen], fp)
    src = tmp_path / "bytes"
    src.write_bytes(os.urandom(8192))
    fd = os.open(src, os.O_RDONLY)
    try:  # the kernel writes the array's pages, not this process's code
        os.readv(fd, [memoryview(frozen).cast("B")[8192: 8192 + 8192]])
    finally:
        os.close(fd)
    assert fps([frozen], fp)[0] == true_fp(frozen)


def test_a_write_to_a_page_two_arrays_share_rereads_the_array_it_changed():
    buf = np.zeros(3 * MiB + 4096, dtype=np.uint8)
    base = buf.ctypes.data
    cut = (-base) % 4096 + MiB + 100  # not on a page boundary: one page holds bytes of both
    a, b = buf[:cut], buf[cut: cut + 2 * MiB]
    fp = Counting()
    armed([a, b], fp)
    reads = fp.reads
    b[0] = 9  # on the shared page: b's edge bytes
    assert fps([a, b], fp) == [true_fp(a), true_fp(b)] and fp.reads == reads + 1
    a[-1] = 3  # a's
    assert fps([a, b], fp) == [true_fp(a), true_fp(b)] and fp.reads == reads + 2
    assert fps([a, b], fp) == [true_fp(a), true_fp(b)] and fp.reads == reads + 2


def test_a_write_to_pages_two_overlapping_views_share_reaches_both():
    t = torch.randn(2 * MiB)
    whole, half = t, t[: MiB]
    fp = Counting()
    armed([whole, half], fp)
    t[MiB // 2] = 5.0
    assert fps([whole, half], fp) == [true_fp(whole), true_fp(half)]


def test_zapped_pages_count_as_changed():
    m = mmap.mmap(-1, 4 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 5
    fp = Counting()
    armed([arr], fp)
    m.madvise(mmap.MADV_DONTNEED, MiB, MiB)  # those bytes read as zeros now, with no write
    assert arr[MiB] == 0
    assert fps([arr], fp)[0] == true_fp(arr)
    del arr
    m.close()


def test_a_shared_mapping_is_never_trusted():
    m = mmap.mmap(-1, 4 * MiB)  # MAP_SHARED: a forked child writes it through its own mapping
    arr = np.frombuffer(m, dtype=np.uint8)
    arr[:] = 1
    fp = Counting()
    for _ in range(4):
        fps([arr], fp)
    assert fp.reads == 4, "a shared mapping must be fingerprinted at every pass"
    pid = os.fork()
    if pid == 0:
        try:
            np.frombuffer(m, dtype=np.uint8)[2 * MiB] = 2
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert fps([arr], fp)[0] == true_fp(arr)
    del arr
    m.close()


def test_memory_mapped_anew_under_an_armed_array_is_read():
    """The pages under an array replaced by a new mapping (its bytes now zeros, with no write, and
    the new mapping not registered): the scan fails for that range and the array is read."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot, private_anon, fixed = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, 0x10
    n = 4 * MiB
    addr = libc.mmap(None, n, prot, private_anon, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
    arr[:] = 7
    fp = Counting()
    armed([arr], fp)
    assert libc.mmap(addr, n, prot, private_anon | fixed, -1, 0) == addr
    assert arr[12345] == 0
    assert fps([arr], fp)[0] == true_fp(arr)
    libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))


def test_private_memory_mapped_where_a_refused_shared_mapping_was_is_armed_later():
    """A shared mapping is refused; unmapped, and private memory mapped at its address with the same
    geometry: that record is tried again within _RETRY_AFTER calls and armed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    prot, anon, fixed = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_ANONYMOUS, 0x10
    n = 4 * MiB
    addr = libc.mmap(None, n, prot, mmap.MAP_SHARED | anon, -1, 0)
    assert addr not in (None, ctypes.c_void_p(-1).value)
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
    arr[:] = 3
    fp = Counting()
    for _ in range(4):
        fps([arr], fp)
    assert fp.reads == 4, "a shared mapping is never armed"
    assert libc.mmap(addr, n, prot, mmap.MAP_PRIVATE | anon | fixed, -1, 0) == addr
    arr[:] = 4
    for _ in range(write_watch._RETRY_AFTER + 3):
        before = fp.reads
        assert fps([arr], fp)[0] == true_fp(arr)
    assert fp.reads == before, "the private memory is armed once the refusal is retried"
    arr[100] = 5
    assert fps([arr], fp)[0] == true_fp(arr) and fp.reads == before + 1
    libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(n))


def test_off_by_environment(monkeypatch):
    fp = Counting()
    w = write_watch._Watch.__new__(write_watch._Watch)
    monkeypatch.setenv("PCCHECK_WRITE_WATCH", "0")
    w.__init__()
    t = torch.randn(2 * MiB)
    infos = [describe("t", t)]
    for _ in range(5):
        w.fingerprints(infos, KEYS, [False], POOL, fp)
    assert not w.active and fp.reads == 5


def _model(seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4, bias=False),
                                torch.nn.Linear(4, 1024, bias=False))
    model[0].requires_grad_(False)  # a 4 MiB frozen base: armed once it is seen unchanged twice
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _step(model, opt, step: int) -> None:  # type: ignore[no-untyped-def]
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("how", ["data", "no_grad", "copy_", "ema"])
def test_an_in_place_change_to_an_armed_frozen_tensor_is_captured(tmp_path, how):
    """End to end: once the frozen base is armed (no longer read at each checkpoint), an in-place
    change to it reaches the store, and the load gives it back bit for bit."""
    d = tmp_path / "ck"
    model, opt = _model()
    frozen = model[0].weight
    with pccheck.Checkpointer(model, opt, d, incremental=True, interval=1) as ck:
        for step in range(1, 7):
            _step(model, opt, step)
            ck.maybe_checkpoint(step)
            ck.wait()
        last = ck.stats().checkpoints[-1]
        assert last.bytes_referenced >= frozen.numel() * 4 and last.bytes_written < MiB
        with torch.no_grad():
            if how == "data":
                frozen.data[3, 7] += 1.0
            elif how == "no_grad":
                frozen[0].mul_(0.5)
            elif how == "copy_":
                frozen.copy_(torch.full_like(frozen, 0.25))
            else:
                frozen.lerp_(torch.zeros_like(frozen), 0.01)
        want = frozen.detach().clone()
        _step(model, opt, 7)
        ck.maybe_checkpoint(7)
        ck.wait()
        assert ck.stats().checkpoints[-1].bytes_written >= frozen.numel() * 4
    fresh, fresh_opt = _model(seed=7)
    assert pccheck.load_latest(d, model=fresh, optimizer=fresh_opt).step == 7
    assert torch.equal(fresh[0].weight, want)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
