"""pccheck.dcp with incremental=True and an s3:// location (FORMAT.md §12.8 with §12.7), against
the real SeaweedFS server of tests/conftest.py: a 2-rank FSDP2 job (real DCP, real gloo on CPU)
with a frozen backbone and a trained head. Each rank's part of a save uploads only the arrays
that changed on that rank since the last save committed there (counted on the client's wire) and
references its earlier objects; retention keeps what a kept step names; with every local
directory gone, the job loads the newest save from s3:// through DCP, bit for bit."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import pccheck  # noqa: E402
import pccheck.dcp  # noqa: E402
from pccheck.tiers.remote import layout  # noqa: E402
from pccheck.tiers.remote.commit import committed  # noqa: E402
from pccheck.tiers.remote.objstore import ObjectStore  # noqa: E402
from test_dcp import _quiet, _same  # noqa: E402,F401  (_quiet: the autouse fixture)

CHILD = str(Path(__file__).with_name("_dcp_incr_child.py"))
SAVES = 5
MiB = 1 << 20


def _run(tmp: Path, mode: str, url: str, stage: Path, out: Path, world: int = 2, timeout: float = 240) -> None:
    init = tmp / f"init-{random.random()}"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1")
    procs = [subprocess.Popen([sys.executable, CHILD, mode, url, str(stage), str(r), str(world), str(init), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    errs = []
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            errs.append(f"rank {r} exit {p.returncode}: {err[-3000:]}")
    assert not errs, "\n".join(errs)


def _manifest(store: ObjectStore, g: int, s: int) -> layout.StepManifest:
    raw, _ = store.get(layout.manifest_key(g, s), layout.MAX_MANIFEST_BYTES)
    return layout.decode_manifest(raw, g, s)


def test_two_rank_incremental_saves_upload_the_changes_and_load_bit_exact_after_machine_loss(s3_url, tmp_path):
    stage, ref = tmp_path / "stage", tmp_path / "ref.pt"
    _run(tmp_path, "save", s3_url, stage, ref)
    for rank in range(2):
        doc = json.loads(Path(f"{ref}.rank-{rank}.json").read_text())
        sent, changed, frozen = doc["sent"], doc["changed"], doc["frozen"]
        assert len(sent) == SAVES and frozen >= MiB // 2 > 8 * changed, doc  # this rank's half of 1 MiB frozen
        per_save = [b - a for a, b in zip(sent[1:], sent[2:])]  # saves 3.. (the wire hook came with save 1's store)
        per_save.insert(0, sent[1])                             # save 2: its own bytes only
        for n in per_save:  # the changed shards (each padded to 4 KiB) and the part, never the frozen ones
            assert 0 < n <= 1.25 * changed + 96 * 1024 < frozen / 4, (rank, n, doc)
        assert doc["last_referenced"] >= frozen and doc["last_bytes"] <= 1.25 * changed + 64 * 1024, doc
    store = ObjectStore(s3_url)
    steps = committed(store)
    assert len(steps) == 2, f"keep_last=2 keeps two saves: {steps}"
    g, newest = steps[0]
    man = _manifest(store, g, newest)
    assert man.world_size == 2
    first = {o.key for o in store.list("data/") if "/s1-" in o.key}  # data/g<G>/s<S>-<token>/rank-<r>.bin
    for part in man.ranks:  # each rank's part references its own earlier objects (the frozen shards)
        assert part.objects and all(k.endswith(f"/rank-{part.rank}.bin") for k in part.keys()), part
        assert any(k in first for k in part.keys()), "the first save's objects hold the frozen shards"
    named = {k for _, s in steps for r in _manifest(store, g, s).ranks for k in r.keys()}
    assert named <= {o.key for o in store.list("data/")}, "retention deleted an object a kept step names"
    local = tmp_path / "local.pt"  # the staging stores are incremental sets too: they load through the cells
    _run(tmp_path, "load", str(stage), tmp_path / "unused", local)
    assert _same(torch.load(local), torch.load(ref))
    shutil.rmtree(stage)  # the machines are lost: only the object store remains
    got = tmp_path / "load.pt"
    _run(tmp_path, "load", s3_url, tmp_path / "stage-load", got)
    assert _same(torch.load(got), torch.load(ref))


def test_incremental_writer_with_an_object_store_is_built_with_its_set_uploader(s3_url, tmp_path):
    """The refusal of incremental=True with a pccheck.dcp set's remote tier is gone: the rank
    store's remote tier is the set-mode uploader over an incremental disk store, and a save of
    one rank loads back from s3:// with the staging directory deleted."""
    import torch.distributed.checkpoint as dcp

    from pccheck.integrations.dcp_store import rank_store
    from pccheck.tiers.remote.sets import SetUploader

    with pytest.raises(pccheck.ConfigError, match="incremental"):
        pccheck.dcp.Writer(s3_url, incremental="yes")
    w = pccheck.dcp.Writer(s3_url, local=tmp_path / "stage", incremental=True)
    frozen = torch.arange(1 << 18, dtype=torch.float32)
    for i in range(3):
        dcp.save({"frozen": frozen, "head": torch.full((16,), float(i))}, storage_writer=w)
    stack = rank_store(w.path, 1, 0, w.engine).stack
    up = stack.tier("remote")
    assert isinstance(up, SetUploader) and stack.disk.cells is not None
    assert up.progress.last_referenced >= frozen.nbytes and up.progress.last_bytes < 64 * 1024
    w.close()
    shutil.rmtree(tmp_path / "stage")
    out = {"frozen": torch.zeros_like(frozen), "head": torch.zeros(16)}
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url))
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["head"], torch.full((16,), 2.0))


