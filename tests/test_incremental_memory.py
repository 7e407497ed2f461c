"""Incremental checkpoints on the memory tier and its replicas: a memory slot gets, and a replica
carries, only the arrays whose bytes differ from what that slot already holds; every slot stays
whole (the 4x footprint at replicas=2 is unchanged) and every array's crc32c is still checked
before use. A frozen base with a trained head, in one process and on two simulated nodes
(test_memory_tier's torchrun helpers, _tier_train.py --frozen --incremental)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import pccheck
from pccheck.persist.recovery import read_manifest, read_store, slot_base, store_files
from test_memory_tier import CHILD, STEPS, Nodes, _footprint, _output, _tag

FROZEN_BYTES = (16 * 512 + 512 + 512 * 512 + 512) * 4  # _tier_train.py --frozen: the frozen base
HEAD_BYTES = (512 * 16 + 16) * 4                        # its trained head: parameters, AdamW's two moments
SLACK = 8 << 10                                         # AdamW's step counts, the RNG states, the data position


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"base": torch.nn.Linear(512, 1024), "head": torch.nn.Linear(1024, 8)})
    model["base"].requires_grad_(False)  # 2 MiB frozen
    return model, torch.optim.AdamW(model["head"].parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(step))
    loss = model["head"](model["base"](x)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v.clone() for k, v in s.items()})
    return out


def _memory_rows(ck: pccheck.Checkpointer) -> dict[int, dict]:
    return {r["step"]: r for r in ck.stats().tiers["memory_bytes"]}


def test_frozen_base_is_copied_into_each_slot_once_and_a_data_change_is_captured(tmp_path):
    """After each of the two slots got the frozen base once, a memory checkpoint copies the head
    and its optimizer state alone; a change through ``.data`` (no optimizer, no requires_grad)
    is copied into each slot again, and a restore from memory is bit for bit the state saved."""
    model, opt = _model()
    base = sum(p.nbytes for p in model["base"].parameters())
    head = 3 * sum(p.nbytes for p in model["head"].parameters())
    mem = tmp_path / "mem"
    saved = {}
    with pccheck.Checkpointer(model, opt, tmp_path / "disk", interval=1000,
                              memory=pccheck.MemoryOptions(every=1, dir=mem), incremental=True) as ck:
        for step in range(1, 9):
            _train(model, opt, step)
            if step == 5:
                model["base"].weight.data[7, 9] += 1.0  # captured although nothing marks it changed
            ck.maybe_checkpoint(step)
            saved[step] = _state(model, opt)
        ck.wait()
        rows = _memory_rows(ck)
    for step, r in rows.items():
        assert r["outcome"] == "committed" and r["copied"] + r["kept"] >= base + head, r
        if step in (1, 2, 5, 6):  # a slot's first checkpoint, and both slots after the base changed
            assert r["copied"] >= base, (step, r)
        else:
            assert head <= r["copied"] <= head + SLACK and r["kept"] >= base, (step, r)
    model2, opt2 = _model()
    got = pccheck.load_latest(tmp_path / "disk", model=model2, optimizer=opt2, memory_dir=mem)
    assert (got.step, got.tier) == (8, "memory")
    restored = _state(model2, opt2)
    assert restored.keys() == saved[8].keys()
    assert all(torch.equal(restored[k], saved[8][k]) for k in restored)
    assert model2["base"].weight[7, 9] == saved[4]["m.base.weight"][7, 9] + 1.0


def test_kept_bytes_are_not_rewritten_and_stale_ones_are_never_loaded(tmp_path):
    """Measured on the store file: bytes planted over the frozen array in both memory slots stay
    there through later checkpoints (nothing rewrote them), and a restore finds every such slot
    failing its crc32c and falls back to the disk checkpoint, bit for bit."""
    model, opt = _model()
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    with pccheck.Checkpointer(model, opt, disk, interval=4, memory=pccheck.MemoryOptions(every=1, dir=mem),
                              incremental=True) as ck:
        for step in range(1, 5):
            _train(model, opt, step)
            ck.maybe_checkpoint(step)
        ck.wait()
        on_disk = _state(model, opt)
        (_, file), = store_files(mem)
        image = read_store(file)
        planted = []
        with open(file, "r+b") as f:
            for s in image.slots:
                if not s.meta:
                    continue
                man = read_manifest(image, s.slot, f.fileno())
                e = next(e for e in man.arrays if e.name.endswith("base.weight"))
                off = slot_base(image, s.slot) + e.offset + 4096
                f.seek(off)
                f.write(b"\xa5" * 64)
                planted.append(off)
        assert len(planted) == 2  # both slots hold the frozen base
        for step in range(5, 7):
            _train(model, opt, step)
            ck.maybe_checkpoint(step)
        ck.wait()
        assert all(r["outcome"] == "committed" for r in ck.stats().tiers["memory_bytes"])
    with open(file, "rb") as f:
        for off in planted:
            f.seek(off)
            assert f.read(64) == b"\xa5" * 64  # the frozen array was not copied again
    model2, opt2 = _model()
    got = pccheck.load_latest(disk, model=model2, optimizer=opt2, memory_dir=mem)
    assert (got.step, got.tier) == (4, "disk")  # neither memory slot passes its checks
    restored = _state(model2, opt2)
    assert all(torch.equal(restored[k], on_disk[k]) for k in on_disk)


def test_memory_incremental_is_a_bool_or_none(tmp_path):
    """None follows incremental=; False keeps the memory tier full beside an incremental disk."""
    assert pccheck.MemoryOptions(every=1).incremental is None
    with pytest.raises(pccheck.ConfigError, match="memory.incremental"):
        pccheck.MemoryOptions(every=1, incremental=1)
    model, opt = _model()
    with pccheck.Checkpointer(model, opt, tmp_path / "disk", interval=1, incremental=True,
                              memory=pccheck.MemoryOptions(every=1, dir=tmp_path / "mem", incremental=False)) as ck:
        for step in range(1, 4):
            _train(model, opt, step)
            ck.maybe_checkpoint(step)
        ck.wait()
        assert "memory_bytes" not in ck.stats().tiers  # full memory checkpoints
        assert ck.stats().checkpoints[-1].bytes_referenced > 0  # an incremental disk beside it


@pytest.mark.slow  # the two-node test below covers a SIGKILL and a resume from own memory by default
def test_single_process_sigkill_resumes_from_memory_bit_for_bit(tmp_path):
    """One process, frozen base, a frozen weight changed through ``.data`` at step 4, SIGKILL
    after step 6: the resume loads from memory exactly the state the run had at that step."""
    p = subprocess.Popen([sys.executable, CHILD, str(tmp_path), str(STEPS), "--single", "--frozen", "--incremental",
                          "--touch-frozen", "4", "--digest", "--sleep", "0.2"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if line.startswith("LOSS 6 "):
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait(30)
    digests = {int(a): b for a, b in _tag("".join(seen), "DIGEST")}
    out = _output(subprocess.Popen([sys.executable, CHILD, str(tmp_path), "8", "--single", "--frozen", "--incremental",
                                    "--resume", "--digest"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True))
    (start, tier), = [(int(a), b) for a, b in _tag(out, "START")]
    assert tier == "memory" and start >= 5, (start, tier)
    (step, digest), = _tag(out, "RESTORED")
    assert int(step) == start and digest == digests[start]


def _rows(job: Nodes, n: int) -> tuple[dict, dict]:
    """Node ``n``'s stats().tiers and wire.wire_bytes() at its end (JSON lines of _tier_train.py)."""
    return (json.loads(" ".join(job._tagged(n, "TIERJSON")[-1])), json.loads(" ".join(job._tagged(n, "WIRE")[-1])))


