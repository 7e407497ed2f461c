"""pccheck.dcp: torch.distributed.checkpoint (real DCP, real FSDP2 on gloo/CPU) saving to and
loading from the pccheck store (FORMAT.md §9, "DCP").

Peer scenarios covered (after PyTorch's own DCP tests: test_file_system_checkpoint,
test_fsdp_dsd / e2e resharding, test_async_process_executor): single-process save/load round
trip with tensors, bf16 and BYTE_IO items; FSDP2 model + AdamW saved on 2 ranks and loaded on 1
and 4 (resharding), exact equality; async_save THREAD with saves in flight at once and PROCESS
mode; a rank killed in write_data leaves the previous save loadable; a damaged array is refused
with an error naming an older save, which loads with ``step=``; checkpoint_id semantics; the
writer pickles as path + options.
"""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils._pytree import tree_flatten

import pccheck
import pccheck.dcp
from pccheck.integrations.dcp_store import close_stores
from pccheck.sharded.index import find_sets

CHILD = str(Path(__file__).with_name("_dcp_child.py"))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        yield
    close_stores()


def _sd(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(6, 4, generator=g), "i": torch.randint(0, 9, (5,), generator=g),
            "h": torch.randn(3, generator=g).bfloat16(), "s": torch.tensor(float(seed)),
            "extra": {"epoch": seed, "name": f"run-{seed}", "ids": [1, 2, seed]}}


def _empty() -> dict:
    return {"w": torch.zeros(6, 4), "i": torch.zeros(5, dtype=torch.long), "h": torch.zeros(3).bfloat16(),
            "s": torch.tensor(0.0), "extra": {"epoch": 0, "name": "", "ids": [0, 0, 0]}}


def _same(a: dict, b: dict) -> bool:
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    return len(fa) == len(fb) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
                                      for x, y in zip(fa, fb))


