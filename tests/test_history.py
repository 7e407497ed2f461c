"""The disk tier's kept checkpoints (``DiskOptions(keep_last=, keep_every=)``): background copies to
PATH/history/.

What is checked, all with a real Checkpointer and real files:

* ``keep_every=k`` keeps every disk checkpoint whose step % k == 0 (steps, not commits), and
  ``keep_last=m`` the newest m besides them (pccheck.tiers.keep, the rule of every tier); the
  0.1.0 spellings ``keep_every``/``max_history`` still work, warning where their meaning changed;
* each kept checkpoint becomes step-XXXXXX.safetensors (+ .json sidecar) holding exactly
  that step's bytes: it loads with the safetensors library, and arrays safetensors cannot type
  (structured, big-endian) come back bit-exact from their raw bytes and the sidecar's dtypes;
* ``keep_last`` deletes the oldest history files only; store files and slots are never touched;
* retention never blocks or removes the latest committed checkpoint: with the copier held back,
  every checkpoint still commits and the latest always loads; copies of slots the writer reused
  meanwhile are skipped with a warning, never written with mixed bytes;
* a copy whose bytes no longer match the manifest's crc32c is discarded;
* a failing history directory never reaches training; ``close`` drains and is idempotent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest

import pccheck
from pccheck.ops.history import HistoryKeeper, history_files
from pccheck.orchestrator.orchestrator import CommitInfo
from pccheck.persist.recovery import read_manifest, read_store, store_files

KW = dict(max_concurrent=2, writer_threads=2, chunk_size=16 << 10)


def disk(**kw) -> pccheck.DiskOptions:
    """The disk tier checkpointing every step (``maybe_checkpoint`` of each one) with ``kw``."""
    return pccheck.DiskOptions(**{"every": 1, **kw})
REC = np.dtype([("id", "<i8"), ("name", "S5"), ("xy", "<f4", (2,))])


def expected(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(900 + step)
    rec = np.zeros(20, dtype=REC)
    rec["id"] = rng.integers(0, 2**40, 20)
    rec["name"] = [bytes(rng.integers(97, 123, 5, dtype=np.uint8)) for _ in range(20)]
    rec["xy"] = rng.standard_normal((20, 2))
    return {
        "w": rng.standard_normal((64, 64)).astype(np.float32),
        "i": rng.integers(-2**60, 2**60, 300),
        "h": rng.standard_normal(50).astype(np.float16),
        "be": rng.standard_normal(7).astype(">f8"),   # stored raw: safetensors is little-endian
        "rec": rec,                                      # stored raw: no safetensors type
        "s": np.array(step, dtype=np.int32),
    }


def fill(state: dict[str, np.ndarray], step: int) -> None:
    for k, v in expected(step).items():
        state[k][...] = v


def checkpoint_steps(ck: pccheck.Checkpointer, state: dict, steps, *, wait_each: bool = True,
                     drain: bool = False) -> None:
    """Checkpoints each step; ``wait_each``: until durable; ``drain``: until its history copy is done
    too (else the copier may fall behind and find the slot reused, which is allowed)."""
    for step in steps:
        fill(state, step)
        ck.maybe_checkpoint(step, metadata={"step": step})
        if wait_each or drain:
            ck.wait()
        if drain:
            assert ck._history is not None and ck._history.wait_idle(30)
    ck.wait()


def won(ck: pccheck.Checkpointer) -> int:
    """Checkpoints that became the durable latest (superseded ones never reach the commit hook)."""
    s = ck.stats() if callable(ck.stats) else ck.stats
    return sum(c.outcome == "committed" for c in getattr(s, "checkpoints", s))


def read_history(file: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A history file read back with the safetensors library, dtypes restored from the sidecar."""
    from safetensors.numpy import load_file

    side = json.loads(file.with_suffix(".json").read_text())
    raw = load_file(file)
    out = {}
    for name, d in side["dtypes"].items():
        dt = np.lib.format.descr_to_dtype(_tuplify(d["dtype"]))
        a = raw[name]
        if d["stored_as"] == "U8" and dt != np.uint8:
            a = a.view(dt).reshape(d["shape"])
        out[name] = a
    return side, out


def _tuplify(descr):
    """JSON turned the descr's tuples into lists: (name, sub-descr[, shape]) fields back to tuples."""
    if isinstance(descr, list):
        return [(f[0], _tuplify(f[1]), *(tuple(x) for x in f[2:])) for f in descr]
    return descr