def test_two_nodes_send_only_changed_arrays_and_a_lost_node_restores_from_its_peer(tmp_path):
    """replicas=2, frozen base, a frozen weight changed through ``.data`` at step 4. SIGKILL of
    every process after step 6, node 1 lost (memory and disk wiped): rank 1 restores from its
    replica on node 0 exactly the state it had (digest), rank 0 from its own memory. The resumed
    run's replicas: the first ones into a slot carry everything (node 1's replica store is new;
    node 0's reopened one holds another sender's fingerprint keys), then each carries the head and
    its optimizer state alone, as counted where the bytes travel (wire.py); the footprint stays 2
    own + 2 replica slots."""
    job = Nodes(tmp_path, "--frozen", "--incremental", "--touch-frozen", "4", "--digest", "--sleep", "0.3")
    job.kill_when(6)
    digests = [{int(a): b for a, b in job._tagged(n, "DIGEST")} for n in range(2)]
    shutil.rmtree(tmp_path / "node-1")
    job = Nodes(tmp_path, "--resume", "--frozen", "--incremental", "--digest")
    job.wait()
    starts = [job.start(n) for n in range(2)]
    assert [t for _, t in starts] == ["memory", "peer"] and starts[0][0] == starts[1][0] >= 5, starts
    start = starts[0][0]
    for n in range(2):
        (step, digest), = job._tagged(n, "RESTORED")
        assert int(step) == start and digest == digests[n][start], n
    tiers, wire = _rows(job, 1)
    sends = tiers["replica_bytes"]
    assert [r["step"] for r in sends] == list(range(start + 1, STEPS + 1))
    total = FROZEN_BYTES + HEAD_BYTES * 3
    assert all(r["sent"]["0"] >= total for r in sends[:2]), sends[:2]  # the receiver's two slots, in full
    for r in sends[2:]:
        assert 3 * HEAD_BYTES <= r["sent"]["0"] <= 3 * HEAD_BYTES + SLACK and r["kept"]["0"] >= FROZEN_BYTES, r
    assert wire["sent"] == sum(r["sent"]["0"] for r in sends)  # rank 1 sent nothing else (it served no restore)
    for node in range(2):
        own, rep, ratio = _footprint(tmp_path / f"node-{node}" / "mem", 1 - node)
        assert (own, rep) == (2, 2) and 4 < ratio < 4.5, (node, own, rep, ratio)


