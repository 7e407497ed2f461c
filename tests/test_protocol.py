"""The commit protocol (Listing 1) under real concurrency: a hypothesis state machine drives
bursts of >= 8 threads through next_counter -> acquire_slot -> commit on the native store, with
injected barrier failures and reopens in between.

Checked: no slot is ever lost or handed out twice; the slot CHECK_ADDR names is never free;
the committed counter only moves forward; it ends at the newest non-failed commit.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pccheck.native import _native
from pccheck.persist.recovery import candidate_order, read_store


class CommitProtocol(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.path = os.path.join(self.dir, "store-000001.pcc")
        self.store = None
        self.max_counter = 0     # newest counter whose commit did not fail
        self.seen_counter = 0    # newest counter observed in CHECK_ADDR

    @initialize(num_slots=st.integers(2, 6))
    def create(self, num_slots: int) -> None:
        self.num_slots = num_slots
        _native.create_store(self.path, num_slots, 8192, 1)
        self.store = _native.Store(self.path, "mmap")
        self.store.init(0, 1)

    def _commit_one(self, step: int) -> bool | None:
        c = self.store.next_counter()
        s = self.store.acquire_slot(30.0)
        assert s is not None, "no slot came free: one was lost"
        try:
            return self.store.commit(s, c, step, b'{"c":%d}' % c, 0, 0), c
        except OSError:
            return None, c

    @rule(threads=st.integers(8, 12), per_thread=st.integers(1, 4),
          fail_nth=st.one_of(st.none(), st.integers(1, 40)), fail_op=st.sampled_from(["msync", "fdatasync"]))
    def burst(self, threads: int, per_thread: int, fail_nth: int | None, fail_op: str) -> None:
        if fail_nth is not None:
            mask = _native.OP_MSYNC if fail_op == "msync" else _native.OP_FDATASYNC
            _native.set_fault(mask, fail_nth, errno.EIO)
        held: set[int] = set()
        lock = threading.Lock()
        problems: list[str] = []
        done = threading.Event()
        results: list[tuple[bool | None, int]] = []

        def watch() -> None:  # CHECK_ADDR's counter must never go backwards
            last = self.seen_counter
            while not done.is_set():
                c = _native.word_counter(self.store.check_word)
                if c < last:
                    problems.append(f"CHECK_ADDR counter went back from {last} to {c}")
                last = c

        def work() -> None:
            for _ in range(per_thread):
                c = self.store.next_counter()
                s = self.store.acquire_slot(30.0)
                if s is None:
                    problems.append("acquire_slot timed out: a slot was lost")
                    return
                with lock:
                    if s in held:
                        problems.append(f"slot {s} handed out twice")
                    held.add(s)
                    w = self.store.check_word
                    if w and _native.word_slot(w) == s:
                        problems.append(f"slot {s} handed out while CHECK_ADDR names it")
                    held.discard(s)  # from here on commit() owns it
                try:
                    won = self.store.commit(s, c, c, b'{"c":%d}' % c, 0, 0)
                except OSError:
                    won = None
                with lock:
                    results.append((won, c))

        watcher = threading.Thread(target=watch)
        watcher.start()
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        done.set()
        watcher.join()
        _native.clear_fault()
        assert not any(t.is_alive() for t in workers), "a worker hung"
        assert not problems, problems
        assert len(results) == threads * per_thread
        self.max_counter = max([self.max_counter] + [c for won, c in results if won is not None])
        # One clean commit settles slots a failed barrier left pending.
        won, c = self._commit_one(0)
        assert won is True
        self.max_counter = max(self.max_counter, c)

    @rule()
    def reopen(self) -> None:
        """Close and reopen like a restart: CHECK_ADDR and the counter continue from the file."""
        before = self.store.check_word
        self.store.close()
        image = read_store(__import__("pathlib").Path(self.path))
        assert image.check_word == before, "the committed word was not durable in the file"
        order = candidate_order(image)
        word = _native.make_word(image.slots[order[0]].meta["counter"], order[0]) if order else 0
        assert word == before
        nxt = max([st.meta["counter"] for st in image.slots if st.meta] + [0]) + 1
        self.store = _native.Store(self.path, "mmap")
        self.store.init(word, nxt)

    @invariant()
    def slots_partitioned(self) -> None:
        if self.store is None:
            return
        free = self.store.free_slots()
        assert len(free) == len(set(free)), f"duplicate free slots {free}"
        w = self.store.check_word
        latest = {_native.word_slot(w)} if w else set()
        assert not latest & set(free), "the latest slot is in the free queue"
        assert set(free) | latest == set(range(self.num_slots)), f"slot lost: free={free} latest={latest}"

    @invariant()
    def counter_monotonic_and_newest(self) -> None:
        if self.store is None:
            return
        c = _native.word_counter(self.store.check_word)
        assert c >= self.seen_counter
        self.seen_counter = c
        assert c == self.max_counter, f"CHECK_ADDR at counter {c}, newest successful commit {self.max_counter}"

    def teardown(self) -> None:
        _native.clear_fault()
        if self.store is not None:
            self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestCommitProtocol = CommitProtocol.TestCase
TestCommitProtocol.settings = settings(max_examples=40, stateful_step_count=6, deadline=None)
