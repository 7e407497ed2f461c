"""Sharded and resharded loads from the remote tier, and a distributed SIGKILL round
(FORMAT.md §12.7 with §9), against the real SeaweedFS server of tests/conftest.py.

Real FSDP2 on a CPU mesh (gloo, FileStore rendezvous): each job is a set of
tests/_remote_sharded.py processes. No job shares a local store with another: every local
directory is deleted before each load, so every byte comes from the object store.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pccheck.tiers.remote import layout
from pccheck.tiers.remote.commit import committed
from pccheck.tiers.remote.objstore import ObjectStore

CHILD = str(Path(__file__).with_name("_remote_sharded.py"))


def _cmd(mode: str, local: Path, url: str, rank: int, world: int, init: Path, ref: Path, *extra: str) -> list[str]:
    return [sys.executable, CHILD, mode, str(local), url, str(rank), str(world), str(init), str(ref), *extra]


def run_job(mode: str, local: Path, url: str, world: int, ref: Path, *extra: str, timeout: float = 300) -> list[str]:
    """WORLD ranks of the child to completion; their stdout, rank by rank."""
    init = local.parent / f"init-{random.random()}"
    procs = [subprocess.Popen(_cmd(mode, local, url, r, world, init, ref, *extra), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ.copy()) for r in range(world)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return [o for o, _ in outs]


def loaded(out: str) -> tuple[int, int, str]:
    line = next(l for l in out.splitlines() if l.startswith("LOADED"))
    step, nbytes, tier = line.split()[1:]
    return int(step), int(nbytes), tier


def _newest(store: ObjectStore) -> layout.StepManifest:
    g, s = committed(store)[0]
    raw, _ = store.get(layout.manifest_key(g, s), layout.MAX_MANIFEST_BYTES)
    return layout.decode_manifest(raw, g, s)


def _check_loads(outs: list[str], step: int, total: int) -> None:
    """Every rank loaded ``step`` from the remote; the gathered state equals the reference; with
    several ranks each fetched only part of the step's bytes (its shards, the replicated tensors
    and its per-rank state), never a whole copy."""
    assert "EQUAL" in outs[0]
    got = [loaded(o) for o in outs]
    assert {(s, t) for s, _, t in got} == {(step, "remote")}, got
    assert all(0 < n <= total for _, n, _ in got), (got, total)
    if len(outs) > 1:
        assert all(n < total for _, n, _ in got), (got, total)


@pytest.mark.slow  # ten processes importing torch, FSDP2 on 4 ranks: 60-120 s here (make test-slow)
def test_fsdp_saved_on_four_resharded_from_the_remote_on_two_one_and_three(s3_url, tmp_path):
    """4 ranks save to the remote; every local directory is deleted; 2 ranks load it (resharded,
    bit for bit), train on and save to the same prefix; with every local directory deleted again,
    1 rank and 3 ranks load that 2-rank step bit for bit."""
    local, ref4, ref6 = tmp_path / "ck", tmp_path / "ref4.pt", tmp_path / "ref6.pt"
    outs = run_job("save", local, s3_url, 4, ref4, "4")
    assert all("REMOTE True 4" in o for o in outs), outs
    store = ObjectStore(s3_url)
    man = _newest(store)
    assert (man.step, man.world_size) == (4, 4)
    shutil.rmtree(local)
    outs = run_job("load", local, s3_url, 2, ref4, "--continue", str(ref6))
    _check_loads(outs, 4, sum(p.size for p in man.ranks))
    assert all("REMOTE True 6" in o for o in outs), outs
    man = _newest(store)
    assert (man.step, man.world_size) == (6, 2) and man.generation == 2
    shutil.rmtree(local)
    total = sum(p.size for p in man.ranks)
    for world in (1, 3):
        _check_loads(run_job("load", local, s3_url, world, ref6), 6, total)
        assert not local.exists()


def test_fsdp_saved_on_two_resharded_to_one_and_falls_back_past_a_damaged_chunk(s3_url, tmp_path):
    """2 ranks save steps 2 and 4 to the remote and their local directories are deleted; one rank
    loads step 4 (only through ranged GETs, every array checked); then a byte inside an array of
    rank 1's data object of step 4 is flipped (a new object at the same key): the load refuses
    step 4 and falls back to step 2, bit for bit."""
    local, ref = tmp_path / "ck", tmp_path / "ref.pt"
    outs = run_job("save", local, s3_url, 2, ref, "4")
    assert all("REMOTE True 4" in o for o in outs), outs
    shutil.rmtree(local)
    store = ObjectStore(s3_url)
    assert [s for _, s in committed(store)] == [4, 2]
    man = _newest(store)
    _check_loads(run_job("load", local, s3_url, 1, ref), 4, sum(p.size for p in man.ranks))
    part = man.ranks[1]
    raw = bytearray(store.get(part.data, part.size + 1)[0])
    first = next(e for e in _local_arrays(part) if e["nbytes"] > 0)
    raw[first["offset"]] ^= 0xFF  # inside an array: only its crc32c can tell
    store.delete(part.data)
    store.put(part.data, bytes(raw))
    older = layout.decode_manifest(store.get(layout.manifest_key(man.generation, 2), 1 << 24)[0], man.generation, 2)
    _check_loads(run_job("load", local, s3_url, 1, Path(str(ref) + ".2")), 2, sum(p.size for p in older.ranks))


def _local_arrays(part: layout.RankPart) -> list[dict]:
    import json

    return json.loads(part.manifest.decode("utf-8"))["arrays"]


@pytest.mark.slow  # two 2-rank FSDP2 jobs and a SIGKILL: 30-60 s here (make test-slow)
def test_sigkill_of_every_rank_during_uploads_then_local_dirs_deleted_resumes_from_remote(s3_url, tmp_path):
    """A 2-rank FSDP2 job checkpoints every step with the remote on; both ranks are SIGKILLed
    while uploads are in flight; every local directory is deleted. A new 2-rank job loads the
    newest committed remote step (never a torn one: every array's crc32c is checked, and the
    manifest is written only after both ranks' parts), which must be one of the steps the job
    reported committed or newer, and bit for bit the state a fresh job reaches at that step."""
    local, ref = tmp_path / "ck", tmp_path / "unused.pt"
    init = tmp_path / f"init-{random.random()}"
    errs = [open(tmp_path / f"err-{r}.txt", "w") for r in range(2)]  # files: a full pipe would stall a rank
    procs = [subprocess.Popen(_cmd("save", local, s3_url, r, 2, init, ref, "--train"), stdout=subprocess.PIPE,
                              stderr=errs[r], text=True, env=os.environ.copy()) for r in range(2)]
    seen, trained = None, 0
    deadline = time.monotonic() + 240
    for line in procs[0].stdout:  # type: ignore[union-attr]
        if line.startswith("STEP"):
            trained = int(line.split()[1])
        if line.startswith("REMOTE") and line.split()[1] != "None":
            seen = int(line.split()[1])
            if seen >= 3 and trained > seen:  # checkpoints newer than the remote's are on their way up
                break
        assert time.monotonic() < deadline, "no remote commit within 240 s"
    for p in procs:
        p.kill()  # SIGKILL mid-training: uploads of newer steps are in flight
    for p, e in zip(procs, errs):
        p.communicate(timeout=60)
        e.close()
        assert p.returncode == -9, (tmp_path / f"err-{procs.index(p)}.txt").read_text()[-3000:]
    assert seen is not None and seen >= 3
    shutil.rmtree(local)
    step = max(s for _, s in committed(ObjectStore(s3_url)))
    assert step >= seen
    # the reference: a fresh 2-rank job trained to exactly that step (the batches depend on the step only)
    want = tmp_path / "want.pt"
    run_job("save", tmp_path / "ref-ck", s3_url + "-ref", 2, want, str(step))
    outs = run_job("load", local, s3_url, 2, want, "--via-local")  # load_latest(local, remote=url)
    assert "EQUAL" in outs[0] and {loaded(o)[:1] + loaded(o)[2:] for o in outs} == {(step, "remote")}
    assert not local.exists()
    assert torch.load(want, weights_only=True)  # the reference exists and is not empty
