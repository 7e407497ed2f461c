"""Reopening a store does no state-size work on the caller's thread."""

from __future__ import annotations

import logging

import numpy as np

import pccheck
from pccheck.persist import recovery

KW = dict(max_concurrent=2, chunk_size=1 << 20)


def _store(path, steps=(1, 2)):
    state = {"w": np.zeros(1 << 20, np.float32), "b": np.zeros(7, np.int64)}
    with pccheck.Checkpointer(state, path, **KW) as ck:
        for s in steps:
            state["w"][:] = s
            ck.checkpoint(s)
            ck.wait()
    return state


def test_a_slot_load_latest_validated_is_not_read_again(tmp_path):
    state = _store(tmp_path)
    assert pccheck.load_latest(tmp_path).step == 2
    with pccheck.Checkpointer(state, tmp_path, **KW) as ck:
        store = ck._orch.store
        assert store._verifier is None and store._guarded == []


def test_an_unvalidated_slot_is_checked_in_the_background_and_the_fallback_released(tmp_path):
    state = _store(tmp_path)
    recovery._validated.clear()  # as in a fresh process
    with pccheck.Checkpointer(state, tmp_path, **KW) as ck:
        store = ck._orch.store
        assert store._verifier is not None
        store._verifier.join(30)
        assert not store.verifying and store._guarded == []
        assert sorted(store.native.free_slots()) == [0, 2]  # slot 0 (step 1) free again after the check


def test_a_damaged_latest_keeps_the_fallback_until_a_new_checkpoint_commits(tmp_path, caplog):
    state = _store(tmp_path)
    image = recovery.read_store(recovery.store_files(tmp_path)[0][1])
    latest = image.word_slot
    off = recovery.slot_base(image, latest) + 8
    with open(image.path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 1]))
    recovery._validated.clear()
    with caplog.at_level(logging.WARNING, logger="pccheck"):
        with pccheck.Checkpointer(state, tmp_path, **KW) as ck:
            store = ck._orch.store
            store._verifier.join(30)
            assert "is damaged" in caplog.text and store._guarded == [1 - latest]
            assert 1 - latest not in store.native.free_slots()
            state["w"][:] = 3
            ck.checkpoint(3)
            ck.wait()
            assert store._guarded == []  # step 3 is durable: recovery no longer needs step 1
    assert pccheck.load_latest(tmp_path).step == 3


def test_a_repaired_word_never_names_a_slot_whose_data_is_damaged(tmp_path):
    """A crash after a commit's data and meta record but before its word: the word on disk is
    0 and the newest slot's data is damaged. Reopening repairs CHECK_ADDR (a commit barrier that
    may reach the disk at once), so it must name the newest slot that validates, never the
    damaged one: a power cut right after the reopen then still recovers step 2. (Found by
    test_powerloss's reopen simulation: the word named the damaged slot, and recovery fell back
    behind it.)"""
    state = _store(tmp_path, steps=(1, 2, 3))
    file = recovery.store_files(tmp_path)[0][1]
    image = recovery.read_store(file)
    damaged = max((s for s in image.slots if s.meta), key=lambda s: s.meta["counter"])
    assert damaged.meta["step"] == 3
    with open(file, "r+b") as f:
        f.seek(128)  # CHECK_ADDR (FORMAT.md §2): as if the commit's word never reached the disk
        f.write(bytes(8))
        f.seek(recovery.slot_base(image, damaged.slot))
        f.write(b"\xff" * 4096)
    recovery._validated.clear()  # as in a fresh process
    with pccheck.Checkpointer(state, tmp_path, **KW) as ck:
        word = recovery.read_store(file)
        assert word.check_word != 0 and word.word_slot != damaged.slot
        assert word.slots[word.word_slot].meta["step"] == 2
        assert pccheck.load_latest(tmp_path).step == 2
        ck.checkpoint(4)
        ck.wait()
    assert pccheck.load_latest(tmp_path).step == 4