def assert_is_step(file: Path, step: int) -> None:
    side, arrays = read_history(file)
    assert side["step"] == step and side["metadata"] == {"step": step}, side
    want = expected(step)
    assert list(arrays) == list(want)
    for k, w in want.items():
        g = arrays[k]
        assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), (step, k)


def store_bytes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.glob("store-*.pcc")}


# -----------------------------------------------------------------------------------------------


def test_every_kth_checkpoint_is_kept_bit_exact(tmp_path: Path) -> None:
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(keep_every=3), **KW) as ck:
        checkpoint_steps(ck, state, range(1, 11), drain=True)
    files = history_files(d)
    assert [s for s, _ in files] == [3, 6, 9]
    for step, f in files:
        assert f.name == f"step-{step:06d}.safetensors"
        assert_is_step(f, step)
        side = json.loads(f.with_suffix(".json").read_text())
        assert side["dtypes"]["w"] == {"dtype": "<f4", "shape": [64, 64], "stored_as": "F32"}
        assert side["dtypes"]["be"]["stored_as"] == "U8" and side["dtypes"]["rec"]["stored_as"] == "U8"
        assert side["counter"] >= step
    # nothing temporary left, and the safetensors header carries the step too
    assert sorted(p.name for p in (d / "history").iterdir()) == sorted(
        [f.name for _, f in files] + [f.with_suffix(".json").name for _, f in files])
    from safetensors import safe_open

    with safe_open(files[0][1], framework="np") as f:
        assert f.metadata()["pccheck.step"] == "3"
    assert pccheck.load_latest(d).step == 10


def test_keep_last_deletes_only_the_oldest_history_files(tmp_path: Path) -> None:
    d = tmp_path / "c"
    state = expected(0)
    (d / "history").mkdir(parents=True)
    (d / "history" / "NOTES.txt").write_text("mine")  # not a history file: never touched
    with pccheck.Checkpointer(state, d, disk=disk(keep_last=3), **KW) as ck:
        checkpoint_steps(ck, state, range(1, 9), drain=True)
        before = store_bytes(d)
        keeper = ck._history
        assert keeper is not None and keeper.wait_idle(30)
        assert keeper.counts.kept == 8 and keeper.counts.deleted == 5
    assert [s for s, _ in history_files(d)] == [6, 7, 8]
    for step, f in history_files(d):
        assert_is_step(f, step)
    assert (d / "history" / "NOTES.txt").read_text() == "mine"
    assert store_bytes(d) == before
    # The store is whole: all three slots still validate, the latest is step 8.
    image = read_store(d / "store-000001.pcc")
    assert sorted(s.meta["step"] for s in image.slots if s.meta) == [6, 7, 8]
    r = pccheck.load_latest(d)
    assert r.step == 8 and all(r.state[k].tobytes() == v.tobytes() for k, v in expected(8).items())


def test_retention_never_blocks_or_removes_the_latest(tmp_path: Path, caplog) -> None:
    """The copier is held back while 14 checkpoints run back to back (3 slots, reused many times):
    every checkpoint commits and the latest always loads; when the copier resumes, the copies
    of reused slots are skipped, the others are exact."""
    caplog.set_level(logging.WARNING, logger="pccheck")
    d = tmp_path / "c"
    state = expected(0)
    done = threading.Event()
    with pccheck.Checkpointer(state, d, disk=disk(keep_last=4), **KW) as ck:
        keeper = ck._history
        assert keeper is not None
        with keeper.paused():
            def train() -> None:
                checkpoint_steps(ck, state, range(1, 15), wait_each=False)
                done.set()

            t = threading.Thread(target=train, daemon=True)
            t.start()
            # The commit hook must only enqueue: with the copier paused, training still finishes.
            assert done.wait(60), "a checkpoint waited for history retention"
            t.join()
            assert ck.last_durable_step == 14
            assert pccheck.load_latest(d).step == 14
            assert not history_files(d)
            c = keeper.counts
            n = won(ck)
            assert c.kept == 0 and c.dropped == max(0, n - 8)  # the queue holds at most 8
        assert keeper.wait_idle(60)
        c = keeper.counts
        assert c.kept + c.skipped + c.dropped == n and c.failed == 0
        assert c.skipped >= 1  # queued steps whose slots were reused while paused
        assert c.kept >= 1  # the latest is still in its slot: it is kept
    assert any("not keeping step" in r.getMessage() for r in caplog.records)
    files = history_files(d)
    assert files and files[-1][0] == 14 and len(files) <= 4
    for step, f in files:
        assert_is_step(f, step)
    r = pccheck.load_latest(d)
    assert r.step == 14 and r.state["w"].tobytes() == expected(14)["w"].tobytes()