def test_a_leased_base_outlives_keep_last_until_its_save_finishes(s3_url, tmp_path):
    """A save in flight references its plan's base: retention (keep_last=1) keeps that step and
    every object it names while the lease lasts, however many newer saves commit meanwhile, and
    collects it once the lease ends. Without the lease the base would go at the next commit."""
    import torch.distributed.checkpoint as dcp

    w = pccheck.dcp.Writer(s3_url, local=tmp_path / "stage", incremental=True,
                           remote=pccheck.RemoteOptions(keep_last=1))
    frozen = torch.arange(1 << 16, dtype=torch.float32)
    sd = lambda i: {"frozen": frozen, "head": torch.full((16,), float(i))}  # noqa: E731
    dcp.save(sd(1), storage_writer=w)
    store = ObjectStore(s3_url)
    (g, first), = committed(store)
    assert w._remote.lease() == first  # a plan in flight on the first save
    for i in (2, 3):
        dcp.save(sd(i), storage_writer=w)
    kept = [s for _, s in committed(store)]
    assert kept == [first + 2, first], kept  # the newest, and the leased base
    named = {k for s in kept for r in _manifest(store, g, s).ranks for k in r.keys()}
    assert named <= {o.key for o in store.list("data/")}
    w._remote.release(first)
    dcp.save(sd(4), storage_writer=w)
    assert [s for _, s in committed(store)] == [first + 3]
    w.close()
    shutil.rmtree(tmp_path / "stage")
    out = {"frozen": torch.zeros_like(frozen), "head": torch.zeros(16)}
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url))
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["head"], torch.full((16,), 4.0))


def test_overlapping_async_saves_keep_every_referenced_object(s3_url, tmp_path):
    """Incremental async saves two at a time under keep_last=1, a frozen array and one that
    toggles between two values (so a save may reference a base older than a step committed
    while it uploads): every committed step's manifest names only objects that exist, and every
    kept step loads bit for bit from s3:// with the staging directory gone. (With retention
    given no leased bases, this failed in two runs of three: a step named a deleted object.)"""
    import torch.distributed.checkpoint as dcp

    w = pccheck.dcp.Writer(s3_url, local=tmp_path / "stage", incremental=True, max_concurrent=2,
                           remote=pccheck.RemoteOptions(keep_last=1))
    frozen = torch.arange(1 << 16, dtype=torch.float32)

    def sd(i: int) -> dict:
        return {"frozen": frozen, "toggle": torch.full((1 << 12,), float(i % 2)), "head": torch.full((16,), float(i))}

    futs = []
    for i in range(1, 9):
        futs.append(dcp.async_save(sd(i), storage_writer=w))
        if len(futs) == 2:
            futs.pop(0).result(timeout=120)
    for f in futs:
        f.result(timeout=120)
    w.close()
    store = ObjectStore(s3_url)
    steps = committed(store)
    assert steps, "nothing committed"
    objects = {o.key for o in store.list("data/")}
    for g, s in steps:
        assert set(k for r in _manifest(store, g, s).ranks for k in r.keys()) <= objects, (s, steps)
    shutil.rmtree(tmp_path / "stage")
    for n, (_, s) in enumerate(steps):
        out = {"frozen": torch.zeros_like(frozen), "toggle": torch.zeros(1 << 12), "head": torch.zeros(16)}
        dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url, step=s))
        i = int(out["head"][0])  # which save this step holds (an older save overtaken in flight is not written)
        assert _same(out, sd(i)) and (n or i == 8), (s, i)  # the newest step is the last save
