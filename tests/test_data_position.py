"""The data position and the RNG states through a SIGKILL and a resume.

- A ``torchdata`` ``StatefulDataLoader`` (2 workers, shuffled) passed in ``extra_state``: the job
  is killed (SIGKILL to its process group, workers included) at a random step and resumed; the
  batches the resumed run consumes, after the committed steps of the killed one, equal the
  uninterrupted run's batch for batch, in every trial.
- A ``DistributedSampler`` in a 2-rank torchrun/gloo job, wrapped in ``pccheck.ResumableSampler``
  (epoch and consumed offset): the same, per rank, across epochs.
- Each rank's torch, numpy and Python (and CUDA, when present) RNG states come back for that
  rank in a 2-rank job, with a whole model per rank and with FSDP2.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pccheck
from pccheck.errors import ConfigError

CHILD = str(Path(__file__).with_name("_loader_child.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def _batches(log: Path) -> dict[int, str]:
    """step -> batch; a later line of a step (the resumed run) replaces an earlier one."""
    out: dict[int, str] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            step, batch = line.split()
            out[int(step)] = batch
    return out


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "DONE" in p.stdout
    return p.stdout


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun starts its ranks in sessions of their own,
    so a process group does not hold them all)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _kill_at(cmd: list[str], logs: list[Path], lines: int) -> None:
    """Starts ``cmd`` and SIGKILLs it and every process below it (ranks, data loader workers)
    once every log holds ``lines`` lines: a node's crash, as the job sees it."""
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while p.poll() is None and time.monotonic() < deadline:
        if all(len(_batches(log)) >= lines for log in logs):
            break
        time.sleep(0.005)
    assert p.returncode in (None, 0), f"{cmd} failed before the kill"
    for pid in _tree(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _resumed(out: str) -> int:
    return next(int(l.split()[1]) for l in out.splitlines() if l.startswith("RESUMED"))


STEPS = 25  # 10 batches an epoch (37 items, batch 4): the kill and the resume cross epochs


@pytest.fixture(scope="module")
def stateful_reference(tmp_path_factory) -> dict[int, str]:
    pytest.importorskip("torchdata")
    tmp = tmp_path_factory.mktemp("ref")
    _run([sys.executable, CHILD, "stateful", str(tmp / "ck"), str(tmp / "log"), str(STEPS)])
    ref = _batches(tmp / "log")
    assert sorted(ref) == list(range(1, STEPS + 1))
    return ref


def _stateful_trial(tmp: Path, ref: dict[int, str], kill_after: int) -> None:
    tmp.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, CHILD, "stateful", str(tmp / "ck"), str(tmp / "log"), str(STEPS)]
    _kill_at(cmd, [tmp / "log"], kill_after)
    killed = _batches(tmp / "log")
    assert len(killed) >= kill_after
    out = _run(cmd)
    step = _resumed(out)
    assert 1 <= step <= max(killed)
    assert _batches(tmp / "log") == ref, f"killed after {max(killed)}, resumed at {step}"


def test_stateful_dataloader_resumes_batch_for_batch(stateful_reference, tmp_path):
    rng = random.Random(11)
    for trial in range(2):
        _stateful_trial(tmp_path / f"t{trial}", stateful_reference, rng.randint(2, STEPS - 3))


@pytest.mark.slow  # five kill trials in a row: about a minute on 2 shared vCPUs
def test_stateful_dataloader_resumes_batch_for_batch_5_of_5(stateful_reference, tmp_path):
    rng = random.Random(11)
    for trial in range(5):
        _stateful_trial(tmp_path / f"t{trial}", stateful_reference, rng.randint(2, STEPS - 3))


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(15))
def test_stateful_dataloader_more_kill_rounds(stateful_reference, tmp_path, trial):
    _stateful_trial(tmp_path, stateful_reference, random.Random(100 + trial).randint(1, STEPS - 1))


EPOCHS = 3  # 29 items on 2 ranks: 15 a rank (padded), 5 batches of 3 an epoch


@pytest.fixture(scope="module")
def sampler_reference(tmp_path_factory) -> list[dict[int, str]]:
    tmp = tmp_path_factory.mktemp("ref")
    _run([*TORCHRUN, CHILD, "sampler", str(tmp / "ck"), str(tmp / "log"), str(EPOCHS)])
    refs = [_batches(tmp / f"log.{r}") for r in (0, 1)]
    assert sorted(refs[0]) == sorted(refs[1]) == list(range(1, EPOCHS * 5 + 1))
    assert refs[0] != refs[1]  # each rank its own part
    return refs


@pytest.mark.parametrize("kill_after", [7, pytest.param(3, marks=pytest.mark.slow),
                                        pytest.param(11, marks=pytest.mark.slow)])
def test_distributed_sampler_resumes_batch_for_batch_on_two_ranks(sampler_reference, tmp_path, kill_after):
    cmd = [*TORCHRUN, CHILD, "sampler", str(tmp_path / "ck"), str(tmp_path / "log"), str(EPOCHS)]
    logs = [tmp_path / f"log.{r}" for r in (0, 1)]
    _kill_at(cmd, logs, kill_after)
    out = _run(cmd)
    assert _resumed(out) >= 1
    assert [_batches(log) for log in logs] == sampler_reference


def test_resumable_sampler_state_and_bad_input():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DistributedSampler

    s = pccheck.ResumableSampler(DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1))
    s.set_epoch(2)
    whole = list(s)
    s.advance(2)
    assert s.state_dict() == {"epoch": 2, "consumed": 2}
    t = pccheck.ResumableSampler(DistributedSampler(range(10), num_replicas=2, rank=1, shuffle=True, seed=1))
    t.load_state_dict(s.state_dict())
    t.set_epoch(2)  # the loaded epoch keeps its offset
    assert list(t) == whole[2:] and len(t) == 3
    t.set_epoch(3)  # a new epoch starts at 0
    assert len(list(t)) == 5 and t.state_dict() == {"epoch": 3, "consumed": 0}
    with pytest.raises(ConfigError, match="set_epoch"):
        pccheck.ResumableSampler(range(3))
    with pytest.raises(ConfigError, match="not a ResumableSampler state"):
        t.load_state_dict({"epoch": 1})
    with pytest.raises(ConfigError, match="an int >= 0"):
        t.advance(-1)
    del torch


def _draws(out: str) -> dict:
    return json.loads(next(l for l in out.splitlines() if l.startswith("DRAWS"))[len("DRAWS "):])


@pytest.mark.parametrize("kind", ["plain", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_each_rank_gets_its_own_rng_states_back(tmp_path, kind):
    """Rank r seeds 100 + r and checkpoints; the next draws of each stream are recorded. A new
    job seeds every rank alike and loads: each rank's next draws are its own saved run's."""
    outs = {}
    for mode in ("rng-save", "rng-load"):
        p = subprocess.run([*TORCHRUN, "--tee=1", CHILD, mode, str(tmp_path / "ck"), kind],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        per_rank = {}
        for line in p.stdout.splitlines():  # "[default0]:DRAWS {...}" with --tee
            if "DRAWS" in line:
                per_rank[int(line.split("]")[0].removeprefix("[default"))] = _draws(line.split("]:", 1)[1])
        assert sorted(per_rank) == [0, 1], p.stdout
        outs[mode] = per_rank
    assert outs["rng-save"][0] != outs["rng-save"][1]  # the ranks' streams differ
    for r in (0, 1):
        assert outs["rng-load"][r] == outs["rng-save"][r], f"rank {r}"
        assert set(outs["rng-load"][r]) >= {"python", "numpy", "torch"}