def test_a_copy_that_does_not_match_its_checksums_is_discarded(tmp_path: Path, caplog) -> None:
    """As if the writer rewrote the slot's data after its meta record was read: the crc32c of the
    copied bytes no longer matches the manifest, so no history file is written."""
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(), **KW) as ck:
        checkpoint_steps(ck, state, [1])
    store = d / "store-000001.pcc"
    image = read_store(store)
    slot = next(s.slot for s in image.slots if s.meta)
    counter = image.slots[slot].meta["counter"]
    with open(store, "rb") as f:
        man = read_manifest(image, slot, f.fileno())
    e = next(a for a in man.arrays if a.name == "i")
    off = image.header["slots_offset"] + slot * image.header["slot_capacity"] + e.offset + 100
    with open(store, "r+b") as f:
        f.seek(off)
        f.write(b"\x01\x02\x03")
    caplog.set_level(logging.WARNING, logger="pccheck")
    keeper = HistoryKeeper(d, keep_last=None)
    keeper(CommitInfo(1, counter, slot, store))
    keeper(CommitInfo(1, counter + 7, slot, store))  # a counter the slot no longer holds
    keeper.close()
    keeper.close()  # idempotent
    assert keeper.counts.skipped == 2 and keeper.counts.kept == 0
    assert not history_files(d) and not [p for p in (d / "history").iterdir()]
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "changed while it was copied" in msgs and "was reused" in msgs


def test_copies_follow_commit_order_when_the_hooks_come_out_of_order(tmp_path: Path) -> None:
    """Two commit threads may call the hook out of order (the later commit's first): the copies
    still run in commit order, so the newest step's file is the newest one and is what stays."""
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(), **{**KW, "max_concurrent": 3}) as ck:
        checkpoint_steps(ck, state, (1, 2))
    (_, store), = store_files(d)
    image = read_store(store)
    infos = sorted((CommitInfo(m["step"], m["counter"], i, store) for i, sl in enumerate(image.slots)
                    if (m := sl.meta) is not None and m["step"] in (1, 2)), key=lambda c: c.counter)
    assert [c.step for c in infos] == [1, 2]
    keeper = HistoryKeeper(d, keep_last=1)
    with keeper.paused():
        keeper(infos[1])  # step 2's hook first
        keeper(infos[0])
    assert keeper.wait_idle(60)
    keeper.close()
    assert [step for step, _ in history_files(d)] == [2] and keeper.newest()["history"] == 2


def test_close_drains_pending_copies_even_when_paused(tmp_path: Path) -> None:
    d = tmp_path / "c"
    state = expected(0)
    ck = pccheck.Checkpointer(state, d, disk=disk(keep_last=None), **{**KW, "max_concurrent": 3})
    keeper = ck._history
    assert keeper is not None
    with keeper.paused():
        checkpoint_steps(ck, state, [1, 2, 3])  # 4 slots: all three stay in place
        ck.close()  # joins the copier: it must not wait for the pause to end
        ck.close()
    assert [s for s, _ in history_files(d)] == [1, 2, 3]
    assert not [t for t in threading.enumerate() if t.name == "pccheck-history"]
    keeper(CommitInfo(9, 9, 0, d / "store-000001.pcc"))  # after close: ignored, no thread
    assert keeper.counts.kept == 3


def test_a_broken_history_directory_never_reaches_training(tmp_path: Path, caplog) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "history").write_text("a file where the directory should be")
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(keep_last=None), **KW) as ck:
        checkpoint_steps(ck, state, range(1, 4))
        assert ck._history is not None and ck._history.wait_idle(30)
        assert ck._history.counts.failed == 3
    assert pccheck.load_latest(d).step == 3
    assert (d / "history").read_text().startswith("a file")


def test_keeper_rejects_bad_arguments(tmp_path: Path) -> None:
    for kw in ({}, {"keep_last": -1}, {"keep_every": 0}, {"keep_last": None, "max_pending": 0}):
        with pytest.raises(pccheck.ConfigError):
            HistoryKeeper(tmp_path, **kw)  # {}: keeps nothing
    for kw in ({"keep_every": 0}, {"keep_last": -1}, {"keep_last": 1.5}, {"every": 0}, {"every": "often"}):
        with pytest.raises(pccheck.ConfigError, match=f"disk.{next(iter(kw))}"):
            pccheck.DiskOptions(**kw)
    with pytest.raises(pccheck.ConfigError, match="keep_every"):
        pccheck.Checkpointer(expected(0), tmp_path / "c", keep_every=0)


