"""The remote tier (FORMAT.md §12) against a real S3 server (SeaweedFS, tests/conftest.py).

Each fault the remote tier must survive is a test: SIGKILL at three points of the remote commit, the server
stopped mid-upload and restarted, wrong credentials / missing bucket / no conditional writes at
construction, a damaged or missing data object, two jobs racing on one prefix, and a cluster-loss
round (train, SIGKILL, delete the local store, resume from the remote bit for bit)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

import pccheck
from pccheck.tiers.remote import layout
from pccheck.tiers.remote.commit import commit_step, committed, read_pointer
from pccheck.tiers.remote.objstore import ObjectStore

HERE = Path(__file__).parent
MiB = 1 << 20


def _arrays(step: int, n: int = 1000) -> dict[str, np.ndarray]:
    return {"w": np.full(n, step, dtype=np.float32), "i": np.arange(7, dtype=np.int64) * step}


def _fill(state: dict, step: int) -> None:
    for k, v in _arrays(step, len(state["w"])).items():
        state[k][...] = v


def _assert_step(r, step: int, n: int = 1000) -> None:
    assert r.step == step
    for k, v in _arrays(step, n).items():
        assert np.array_equal(r.state[k], v), k


def test_roundtrip_stats_and_fallback_to_remote(s3_url, tmp_path):
    state = _arrays(0)
    ck = pccheck.Checkpointer(state, tmp_path / "ck", remote=s3_url)
    for s in (1, 2, 3):
        _fill(state, s)
        ck.checkpoint(s)
    assert ck.wait(remote=True, timeout=60)
    st = ck.stats()
    assert st.remote_step == 3 and st.remote_lag_s == 0.0
    assert st.as_dict()["summary"]["remote_step"] == 3
    ck.close()
    r = pccheck.load_latest(s3_url)
    assert r.tier == "remote"
    _assert_step(r, 3)
    local = pccheck.load_latest(tmp_path / "ck", remote=s3_url)
    assert local.tier == "disk" and local.step == 3
    shutil.rmtree(tmp_path / "ck")  # the machine is gone: the local store with it
    r = pccheck.load_latest(tmp_path / "ck", remote=s3_url)
    assert r.tier == "remote"
    _assert_step(r, 3)


def test_remote_every_selects_steps_not_commits(s3_url, tmp_path):
    """every=4 with disk checkpoints at steps 2, 4, ..., 12: the steps divisible by 4 are uploaded
    (each waited for, so none is superseded), not every 4th durable checkpoint (step 8 alone)."""
    state = _arrays(0)
    with pccheck.Checkpointer(state, tmp_path / "ck", remote=pccheck.RemoteOptions(url=s3_url, every=4)) as ck:
        for s in range(2, 13, 2):
            _fill(state, s)
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
        assert ck.stats().remote["remote_uploads"] == 3
    assert sorted(s for _, s in committed(ObjectStore(s3_url))) == [4, 8, 12]


def test_older_remote_keywords_are_aliases():
    """The 0.1.0 remote keywords still build the same RemoteOptions; remote_every warns (it
    counted durable checkpoints, `every` selects steps), unless 1 (each one in both meanings)."""
    import warnings

    url = "s3://bucket/prefix"
    want = pccheck.RemoteOptions(url=url, keep_last=2, keep_every=3, part_size=16 * MiB, concurrency=2,
                                 close_timeout=5.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = pccheck.Options().updated(remote=url, remote_every=1, remote_keep_last=2, remote_keep_every=3,
                                         remote_part_size=16 * MiB, remote_concurrency=2, remote_close_timeout=5.0)
        assert opts.remote == want
        assert pccheck.RemoteOptions(remote=url, remote_keep_last=2, remote_keep_every=3, remote_part_size=16 * MiB,
                                     remote_concurrency=2, remote_close_timeout=5.0) == want
        assert (opts.remote.remote, opts.remote.remote_keep_last, opts.remote.remote_part_size) == (url, 2, 16 * MiB)
    # remote_every=k > 1 keeps counting durable checkpoints (legacy_every), and says so
    with pytest.warns(DeprecationWarning, match=r"0\.1\.0 meaning.*RemoteOptions\(url=\.\.\., every=N\)"):
        r = pccheck.Options().updated(remote=url, remote_every=2).remote
    assert (r.every, r.legacy_every, r.remote_every) == (1, 2, 2)
    with pytest.warns(DeprecationWarning, match="counted as they commit"):
        assert pccheck.RemoteOptions(remote=url, remote_every=2) == r
    with pytest.warns(DeprecationWarning):  # the older flat keyword over a tier object, as for the others
        assert pccheck.Options().updated(remote=pccheck.RemoteOptions(url=url, every=5), remote_every=3).remote == \
            pccheck.RemoteOptions(url=url, legacy_every=3)
    with pytest.raises(pccheck.ConfigError, match="cannot be combined"):
        pccheck.RemoteOptions(url=url, every=4, legacy_every=2)
    with pytest.raises(pccheck.ConfigError, match="remote_every"):
        pccheck.Options().updated(remote_every=0)
    with pytest.raises(pccheck.ConfigError, match="remote.every"):
        pccheck.Options().updated(remote=pccheck.RemoteOptions(url=url, every=0))


def test_remote_every_and_close_waits(s3_url, tmp_path):
    state = _arrays(0)
    with pccheck.Checkpointer(state, tmp_path / "ck", remote=pccheck.RemoteOptions(url=s3_url, every=2)) as ck:
        for s in range(1, 6):
            _fill(state, s)
            ck.checkpoint(s)
            ck.wait()
    store = ObjectStore(s3_url)
    steps = {s for _, s in committed(store)}
    assert steps <= {2, 4} and 4 in steps  # only every 2nd; close() waited for the newest
    _assert_step(pccheck.load_latest(s3_url), 4)


def test_remote_every_keeps_counting_durable_checkpoints(s3_url, tmp_path):
    """pccheck 0.1.0's remote_every=k uploads every k-th durable checkpoint: interval=10 with
    remote_every=2 over steps 1..60 uploads 20, 40, 60; from step 0 (commits 0, 10, 20, ...) it
    uploads 10, 30, 50, which no step rule gives; explicit checkpoints count too."""
    for first, want in ((1, [20, 40, 60]), (0, [10, 30, 50])):
        url = f"{s3_url}-{first}"
        state = _arrays(0)
        with pytest.warns(DeprecationWarning, match="0.1.0 meaning"):
            ck = pccheck.Checkpointer(state, tmp_path / f"ck{first}", interval=10, remote=url, remote_every=2)
        with ck:
            for s in range(first, 61):
                _fill(state, s)
                if ck.maybe_checkpoint(s):
                    assert ck.wait(remote=True, timeout=60)
            assert ck.stats().remote["remote_uploads"] == 3
        assert sorted(s for _, s in committed(ObjectStore(url))) == want
    url = f"{s3_url}-x"
    state = _arrays(0)
    with pytest.warns(DeprecationWarning):
        ck = pccheck.Checkpointer(state, tmp_path / "ckx", remote=pccheck.RemoteOptions(url=url, remote_every=3))
    with ck:
        for s in (5, 7, 11, 13, 17, 19):
            _fill(state, s)
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
    assert sorted(s for _, s in committed(ObjectStore(url))) == [11, 19]


@pytest.mark.parametrize("mode,survivor", [("parts", 1), ("manifest", 1), ("pointer", 2)])
def test_sigkill_during_the_remote_commit_never_tears(s3_url, tmp_path, mode, survivor):
    n = 5 << 19  # _remote_child.N
    out = subprocess.run([sys.executable, str(HERE / "_remote_child.py"), str(tmp_path / "ck"), s3_url, mode],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == -9, out.stderr[-2000:]
    assert "REMOTE 1" in out.stdout and "NOT KILLED" not in out.stdout
    r = pccheck.load_latest(s3_url)  # the newest committed step, whole
    _assert_step(r, survivor, n)
    ptr, _ = read_pointer(ObjectStore(s3_url))
    assert ptr is not None and ptr.step == 1  # the pointer never moved past step 1
    if mode != "pointer":
        return
    # A job that resumes in the same prefix continues there: its generation supersedes, here a
    # committed step 2 the pointer never named.
    state = _arrays(1, 1000)
    with pccheck.Checkpointer(state, tmp_path / "ck2", remote=s3_url) as ck:
        assert ck._remote.generation == 2
        ck.checkpoint(1)  # a step below the old job's newest: it still supersedes it
    r3 = pccheck.load_latest(s3_url)
    _assert_step(r3, 1)
    assert r3.generation == 2


def test_server_stopped_mid_upload_then_restarted(s3_server, s3_url, tmp_path):
    state = _arrays(0, n=5 * MiB)  # 20 MiB: three parts of 8 MiB
    ck = pccheck.Checkpointer(state, tmp_path / "ck", remote=s3_url, remote_part_size=8 * MiB, remote_concurrency=1)
    try:
        _fill(state, 1)
        ck.checkpoint(1)
        s3_server.stop(kill=True)  # mid-upload (or before it starts): every request now fails
        for s in range(2, 6):  # training goes on: checkpoints commit locally, nothing waits on S3
            _fill(state, s)
            assert ck.checkpoint(s)
            ck.wait()
            assert ck.last_durable_step == s
        assert ck.stats().remote_step is None
    finally:
        s3_server.start()
    assert ck.wait(remote=True, timeout=120)  # the newest is uploaded once the server is back
    assert ck.stats().remote_step == 5
    ck.close()
    _assert_step(pccheck.load_latest(s3_url), 5, 5 * MiB)


def test_construction_errors_are_clear(s3_server, s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(pccheck.RemoteConfigError, match="access denied|refuses writes"):
        pccheck.Checkpointer(_arrays(0), tmp_path / "a", remote=s3_url)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.env()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(pccheck.RemoteConfigError, match="does not exist"):
        pccheck.Checkpointer(_arrays(0), tmp_path / "b", remote="s3://no-such-bucket-28/x")
    import _s3proxy

    proxy = _s3proxy.start(s3_server.ports["s3.port"])
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
        with pytest.raises(pccheck.RemoteConfigError, match="conditional writes"):
            pccheck.Checkpointer(_arrays(0), tmp_path / "c", remote=s3_url)
    finally:
        proxy.shutdown()
    assert not (tmp_path / "a").exists() or not list((tmp_path / "a").glob("store-*"))  # nothing was opened
    with pytest.raises(pccheck.ConfigError):
        pccheck.Checkpointer(_arrays(0), tmp_path / "d", remote="http://x/y")
    with pytest.raises(pccheck.ConfigError):
        pccheck.Checkpointer(_arrays(0), tmp_path / "d", remote=s3_url, remote_part_size=MiB)


def _two_steps(s3_url: str, tmp_path: Path) -> ObjectStore:
    state = _arrays(0)
    with pccheck.Checkpointer(state, tmp_path / "ck", remote=s3_url) as ck:
        for s in (1, 2):
            _fill(state, s)
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
    return ObjectStore(s3_url)


def _data_key(store: ObjectStore, step: int) -> str:
    raw, _ = store.get(layout.manifest_key(1, step), 1 << 20)
    return layout.decode_manifest(raw, 1, step).ranks[0].data


def test_damaged_data_object_falls_back(s3_url, tmp_path, caplog):
    store = _two_steps(s3_url, tmp_path)
    key = _data_key(store, 2)
    raw = bytearray(store.client.get_object(Bucket=store.bucket, Key=store.key(key))["Body"].read())
    raw[5] ^= 0x01  # one bit of step 2's first array
    store.put(key, bytes(raw))
    with caplog.at_level(logging.WARNING, logger="pccheck"):
        r = pccheck.load_latest(s3_url)
    _assert_step(r, 1)
    assert "checksum mismatch" in caplog.text


def test_missing_data_object_falls_back(s3_url, tmp_path):
    store = _two_steps(s3_url, tmp_path)
    store.delete(_data_key(store, 2))
    _assert_step(pccheck.load_latest(s3_url), 1)
    store.delete(_data_key(store, 1))
    with pytest.raises(pccheck.NoCheckpointError):
        pccheck.load_latest(s3_url)


def test_racing_commits_of_one_step_exactly_one_wins(s3_url):
    store = ObjectStore(s3_url)
    part = layout.RankPart(0, "data/x.bin", 0, 8 * MiB, (0,), b"{}")
    results: list[object] = []
    go = threading.Barrier(8)

    def racer() -> None:
        go.wait()
        try:
            commit_step(store, layout.StepManifest(1, 7, 1, 0.0, (part,)))
            results.append("won")
        except pccheck.RemoteConflictError as exc:
            results.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count("won") == 1
    assert all("another job writes the same prefix" in str(e) for e in results if e != "won")


def test_two_jobs_on_one_prefix_one_wins_each_step_the_other_errors(s3_url, tmp_path):
    a_state, b_state = _arrays(0), _arrays(0)
    errors: dict[str, list] = {"a": [], "b": []}
    a = pccheck.Checkpointer(a_state, tmp_path / "a", remote=s3_url, on_error=errors["a"].append)
    b = pccheck.Checkpointer(b_state, tmp_path / "b", remote=s3_url, on_error=errors["b"].append)
    assert a._remote.generation == b._remote.generation  # started together: the same generation
    _fill(a_state, 1)
    b_state["w"][:] = -1.0
    a.checkpoint(1)
    b.checkpoint(1)
    a.wait(remote=True, timeout=60)
    b.wait(remote=True, timeout=60)
    a.close()
    b.close()
    lost = [k for k, v in errors.items() if v]
    assert len(lost) == 1, errors  # exactly one lost, with a clear error
    assert isinstance(errors[lost[0]][0], pccheck.RemoteConflictError)
    assert [s for _, s in committed(ObjectStore(s3_url))] == [1]
    r = pccheck.load_latest(s3_url)
    assert r.step == 1 and r.state["w"][0] == (-1.0 if lost == ["a"] else 1.0)


def test_manifest_and_pointer_decoding_refuses_hostile_input():
    part = layout.RankPart(0, "data/g00000001/s1-x/rank-0.bin", 20 * MiB, 8 * MiB, (1, 2, 3), b"{}")
    good = layout.encode_manifest(layout.StepManifest(1, 1, 1, 0.0, (part,)))
    assert layout.decode_manifest(good, 1, 1).ranks[0].part_crcs == (1, 2, 3)
    bad = [good.replace(b'"step":1', b'"step":2'), good.replace(b'"size":20971520', b'"size":99999999999'),
           good.replace(b"data/g", b"../g"), good[:-5], b"\xff", good.replace(b'"world_size":1', b'"world_size":2')]
    for raw in bad:
        with pytest.raises(pccheck.CorruptCheckpointError):
            layout.decode_manifest(raw, 1, 1)
    with pytest.raises(pccheck.CorruptCheckpointError):
        layout.decode_pointer(layout.encode_pointer(layout.Pointer(1, 5)).replace(b"s5.json", b"s6.json"))
    assert layout.parse_manifest_key("manifests/g00000003/s-12.json") == (3, -12)
    assert layout.parse_manifest_key("manifests/g3/s1.json") is None


def _remote_losses(out: str) -> dict[int, float]:
    return {int(l.split()[1]): float(l.split()[2]) for l in out.splitlines() if l.startswith("LOSS")}


def test_cluster_loss_resume_from_remote_is_bitwise(s3_url, tmp_path):
    """Train with the remote tier, SIGKILL, delete every local directory, resume from the remote
    (here, in this process): the rest of the loss curve and the final weights equal an
    uninterrupted run's."""
    import torch

    import _torch_train as tt

    steps = 12
    tt.setup()
    model, optim, sched = tt.make(width=64)
    ref = {s: tt.train_step(model, optim, sched, s) for s in range(1, steps + 1)}
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}
    child = [sys.executable, str(HERE / "_remote_train.py"), str(tmp_path / "ck"), s3_url, str(steps)]
    proc = subprocess.Popen(child, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("REMOTE") and line.split()[1] != "None" and int(line.split()[1]) >= 6:
            proc.kill()  # SIGKILL: the machine is gone
            break
    proc.wait(60)
    assert proc.returncode == -9
    shutil.rmtree(tmp_path / "ck")
    tt.setup()
    model, optim, sched = tt.make(width=64)
    r = pccheck.load_latest(tmp_path / "ck", model=model, optimizer=optim, extra_state={"sched": sched}, remote=s3_url)
    assert r.tier == "remote" and r.step >= 6
    for s in range(r.step + 1, steps + 1):
        assert tt.train_step(model, optim, sched, s) == ref[s], f"step {s} after resuming at {r.step}"
    assert all(torch.equal(model.state_dict()[k], ref_state[k]) for k in ref_state)


def test_slot_held_while_its_upload_runs(s3_url, tmp_path, monkeypatch):
    """Step 1's upload is stalled (in this process, on the real server) while five more local
    checkpoints commit: training never waits, the slot under upload is never reused (its upload
    commits with every crc matching), and the newest supersedes the queued ones."""
    from pccheck.tiers.remote import objstore
    from pccheck.tiers.remote.load import _load_step

    gate, started = threading.Event(), threading.Event()
    orig = objstore.ObjectStore.upload_part

    def stalled(self, rel, upload_id, number, data, **kw):
        if "/s1-" in rel and number == 1:
            started.set()
            gate.wait(60)
        return orig(self, rel, upload_id, number, data, **kw)

    monkeypatch.setattr(objstore.ObjectStore, "upload_part", stalled)
    n = 7 * MiB  # 28 MiB: four parts; the reader is stalled mid-slot (two part buffers, one sender)
    state = _arrays(0, n)
    ck = pccheck.Checkpointer(state, tmp_path / "ck", remote=s3_url, max_concurrent=1, remote_part_size=8 * MiB,
                              remote_concurrency=1)
    try:
        _fill(state, 1)
        ck.checkpoint(1)
        assert started.wait(60)
        for s in range(2, 7):  # 1 in flight + the latest + 1 held: the held slot is never taken
            _fill(state, s)
            assert ck.checkpoint(s)
            ck.wait()
            assert ck.last_durable_step == s
        gate.set()
        assert ck.wait(remote=True, timeout=60)
        p = ck.stats().remote
        assert p["remote_abandoned"] == 0 and p["remote_uploads"] == 2 and p["remote_superseded"] == 4
    finally:
        gate.set()
        ck.close()
    store = ObjectStore(s3_url)
    assert [s for _, s in committed(store)] == [6, 1]
    _assert_step(_load_step(store, 1, 1), 1, n)
    _assert_step(pccheck.load_latest(s3_url), 6, n)


def test_remote_retention_keeps_last_and_every_and_collects_orphans(s3_url, tmp_path):
    store = ObjectStore(s3_url)
    # an older job's leftovers: a data object no manifest names, and an upload never completed
    store.put("data/g00000000/s9-dead/rank-0.bin", b"x")
    stale = store.start_multipart("data/g00000000/s9-beef/rank-0.bin")
    state = _arrays(0)
    remote = pccheck.RemoteOptions(url=s3_url, keep_last=2, keep_every=3)
    with pccheck.Checkpointer(state, tmp_path / "ck", remote=remote) as ck:
        for s in range(1, 8):
            _fill(state, s)
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
    assert [s for _, s in committed(store)] == [7, 6, 3]
    data = {o.key for o in store.list("data/")}
    assert len(data) == 3 and not any(k.startswith("data/g00000000/") for k in data)
    assert all(u[1] != stale for u in store.stale_uploads("data/"))
    _assert_step(pccheck.load_latest(s3_url), 7)


@pytest.mark.slow  # four processes importing torch: 20-45 s here (make test-slow)
def test_two_ranks_each_upload_their_part_and_resume_from_remote(s3_url, tmp_path):
    """A 2-rank job: each rank uploads its part, rank 0 commits one global manifest; with every
    local store deleted, a new 2-rank job loads each rank's part from the remote, bit for bit."""
    _two_rank_rounds(s3_url, tmp_path, replicated=False)


@pytest.mark.slow  # four processes importing torch (make test-slow)
def test_replicated_rank0_uploads_alone_and_every_rank_loads_it(s3_url, tmp_path):
    """replicated="rank0": rank 0 alone writes and uploads (world_size 1); a new 2-rank job
    with no local store loads that one part on every rank."""
    _two_rank_rounds(s3_url, tmp_path, replicated=True)


@pytest.mark.slow  # four processes importing torch (make test-slow)
def test_two_ranks_restore_lazily_from_remote(s3_url, tmp_path):
    """A 2-rank job uploads its parts; with every local store deleted, a new 2-rank job restores
    with lazy=True from the remote (the ranks agree on the step, each fetches its own part's
    arrays by ranged GETs as they are needed), bit for bit."""
    _two_rank_rounds(s3_url, tmp_path, replicated=False, resume="--lazy")


def _two_rank_rounds(s3_url: str, tmp_path: Path, replicated: bool, resume: str = "--resume") -> None:
    import torch

    flags = ["--replicated"] if replicated else []

    def launch(*extra: str) -> list[str]:
        init = tmp_path / f"init-{uuid.uuid4().hex}"
        procs = [subprocess.Popen([sys.executable, str(HERE / "_remote_dist.py"), str(tmp_path / "ck"), s3_url, "8",
                                   str(r), "2", str(init), str(tmp_path), *flags, *extra], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=os.environ.copy()) for r in range(2)]
        outs = [p.communicate(timeout=180) for p in procs]
        for p, (o, e) in zip(procs, outs):
            assert p.returncode == 0, e[-3000:]
        return [o for o, _ in outs]

    outs = launch()
    assert "REMOTE True 8" in outs[0] and (replicated or "REMOTE True 8" in outs[1])
    store = ObjectStore(s3_url)
    (g, s), *_ = committed(store)
    raw, _ = store.get(layout.manifest_key(g, s), 1 << 20)
    man = layout.decode_manifest(raw, g, s)
    assert (s, man.world_size, [p.rank for p in man.ranks]) == ((8, 1, [0]) if replicated else (8, 2, [0, 1]))
    shutil.rmtree(tmp_path / "ck")  # every node is gone
    outs = launch(resume)
    for r in range(2):
        assert ("START 8 lazy" if resume == "--lazy" else "START 8 remote") in outs[r]
        final = torch.load(tmp_path / f"final-{0 if replicated else r}.pt", weights_only=True)
        loaded = torch.load(tmp_path / f"loaded-{r}.pt", weights_only=True)
        assert all(torch.equal(final[k], loaded[k]) for k in final)


def test_cli_ls_and_verify_take_s3(s3_url, tmp_path):
    import json

    from typer.testing import CliRunner

    from pccheck.commands.cli import app

    store = _two_steps(s3_url, tmp_path)
    run = CliRunner().invoke
    out = run(app, ["ls", s3_url, "--json"])
    assert out.exit_code == 0, out.output
    assert [(s["step"], s["pointer"]) for s in json.loads(out.output)["steps"]] == [(2, True), (1, False)]
    assert run(app, ["verify", s3_url]).exit_code == 0
    store.delete(_data_key(store, 2))  # the newest no longer loads: verify says 1, and why
    out = run(app, ["verify", s3_url, "--json"])
    doc = json.loads(out.output)
    assert out.exit_code == 1 and doc["exit_code"] == 1
    assert doc["steps"][0]["problem"] and doc["steps"][1]["problem"] is None
    out = run(app, ["inspect", s3_url, "--step", "2", "--json"])  # the manifest alone: still fine
    assert out.exit_code == 0 and [a["name"] for a in json.loads(out.output)["arrays"]] == ["w", "i"]
    dest = tmp_path / "x.safetensors"
    assert run(app, ["export", s3_url, "--out", str(dest)]).exit_code == 0  # falls back to step 1
    from safetensors.numpy import load_file

    assert np.array_equal(load_file(dest)["w"], _arrays(1)["w"])
    assert run(app, ["export", s3_url, "--step", "2", "--out", str(dest)]).exit_code == 2


def test_lazy_restore_from_remote_matches_eager(s3_url, tmp_path):
    import torch

    import _torch_train as tt

    tt.setup()
    model, optim, sched = tt.make(width=64)
    with pccheck.Checkpointer(model, optim, tmp_path / "ck", extra_state={"sched": sched}, remote=s3_url) as ck:
        for s in range(1, 4):
            tt.train_step(model, optim, sched, s)
            ck.checkpoint(s)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    m2, o2, s2 = tt.make(width=64)
    r = pccheck.load_latest(s3_url, model=m2, optimizer=o2, extra_state={"sched": s2}, lazy=True)
    assert isinstance(r, pccheck.LazyRestore) and r.step == 3
    r.wait()
    assert all(torch.equal(m2.state_dict()[k], want[k]) for k in want)
    want_opt = optim.state_dict()["state"]
    assert all(torch.equal(o2.state_dict()["state"][i][k], want_opt[i][k]) for i in want_opt for k in want_opt[i])
    shutil.rmtree(tmp_path / "ck")  # lazy with remote= falls back to the remote tier too
    m3, o3, s3 = tt.make(width=64)
    r = pccheck.load_latest(tmp_path / "ck", model=m3, optimizer=o3, extra_state={"sched": s3}, lazy=True, remote=s3_url)
    r.wait()
    assert r.step == 3 and all(torch.equal(m3.state_dict()[k], want[k]) for k in want)


def test_an_older_commit_reported_late_never_supersedes_a_newer_one(s3_url, tmp_path):
    """Two commit threads may report their commits in either order: the older one must not
    replace the newer one in the upload queue (a regression test for a flaky round trip)."""
    from pccheck.orchestrator.orchestrator import CommitInfo

    state = _arrays(0)
    with pccheck.Checkpointer(state, tmp_path / "ck", remote=s3_url) as ck:
        for s in (1, 2):
            _fill(state, s)
            ck.checkpoint(s)
            ck.wait()
        up = ck._remote  # replay step 1's commit report after step 2's
        up.on_commit(CommitInfo(1, 1, 0, ck._orch.store.file))
        assert ck.wait(remote=True, timeout=60)
        assert ck.stats().remote_step == 2
    _assert_step(pccheck.load_latest(s3_url), 2)


def test_one_pass_crcs_equal_each_parts_and_each_arrays_own():
    """upload.py checksums each byte once (pieces cut at array bounds, combined): every part's
    crc32c and every array's equal the direct ones, with parts cutting arrays, gaps between
    arrays and zero-size arrays; one flipped byte fails the check."""
    from pccheck.persist.reader import crc32c
    from pccheck.tiers.remote.upload import _Crcs

    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 5 * 4096, dtype=np.uint8)
    spans = [(0, 100), (128, 0), (128, 5000), (5120, 0), (5184, 9000), (20000, 480)]  # (offset, nbytes)
    arrays = [(o, n, crc32c(memoryview(data)[o:o + n])) for o, n in spans]
    for part in (4096, 8192, 3 * 4096, 5 * 4096):
        crcs = _Crcs(arrays)
        got = [crcs.part(o, memoryview(data)[o:o + part]) for o in range(0, len(data), part)]
        assert got == [crc32c(memoryview(data)[o:o + part]) for o in range(0, len(data), part)]
        assert crcs.got == [c for _, _, c in arrays]
        crcs.check("ok")
    data[6000] ^= 1
    crcs = _Crcs(arrays)
    for o in range(0, len(data), 8192):
        crcs.part(o, memoryview(data)[o:o + 8192])
    with pytest.raises(pccheck.CorruptCheckpointError, match="does not match"):
        crcs.check("damaged")


def test_the_server_refuses_a_part_that_does_not_match_its_crc32c(s3_url):
    """Parts go with their crc32c (x-amz-checksum-crc32c, the body unsigned): a body that does
    not match it is refused by the server, not stored."""
    from pccheck.errors import RemoteError
    from pccheck.persist.reader import crc32c

    store = ObjectStore(s3_url)
    body = memoryview(np.arange(1 << 20, dtype=np.uint8))
    up = store.start_multipart("data/crc-check", crc32c=True)
    try:
        with pytest.raises(RemoteError, match="BadDigest|checksum|Checksum|Digest"):
            store.upload_part("data/crc-check", up, 1, body, crc32c=crc32c(body) ^ 1)
        etag = store.upload_part("data/crc-check", up, 1, body, crc32c=crc32c(body))
        store.complete_multipart("data/crc-check", up, [etag], [crc32c(body)])
    except BaseException:
        store.abort_multipart("data/crc-check", up)
        raise
    assert store.get("data/crc-check", 2 << 20)[0] == bytes(body)
