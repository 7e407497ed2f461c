"""Multi-process training with torch.distributed (gloo on loopback, FileStore rendezvous in a tmp
dir, so parallel tests never collide on ports): per-rank stores, globally consistent recovery."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import pccheck
from pccheck.persist.recovery import read_store, store_files

CHILD = str(Path(__file__).with_name("_dist_train.py"))
STEPS, INTERVAL = 40, 2


class Job:
    """WORLD rank processes of _dist_train.py, their output lines collected per rank."""

    def __init__(self, path: Path, world: int, tmp: Path, *extra: str) -> None:
        init = tmp / f"init-{random.random()}"
        self.lines: list[list[str]] = [[] for _ in range(world)]
        self.procs = [subprocess.Popen([sys.executable, CHILD, str(path), str(STEPS), str(INTERVAL), str(r),
                                        str(world), str(init), *[e.replace("{r}", str(r)) for e in extra]],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                      for r in range(world)]
        self.readers = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in range(world)]
        for t in self.readers:
            t.start()

    def _read(self, r: int) -> None:
        for line in self.procs[r].stdout:  # type: ignore[union-attr]
            self.lines[r].append(line.strip())

    def losses(self, r: int) -> dict[int, float]:
        return {int(l.split()[1]): float(l.split()[2]) for l in list(self.lines[r]) if l.startswith("LOSS")}

    def start(self, r: int) -> int:
        return int(next(l for l in self.lines[r] if l.startswith("START")).split()[1])

    def wait(self) -> None:
        for p in self.procs:
            p.wait(180)
        for t in self.readers:
            t.join(10)
        errs = [p.stderr.read() for p in self.procs if p.returncode != 0]  # type: ignore[union-attr]
        assert not errs, errs[0][-3000:]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait(30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("ref")
    job = Job(tmp / "ck", 2, tmp, "--final", str(tmp / "final-{r}.pt"))
    job.wait()
    return {"losses": [job.losses(r) for r in range(2)],
            "final": [torch.load(tmp / f"final-{r}.pt", weights_only=True) for r in range(2)]}


def _check_resumed(job: Job, reference: dict, world: int, tmp: Path) -> int:
    starts = {job.start(r) for r in range(world)}
    assert len(starts) == 1, f"ranks resumed at different steps {starts}"
    start = starts.pop()
    for r in range(world):
        losses = job.losses(r)
        assert sorted(losses) == list(range(start + 1, STEPS + 1))
        for s, v in losses.items():
            assert v == reference["losses"][r][s], (r, s, v, reference["losses"][r][s])
        final = torch.load(tmp / f"final-{r}.pt", weights_only=True)
        for k, v in reference["final"][r].items():
            assert torch.equal(final[k], v), (r, k)
    return start


@pytest.mark.parametrize("kills", [3, pytest.param(10, marks=pytest.mark.slow)])  # 10: `make test-slow`
def test_two_ranks_sigkill_restart_chain(tmp_path, reference, kills):
    """``kills`` times: SIGKILL one rank at a random step, tear the job down, restart it. Every
    restart resumes all ranks at the same, globally committed step, and every loss equals the
    uninterrupted run's; the final weights are identical."""
    rng = random.Random(11)
    path = tmp_path / "ck"
    start = 0
    for trial in range(kills + 1):
        last = trial == kills
        extra = (["--resume"] if trial else []) + (["--final", str(tmp_path / "final-{r}.pt")] if last else [])
        glob = json.loads((path / "GLOBAL").read_text())["step"] if (path / "GLOBAL").exists() else 0
        if last:
            job = Job(path, 2, tmp_path, *extra)
            job.wait()
        else:  # (20 ms after each step: the kill lands at the step drawn, not steps later)
            job = Job(path, 2, tmp_path, *extra, "--sleep", "0.02")
            victim, kill_step = rng.randrange(2), rng.randint(start + 1, min(start + 6, STEPS - 1))
            while not any(s >= kill_step for s in job.losses(victim)) and job.procs[victim].poll() is None:
                threading.Event().wait(0.01)
            if job.procs[victim].poll() is None:
                os.kill(job.procs[victim].pid, signal.SIGKILL)   # one rank dies ...
            job.kill_all()                                    # ... and the job is torn down
            for t in job.readers:
                t.join(10)
        starts = {job.start(r) for r in range(2)}
        assert len(starts) == 1, f"trial {trial}: ranks resumed at different steps {starts}"
        start = starts.pop()
        assert start >= glob and start % INTERVAL == 0, (trial, start, glob)
        for r in range(2):
            for s, v in job.losses(r).items():
                assert s > start and v == reference["losses"][r][s], (trial, r, s)
    for r in range(2):
        final = torch.load(tmp_path / f"final-{r}.pt", weights_only=True)
        for k, v in reference["final"][r].items():
            assert torch.equal(final[k], v), (r, k)


@pytest.mark.slow  # `make test-slow`: the two-rank chain and the teardown tests cover the same path in `make test`
def test_four_ranks_resume_after_teardown(tmp_path):
    path = tmp_path / "ck"
    ref = Job(tmp_path / "ref", 4, tmp_path, "--final", str(tmp_path / "ref-{r}.pt"))
    ref.wait()
    job = Job(path, 4, tmp_path)
    while not any(s >= 15 for s in job.losses(2)) and job.procs[2].poll() is None:
        threading.Event().wait(0.01)
    job.kill_all()
    resumed = Job(path, 4, tmp_path, "--resume", "--final", str(tmp_path / "final-{r}.pt"))
    resumed.wait()
    reference = {"losses": [ref.losses(r) for r in range(4)],
                 "final": [torch.load(tmp_path / f"ref-{r}.pt", weights_only=True) for r in range(4)]}
    start = _check_resumed(resumed, reference, 4, tmp_path)
    assert start > 0
    for r in range(4):  # one store per rank, with the rank and world size in its header
        (gen, file), *_ = store_files(path / f"rank-{r}")
        h = read_store(file).header
        assert (h["rank"], h["world_size"]) == (r, 4)


def test_corrupt_newest_slot_on_one_rank_falls_back_together(tmp_path, reference):
    path = tmp_path / "ck"
    Job(path, 2, tmp_path).wait()  # runs to the end: the newest checkpoint is step STEPS
    (gen, file), *_ = store_files(path / "rank-1")
    image = read_store(file)
    newest = max((st for st in image.slots if st.meta), key=lambda st: st.meta["counter"])
    assert newest.meta["step"] == STEPS
    off = image.header["slots_offset"] + newest.slot * image.header["slot_capacity"] + 100
    with open(file, "r+b") as f:  # damage an array of rank 1's newest checkpoint
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    # Run the resumed job only to STEPS: it must restart both ranks from the previous common step.
    resumed = Job(path, 2, tmp_path, "--resume", "--final", str(tmp_path / "final-{r}.pt"))
    resumed.wait()
    assert {resumed.start(0), resumed.start(1)} == {STEPS - INTERVAL}
    _check_resumed(resumed, reference, 2, tmp_path)
