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


# Four kill points in `make test`, all ten in `make test-slow` (the suite's time budget).
@pytest.mark.parametrize("trial", [t if t < 2 else pytest.param(t, marks=pytest.mark.slow) for t in range(10)])
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


def _adamw_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int) -> None:
    x = torch.randn(8, 64)
    for _ in range(steps):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("order", ["build_first", "load_first"])
def test_first_checkpoint_after_a_restart_reuses_the_pool_made_when_the_state_was_final(tmp_path, order):
    """With the Checkpointer built before load_latest, the optimizer has no state at construction:
    a pool made then (sized for the parameters alone) and the unopened store would be remade and
    opened inside the first checkpoint's call. They are made once the state is final (after the
    load, or the first step), and the first checkpoint uses them as they are."""
    import pccheck

    model, opt = _adamw_model()
    with pccheck.Checkpointer(model, opt, tmp_path, interval=1) as ck:
        assert ck.copy_engine.native_engine is None  # Adam's state appears at the first step
        _train(model, opt, 1)
        pool = ck.copy_engine.native_engine
        assert pool is not None and ck.storage != "closed"  # made at the end of that step
        ck.maybe_checkpoint(1)
        assert ck.copy_engine.native_engine is pool
    model, opt = _adamw_model()
    if order == "build_first":
        ck = pccheck.Checkpointer(model, opt, tmp_path, interval=1)
        assert ck.copy_engine.native_engine is None
        assert pccheck.load_latest(tmp_path, model=model, optimizer=opt).step == 1
    else:
        assert pccheck.load_latest(tmp_path, model=model, optimizer=opt).step == 1
        ck = pccheck.Checkpointer(model, opt, tmp_path, interval=1)
    with ck:
        pool = ck.copy_engine.native_engine
        assert pool is not None and ck.storage != "closed"  # ready before the first step
        _train(model, opt, 1)
        ck.maybe_checkpoint(2)
        assert ck.copy_engine.native_engine is pool
        ck.wait()
    model, opt = _adamw_model()
    assert pccheck.load_latest(tmp_path, model=model, optimizer=opt).step == 2
