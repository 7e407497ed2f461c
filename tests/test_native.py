"""The native building blocks on their own: crc32c (against the `crc32c` package), combine,
the engine's chunk pool and strided copies, and the store's slot queue."""

from __future__ import annotations

import crc32c as reference
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pccheck.native import _native


def test_crc32c_check_value():
    assert _native.crc32c(b"123456789") == 0xE3069283
    assert _native.crc32c(b"") == 0


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=70_000), cut=st.integers(0, 70_000))
def test_crc32c_matches_reference_and_combines(data, cut):
    cut = min(cut, len(data))
    assert _native.crc32c(data) == reference.crc32c(data)
    a, b = data[:cut], data[cut:]
    assert _native.crc32c_combine(_native.crc32c(a), _native.crc32c(b), len(b)) == _native.crc32c(data)
    assert _native.crc32c(b, _native.crc32c(a)) == _native.crc32c(data)


def test_crc32c_large_interleaved_path():
    data = np.random.default_rng(0).integers(0, 256, 3 * 8192 * 5 + 77, dtype=np.uint8)
    assert _native.crc32c(data) == reference.crc32c(data.tobytes())


def test_prefault_keeps_contents_and_needs_a_writable_buffer():
    import mmap

    mm = mmap.mmap(-1, (8 << 20) + 4096)
    view = np.frombuffer(mm, np.uint8)
    view[::4096] = 7  # half of the pages touched already, the rest fresh
    view[4096 * 3 + 5] = 9
    _native.prefault(memoryview(mm)[4096:])  # fresh anonymous pages stay zero, written ones keep their bytes
    assert view[::4096].tolist() == [7] * len(view[::4096])
    assert view[4096 * 3 + 5] == 9 and int(view.sum()) == 7 * len(view[::4096]) + 9
    arr = np.arange(1000, dtype=np.int64)[::3]  # not page-aligned, strided base
    base = arr.base.copy()
    _native.prefault(arr.base)
    assert np.array_equal(arr.base, base)
    with pytest.raises(BufferError):
        _native.prefault(b"read-only bytes")
    del view
    mm.close()


def test_engine_rejects_bad_geometry():
    with pytest.raises(ValueError):
        _native.Engine(1000, 2, 1)  # not a multiple of 4096
    with pytest.raises(ValueError):
        _native.Engine(4096, 0, 1)


@pytest.mark.parametrize("given", ["layout order", "reversed"])
def test_engine_copy_strided_sources(tmp_path, given):
    """A job copies strided arrays into chunks and the writers put them at the slot offset; its
    crcs come in the order the arrays were given, whatever order their regions are in."""
    path = str(tmp_path / "s.pcc")
    _native.create_store(path, 2, 1 << 20, 1)
    store = _native.Store(path, "odirect")
    store.init(0, 1)
    engine = _native.Engine(8192, 2, 2)
    base = np.arange(60_000, dtype=np.int32).reshape(300, 200)
    views = [base[::3, ::-2], base.T, np.broadcast_to(np.int64(7), (50, 40))]
    sources, off = [], 0
    for v in views:
        sources.append((v.ctypes.data, off, v.nbytes, v.itemsize, v.shape, v.strides))
        off = (off + v.nbytes + 63) // 64 * 64
    stream = (off + 4095) // 4096 * 4096
    slot = store.acquire_slot()
    job = engine.begin(store, slot, sources if given == "layout order" else sources[::-1], stream)
    job.copy()
    assert job.wait(30) and job.error == 0
    crcs = job.crcs if given == "layout order" else job.crcs[::-1]
    assert engine.free_chunks() == 2  # every chunk came back after its write
    slot_off = store.header["slots_offset"] + slot * store.header["slot_capacity"]
    with open(path, "rb") as f:
        for (_, o, n, *_), v, crc in zip(sources, views, crcs):
            f.seek(slot_off + o)
            raw = f.read(n)
            assert raw == np.ascontiguousarray(v).tobytes()
            assert crc == reference.crc32c(raw)
    engine.close()
    store.close()


def test_store_slot_queue_and_commit(tmp_path):
    path = str(tmp_path / "s.pcc")
    _native.create_store(path, 3, 8192, 1)
    store = _native.Store(path, "odirect")
    store.init(0, 1)
    assert sorted(store.free_slots()) == [0, 1, 2]
    c1, s1 = store.next_counter(), store.acquire_slot()
    c2, s2 = store.next_counter(), store.acquire_slot()
    assert s1 != s2 and store.acquire_slot(0.05) is not None  # the third slot
    # The newer one commits first; the older one must then lose and free its slot.
    assert store.commit(s2, c2, 20, b"{}", 0, 0) is True
    assert store.commit(s1, c1, 10, b"{}", 0, 0) is False
    assert _native.word_slot(store.check_word) == s2
    assert s2 not in store.free_slots() and s1 in store.free_slots()
    store.close()


def test_commit_rejects_manifest_past_slot(tmp_path):
    path = str(tmp_path / "s.pcc")
    _native.create_store(path, 2, 8192, 1)
    store = _native.Store(path, "odirect")
    store.init(0, 1)
    c, s = store.next_counter(), store.acquire_slot()
    with pytest.raises(OSError):
        store.commit(s, c, 1, b"x" * 9000, 0, 0)
    assert s in store.free_slots()  # the failed commit gave its slot back
    assert store.check_word == 0
    store.close()


