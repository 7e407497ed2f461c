"""pccheck.dcp.Writer and Reader with an ``s3://`` location (FORMAT.md §9.1 with §12),
against the real SeaweedFS server of tests/conftest.py: real DCP, and real FSDP2 on gloo/CPU for
the resharded load. Every load here runs with the local staging directories deleted, so every
byte comes from the object store."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import pccheck
import pccheck.dcp
from pccheck.tiers.remote import layout
from pccheck.tiers.remote.commit import committed, read_pointer
from pccheck.tiers.remote.objstore import ObjectStore
from test_dcp import _empty, _quiet, _run, _same, _sd  # noqa: F401  (_quiet: the autouse fixture)


def _manifest(store: ObjectStore, g: int, s: int) -> layout.StepManifest:
    return layout.decode_manifest(store.get(layout.manifest_key(g, s), 1 << 24)[0], g, s)


def test_s3_saves_commit_remotely_and_load_with_the_staging_dir_gone(s3_url, tmp_path):
    """Two saves and two async saves in flight: each is committed on the store (a step manifest
    written after the part, the pointer moved forward); with the local staging directory
    deleted, the Reader loads the newest (and ``step=`` an older one) from the store, and
    ``load_latest`` reads the same set."""
    stage = tmp_path / "stage"
    w = pccheck.dcp.Writer(s3_url, local=stage, max_concurrent=2)
    assert w.checkpoint_id == s3_url and pccheck.dcp.Writer.validate_checkpoint_id(s3_url)
    for seed in (1, 2):
        dcp.save(_sd(seed), storage_writer=w)
    futs = [dcp.async_save(_sd(seed), storage_writer=w) for seed in (3, 4)]
    for f in futs:
        f.result(timeout=120)
    w.close()
    store = ObjectStore(s3_url)
    steps = committed(store)
    assert len(steps) >= 3 and steps[0][1] == max(s for _, s in steps)
    g, newest = steps[0]
    assert read_pointer(store)[0].order == (g, newest)
    man = _manifest(store, g, newest)
    assert man.world_size == 1 and "dcp" in json.loads(man.ranks[0].manifest)["tree"]
    parts = {o.key for o in store.list("parts/")}  # each committed step's part went up first
    assert all(f"parts/g{gen:08d}/s{s}/rank-0.json" in parts for gen, s in steps)
    shutil.rmtree(stage)
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url))
    assert _same(out, _sd(4))
    first = min(s for _, s in steps)
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url, step=first))
    assert _same(out, _sd(1))
    r = pccheck.load_latest(s3_url)  # pccheck's own loader reads the DCP set (flat tensors)
    assert r.tier == "remote" and r.step == newest and torch.equal(r.state["w"], _sd(4)["w"])


def test_s3_damaged_array_is_refused_naming_an_older_step_which_loads(s3_url, tmp_path):
    w = pccheck.dcp.Writer(s3_url, local=tmp_path / "stage")
    for seed in (1, 2):
        dcp.save(_sd(seed), storage_writer=w)
    w.close()
    store = ObjectStore(s3_url)
    (g, s2), (_, s1) = committed(store)[:2]
    part = _manifest(store, g, s2).ranks[0]
    entry = next(a for a in json.loads(part.manifest)["arrays"] if a["name"] == "w")
    raw = bytearray(store.get(part.data, part.size + 1)[0])
    raw[entry["offset"] + 5] ^= 0xFF
    store.delete(part.data)
    store.put(part.data, bytes(raw))
    out = _empty()
    with pytest.raises(CheckpointException, match=rf"checksum mismatch.*step={s1}"):
        dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url))
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url, step=s1))
    assert _same(out, _sd(1))
    with pytest.raises(CheckpointException, match="no committed step 99"):
        dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url, step=99))


def test_s3_writer_refuses_a_store_it_cannot_use_at_construction(s3_server, s3_url, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(pccheck.RemoteConfigError):
        pccheck.dcp.Writer(s3_url)


@pytest.mark.slow  # two torchrun-style ranks with FSDP2 plus a loading job (make test-slow); the fast
# proof of sharded remote loads is test_remote_sharded's 2 -> 1 round
def test_s3_fsdp2_saved_on_two_ranks_resharded_to_one(s3_url, tmp_path, monkeypatch):
    """FSDP2 + AdamW saved on 2 ranks to s3:// (the third save loses rank 1 in write_data: rank 0
    uploads its part, but no step manifest is written); with the staging directories deleted,
    one rank loads the second save through Reader(s3://), bit for bit."""
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the children's staging directory
    (tmp_path / "tmp").mkdir()
    full = tmp_path / "full.pt"
    _run(tmp_path, "save", s3_url, 2, full)  # type: ignore[arg-type]
    store = ObjectStore(s3_url)
    steps = committed(store)
    assert [s for _, s in steps] == [2, 1], "the third save must not be committed"
    assert _manifest(store, *steps[0]).world_size == 2
    assert any("/s3/" in o.key for o in store.list("parts/")), "rank 0's part of the third save is up"
    shutil.rmtree(tmp_path / "tmp")
    got = tmp_path / "load1.pt"
    _run(tmp_path, "load", s3_url, 1, got)  # type: ignore[arg-type]
    assert _same(torch.load(got), torch.load(full))


def test_s3_saves_take_the_remote_tiers_options_and_a_local_directory(s3_url, tmp_path):
    """The remote tier of a DCP save is the shared one, with its RemoteOptions: a local
    directory with ``remote=RemoteOptions(url=...)`` uploads each save (the rank store's tier
    stack holds the set-mode uploader), ``keep_last`` prunes the store after each commit, and
    ``every`` other than 1 is refused (every DCP save is committed whole)."""
    from pccheck.integrations.dcp_store import rank_store
    from pccheck.tiers.remote.sets import SetUploader

    with pytest.raises(pccheck.ConfigError, match="remote.every must be 1"):
        pccheck.dcp.Writer(s3_url, remote=pccheck.RemoteOptions(every=2))
    with pytest.raises(pccheck.ConfigError, match="give one"):
        pccheck.dcp.Writer(s3_url, remote=pccheck.RemoteOptions(url=s3_url + "-other"))
    w = pccheck.dcp.Writer(tmp_path / "ck", remote=pccheck.RemoteOptions(url=s3_url, keep_last=1,
                                                                         part_size=8 << 20))
    for seed in (1, 2, 3):
        dcp.save(_sd(seed), storage_writer=w)
    assert isinstance(rank_store(tmp_path / "ck", 1, 0, w.engine).stack.tier("remote"), SetUploader)
    w.close()
    store = ObjectStore(s3_url)
    assert [s for _, s in committed(store)] == [3], "keep_last=1 keeps the newest committed step only"
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(tmp_path / "ck"))
    assert _same(out, _sd(3))
    shutil.rmtree(tmp_path / "ck")
    out = _empty()
    dcp.load(out, storage_reader=pccheck.dcp.Reader(s3_url))
    assert _same(out, _sd(3))
