"""Round trips: what goes in comes out with the same names, dtypes, shapes and bytes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import pccheck
from pccheck.native import _native
from conftest import assert_state_equal


def roundtrip(state, path, **kw):
    kw.setdefault("interval", 1)
    with pccheck.Checkpointer(state, path=path, **kw) as ck:
        assert ck.maybe_checkpoint(7)
        ck.wait()
        assert ck.last_durable_step == 7
    r = pccheck.load_latest(path)
    assert r.step == 7
    assert_state_equal(r.state, state)
    return r


ALL_DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128, np.clongdouble,
    "M8[ns]", "m8[us]", "M8[D]", "S7", "U5", "V3", ">i4", ">f8", "<c8",
    np.dtype([("a", "<i4"), ("b", [("c", "<f8", (2,))]), ("d", "S3")]),
    np.dtype({"names": ["x", "y"], "formats": ["u1", "<f4"], "offsets": [0, 8], "itemsize": 16}),
]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_class(store_dir, dtype):
    dt = np.dtype(dtype)
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(5, 3, dt.itemsize), dtype=np.uint8)
    arr = raw.view(dt).reshape(5, 3)  # arbitrary bytes, including NaN payloads and padding
    roundtrip({"x": arr, "scalar": arr[1, 1, ...]}, store_dir)


def test_shapes_empty_0d_noncontiguous(store_dir):
    base = np.arange(4 * 5 * 6, dtype=np.float64).reshape(4, 5, 6)
    state = {
        "empty": np.zeros((0, 3), np.float32),
        "empty2": np.zeros((4, 0, 2), np.int8),
        "zero_d": np.array(3.25),
        "transposed": base.transpose(2, 0, 1),
        "strided": base[::2, 1:, ::-3],
        "fortran": np.asfortranarray(base),
        "column": base[:, 2, 3],
        "broadcast": np.broadcast_to(np.arange(6, dtype=np.int16), (5, 6)),
    }
    r = roundtrip(state, store_dir, chunk_size=4096)
    assert r.state["transposed"].flags.c_contiguous


def test_many_empty_arrays_share_offsets_with_their_neighbours(store_dir):
    # An empty array takes the offset of the array after it. With more than 16 arrays the engine's
    # sort is not stable: it must still order each empty one first (FSDP2 gives a rank empty
    # shards, and a DCP save of that rank failed with "array regions overlap").
    state = {f"a{i:03d}": (np.zeros((0, 32), np.float32) if i % 3 == 0 else np.full(i + 1, i, np.float32))
             for i in range(200)}
    roundtrip(state, store_dir)


def test_huge_but_sparse(store_dir):
    """128 MiB logical arrays backed by almost no memory: a broadcast scalar and untouched zeros."""
    state = {
        "bcast": np.broadcast_to(np.float64(3.5), (4096, 4096)),
        "lazy_zeros": np.zeros(16 << 20, dtype=np.float64),
    }
    r = roundtrip(state, store_dir, chunk_size=8 << 20)
    assert r.state["bcast"].shape == (4096, 4096) and float(r.state["bcast"][-1, -1]) == 3.5


@pytest.mark.parametrize("chunk_size", [4096, 12288, 65536 + 4096, 1 << 20])
def test_chunk_sizes_not_dividing_arrays(store_dir, chunk_size):
    rng = np.random.default_rng(1)
    state = {f"a{i}": rng.random(n) for i, n in enumerate([1, 511, 4097, 70_001, 3])}
    roundtrip(state, store_dir, chunk_size=chunk_size)


def test_state_larger_than_dram_budget(store_dir):
    """Back-pressure: 8 MiB of state through a 64 KiB pool of 16 KiB chunks."""
    rng = np.random.default_rng(2)
    state = {"big": rng.random(1 << 20), "small": rng.random(100)}
    with pccheck.Checkpointer(state, path=store_dir, interval=1, chunk_size=16 << 10,
                              dram_budget=64 << 10, max_concurrent=3) as ck:
        for step in range(1, 6):
            state["big"] += 1.0
            ck.maybe_checkpoint(step)
        ck.wait()
        stats = ck.stats().checkpoints
    assert max(s.backpressure_s for s in stats) > 0
    assert all(s.outcome in ("committed", "superseded") for s in stats)
    r = pccheck.load_latest(store_dir)
    assert r.step == 5
    assert_state_equal(r.state, state)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arrays=st.lists(hnp.arrays(dtype=hnp.scalar_dtypes(), shape=hnp.array_shapes(min_dims=0, max_dims=3,
                                                                                   min_side=0, max_side=9)),
                       min_size=1, max_size=4),
       chunk_pages=st.integers(1, 3))
def test_roundtrip_property(tmp_path_factory, arrays, chunk_pages):
    path = tmp_path_factory.mktemp("prop")
    state = {f"k{i}": a for i, a in enumerate(arrays)}
    roundtrip(state, path, chunk_size=4096 * chunk_pages)


def test_interval_and_metadata(store_dir):
    state = {"x": np.zeros(10)}
    with pccheck.Checkpointer(state, path=store_dir, interval=10, metadata={"run": "abc"}) as ck:
        took = [ck.maybe_checkpoint(s, metadata={"loss": s / 10}) for s in range(1, 31)]
        ck.wait()
    assert [i + 1 for i, t in enumerate(took) if t] == [10, 20, 30]
    r = pccheck.load_latest(store_dir)
    assert r.step == 30 and r.metadata == {"run": "abc", "loss": 3.0}


def test_slot_size_follows_the_metadata_even_when_changed_in_place(store_dir, monkeypatch):
    """The orchestrator keeps its slot-size answer for unchanged arrays and metadata (a manifest's
    upper bound is built once, not per checkpoint), yet a metadata dict the caller grows in place
    between two checkpoints gets a slot that holds it: the step commits and loads with it."""
    import pccheck.orchestrator.slot_size as orch_mod

    built = []
    real = orch_mod.manifest_upper_bound
    monkeypatch.setattr(orch_mod, "manifest_upper_bound", lambda *a, **k: built.append(1) or real(*a, **k))
    arrays = {"w": np.arange(1000, dtype=np.float32)}
    meta = {"note": "short"}
    with pccheck.Checkpointer(arrays, store_dir, interval=1, max_concurrent=1) as ck:
        ck.checkpoint(1, meta)
        ck.wait()
        first = len(built)
        for step in range(2, 6):
            ck.checkpoint(step, meta)
            ck.wait()
        assert len(built) == first, built  # not again for the same arrays and metadata
        meta["note"] = "x" * (256 << 10)  # the same dict, now larger than the slot's slack
        ck.checkpoint(6, meta)
        ck.wait()
        assert len(built) == first + 1
    r = pccheck.load_latest(store_dir)
    assert r.step == 6 and r.metadata["note"] == meta["note"]


def test_concurrent_checkpoints_keep_newest(store_dir):
    rng = np.random.default_rng(3)
    state = {"a": rng.random(300_000), "b": rng.integers(0, 9, 1000)}
    with pccheck.Checkpointer(state, path=store_dir, interval=1, max_concurrent=4,
                              chunk_size=64 << 10, writer_threads=3) as ck:
        for step in range(1, 41):
            state["a"][step] = step
            ck.maybe_checkpoint(step)
        ck.wait()
        assert ck.last_durable_step == 40
        assert ck.generation == 1
    assert_state_equal(pccheck.load_latest(store_dir).state, state)


def test_reopen_continues_counter_and_never_truncates(store_dir):
    state = {"a": np.arange(1000.0)}
    with pccheck.Checkpointer(state, path=store_dir, interval=1) as ck:
        for s in range(1, 4):
            ck.maybe_checkpoint(s)
    first = pccheck.load_latest(store_dir)
    state["a"] += 1
    with pccheck.Checkpointer(state, path=store_dir, interval=1) as ck:
        # Opening must not disturb the last checkpoint.
        r = pccheck.load_latest(store_dir)
        assert (r.step, r.counter) == (first.step, first.counter)
        ck.maybe_checkpoint(4)
    r = pccheck.load_latest(store_dir)
    assert r.step == 4 and r.counter > first.counter and r.generation == first.generation


def test_growing_state_gets_new_generation(store_dir):
    state = {"a": np.arange(1000.0)}
    with pccheck.Checkpointer(state, path=store_dir, interval=1) as ck:
        ck.maybe_checkpoint(1)
        ck.wait()
        gen1 = ck.generation
        state["b"] = np.ones(200_000)  # e.g. optimizer state appearing after the first step
        ck.maybe_checkpoint(2)
        ck.wait()
        assert ck.generation == gen1 + 1
    assert sorted(p.name for p in store_dir.glob("store-*.pcc")) == [f"store-{gen1 + 1:06d}.pcc"]
    r = pccheck.load_latest(store_dir)
    assert r.step == 2
    assert_state_equal(r.state, state)


def test_new_generation_keeps_old_until_commit(store_dir):
    """A store that no longer fits is replaced only once the new one has a commit."""
    with pccheck.Checkpointer({"a": np.arange(10.0)}, path=store_dir, interval=1) as ck:
        ck.maybe_checkpoint(1)
    big = {"a": np.arange(10.0), "b": np.ones(100_000)}
    with pccheck.Checkpointer(big, path=store_dir, interval=1) as ck:
        assert len(list(store_dir.glob("store-*.pcc"))) == 2
        assert pccheck.load_latest(store_dir).step == 1  # the old generation still serves
        ck.maybe_checkpoint(2)
        ck.wait()
    assert len(list(store_dir.glob("store-*.pcc"))) == 1
    assert pccheck.load_latest(store_dir).step == 2


def test_zero_copy_load(store_dir):
    state = {"a": np.arange(5000, dtype=np.int32), "e": np.zeros(0), "z": np.array(2.0)}
    roundtrip(state, store_dir)
    r = pccheck.load_latest(store_dir, zero_copy=True)
    assert_state_equal(r.state, state)
    assert not r.state["a"].flags.writeable
    with pytest.raises(ValueError):
        r.state["a"][0] = 1


def test_default_path_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("PCCHECK_DIR", str(tmp_path / "envdir"))
    state = {"x": np.arange(3)}
    with pccheck.Checkpointer(state, interval=1) as ck:
        ck.maybe_checkpoint(1)
    assert (tmp_path / "envdir").is_dir()
    assert pccheck.load_latest().step == 1


def test_default_path_is_checkpoints_in_cwd(tmp_path, monkeypatch):
    monkeypatch.delenv("PCCHECK_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pccheck.Checkpointer({"x": np.arange(3)}, interval=1) as ck:
        ck.maybe_checkpoint(1)
    assert (tmp_path / "checkpoints").is_dir()
    assert pccheck.load_latest().step == 1


def test_maybe_checkpoint_returns_before_persist(store_dir):
    """The arrays may change as soon as maybe_checkpoint returns: the checkpoint keeps old bytes."""
    state = {"a": np.zeros(2_000_000)}
    with pccheck.Checkpointer(state, path=store_dir, interval=1, chunk_size=64 << 10) as ck:
        ck.maybe_checkpoint(1)
        state["a"][:] = 1.0  # mutate while chunks are still being written
        ck.wait()
    r = pccheck.load_latest(store_dir)
    assert r.step == 1 and not r.state["a"].any()


def test_writer_modes_roundtrip(store_dir):
    state = {"a": np.random.default_rng(5).random(100_000)}
    for storage in ("odirect", "mmap"):
        path = store_dir / storage
        with pccheck.Checkpointer(state, path=path, interval=1, storage=storage) as ck:
            ck.maybe_checkpoint(1)
            ck.wait()
            assert ck.storage == storage
        assert_state_equal(pccheck.load_latest(path).state, state)


PMEM_SCRIPT = r"""
import sys, numpy as np, pccheck
path = sys.argv[1]
rng = np.random.default_rng(9)
state = {"a": rng.random(200_001), "b": np.arange(77, dtype=np.int16)[::2], "z": np.array(1)}
with pccheck.Checkpointer(state, path=path, interval=1, storage=sys.argv[2], chunk_size=64 << 10) as ck:
    for s in range(1, 6):
        state["a"] += 1
        ck.maybe_checkpoint(s)
    ck.wait()
    mode = ck.storage