@pytest.mark.slow
def test_two_nodes_incremental_matches_an_uninterrupted_run_after_every_rank_is_killed(tmp_path):
    """The uninterrupted incremental run's losses and final tensors, bit for bit, after every
    process was SIGKILLed at step 6 and both ranks resumed from their own memory."""
    ref = Nodes(tmp_path / "ref", "--final", "--frozen", "--incremental", "--touch-frozen", "4")
    ref.wait()
    want = [ref.losses(n) for n in range(2)]
    job = Nodes(tmp_path / "run", "--frozen", "--incremental", "--touch-frozen", "4", "--sleep", "0.3")
    job.kill_when(6)
    job = Nodes(tmp_path / "run", "--resume", "--final", "--frozen", "--incremental", "--touch-frozen", "4")
    job.wait()
    for n in range(2):
        start, tier = job.start(n)
        assert tier == "memory" and start >= 5
        assert job.losses(n) == {s: v for s, v in want[n].items() if s > start}
        a = torch.load(tmp_path / "ref" / f"final-{n}.pt", weights_only=True)
        b = torch.load(tmp_path / "run" / f"final-{n}.pt", weights_only=True)
        assert all(torch.equal(a[k], b[k]) for k in a)
    tiers, wire = _rows(ref, 0)
    changed = [r["sent"]["1"] for r in tiers["replica_bytes"]][2:]
    assert changed and all(c <= 1.25 * 3 * HEAD_BYTES + SLACK for c in changed if c < FROZEN_BYTES)
    assert np.median(changed) <= 1.25 * 3 * HEAD_BYTES + SLACK


@pytest.mark.parametrize("raw, why", [
    ("not json", "not JSON"),
    ('{"need": [2, 1]}', "ascending"),
    ('{"need": [0, 0]}', "ascending"),
    ('{"need": [9]}', "ascending"),
    ('{"need": [-1]}', "ascending"),
    ('{"need": ["0"]}', "ascending"),
    ('{"need": [true]}', "ascending"),
    ('{"need": 3}', "ascending"),
    ("[0, 1]", "ascending"),
])
def test_a_replicas_answer_is_untrusted(raw, why):
    """The sender checks the receiver's answer before it sends a byte: JSON, indices of the
    manifest's arrays, strictly ascending; ``{"skip": true}`` means nothing is sent."""
    from pccheck.errors import CorruptCheckpointError
    from pccheck.tiers.memory.delta import parse_need

    with pytest.raises(CorruptCheckpointError, match=why):
        parse_need(raw, 3)
    assert parse_need('{"skip": true}', 3) is None
    assert parse_need('{"need": [0, 2]}', 3) == [0, 2] and parse_need('{"need": []}', 3) == []


