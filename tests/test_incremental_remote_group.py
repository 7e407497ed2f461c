"""Incremental checkpoints on the remote tier of a torch.distributed group (FORMAT.md §12.8, §12.7),
against a real S3 server (SeaweedFS, tests/conftest.py): a 2-rank FSDP2 job (gloo on CPU) with a
frozen backbone uploads, per rank and step, only the arrays that changed on that rank; each rank's
part references its earlier objects; retention keeps what a kept step names; with every local
directory gone, the job loads from s3:// on 2 ranks and resharded on 1, bit for bit; a damaged
object one rank's parts reference takes the whole group back to an older complete step."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pccheck.tiers.remote import layout  # noqa: E402
from pccheck.tiers.remote.commit import committed  # noqa: E402
from pccheck.tiers.remote.load import local_manifest  # noqa: E402
from pccheck.tiers.remote.objstore import ObjectStore  # noqa: E402
from test_incremental_group import STEPS, _equal, _job, _loaded_step  # noqa: E402

MiB = 1 << 20
WIDTH = 512  # a 1 MiB frozen linear per block: what is referenced dwarfs the adapters' padding


@pytest.fixture(scope="module")
def saved(s3_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The 2-rank job saved to disk and to a fresh prefix; then every local directory is deleted."""
    tmp = tmp_path_factory.mktemp("grp-remote")
    env = dict(os.environ, **s3_server.env(), PCCHECK_TEST_WIDTH=str(WIDTH),
               AWS_CONFIG_FILE=str(tmp / "no-aws-config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp / "no-aws-credentials"))
    for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        env.pop(k, None)
    url = f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:10]}"
    _job("fsdp", "save", tmp / "ck", tmp / "ref", world=2, remote=url, env=env)
    shutil.rmtree(tmp / "ck")  # the machines are lost: only the object store remains
    return tmp, url, env


def _store(url: str, env: dict[str, str], monkeypatch) -> ObjectStore:  # type: ignore[no-untyped-def]
    for k, v in env.items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    return ObjectStore(url)


def _manifest(store: ObjectStore, step: int) -> layout.StepManifest:
    raw, _ = store.get(layout.manifest_key(1, step), layout.MAX_MANIFEST_BYTES)
    return layout.decode_manifest(raw, 1, step)


def test_each_rank_uploads_only_its_changed_bytes(saved):
    tmp, _, _ = saved
    for rank in range(2):
        steps = json.loads((tmp / f"ref.remote-{rank}.json").read_text())
        assert [s["remote_step"] for s in steps] == list(range(1, STEPS + 1)), steps
        assert steps[0]["referenced"] == 0 and steps[0]["uploaded"] >= steps[0]["written"] > 2 * MiB
        for s in steps[1:]:  # the frozen shards referenced; the adapters and AdamW state uploaded
            assert s["uploaded"] <= 1.25 * s["written"] + 4 * MiB, (rank, steps)
            assert s["referenced"] > 4 * s["uploaded"] > 0, (rank, steps)
        # step 3 changed a frozen bias in place: this rank's shard of it is uploaded then
        assert steps[2]["uploaded"] > steps[1]["uploaded"], (rank, steps)


def test_parts_reference_their_own_ranks_objects_and_retention_keeps_them(saved, monkeypatch):
    _, url, env = saved
    store = _store(url, env, monkeypatch)
    assert committed(store) == [(1, s) for s in range(STEPS, STEPS - 3, -1)]  # keep_last=3
    raw, _ = store.get(layout.manifest_key(1, STEPS), layout.MAX_MANIFEST_BYTES)
    assert json.loads(raw)["version"] == layout.REFS_VERSION
    named: set[str] = set()
    for step in range(STEPS - 2, STEPS + 1):
        for part in _manifest(store, step).ranks:
            assert part.objects, "a later step references nothing"
            assert all(key.endswith(f"/rank-{part.rank}.bin") for key in part.keys())  # its own rank's only
            named.update(part.keys())
    first = {k for k in named if "/s1-" in k}
    assert len(first) == 2  # step 1's frozen shards, one object per rank: its manifest went, they stay
    assert set(o.key for o in store.list("data/")) == named  # nothing else is left


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 1])  # 1: resharded (sharded reader);
# 2 ranks load through the references in the damaged-object test below too
def test_loads_from_s3_on_the_same_and_another_world(saved, tmp_path, world):
    tmp, url, env = saved
    outs = _job("fsdp", "load", url, tmp_path / "got", world=world, env=env)
    assert _loaded_step(outs) == {STEPS}
    assert _equal(tmp_path / "got", tmp / f"ref.{STEPS}")


def test_a_damaged_object_one_rank_references_takes_the_group_back(saved, tmp_path, monkeypatch):
    """Step 4 of rank 1 reads the bias step 3 changed from step 3's object: one bit flipped there
    breaks steps 3 and 4 of that rank, so both ranks load step 2."""
    tmp, url, env = saved
    store = _store(url, env, monkeypatch)
    p3, p4 = _manifest(store, 3).ranks[1], _manifest(store, 4).ranks[1]
    names = [e.name for e in local_manifest(p4, 4).arrays]
    bias = next(i for i, n in enumerate(names) if n.endswith("1.base.bias"))
    obj, off = p4.where[bias]
    assert obj > 0 and p4.objects[obj - 1][0] == p3.data  # referenced, in step 3's object
    good = store.client.get_object(Bucket=store.bucket, Key=store.key(p3.data))["Body"].read()
    bad = bytearray(good)
    bad[off + 4] ^= 0x10
    store.put(p3.data, bytes(bad))
    try:
        outs = _job("fsdp", "load", url, tmp_path / "got", world=2, env=env)
        assert _loaded_step(outs) == {STEPS - 2}
        assert _equal(tmp_path / "got", tmp / f"ref.{STEPS - 2}")
    finally:
        store.put(p3.data, good)