r = pccheck.load_latest(path)
assert r.step == 5
for k in state:
    assert np.array_equal(r.state[k], state[k]) and r.state[k].dtype == state[k].dtype
print(mode, pccheck.native._native.ntcopy_kernel())
"""


@pytest.mark.parametrize("storage", ["pmem", "auto"])
def test_pmem_roundtrip_forced(storage):
    """On /dev/shm with PMEM_IS_PMEM_FORCE=1 the PMEM writer (NT copy + drain) runs and round-trips;
    storage="auto" picks it by itself."""
    import tempfile

    env = dict(os.environ, PMEM_IS_PMEM_FORCE="1")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        out = subprocess.run([sys.executable, "-c", PMEM_SCRIPT, d, storage], env=env,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    mode, kernel = out.stdout.split()
    assert mode == "pmem"
    assert kernel == ("libpmem" if _native.have_libpmem() else kernel)


def _odirect_supported(directory: str) -> bool:
    probe = os.path.join(directory, "probe")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def test_tmpfs_auto_picks_a_working_mode():
    """tmpfs supports O_DIRECT only on newer kernels (6.6+): "auto" uses it there, and falls back
    to mmap + msync where opening with O_DIRECT fails with EINVAL."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        want = "odirect" if _odirect_supported(d) else "mmap"
        state = {"a": np.arange(100)}
        with pccheck.Checkpointer(state, path=d, interval=1) as ck:
            ck.maybe_checkpoint(1)
            assert ck.storage == want
        assert pccheck.load_latest(d).step == 1