def _mmap_store(tmp_path, slots: int, capacity: int):
    path = str(tmp_path / "m.pcc")
    _native.create_store(path, slots, capacity, 1)
    store = _native.Store(path, "mmap")
    store.init(0, 1)
    return path, store


def _slot_bytes(path: str, slots: int, capacity: int, slot: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek((1 + slots) * 4096 + slot * capacity)
        return f.read(n)


def test_in_place_job_fills_the_slot_without_the_pool(tmp_path):
    """begin(in_place=True) on an mmap store: copy() writes each chunk straight into the slot (a
    state 8x the pool goes through, the pool's bytes stay untouched), the writers' crc32c is the
    state's, and the commit names the slot."""
    import ctypes

    cap = 1 << 20
    path, store = _mmap_store(tmp_path, 2, cap)
    engine = _native.Engine(8192, 4, 2)
    assert engine.wait_prefaulted(30)
    data = np.random.default_rng(1).integers(0, 256, 256 * 1024 + 100, dtype=np.uint8)
    strided = np.arange(50_000, dtype=np.int32)[::-2]  # a negative stride: copied run by run
    off = (data.nbytes + 4095) // 4096 * 4096
    srcs = [(data.ctypes.data, 0, data.nbytes, 1, [data.size], [1]),
            (strided.ctypes.data, off, strided.nbytes, 4, [strided.size], [-8])]
    stream = (off + strided.nbytes + 4095) // 4096 * 4096
    c, s = store.next_counter(), store.acquire_slot(-1.0, False)
    job = engine.begin(store, s, srcs, stream, zero_meta=True, in_place=True)
    assert job.in_place and job.num_chunks == stream // 8192
    job.copy()
    assert job.wait(30) and job.error == 0
    assert job.crcs == [reference.crc32c(data.tobytes()), reference.crc32c(strided.tobytes())]
    pool = (ctypes.c_uint8 * engine.pool_bytes).from_address(engine.pool_address)
    assert not any(bytes(pool))  # nothing went through the chunk pool
    got = _slot_bytes(path, 2, cap, s, off + strided.nbytes)
    assert got[:data.nbytes] == data.tobytes() and got[off:] == strided.tobytes()
    assert store.commit(s, c, 7, b"{}", stream, stream) is True
    assert _native.word_slot(store.check_word) == s
    engine.close()
    store.close()


def test_in_place_chunk_zeroes_the_old_meta_first_and_external_fills_commit(tmp_path):
    """An engine that fills chunks itself (a replica off the wire) asks in_place_chunk(k) for the
    slot's address: the slot's old meta record is zeroed before any byte lands (FORMAT.md §3),
    submit_in_place hands the chunk to the writers, and a job that is not in place answers 0.
    in_place on an O_DIRECT store is refused."""
    import ctypes

    cap = 64 << 10
    path, store = _mmap_store(tmp_path, 2, cap)
    engine = _native.Engine(8192, 2, 1)
    for step in (1, 2):  # slot a: step 1, then superseded by step 2 in slot b (a is free again)
        c, s = store.next_counter(), store.acquire_slot(-1.0, True)
        assert store.commit(s, c, step, b"{}", 0, 0) is True
    a = store.acquire_slot(-1.0, False)
    with open(path, "rb") as f:
        f.seek((1 + a) * 4096)
        assert _native.parse_meta(f.read(4096), a, cap)["step"] == 1  # the old record is still there
    data = np.arange(4096 * 3, dtype=np.uint8)
    job = engine.begin(store, a, [(0, 0, data.nbytes, 1, [data.size], [1])], data.nbytes, zero_meta=True,
                       in_place=True)
    while (k := job.claim()) >= 0:
        addr = job.in_place_chunk(k)
        with open(path, "rb") as f:
            f.seek((1 + a) * 4096)
            assert _native.parse_meta(f.read(4096), a, cap) is None  # zeroed before the bytes land
        n = job.chunk_len(k)
        ctypes.memmove(addr, data.ctypes.data + k * 8192, n)
        job.submit_in_place(k)
    assert job.wait(30) and job.error == 0 and job.crcs == [reference.crc32c(data.tobytes())]
    assert _slot_bytes(path, 2, cap, a, data.nbytes) == data.tobytes()
    assert store.commit(a, store.next_counter(), 3, b"{}", data.nbytes, data.nbytes) is True
    b = store.acquire_slot(-1.0, True)
    plain = engine.begin(store, b, [(data.ctypes.data, 0, data.nbytes, 1, [data.size], [1])], data.nbytes)
    assert not plain.in_place and plain.in_place_chunk(0) == 0
    plain.copy()
    assert plain.wait(30) and plain.crcs == job.crcs
    engine.close()
    store.close()
    _native.create_store(str(tmp_path / "d.pcc"), 2, cap, 1)
    direct = _native.Store(str(tmp_path / "d.pcc"), "odirect")
    direct.init(0, 1)
    engine = _native.Engine(8192, 2, 1)
    with pytest.raises(ValueError, match="in place"):
        engine.begin(direct, 0, [], 0, in_place=True)
    engine.close()
    direct.close()
