"""Every keyword of ``load_latest`` is honoured or refused with its REFUSED message, on every path:
the memory tier (its per-rank plan), the disk store, the remote tier, lazily from the disk and
from the remote, and sharded (a DTensor checkpoint; eagerly, and through the memory tier). The
group-only rows are checked by tests/test_restore_plan.py's 2-rank job."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pccheck
from pccheck.persist.recovery import read_store, slot_base, store_files
from pccheck.restore import REFUSED

WHY = dict(REFUSED)
PATHS = ["memory", "disk", "remote", "lazy-disk", "lazy-remote"]
SHARDED = str(Path(__file__).with_name("_sharded_save.py"))


class Counter:
    """An extra_state object: restored through its load_state_dict."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": torch.tensor(self.n)}

    def load_state_dict(self, sd: dict) -> None:
        self.n = int(sd["n"])


def _model(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


@pytest.fixture
def saved(tmp_path, s3_url):
    """One step of a model, optimizer and extra object on disk, in memory and on the remote."""
    m, o = _model(0)
    m(torch.ones(2, 8)).sum().backward()
    o.step()
    ck = pccheck.Checkpointer(m, o, tmp_path / "ck", interval=1, memory_interval=1, memory_dir=tmp_path / "mem",
                              remote=s3_url, extra_state={"counter": Counter(7)})
    ck.maybe_checkpoint(1)
    assert ck.wait(remote=True, timeout=120)
    ck.close()
    want = {"model": {k: v.clone() for k, v in m.state_dict().items()},
            "momentum": [o.state[p]["momentum_buffer"].clone() for p in m.parameters()]}
    return tmp_path, s3_url, want


def _load(where: str, tmp_path: Path, url: str, **kw):
    if where == "memory":
        return pccheck.load_latest(tmp_path / "ck", memory_dir=tmp_path / "mem", **kw)
    lazy = {"lazy": True} if where.startswith("lazy") else {}
    return pccheck.load_latest(url if where.endswith("remote") else tmp_path / "ck", **lazy, **kw)


def _refused(case: str, call) -> None:
    with pytest.raises(pccheck.ConfigError) as info:
        call()
    assert str(info.value) == WHY[case]


@pytest.mark.parametrize("where", PATHS)
def test_model_optimizer_extra_state_and_map_location(saved, where):
    tmp_path, url, want = saved
    m, o = _model(1)
    c = Counter()
    r = _load(where, tmp_path, url, model=m, optimizer=o, extra_state={"counter": c})
    if where.startswith("lazy"):
        assert isinstance(r, pccheck.LazyRestore)
        r.wait()
    else:
        assert r.tier == {"memory": "memory", "disk": "disk", "remote": "remote"}[where]
    assert r.step == 1 and c.n == 7
    assert all(torch.equal(v, want["model"][k]) for k, v in m.state_dict().items())
    assert all(torch.equal(o.state[p]["momentum_buffer"], b) for p, b in zip(m.parameters(), want["momentum"]))
    # map_location: eagerly the returned tensors are moved; lazily it is refused
    if where.startswith("lazy"):
        _refused("lazy= with zero_copy=, verify=False or map_location=",
                 lambda: _load(where, tmp_path, url, model=m, map_location="meta"))
    else:
        r = _load(where, tmp_path, url, map_location="meta")
        assert r.state["model"]["0.weight"].device.type == "meta"


@pytest.mark.parametrize("where", PATHS)
def test_zero_copy_verify_lazy_and_lone_keywords_refused_where_they_cannot_apply(saved, where):
    tmp_path, url, _ = saved
    m, o = _model(1)
    before = [p.detach().clone() for p in m.parameters()]
    lazy = where.startswith("lazy")
    remote = where.endswith("remote")
    zc = ("an s3:// path or remote= with zero_copy= or verify=False" if remote else "zero_copy= with model="
          if lazy else "memory_dir= with lazy= or zero_copy=" if where == "memory" else None)
    if zc is not None:
        _refused(zc, lambda: _load(where, tmp_path, url, zero_copy=True, **({"model": m} if lazy else {})))
    vf = ("an s3:// path or remote= with zero_copy= or verify=False" if remote else
          "lazy= with zero_copy=, verify=False or map_location=" if lazy else None)
    if vf is not None:
        _refused(vf, lambda: _load(where, tmp_path, url, verify=False, **({"model": m} if lazy else {})))
    if where == "memory":
        _refused("memory_dir= with lazy= or zero_copy=", lambda: _load(where, tmp_path, url, model=m, lazy=True))
    if lazy:
        _refused("lazy= without model=", lambda: _load(where, tmp_path, url))
    for extra in ({"optimizer": o}, {"extra_state": {}}):  # even an empty one: never silently dropped
        _refused("optimizer= or extra_state= without model=", lambda: _load(where, tmp_path, url, **extra))
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_path_remote_and_memory_dir_combinations_refused(saved):
    tmp_path, url, _ = saved
    _refused("memory_dir= with an s3:// path", lambda: pccheck.load_latest(url, memory_dir=tmp_path / "mem"))
    _refused("remote= with an s3:// path", lambda: pccheck.load_latest(url, remote=url))
    _refused("remote= that is not an s3:// URL", lambda: pccheck.load_latest(tmp_path / "ck", remote=str(tmp_path)))
    # memory_dir=False is no memory tier, distributed=False one process (no group here either)
    assert pccheck.load_latest(tmp_path / "ck", memory_dir=False, distributed=False).tier == "disk"


def test_remote_is_a_source_of_the_memory_tiers_plan(saved):
    """With memory and disk gone, the memory tier's plan takes the remote's step (not the remote
    tier's own fallback after it); with memory kept, the nearest (memory) wins the same step."""
    tmp_path, url, want = saved
    r = pccheck.load_latest(tmp_path / "ck", memory_dir=tmp_path / "mem", remote=url)
    assert (r.step, r.tier) == (1, "memory")
    shutil.rmtree(tmp_path / "mem")
    shutil.rmtree(tmp_path / "ck")
    from pccheck.tiers.memory import load_nearest

    r = load_nearest(tmp_path / "ck", tmp_path / "mem", None, remote=url)
    assert (r.step, r.tier) == (1, "remote")
    m, _ = _model(1)
    r = pccheck.load_latest(tmp_path / "ck", model=m, memory_dir=tmp_path / "mem", remote=url)
    assert (r.step, r.tier) == (1, "remote")
    assert all(torch.equal(v, want["model"][k]) for k, v in m.state_dict().items())


def _flip(directory: Path) -> None:
    """Flips a byte of the array data of the newest committed slot of a store."""
    _, file = store_files(directory)[0]
    image = read_store(file)
    st = max((s for s in image.slots if s.meta), key=lambda s: s.meta["counter"])
    with open(file, "r+b") as f:
        f.seek(slot_base(image, st.slot) + 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_verify_false_is_honoured_on_local_eager_loads(tmp_path, where):
    with pccheck.Checkpointer({"w": np.full(4096, 3.0, dtype=np.float32)}, tmp_path / "ck", interval=1,
                              memory_interval=1, memory_dir=tmp_path / "mem") as ck:
        ck.maybe_checkpoint(1)
    _flip(tmp_path / ("mem" if where == "memory" else "ck"))
    kw = {"memory_dir": tmp_path / "mem"} if where == "memory" else {}
    if where == "memory":  # the damaged memory copy fails its crc32c: the disk's copy is next
        r = pccheck.load_latest(tmp_path / "ck", **kw)
        assert (r.tier, float(r.state["w"][25])) == ("disk", 3.0)
    else:
        with pytest.raises((pccheck.CorruptCheckpointError, pccheck.NoCheckpointError)):
            pccheck.load_latest(tmp_path / "ck", **kw)
    r = pccheck.load_latest(tmp_path / "ck", verify=False, **kw)  # unchecked: the damaged bytes themselves
    assert r.tier == where and float(r.state["w"][25]) != 3.0


@pytest.fixture(scope="module")
def sharded_saved(tmp_path_factory):
    """A DTensor model (Shard(0) on a mesh of one gloo rank) checkpointed on disk and in memory
    by a child process; its full state."""
    tmp = tmp_path_factory.mktemp("sharded")
    subprocess.run([sys.executable, SHARDED, str(tmp), ""], check=True, timeout=120)
    return tmp, torch.load(tmp / "ref.pt", weights_only=True)


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_sharded_paths_honour_model_optimizer_and_map_location_and_refuse_the_rest(sharded_saved, where):
    tmp, ref = sharded_saved
    kw = {"memory_dir": tmp / "mem"} if where == "memory" else {}
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 5))
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    r = pccheck.load_latest(tmp / "ck", model=m, optimizer=o, **kw)
    assert r.tier == where and all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())
    assert len(o.state) == 4
    r = pccheck.load_latest(tmp / "ck", map_location="meta", **kw)
    assert r.state["model"]["0.weight"].device.type == "meta"
    if where == "disk":
        for bad in ({"zero_copy": True}, {"verify": False}):
            _refused("a sharded checkpoint or model with zero_copy= or verify=False",
                     lambda: pccheck.load_latest(tmp / "ck", **bad))
        _refused("lazy= with sharded (DTensor) state", lambda: pccheck.load_latest(tmp / "ck", model=m, lazy=True))
    else:
        _refused("memory_dir= with lazy= or zero_copy=", lambda: pccheck.load_latest(tmp / "ck", zero_copy=True, **kw))


def test_sharded_memory_path_keeps_remote(tmp_path, s3_url):
    """The sharded + memory path: with memory and disk gone, remote= is a source of its plan."""
    subprocess.run([sys.executable, SHARDED, str(tmp_path), s3_url], check=True, timeout=180)
    ref = torch.load(tmp_path / "ref.pt", weights_only=True)
    shutil.rmtree(tmp_path / "mem")
    shutil.rmtree(tmp_path / "ck")
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 5))
    r = pccheck.load_latest(tmp_path / "ck", model=m, memory_dir=tmp_path / "mem", remote=s3_url)
    assert r.tier == "remote" and all(torch.equal(v, ref[k]) for k, v in m.state_dict().items())
