"""Bitwise resume: SIGKILL a training child at random steps (checkpoints in flight), resume in a
fresh process, and the rest of the loss curve and the final weights equal an uninterrupted run.
A negative control without RNG capture must diverge, proving the comparison can fail."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _torch_train as tt

CHILD = str(Path(__file__).with_name("_torch_train.py"))
STEPS, INTERVAL = 30, 2


@pytest.fixture(scope="module")
def reference() -> tuple[dict[int, float], dict]:
    tt.setup()
    model, optim, sched = tt.make()
    losses = {s: tt.train_step(model, optim, sched, s) for s in range(1, STEPS + 1)}
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _kill_at(path: Path, kill_step: int, extra: list[str]) -> int:
    proc = subprocess.Popen([sys.executable, CHILD, str(path), str(STEPS), str(INTERVAL), *extra],
                            stdout=subprocess.PIPE, text=True)
    last = 0
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("LOSS"):
            last = int(line.split()[1])
            if last >= kill_step:
                os.kill(proc.pid, signal.SIGKILL)
                break
    proc.wait(60)
    assert proc.returncode == -signal.SIGKILL, "child finished before it could be killed"
    return last


def _resume(path: Path, final: Path, extra: list[str]) -> tuple[int, dict[int, float]]:
    out = subprocess.run([sys.executable, CHILD, str(path), str(STEPS), str(INTERVAL), "--resume",
                          "--final", str(final), *extra], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    start = int(next(line for line in out.stdout.splitlines() if line.startswith("START")).split()[1])
    losses = {int(l.split()[1]): float(l.split()[2]) for l in out.stdout.splitlines() if l.startswith("LOSS")}
    return start, losses


@pytest.mark.parametrize("trial", range(10))
def test_sigkill_then_resume_is_bitwise(tmp_path, reference, trial):
    ref_losses, ref_state = reference
    kill = random.Random(trial).randint(3, STEPS - 3)
    killed_after = _kill_at(tmp_path / "ck", kill, [])
    start, losses = _resume(tmp_path / "ck", tmp_path / "final.pt", [])
    assert 0 <= start <= killed_after and start % INTERVAL == 0
    assert sorted(losses) == list(range(start + 1, STEPS + 1))
    for s, loss in losses.items():
        assert loss == ref_losses[s], f"step {s}: {loss!r} != {ref_losses[s]!r} (resumed at {start})"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final.keys() == ref_state.keys()
    for k in ref_state:
        assert torch.equal(final[k], ref_state[k]), k


def test_negative_control_without_rng_capture_diverges(tmp_path, reference):
    """Dropout draws from the torch RNG: resuming without its state gives another loss curve."""
    ref_losses, _ = reference
    _kill_at(tmp_path / "ck", 11, ["--no-rng"])
    start, losses = _resume(tmp_path / "ck", tmp_path / "final.pt", ["--no-rng"])
    assert start >= 2
    assert any(loss != ref_losses[s] for s, loss in losses.items())