def test_runs_merge_only_arrays_without_padding_between_them():
    """Both ends cut the same ranges from the manifest: neighbours with no padding between them
    share one range; padding and zero-size arrays are never sent."""
    from pccheck.persist.layout import plan
    from pccheck.tiers.memory.delta import runs_of

    arrays = {"a": np.zeros(1024, np.float32), "b": np.zeros(10, np.uint8), "c": np.zeros(0, np.float32),
              "d": np.zeros(4096, np.uint8), "e": np.zeros(8, np.uint8)}
    man = type("M", (), {"arrays": plan(arrays, 4096).entries})()
    offs = {e.name: e.offset for e in man.arrays}
    assert runs_of(man, [0, 1]) == [(0, 4096 + 10)]          # a fills its blocks: b follows it directly
    assert runs_of(man, [1, 2, 3]) == [(offs["b"], 10), (offs["d"], 4096)]
    assert runs_of(man, [3, 4]) == [(offs["d"], 4096 + 8)]
    assert runs_of(man, []) == []


def test_slot_records_trust_only_finished_writes_and_the_senders_crc():
    """What a slot is known to hold: nothing before a write into it finished and committed (an
    abandoned one leaves its arrays to be copied again), each slot on its own, and for a replica
    the sender's fingerprint *and* crc32c under the same keys."""
    from pccheck.orchestrator.slot_records import Given, SlotRecords
    from pccheck.persist.layout import plan

    arrays = {"frozen": np.arange(4096, dtype=np.float32), "head": np.ones(16, np.float32)}
    layout = plan(arrays, 4096)
    rec = SlotRecords()
    try:
        def ckpt(counter, slot, outcome="committed", given=None):
            p = rec.plan(layout, counter, slot, 2, lambda s: s * layout.data_len, given=given)
            written = [given.crcs[i] if given else 1000 + i for i in p.changed]  # the writers' crc32c
            rec.end(p, outcome, p.crcs(written))
            return p.changed

        assert ckpt(1, 0) == (0, 1) and ckpt(2, 1) == (0, 1)  # each slot once
        arrays["head"] += 1
        assert ckpt(3, 0) == (1,)
        assert ckpt(4, 1, "abandoned") == (1,)
        assert ckpt(5, 1) == (1,)  # the abandoned write may have been cut short: copied again
        arrays["frozen"][5] = -1.0  # a change nothing announces
        assert ckpt(6, 0) == (0,)  # slot 0 holds the head of checkpoint 3 already
        rec.reset(None)  # a reopened store: nothing known
        assert ckpt(7, 1) == (0, 1)

        p = rec.plan(layout, 8, 0, 2, lambda s: 0)
        rec.end(p, "committed", p.crcs([]))
        fps, keys = p.fps, rec.keys
        g = Given(keys, fps, (7, 8))
        assert ckpt(9, 0, given=g) == (0, 1)
        assert ckpt(10, 0, given=g) == ()  # the slot holds both, as the sender says
        assert ckpt(11, 0, given=Given(keys, fps, (7, 9))) == (1,)  # same fingerprint, other crc32c
        assert ckpt(12, 0, given=Given((keys[1], keys[0]), fps, (7, 9))) == (0, 1)  # other keys
    finally:
        rec.close()


def test_arrays_that_keep_changing_stop_being_fingerprinted(tmp_path, monkeypatch):
    """Every parameter trained: once an array's fingerprints differed twice from its slot's, it is
    copied without a fingerprint while the crc32c of its copies differ (no pass after the first
    checkpoints); the restore is bit for bit."""
    from pccheck.orchestrator import slot_records

    reads: list[int] = []  # the address of each array read
    real = slot_records._fingerprint
    monkeypatch.setattr(slot_records, "_fingerprint", lambda info, keys: reads.append(info.ptr) or real(info, keys))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    per_step = []
    with pccheck.Checkpointer(model, opt, tmp_path / "disk", interval=1000,
                              memory=pccheck.MemoryOptions(every=1, dir=tmp_path / "mem"), incremental=True) as ck:
        for step in range(1, 11):
            x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            before = len(reads)
            ck.maybe_checkpoint(step)
            ck.wait()
            params = {p.data_ptr() for p in model.parameters()}
            per_step.append(sum(ptr in params for ptr in reads[before:]))
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert per_step[0] == 4 and per_step[-4:] == [0] * 4, per_step
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 8))
    got = pccheck.load_latest(tmp_path / "disk", model=fresh, memory_dir=tmp_path / "mem")
    assert (got.step, got.tier) == (10, "memory")
    assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
