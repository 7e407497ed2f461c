"""Device-side soft copy-on-write (``device_reserve``) with the CPU engine standing in for the
device: the throttled engine ships chunks at an emulated PCIe rate, the reserve stages them at
memcpy speed. The optimizer step that arrives while a snapshot is still being copied stages the
unclaimed chunks and runs on; the persisted checkpoint must still equal the state of its step."""

from __future__ import annotations


import pytest
import torch

import pccheck
from conftest import assert_same_tree, clone_tree
from pccheck.orchestrator.copy_engine import CpuCopyEngine, ThrottledCopyEngine

CHUNK = 64 << 10


def _make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return model, optim


def _step(model, optim, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    x = torch.randn(32, 256, generator=g)
    optim.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optim.step()


def _run(tmp_path, reserve, *, rate=8 << 20, max_concurrent=2, checkpoints=(2,), steps=6):
    """Trains ``steps`` steps, checkpointing at ``checkpoints`` with the copy still running when the
    next optimizer step arrives; returns (per-checkpoint stats, references, reserve free slots)."""
    model, optim = _make()
    refs = {}
    engine = ThrottledCopyEngine(rate)  # ~0.4 s for the ~3.2 MiB state: several steps' worth
    with pccheck.Checkpointer(model, optim, path=tmp_path, interval=10**6, chunk_size=CHUNK,
                              max_concurrent=max_concurrent, device_reserve=reserve,
                              copy_engine=engine) as ck:
        for s in range(1, steps + 1):
            _step(model, optim, s)  # the pre-hook of this step meets the previous checkpoint's copy
            if s in checkpoints:
                ck.checkpoint(s)
                refs[s] = (clone_tree(model.state_dict()), clone_tree(optim.state_dict()))
        ck.wait()
        free = ck._orch.reserve.free_slots() if ck._orch.reserve is not None else None
        slots = ck._orch.reserve.slots if ck._orch.reserve is not None else None
        stats = ck.stats().checkpoints
    return stats, refs, (free, slots)


def _load(path, step):
    model, optim = _make(seed=99)
    r = pccheck.load_latest(path, model=model, optimizer=optim)
    assert r.step == step
    return model.state_dict(), optim.state_dict()


def test_step_runs_on_while_staged_chunks_ship_and_the_checkpoint_is_exact(tmp_path):
    stats, refs, (free, slots) = _run(tmp_path, 16 << 20, checkpoints=(2,))
    st = stats[0]
    assert st.outcome == "committed"
    # the pre-hook of step 3 staged what the copy thread had not claimed yet: most of the state
    assert st.reserve_bytes > st.nbytes // 2, (st.reserve_bytes, st.nbytes)
    assert free == slots  # every slot given back once its chunk shipped
    got_model, got_optim = _load(tmp_path, 2)
    assert_same_tree(refs[2][0], got_model, "model")
    assert_same_tree(refs[2][1], got_optim, "optimizer")


def test_without_reserve_the_step_waits_for_the_copy(tmp_path):
    stats, refs, _ = _run(tmp_path, None, checkpoints=(2,))
    st = stats[0]
    assert st.outcome == "committed" and st.reserve_bytes == 0
    assert st.cow_wait_s > 0  # control: the step did meet the copy in flight
    got_model, got_optim = _load(tmp_path, 2)
    assert_same_tree(refs[2][0], got_model)
    assert_same_tree(refs[2][1], got_optim)


def test_a_small_reserve_stages_what_fits_and_the_rest_is_copied_before_the_step(tmp_path):
    stats, refs, (free, slots) = _run(tmp_path, 3 * CHUNK + 100, checkpoints=(2,))
    st = stats[0]
    assert slots == 3 and free == 3
    assert 0 < st.reserve_bytes <= 3 * CHUNK
    got_model, got_optim = _load(tmp_path, 2)
    assert_same_tree(refs[2][0], got_model)
    assert_same_tree(refs[2][1], got_optim)


def test_concurrent_checkpoints_share_the_reserve_and_reuse_its_slots(tmp_path):
    # Checkpoints at steps 2, 3 and 5 with N=2: two flights stage into one 8-chunk reserve, whose
    # slots come back and are reused. Every checkpoint must be exact; the newest is loaded.
    stats, refs, (free, slots) = _run(tmp_path, 8 * CHUNK, checkpoints=(2, 3, 5), steps=7)
    assert [s.outcome for s in stats].count("failed") == 0
    assert sum(s.reserve_bytes for s in stats) > 8 * CHUNK  # slots were reused
    assert free == slots
    got_model, got_optim = _load(tmp_path, 5)
    assert_same_tree(refs[5][0], got_model)
    assert_same_tree(refs[5][1], got_optim)


class _FailingStage(ThrottledCopyEngine):
    def stage(self, job, src, k, reserve, off):
        raise RuntimeError("device clone failed (injected)")


def test_a_failed_clone_fails_that_checkpoint_only(tmp_path):
    model, optim = _make()
    with pccheck.Checkpointer(model, optim, path=tmp_path, interval=10**6, chunk_size=CHUNK,
                              device_reserve=1 << 20, copy_engine=ThrottledCopyEngine(64 << 20),
                              on_error="log") as ck:
        _step(model, optim, 1)
        ck.checkpoint(1)
        ck.wait()
        want = clone_tree(model.state_dict())
        ck._orch.copy_engine.__class__ = _FailingStage  # the next clone fails
        ck.checkpoint(2)
        _step(model, optim, 3)  # the pre-hook stages: the clone raises, training goes on
        ck.wait()
        outcomes = [s.outcome for s in ck.stats().checkpoints]
        assert ck._orch.reserve.free_slots() == ck._orch.reserve.slots
    assert outcomes == ["committed", "failed"]
    got_model, _ = _load(tmp_path, 1)
    assert_same_tree(want, got_model)


def test_device_reserve_arguments(tmp_path):
    model, optim = _make()
    with pytest.raises(pccheck.ConfigError, match="device_reserve"):
        pccheck.Checkpointer(model, optim, path=tmp_path, device_reserve="lots")
    with pytest.raises(pccheck.ConfigError, match="device_reserve"):
        pccheck.Checkpointer(model, optim, path=tmp_path, device_reserve=-1)
    with pytest.raises(pccheck.ConfigError, match="soft copy-on-write"):
        pccheck.Checkpointer({"w": torch.zeros(4)}, path=tmp_path, device_reserve=1 << 20)
    # "auto" on the CPU: there is no device memory to stage into
    with pccheck.Checkpointer(model, optim, path=tmp_path, device_reserve="auto") as ck:
        assert ck._orch.reserve is None
        assert isinstance(ck.copy_engine, CpuCopyEngine)
