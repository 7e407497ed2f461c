"""Soft copy-on-write keeps snapshots exact: with a copy engine throttled to emulate PCIe, step
k+1's update starts while step k is still being copied, and the persisted checkpoint of step k is
still byte-identical to a deep copy taken at step k."""

from __future__ import annotations

import random

import pytest
import torch

import pccheck
from conftest import assert_same_tree, clone_tree
from pccheck.orchestrator.copy_engine import ThrottledCopyEngine
import _torch_train as tt

OPTIMIZERS = ["sgd_momentum", "adam_foreach", "adam_loop", "adamw_fused", "adamw"]


def test_snapshot_is_exact_while_next_update_runs(tmp_path):
    rng = random.Random(2024)
    waited = 0
    runs = 60
    for run in range(runs):
        opt_name = OPTIMIZERS[run % len(OPTIMIZERS)]
        width, k = rng.choice([32, 64, 128, 256]), rng.randint(1, 4)
        tt.setup()
        model, optim, sched = tt.make(width=width, opt=opt_name)
        path = tmp_path / f"run{run}"
        for s in range(1, k + 1):
            tt.train_step(model, optim, sched, s)
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
        engine = ThrottledCopyEngine(nbytes / 0.03)  # ~30 ms to copy the whole state
        with pccheck.Checkpointer(model, optim, path=path, extra_state={"sched": sched}, interval=10**6,
                                  chunk_size=4096, copy_engine=engine) as ck:
            ck.checkpoint(k)
            want_model = clone_tree(model.state_dict())
            want_optim = clone_tree(optim.state_dict())
            for s in range(k + 1, k + 3):  # updates race with the copy of step k
                tt.train_step(model, optim, sched, s)
            ck.wait()
            st = ck.stats().checkpoints[0]
            waited += st.cow_wait_s > 0
            assert st.outcome == "committed"
        model2, optim2, sched2 = tt.make(width=width, opt=opt_name)
        r = pccheck.load_latest(path, model=model2, optimizer=optim2, extra_state={"sched": sched2})
        assert r.step == k
        assert_same_tree(want_model, model2.state_dict(), f"run {run} {opt_name} model")
        assert_same_tree(want_optim, optim2.state_dict(), f"run {run} {opt_name} optimizer")
    # The race really happened: the optimizer pre-hook had to wait for the copy in most runs.
    assert waited >= runs // 2, waited


def test_mutation_outside_optimizer_step_is_detected(tmp_path):
    """Version counters catch an in-place update that bypasses the optimizer pre-hook."""
    model = torch.nn.Linear(256, 256)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ThrottledCopyEngine(1 << 20)  # 1 MiB/s: the copy is still running below
    ck = pccheck.Checkpointer(model, optim, path=tmp_path, interval=1, chunk_size=4096, copy_engine=engine)
    ck.checkpoint(1)
    with torch.no_grad():
        model.weight.add_(1.0)  # not through optimizer.step(): bumps _version
    ck.wait_copied()
    with pytest.raises(pccheck.SnapshotError, match="modified in place"):
        ck.wait()
    ck.checkpoint(2)  # training goes on; the next checkpoint is fine
    ck.close()
    r = pccheck.load_latest(tmp_path)
    assert r.step == 2
    assert torch.equal(r.state["model"]["weight"], model.weight.detach())