def test_history_of_a_store_that_grows_a_new_generation(tmp_path: Path) -> None:
    """The state outgrows its slots mid-run: copies read whichever store file the commit named."""
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(keep_last=None), **KW) as ck:
        checkpoint_steps(ck, state, [1, 2], drain=True)
        state["big"] = np.arange(200_000, dtype=np.float32)
        fill(state, 3)
        ck.maybe_checkpoint(3, metadata={"step": 3})
        ck.wait()
        assert ck.generation == 2
    _, arrays = read_history(d / "history" / "step-000003.safetensors")
    assert np.array_equal(arrays["big"], np.arange(200_000, dtype=np.float32))
    assert [s for s, _ in history_files(d)] == [1, 2, 3]
    assert os.listdir(d / "history") and sorted(p.name for p in d.glob("store-*.pcc")) == ["store-000002.pcc"]


def test_history_goes_beside_the_store_file_of_each_commit(tmp_path: Path) -> None:
    """Distributed runs keep one store per rank (PATH/rank-<r>/): each rank's history goes beside
    its own store, so ranks never overwrite or prune each other's files."""
    top = tmp_path / "c"
    for rank in (0, 1):
        state = expected(rank)
        with pccheck.Checkpointer(state, top / f"rank-{rank}", disk=disk(), **KW) as ck:
            checkpoint_steps(ck, state, [5])
    keeper = HistoryKeeper(top, keep_last=1)  # as a distributed Checkpointer constructs it: the top path
    for rank in (0, 1):
        store = top / f"rank-{rank}" / "store-000001.pcc"
        image = read_store(store)
        slot = next(s.slot for s in image.slots if s.meta)
        keeper(CommitInfo(5, image.slots[slot].meta["counter"], slot, store))
    keeper.close()
    assert keeper.counts.kept == 2 and keeper.counts.deleted == 0
    assert not (top / "history").exists()
    for rank in (0, 1):
        assert [s for s, _ in history_files(top / f"rank-{rank}")] == [5]


# -- the tier table's meanings: every, keep_last, keep_every on the disk tier ---------------------


def _steps(d: Path) -> list[int]:
    return sorted(s for s, _ in history_files(d))


def test_disk_every_and_keep_every_count_steps_not_commits(tmp_path: Path) -> None:
    """every=2: disk checkpoints at steps 2, 4, ..., 12 (six commits); keep_every=4 keeps the
    steps divisible by 4, not every 4th commit (which would be step 8 alone)."""
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=pccheck.DiskOptions(every=2, keep_every=4), **KW) as ck:
        checkpoint_steps(ck, state, range(1, 13), drain=True)
        assert won(ck) == 6 and ck.interval == 2
    assert _steps(d) == [4, 8, 12]
    for step, f in history_files(d):
        assert_is_step(f, step)


def test_disk_keep_last_keeps_the_newest_besides_keep_every(tmp_path: Path) -> None:
    """keep_last=2 with keep_every=4 over steps 1..10: the newest two (9, 10) and, whatever
    keep_last says, every step divisible by 4 (4, 8): the rule the remote tier applies too."""
    d = tmp_path / "c"
    state = expected(0)
    with pccheck.Checkpointer(state, d, disk=disk(keep_last=2, keep_every=4), **KW) as ck:
        checkpoint_steps(ck, state, range(1, 11), drain=True)
        assert ck._history.counts.kept == 10
    assert _steps(d) == [4, 8, 9, 10]


