"""``load_latest`` walks the tiers in one loop (memory, disk, remote) and refuses every
combination in its one table (pccheck.restore.REFUSED) with that table's message, before
anything is read or changed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

import pccheck
from pccheck.restore import REFUSED

WHY = dict(REFUSED)


def _arrays(v: float = 1.0):
    return {"w": np.full(4096, v, dtype=np.float32), "i": np.arange(10, dtype=np.int64)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.fixture
def saved_model(tmp_path):
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pccheck.Checkpointer(m, o, tmp_path / "ck", interval=1) as ck:
        ck.maybe_checkpoint(1)
    return tmp_path / "ck"


def test_every_refused_combination_raises_its_own_message(saved_model, tmp_path):
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    calls = {
        "optimizer= or extra_state= without model=": dict(optimizer=o),
        "memory_dir= with lazy= or zero_copy=": dict(memory_dir=True, zero_copy=True),
        "an s3:// path or remote= with zero_copy= or verify=False": dict(remote="s3://b/p", verify=False),
        "zero_copy= with model=": dict(model=m, zero_copy=True),
        "lazy= without model=": dict(lazy=True),
        "lazy= with zero_copy=, verify=False or map_location=": dict(model=m, optimizer=o, lazy=True,
                                                                      map_location="cpu"),
    }
    for case, kw in calls.items():
        with pytest.raises(pccheck.ConfigError) as info:
            pccheck.load_latest(saved_model, **kw)
        assert str(info.value) == WHY[case], case
    # nothing was put back into the model by a refused call
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    # every row of the table is a case some path checks (the docstring shows the same table)
    assert set(calls) <= set(WHY) and len(WHY) == len(REFUSED)
    doc = " ".join(pccheck.load_latest.__doc__.split())
    assert all(f"- {case}:" in doc for case in WHY), [c for c in WHY if f"- {c}:" not in doc]


def test_zero_copy_is_honoured_or_refused_never_ignored(tmp_path):
    with pccheck.Checkpointer(_arrays(2.0), tmp_path / "ck", interval=1) as ck:
        ck.maybe_checkpoint(1)
    r = pccheck.load_latest(tmp_path / "ck", zero_copy=True)
    assert not r.state["w"].flags.writeable and float(r.state["w"][0]) == 2.0  # a view of the file
    r = pccheck.load_latest(tmp_path / "ck")
    assert r.state["w"].flags.writeable


def test_the_tiers_are_walked_nearest_first_each_falling_back_to_the_next(tmp_path, s3_url):
    mem = tmp_path / "mem"
    ck = pccheck.Checkpointer(_arrays(1.0), tmp_path / "ck", interval=2, memory_interval=1, memory_dir=mem,
                              remote=s3_url)
    arrays = ck.state
    for step in range(1, 6):
        arrays["w"][:] = step
        ck.maybe_checkpoint(step)
    ck.close()
    r = pccheck.load_latest(tmp_path / "ck", memory_dir=mem, remote=s3_url)
    assert (r.tier, r.step, float(r.state["w"][0])) == ("memory", 5, 5.0)
    shutil.rmtree(mem)  # the machine rebooted: the disk is next
    r = pccheck.load_latest(tmp_path / "ck", memory_dir=mem, remote=s3_url)
    assert (r.tier, r.step, float(r.state["w"][0])) == ("disk", 4, 4.0)
    shutil.rmtree(tmp_path / "ck")  # the machine is gone: the remote tier
    r = pccheck.load_latest(tmp_path / "ck", memory_dir=mem, remote=s3_url)
    assert (r.tier, r.step, float(r.state["w"][0])) == ("remote", 4, 4.0)
    with pytest.raises(pccheck.NoCheckpointError):  # no tier holds one, and none is asked for
        pccheck.load_latest(tmp_path / "ck", memory_dir=mem)


def test_lazy_falls_back_from_the_disk_to_the_remote_tier(tmp_path, s3_url):
    m = _model()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    with pccheck.Checkpointer(m, o, tmp_path / "ck", interval=1, remote=s3_url) as ck:
        ck.maybe_checkpoint(1)
    want = [p.detach().clone() for p in m.parameters()]
    shutil.rmtree(tmp_path / "ck")
    m2 = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    r = pccheck.load_latest(tmp_path / "ck", model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
                            lazy=True, remote=s3_url)
    r.wait()
    assert r.step == 1 and all(torch.equal(a, b) for a, b in zip(want, m2.parameters()))
