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