def test_the_older_history_keywords_still_work(tmp_path: Path) -> None:
    """keep_every=1 with max_history=m (each commit copied, the newest m kept) is keep_last=m,
    silently; keep_every=k > 1 keeps its 0.1.0 meaning (every k-th commit, counted) and warns with
    the per-tier spelling, without changing what is kept."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = pccheck.Options().updated(interval=1, keep_every=1, max_history=3)
        assert opts.disk == pccheck.DiskOptions(every=1, keep_last=3)
        assert pccheck.Options(history=pccheck.HistoryOptions(keep_every=1, max_history=3)).disk == \
            pccheck.DiskOptions(keep_last=3)
        assert pccheck.Options().updated(keep_every=1).disk == pccheck.DiskOptions(keep_last=None)
        # given in two calls, as 0.1.0's replace() of the history group allowed
        assert pccheck.Options().updated(keep_every=1).updated(max_history=3).disk == pccheck.DiskOptions(keep_last=3)
    with pytest.warns(DeprecationWarning, match=r"0\.1\.0 meaning.*DiskOptions\(keep_every="):
        opts = pccheck.Options().updated(keep_every=4)
    assert opts.disk.keep_every is None and opts.disk.legacy_history == pccheck.HistoryOptions(keep_every=4)
    assert opts.history.keep_every == 4 and opts.history.max_history is None
    with pytest.warns(DeprecationWarning, match="0.1.0 meaning"):
        opts = pccheck.Options().updated(keep_every=4, max_history=2)
    assert (opts.disk.keep_last, opts.disk.keep_every) == (0, None)
    assert (opts.history.keep_every, opts.history.max_history) == (4, 2)
    assert pccheck.Options(disk=pccheck.DiskOptions(keep_every=8)).history is None  # steps: no 0.1.0 spelling
    with pytest.raises(pccheck.ConfigError, match="cannot be combined"):
        pccheck.Options().updated(disk=pccheck.DiskOptions(keep_every=8), keep_every=2)
    d = tmp_path / "c"
    state = expected(0)
    with pytest.warns(DeprecationWarning, match="0.1.0 meaning"):
        ck = pccheck.Checkpointer(state, d, interval=1, keep_every=4, **KW)
    with ck:
        checkpoint_steps(ck, state, range(1, 10), drain=True)
    assert _steps(d) == [4, 8]


def test_keep_every_with_max_history_keeps_the_0_1_0_copies(tmp_path: Path) -> None:
    """pccheck 0.1.0: keep_every=2, max_history=3 over steps 1..10 at interval 1 copies every 2nd
    commit (2, 4, 6, 8, 10) and keeps the newest three of those copies: 6, 8, 10."""
    d = tmp_path / "c"
    state = expected(0)
    with pytest.warns(DeprecationWarning):
        ck = pccheck.Checkpointer(state, d, interval=1, keep_every=2, max_history=3, **KW)
    with ck:
        checkpoint_steps(ck, state, range(1, 11), drain=True)
        assert ck._history.counts.kept == 5 and ck._history.counts.deleted == 2
    assert _steps(d) == [6, 8, 10]
    for step, f in history_files(d):
        assert_is_step(f, step)
    # the same through the 0.1.0 group
    d2 = tmp_path / "g"
    with pytest.warns(DeprecationWarning):
        opts = pccheck.Options(history=pccheck.HistoryOptions(keep_every=2, max_history=3))
    with pccheck.Checkpointer(state, d2, options=opts, interval=1, **KW) as ck:
        checkpoint_steps(ck, state, range(1, 11), drain=True)
    assert _steps(d2) == [6, 8, 10]


def test_keep_every_counts_commits_not_steps(tmp_path: Path) -> None:
    """0.1.0's keep_every=k copies every k-th commit, whatever its step: at interval 3 from step 0
    the commits are steps 0, 3, 6, 9, 12, 15 and keep_every=2 copies 3, 9, 15 (no multiple of 6
    among them). max_history alone copies nothing, as in 0.1.0."""
    d = tmp_path / "c"
    state = expected(0)
    with pytest.warns(DeprecationWarning):
        ck = pccheck.Checkpointer(state, d, interval=3, keep_every=2, **KW)
    with ck:
        checkpoint_steps(ck, state, range(0, 16), drain=True)
    assert _steps(d) == [3, 9, 15]
    with pytest.warns(DeprecationWarning, match="no copies"):
        ck = pccheck.Checkpointer(state, tmp_path / "m", interval=1, max_history=3, **KW)
    with ck:
        assert ck._history is None


def test_keeper_legacy_mode_counts_calls(tmp_path: Path) -> None:
    """HistoryKeeper(legacy=(k, m)) selects by the count of commits it is told of (so an
    explicit checkpoint, a resumed run or interval="auto" count as in 0.1.0) and caps the copies
    at m; bad legacy values are refused."""
    for bad in ((0, None), (2, 0)):
        with pytest.raises(pccheck.ConfigError):
            HistoryKeeper(tmp_path, legacy=bad)
    with pytest.raises(pccheck.ConfigError):
        HistoryKeeper(tmp_path, keep_last=2, legacy=(2, None))
    keeper = HistoryKeeper(tmp_path, legacy=(3, None))
    with keeper.paused():
        for step in (5, 7, 11, 12, 100, 101):  # any steps: the 3rd and 6th are queued
            keeper(CommitInfo(step, step, 0, tmp_path / "none.pcc"))
        assert [i.step for i in keeper._pending] == [11, 101]
    keeper.close()
