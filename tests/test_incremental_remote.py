"""Incremental checkpoints on the remote tier (FORMAT.md §12.8) against a real S3 server
(SeaweedFS, tests/conftest.py): only changed arrays are uploaded, the rest referenced in earlier
steps' data objects; every referenced byte is checked on load; retention keeps what a kept step
references; a damaged referenced object and a SIGKILL mid-upload fall back to an older step."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import pccheck
from pccheck.commands.cli import app
from pccheck.tiers.remote import layout
from pccheck.tiers.remote.commit import committed
from pccheck.tiers.remote.load import local_manifest, locate_remote
from pccheck.tiers.remote.objstore import ObjectStore

HERE = Path(__file__).parent
MiB = 1 << 20
KW = dict(interval=1, writer_threads=2, chunk_size=1 << 20)


def _lora(seed: int = 0, width: int = 1024, layers: int = 4, rank: int = 8):
    """A frozen backbone (``layers`` width x width linears, 16 MiB at the defaults) with a rank-8
    adapter pair beside each layer; AdamW on the adapters only."""
    import torch

    torch.manual_seed(seed)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
            self.down = torch.nn.ModuleList(torch.nn.Linear(width, rank, bias=False) for _ in range(layers))
            self.up = torch.nn.ModuleList(torch.nn.Linear(rank, width, bias=False) for _ in range(layers))
            for p in self.base.parameters():
                p.requires_grad_(False)

        def forward(self, x):
            for b, d, u in zip(self.base, self.down, self.up):
                x = torch.tanh(b(x) + u(d(x)))
            return x

    model = Model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train(model, opt, steps, ck=None, after=None) -> None:
    import torch

    for step in steps:
        x = torch.randn(4, model.base[0].in_features, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ck is not None:
            ck.checkpoint(step)
            assert ck.wait(remote=True, timeout=60)
            if after is not None:
                after(step)


def _changed_bytes(model, opt) -> int:
    """What a step changes: the trainable parameters, their optimizer state and the buffers."""
    n = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n += sum(b.numel() * b.element_size() for b in model.buffers())
    n += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if hasattr(v, "numel"))
    return n


class _Sent:
    """The bytes the boto3 client puts on the wire (every request's Content-Length), counted by
    a botocore hook: independent of the library's own counters."""

    def __init__(self, store: ObjectStore) -> None:
        self.bytes = 0
        for client in {id(c): c for c in (store.client, store._parts)}.values():  # the parts have their own
            client.meta.events.register("before-send.s3", self._count)

    def _count(self, request, **_) -> None:
        self.bytes += int(request.headers.get("Content-Length", 0) or 0)


def _data_objects(store: ObjectStore) -> dict[str, int]:
    return {o.key: o.size for o in store.list("data/")}


def _step_manifest(store: ObjectStore, step: int, generation: int = 1) -> layout.StepManifest:
    raw, _ = store.get(layout.manifest_key(generation, step), 1 << 24)
    return layout.decode_manifest(raw, generation, step)


def _sd_equal(a, b) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _opt_equal(a, b) -> bool:
    import torch

    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    return sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_lora_uploads_only_the_changed_bytes_and_resumes_bit_exact_after_machine_loss(s3_url, tmp_path):
    model, opt = _lora()
    d = tmp_path / "ck"
    sent: list[int] = []
    with pccheck.Checkpointer(model, opt, d, incremental=True, remote=s3_url, **KW) as ck:
        wire = _Sent(ck._remote.store)
        _train(model, opt, range(1, 5), ck, after=lambda s: sent.append(wire.bytes))
        stats = ck.stats()
        remote = stats.remote
    per_step = np.diff([0] + sent)
    changed = _changed_bytes(model, opt)
    frozen = sum(p.numel() * 4 for p in model.base.parameters())
    assert per_step[0] >= frozen  # the first step uploads everything
    for s, n in enumerate(per_step[1:], start=2):  # then only what changed, counted on the wire
        assert n <= 1.25 * changed + 4 * MiB, (s, n, changed)
    assert remote["remote_last_referenced"] >= frozen
    assert remote["remote_last_bytes"] <= 1.25 * changed
    assert remote["remote_bytes_referenced"] >= 3 * frozen
    # the server agrees: steps 2..4 each added one object holding only the changed arrays
    store = ObjectStore(s3_url)
    sizes = _data_objects(store)
    own = {s: _step_manifest(store, s).ranks[0] for s in range(1, 5)}
    assert own[1].where is not None and own[1].objects == ()  # the first references nothing
    for s in range(2, 5):
        part = own[s]
        assert sizes[part.data] <= 1.25 * changed
        assert part.objects and all(k in sizes for k, _ in part.objects)
        assert own[1].data in part.keys()  # the frozen backbone: step 1's object
    # machine loss: every local directory gone, the remote alone restores step 4 bit for bit
    shutil.rmtree(d)
    fresh, fresh_opt = _lora(seed=7)
    r = pccheck.load_latest(s3_url, model=fresh, optimizer=fresh_opt)
    assert r.step == 4 and r.tier == "remote"
    assert _sd_equal(fresh.state_dict(), model.state_dict()) and _opt_equal(fresh_opt, opt)
    # lazily too, and training continues identically from either
    lazy, lazy_opt = _lora(seed=9)
    lr = pccheck.load_latest(s3_url, model=lazy, optimizer=lazy_opt, lazy=True)
    lr.wait()
    assert lr.step == 4 and _sd_equal(lazy.state_dict(), model.state_dict()) and _opt_equal(lazy_opt, opt)
    for m, o in ((model, opt), (fresh, fresh_opt), (lazy, lazy_opt)):
        _train(m, o, range(5, 7))
    assert _sd_equal(fresh.state_dict(), model.state_dict()) and _sd_equal(lazy.state_dict(), model.state_dict())


def _steps(s3_url: str, tmp_path: Path, steps: range, remote_kw: dict | None = None, mid_until: int = 2):
    """A frozen array, an array that changes up to step ``mid_until`` and then stays, and an
    adapter that changes every step; each step committed remotely before the next."""
    state = {"frozen": np.arange(MiB // 4, dtype=np.float32), "mid": np.zeros(50_000, np.float32),
             "adapter": np.zeros(3000, np.float32)}
    remote = pccheck.RemoteOptions(url=s3_url, **(remote_kw or {}))
    with pccheck.Checkpointer(state, tmp_path / "ck", incremental=True, remote=remote, **KW) as ck:
        for s in steps:
            if s <= mid_until:
                state["mid"][:] = s
            state["adapter"][:] = s
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
    return ObjectStore(s3_url)


def _assert_step(r, step: int, mid_until: int = 2) -> None:
    assert r.step == step
    assert np.array_equal(r.state["frozen"], np.arange(MiB // 4, dtype=np.float32))
    assert np.all(r.state["mid"] == min(step, mid_until)) and np.all(r.state["adapter"] == step)


def test_retention_keeps_referenced_objects_and_deletes_the_rest(s3_url, tmp_path):
    store = _steps(s3_url, tmp_path, range(1, 6), dict(keep_last=2))
    assert [s for _, s in committed(store)] == [5, 4]
    kept = {s: _step_manifest(store, s).ranks[0] for s in (4, 5)}
    named = {k for p in kept.values() for k in p.keys()}
    objs = set(_data_objects(store))
    # step 1 (frozen) and step 2 (mid) are uncommitted now but their objects are referenced: kept;
    # step 3 is gone with its object (nothing references it)
    assert objs == named and len(objs) == 4
    assert all(any(k.startswith(f"data/g00000001/s{s}-") for k in objs) for s in (1, 2, 4, 5))
    assert not any(k.startswith(f"data/g00000001/s{s}-") for k in objs for s in (3,))
    _assert_step(pccheck.load_latest(s3_url), 5)
    # verify and ls read through the references
    run = CliRunner().invoke
    out = run(app, ["ls", s3_url, "--json"])
    assert out.exit_code == 0 and [s["step"] for s in json.loads(out.output)["steps"]] == [5, 4]
    out = run(app, ["verify", s3_url, "--json"])
    assert out.exit_code == 0, out.output
    assert [s["step"] for s in json.loads(out.output)["steps"]] == [5, 4]
    dest = tmp_path / "x.safetensors"
    assert run(app, ["export", s3_url, "--out", str(dest)]).exit_code == 0
    from safetensors.numpy import load_file

    got = load_file(dest)
    assert np.all(got["mid"] == 2) and np.all(got["adapter"] == 5)
    out = run(app, ["inspect", s3_url, "--step", "5", "--json"])
    assert out.exit_code == 0 and [a["name"] for a in json.loads(out.output)["arrays"]] == ["frozen", "mid", "adapter"]


def test_damaged_referenced_object_falls_back_to_an_older_complete_step(s3_url, tmp_path, caplog):
    store = _steps(s3_url, tmp_path, range(1, 4))
    p3 = _step_manifest(store, 3).ranks[0]
    p2 = _step_manifest(store, 2).ranks[0]
    assert p2.data in p3.keys() and p2.data != p3.data  # step 3 reads "mid" from step 2's object
    raw = bytearray(store.client.get_object(Bucket=store.bucket, Key=store.key(p2.data))["Body"].read())
    mid = [e.name for e in local_manifest(p2, 2).arrays].index("mid")
    raw[p2.where[mid][1] + 8] ^= 0x10  # one bit of "mid" in step 2's object
    store.put(p2.data, bytes(raw))
    with caplog.at_level(logging.WARNING, logger="pccheck"):
        r = pccheck.load_latest(s3_url)
    _assert_step(r, 1)  # steps 3 and 2 both read the damaged bytes
    assert "cannot load step 3" in caplog.text and "checksum mismatch" in caplog.text
    # a lazy restore's reader (it locates step 3 by its manifests alone) checks the same bytes
    located = locate_remote(s3_url)
    entries = {e.name: (e, c) for e, c in zip(located.manifest.arrays, located.manifest.crcs)}
    assert located.manifest.step == 3 and np.all(located.read(*entries["adapter"], None) == 3)
    with pytest.raises(pccheck.CorruptCheckpointError, match="'mid' checksum mismatch"):
        located.read(*entries["mid"], None)
    # a missing referenced object: the same fallback
    store.delete(p2.data)
    _assert_step(pccheck.load_latest(s3_url), 1)


def test_sigkill_during_an_incremental_upload_leaves_the_newest_committed_step(s3_url, tmp_path):
    out = subprocess.run([sys.executable, str(HERE / "_incr_remote_child.py"), str(tmp_path / "ck"), s3_url],
                         capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert out.returncode == -9, out.stderr[-2000:]
    assert "REMOTE 2" in out.stdout and "NOT KILLED" not in out.stdout
    r = pccheck.load_latest(s3_url)  # step 3's upload never completed: step 2, whole
    assert r.step == 2
    import _incr_remote_child as child

    for k, v in child.state_at(2).items():
        assert np.array_equal(r.state[k], v), k
    # the next job on the prefix starts a new generation and uploads in full, then incrementally
    state = child.state_at(3)
    with pccheck.Checkpointer(state, tmp_path / "ck2", incremental=True, remote=s3_url, **KW) as ck:
        for s in (3, 4):
            state["adapter"][:] = s
            ck.checkpoint(s)
            assert ck.wait(remote=True, timeout=60)
        assert ck._remote.generation == 2
    r = pccheck.load_latest(s3_url)
    assert r.step == 4 and r.generation == 2 and np.all(r.state["adapter"] == 4)


def test_a_step_with_nothing_changed_uploads_an_empty_object(s3_url, tmp_path):
    store = _steps(s3_url, tmp_path, range(1, 3))  # the same state checkpointed again as step 3
    state = {"frozen": np.arange(MiB // 4, dtype=np.float32), "mid": np.full(50_000, 2, np.float32),
             "adapter": np.full(3000, 2, np.float32)}
    with pccheck.Checkpointer(state, tmp_path / "ck", incremental=True, remote=s3_url, **KW) as ck:
        ck.checkpoint(3)
        assert ck.wait(remote=True, timeout=60)
        ck.checkpoint(4)  # nothing changed since step 3
        assert ck.wait(remote=True, timeout=60)
        assert ck.stats().remote["remote_last_bytes"] == 0
    p4 = _step_manifest(store, 4, generation=2).ranks[0]
    assert p4.size == 0 and all(o != 0 for o, _ in p4.where)
    r = pccheck.load_latest(s3_url)
    assert r.step == 4 and np.all(r.state["adapter"] == 2) and np.all(r.state["mid"] == 2)


def test_two_incremental_jobs_racing_on_one_prefix_one_wins_and_loads_whole(s3_url, tmp_path):
    """Started together (the same generation), two incremental jobs race for each step: the
    create-only step manifest lets one win; the loser stops with RemoteConflictError. The
    winner's later steps reference only its own objects, and the newest loads whole."""
    states = {k: {"frozen": np.full(MiB, v, np.float32), "adapter": np.zeros(2000, np.float32)}
              for k, v in (("a", 1.0), ("b", 2.0))}
    errors: dict[str, list] = {"a": [], "b": []}
    cks = {k: pccheck.Checkpointer(states[k], tmp_path / k, incremental=True, remote=s3_url,
                                   on_error=errors[k].append, **KW) for k in states}
    assert cks["a"]._remote.generation == cks["b"]._remote.generation
    try:
        for s in (1, 2, 3):
            for k, ck in cks.items():
                states[k]["adapter"][:] = s
                ck.checkpoint(s)
            for ck in cks.values():
                ck.wait(remote=True, timeout=60)
    finally:
        for ck in cks.values():
            ck.close()
    lost = [k for k, v in errors.items() if v]
    assert len(lost) == 1 and isinstance(errors[lost[0]][0], pccheck.RemoteConflictError), errors
    won = "a" if lost == ["b"] else "b"
    store = ObjectStore(s3_url)
    assert [s for _, s in committed(store)] == [3, 2, 1]
    mine = {_step_manifest(store, s).ranks[0].data for s in (1, 2, 3)}
    assert all(set(_step_manifest(store, s).ranks[0].keys()) <= mine for s in (2, 3))
    r = pccheck.load_latest(s3_url)
    assert r.step == 3 and np.all(r.state["adapter"] == 3) and np.array_equal(r.state["frozen"], states[won]["frozen"])


def test_old_readers_refuse_a_referencing_step_manifest(s3_url, tmp_path):
    """Version 2: a reader that knows only version 1 refuses it ("unknown format") rather than
    reading arrays at their local offsets in an object that does not hold them there."""
    store = _steps(s3_url, tmp_path, range(1, 3))
    raw, _ = store.get(layout.manifest_key(1, 2), 1 << 24)
    assert json.loads(raw)["version"] == layout.REFS_VERSION
    with pytest.raises(pccheck.CorruptCheckpointError, match="unknown format"):
        layout._load(raw, layout.FORMAT, "m")  # the version-1 reader's check
    doc = json.loads(raw)

    def part_with(where):
        doc["ranks"][0]["where"] = where
        return layout.decode_manifest(json.dumps(doc).encode(), 1, 2).ranks[0]

    assert local_manifest(part_with(doc["ranks"][0]["where"]), 2).step == 2
    with pytest.raises(pccheck.CorruptCheckpointError, match="bad array location"):
        part_with([[5, 0]] * 3)  # no such object
    with pytest.raises(pccheck.CorruptCheckpointError, match="beyond the end"):
        local_manifest(part_with([[0, 1 << 40]] * 3), 2)  # past the object's size
    with pytest.raises(pccheck.CorruptCheckpointError, match="3 arrays"):
        local_manifest(part_with([[0, 0]] * 2), 2)  # a location missing
    doc["ranks"][0]["objects"] = [{"key": doc["ranks"][0]["data"], "size": 1}]
    with pytest.raises(pccheck.CorruptCheckpointError, match="named twice"):
        part_with([[0, 0]] * 3)


@pytest.mark.parametrize("hold", [True, False])
def test_cells_of_an_upload_in_progress_are_never_rewritten(s3_url, tmp_path, monkeypatch, hold):
    """Step 2's upload is stalled after its first part while ten more local checkpoints commit,
    each changing a random subset of the arrays (so later ones write into cells older
    checkpoints left). Its cells stay pinned: the upload reads the bytes its manifest names and
    commits. Without the pin (``hold=False``, the rule switched off) a cell is rewritten under it
    and the upload is abandoned, never committed torn."""
    from pccheck.orchestrator.incremental import Incremental
    from pccheck.tiers.remote import objstore

    if not hold:
        monkeypatch.setattr(Incremental, "hold", lambda self, counter: False)
    gate, started = threading.Event(), threading.Event()
    orig = objstore.ObjectStore.upload_part

    def stalled(self, rel, upload_id, number, data, **kw):
        if "/s2-" in rel and number == 1:
            started.set()
            gate.wait(60)
        return orig(self, rel, upload_id, number, data, **kw)

    monkeypatch.setattr(objstore.ObjectStore, "upload_part", stalled)
    rng = np.random.default_rng(5)
    state = {"big": np.zeros(5 * MiB, np.float32), **{f"x{i}": np.zeros(MiB // 4, np.float32) for i in range(4)}}
    want2 = None
    ck = pccheck.Checkpointer(state, tmp_path / "ck", incremental=True, max_concurrent=1, remote_part_size=8 * MiB,
                              remote_concurrency=1, remote=s3_url)
    try:
        for s in range(1, 13):
            for k in state:
                if s <= 2 or (k != "big" and rng.random() < 0.5):
                    state[k][:] = s
            ck.checkpoint(s)
            ck.wait()
            if s == 1:
                assert ck.wait(remote=True, timeout=60)
            if s == 2:
                want2 = {k: v.copy() for k, v in state.items()}
                assert started.wait(60)
        gate.set()
        assert ck.wait(remote=True, timeout=60)
        p = ck.stats().remote
    finally:
        gate.set()
        ck.close()
    store = ObjectStore(s3_url)
    steps = [s for _, s in committed(store)]
    if not hold:
        assert p["remote_abandoned"] == 1 and 2 not in steps
        return
    assert p["remote_abandoned"] == 0 and steps == [12, 2, 1]
    r = pccheck.load_latest(s3_url)
    assert r.step == 12 and all(np.array_equal(r.state[k], state[k]) for k in state)
    from pccheck.tiers.remote.load import _load_step

    r2 = _load_step(store, 1, 2)
    assert all(np.array_equal(r2.state[k], want2[k]) for k in want2)


def test_all_three_tiers_incremental_in_one_process(s3_url, tmp_path):
    """incremental=True with the memory tier, the disk tier and the remote tier together: each tier
    writes only what changed (its own counters), and after the machine is lost the remote's newest
    step loads bit for bit."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    base = torch.nn.Linear(256, 256).requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model[1].parameters())
    frozen = sum(p.numel() * 4 for p in base.parameters())
    with pccheck.Checkpointer(model, opt, path=tmp_path / "ck", interval=1, incremental=True, remote=s3_url,
                              memory=pccheck.MemoryOptions(every=1, dir=tmp_path / "mem")) as ck:
        for s in range(1, 6):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            ck.maybe_checkpoint(s)
            ck.wait()
            assert ck.wait(remote=True, timeout=60)  # every step uploaded: the last references the first
        st = ck.stats()
        assert st.checkpoints[-1].bytes_referenced >= frozen > st.checkpoints[-1].bytes_written
        assert st.tiers["memory_bytes"][-1]["kept"] >= frozen > st.tiers["memory_bytes"][-1]["copied"]
        assert st.remote["remote_last_referenced"] >= frozen > st.remote["remote_last_bytes"]
        want = {k: v.clone() for k, v in model.state_dict().items()}
    shutil.rmtree(tmp_path / "ck")
    shutil.rmtree(tmp_path / "mem")
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    r = pccheck.load_latest(s3_url, model=fresh)
    assert r.step == 5
    assert all(torch.equal(want[k], v) for k, v in fresh.state_dict().items())


def test_a_given_up_incremental_upload_cuts_its_part_in_flight_short(s3_url, tmp_path):
    # as a full upload's: once given up (a flush supersedes it), the part being sent stops at its
    # next block, so the flush's own upload has the bandwidth and the upload thread at once
    from concurrent.futures import ThreadPoolExecutor

    from pccheck.persist.recovery import read_store
    from pccheck.tiers.remote.increment import upload_changed
    from pccheck.tiers.remote.upload import BufferPool, Cancelled, SlotRef

    d = tmp_path / "ck"
    with pccheck.Checkpointer({"w": np.ones(4 * MiB, np.float32)}, d, incremental=True, **KW) as ck:
        ck.checkpoint(1)
        ck.wait()
    store_file = d / "store-000001.pcc"
    image = read_store(store_file)
    ref = SlotRef(store_file, image.word_slot, image.word_counter, 1)
    store, given_up = ObjectStore(s3_url), threading.Event()
    real_part = store.upload_part

    def upload_part(*args, **kw):  # the flush gives the upload up as its first part goes out
        given_up.set()
        return real_part(*args, **kw)

    store.upload_part = upload_part
    aborted: list = []
    with ThreadPoolExecutor(1) as senders:
        with pytest.raises(Cancelled):
            upload_changed(store, ref, 1, 0, 8 * MiB, BufferPool(1, 8 * MiB), senders, given_up.is_set, None,
                           lambda *a: aborted.append(a))
        (_, key, upload_id, futures), = aborted
        for fut in futures:  # the part in flight was cut, not sent whole
            assert isinstance(fut.exception(timeout=60), Cancelled), fut.result()
        store.abort_multipart(key, upload_id)