def _run(tmp: Path, mode: str, path: Path, world: int, out: Path, timeout: float = 120) -> None:
    init = tmp / f"init-{random.random()}"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    procs = [subprocess.Popen([sys.executable, CHILD, mode, str(path), str(r), str(world), str(init), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    errs = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        expected = (0, -9) if mode == "save" and r == 1 else (0,)
        if p.returncode not in expected:
            errs.append(f"rank {r} exit {p.returncode}: {err[-3000:]}")
    assert not errs, "\n".join(errs)


def test_save_load_roundtrip_single_process(tmp_path):
    sd = _sd(1)
    dcp.save(sd, storage_writer=pccheck.dcp.Writer(tmp_path / "ck"))
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert _same(out, sd)
    r = pccheck.load_latest(tmp_path / "ck")  # the same slot through pccheck's own reader
    assert torch.equal(r.state["w"], sd["w"]) and torch.equal(r.state["h"], sd["h"])


class Opaque:
    """A class torch.load(weights_only=True) does not allow (its unpickling could run anything)."""

    def __init__(self, x: int) -> None:
        self.x = x


def test_a_byte_item_weights_only_refuses_is_never_unpickled(tmp_path):
    dcp.save({"w": torch.ones(3), "obj": Opaque(7)}, storage_writer=pccheck.dcp.Writer(tmp_path / "ck"))
    out = {"w": torch.zeros(3), "obj": None}
    # DCP wraps a storage reader's error in its CheckpointException (per rank): pccheck's is inside.
    with pytest.raises(CheckpointException, match=r"ConfigError: checkpoint key 'obj'.*weights_only=True.*Opaque"):
        dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert out["obj"] is None
    with torch.serialization.safe_globals([Opaque]):  # allowed by the user: it loads
        dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert isinstance(out["obj"], Opaque) and out["obj"].x == 7


def test_empty_state_dict_saves_and_loads(tmp_path):
    # A plan with no items (DCP's own e2e test_no_dist / a Stateful returning {}) still commits a
    # slot and is recorded as finished: finish learns the save from a marker WriteResult.
    dcp.save({}, storage_writer=pccheck.dcp.Writer(tmp_path / "ck"))
    assert [s.step for s in find_sets(tmp_path / "ck")] == [1]
    dcp.load({}, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    dcp.save(_sd(1), storage_writer=pccheck.dcp.Writer(tmp_path / "ck"))  # then a real one
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert _same(out, _sd(1))
    from pccheck.group.distributed import read_global

    assert read_global(tmp_path / "ck")["step"] == 2


def test_checkpoint_id_is_a_directory_and_saves_accumulate(tmp_path):
    w = pccheck.dcp.Writer()
    for seed in (1, 2):
        dcp.save(_sd(seed), checkpoint_id=tmp_path / "ck", storage_writer=w)
    assert [s.step for s in find_sets(tmp_path / "ck")] == [2, 1]
    assert pccheck.dcp.Reader.validate_checkpoint_id(tmp_path / "ck")
    assert not pccheck.dcp.Reader.validate_checkpoint_id(tmp_path / "nothing")
    out = _empty()
    dcp.load(out, checkpoint_id=tmp_path / "ck", storage_reader=pccheck.dcp.Reader())
    assert _same(out, _sd(2))
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck", step=1))
    assert _same(out, _sd(1))
    with pytest.raises(CheckpointException, match="saves found: 2, 1"):  # DCP wraps our NoCheckpointError
        dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck", step=7))
    with pytest.raises(pccheck.ConfigError, match="unknown"):
        pccheck.dcp.Writer(tmp_path, max_inflight=3)


def test_writer_pickles_as_path_and_options(tmp_path):
    w = pccheck.dcp.Writer(tmp_path / "ck", max_concurrent=3)
    w.stage(_sd(1))  # a staging pool exists now; it must not travel
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.path == w.path and w2.options == {"max_concurrent": 3} and w2._pool is None
    w.close()


def test_async_save_thread_with_saves_in_flight(tmp_path):
    w = pccheck.dcp.Writer(tmp_path / "ck", max_concurrent=2)
    futs = [dcp.async_save(_sd(seed), storage_writer=w) for seed in range(1, 5)]  # none waited for
    for f in futs:
        f.result(timeout=60)
    assert len(w._pool._buffers) <= 2  # staging reused its buffers: host memory does not grow
    steps = [s.step for s in find_sets(tmp_path / "ck")]
    assert steps and len(set(steps)) == len(steps)
    # Upload threads may reach write_data out of order: a save staged before one that already
    # started is not written, so the newest set always holds the newest state.
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert _same(out, _sd(4))
    w.close()


def test_damaged_array_is_refused_and_older_save_loads(tmp_path):
    w = pccheck.dcp.Writer(tmp_path / "ck")
    for seed in (1, 2):
        dcp.save(_sd(seed), storage_writer=w)
    close_stores()
    newest = find_sets(tmp_path / "ck")[0]
    m = newest.members[0]
    entry = m.entries["w"][0]
    from pccheck.persist.recovery import slot_base

    pos = slot_base(m.image, m.slot) + entry.offset + 5
    with open(m.image.path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))
    out = _empty()
    with pytest.raises(CheckpointException, match=r"checksum mismatch.*step=1"):  # wraps CorruptCheckpointError
        dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck", step=1))
    assert _same(out, _sd(1))


def test_fsdp2_two_ranks_reshard_to_one_and_four_and_crash_in_write(tmp_path):
    """Saved on 2 ranks (the third save loses rank 1 in write_data), loaded on 1 and 4."""
    ck, full = tmp_path / "ck", tmp_path / "full.pt"
    _run(tmp_path, "save", ck, 2, full)
    sets = find_sets(ck)
    assert [s.step for s in sets][:2] == [2, 1], "the third save must stay incomplete"
    want = torch.load(full)
    for world in (1, 4):
        got = tmp_path / f"load{world}.pt"
        _run(tmp_path, "load", ck, world, got)
        assert _same(torch.load(got), want), f"load on {world} rank(s) differs"


def test_async_save_process_mode(tmp_path):
    ck, full = tmp_path / "ck", tmp_path / "full.pt"
    _run(tmp_path, "process", ck, 1, full)
    assert [s.step for s in find_sets(ck)][0] == 3
    got = tmp_path / "load.pt"
    _run(tmp_path, "load", ck, 1, got)
    assert _same(torch.load(got), torch.load(full))


def test_a_memory_tier_is_refused_saying_why(tmp_path):
    """DCP saves have no memory tier (no steps, no state source): asked for one, the Writer and
    the tier stack a rank store opens both refuse it, naming the way to a RAM tier."""
    with pytest.raises(pccheck.ConfigError, match="no memory tier.*pccheck.Checkpointer"):
        pccheck.dcp.Writer(tmp_path / "ck", memory=pccheck.MemoryOptions(every=1))
    from pccheck.integrations.dcp_store import RankStore

    store = RankStore(tmp_path / "ck", 1, 0, pccheck.dcp.Writer(tmp_path / "ck").engine,
                      pccheck.Options(memory=pccheck.MemoryOptions(every=1)))
    with pytest.raises(pccheck.ConfigError, match="no memory tier"):
        store.write(None, None, {"w": torch.ones(4)}, {"shards": {}, "dcp": None})
    assert not list((tmp_path / "ck").glob("store-*")), "nothing was written"


def test_the_rank_store_opens_its_tiers_through_the_stack(tmp_path):
    """A save's rank store is a TierStack's disk tier (the one place every entry point gets its
    tiers from); closing the Writer closes it, and the next save opens it again."""
    from pccheck.integrations.dcp_store import rank_store
    from pccheck.tiers.stack import TierStack

    w = pccheck.dcp.Writer(tmp_path / "ck")
    dcp.save(_sd(1), storage_writer=w)
    store = rank_store(tmp_path / "ck", 1, 0, w.engine)
    assert isinstance(store.stack, TierStack) and store.stack.disk.last_durable_step == 1
    assert store.stack.tiers == []  # a local directory: no tier beside or after the disk
    w.close()
    dcp.save(_sd(2), storage_writer=w)
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert _same(out, _sd(2))
