"""The tiers' one shape (pccheck/tiers/base.py, pccheck/tiers/stack.py): every tier has the same
life, a tier that is not configured is absent, teardown runs in one order, and a construction
that fails half way leaves nothing running."""

from __future__ import annotations

import inspect
import threading

import numpy as np
import pytest

import pccheck
from pccheck.ops.history import HistoryKeeper
from pccheck.tiers.base import Tier
from pccheck.tiers.memory.shm_store import MemoryTier
from pccheck.tiers.remote.group import GroupUploader
from pccheck.tiers.remote.uploader import RemoteUploader

LIFE = [name for name, _ in inspect.getmembers(Tier, inspect.isfunction) if not name.startswith("_")]


@pytest.mark.parametrize("cls", [MemoryTier, RemoteUploader, GroupUploader, HistoryKeeper])
def test_every_tier_has_the_one_life(cls):
    assert set(LIFE) == {"start", "prepare", "on_step", "on_commit", "ensure_copied", "wait", "flush", "newest", "close"}
    for name in LIFE:
        theirs = inspect.signature(getattr(cls, name))
        ours = inspect.signature(getattr(Tier, name))
        assert list(theirs.parameters)[:len(ours.parameters)] == list(ours.parameters), (cls.__name__, name)
    assert cls.name in ("memory", "remote", "history") and isinstance(cls.after_disk, bool)


def _state():
    return {"w": np.arange(1 << 16, dtype=np.float32), "b": np.ones(7, dtype=np.int64)}


def test_a_tier_not_configured_is_absent(tmp_path):
    with pccheck.Checkpointer(_state(), tmp_path / "a") as ck:
        assert ck._stack.tiers == [] and ck._memory is None and ck._remote is None and ck._history is None
    with pccheck.Checkpointer(_state(), tmp_path / "b", memory=pccheck.MemoryOptions(every=1, dir=tmp_path / "m"),
                              disk=pccheck.DiskOptions(every=1, keep_last=2)) as ck:
        assert [t.name for t in ck._stack.tiers] == ["history", "memory"]
        ck.maybe_checkpoint(1)
        ck.wait()
        assert ck.stats().tiers["disk"] == 1 and ck.stats().tiers["memory"] == 1


def test_teardown_runs_once_in_one_order(tmp_path, monkeypatch):
    order: list[str] = []
    for cls, name in [(MemoryTier, "memory"), (HistoryKeeper, "history")]:
        real = cls.close

        def close(self, *a, _real=real, _name=name, **k):
            order.append(_name)
            return _real(self, *a, **k)
        monkeypatch.setattr(cls, "close", close)
    from pccheck.orchestrator.orchestrator import Orchestrator

    real_close, real_wait = Orchestrator.close, Orchestrator.wait

    def orch_close(self):
        order.append("disk" if "mem" not in str(self.store.path) else "memory-store")
        return real_close(self)
    monkeypatch.setattr(Orchestrator, "close", orch_close)
    ck = pccheck.Checkpointer(_state(), tmp_path / "ck", memory_interval=1, memory_dir=tmp_path / "mem",
                              disk=pccheck.DiskOptions(every=1, keep_last=1))
    ck.maybe_checkpoint(1)
    ck.close()
    ck.close()  # idempotent: nothing closes twice
    # the memory tier first (its own store inside it), then the disk store, then the history's copies
    assert order == ["memory", "memory-store", "disk", "history"], order
    assert pccheck.load_latest(tmp_path / "ck").step == 1


def test_a_construction_that_fails_half_way_leaves_nothing_running(tmp_path, s3_url):
    before = {t.ident for t in threading.enumerate()}
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"x")  # the memory tier's directory cannot be made: it fails after the remote
    with pytest.raises(pccheck.PCCheckError):  # tier started its upload threads
        pccheck.Checkpointer(_state(), tmp_path / "ck", memory_interval=1, memory_dir=blocker / "sub",
                             disk=pccheck.DiskOptions(every=1, keep_last=1), remote=s3_url)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("pccheck")]
    assert left == []
    # and the directory is free for the next Checkpointer (no lock left behind)
    with pccheck.Checkpointer(_state(), tmp_path / "ck") as ck:
        ck.checkpoint(3)
    assert pccheck.load_latest(tmp_path / "ck").step == 3
