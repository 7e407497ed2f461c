"""The CPU copy engine's helper threads: several threads claim chunks of one snapshot."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import pccheck
from pccheck.orchestrator.copy_engine import CpuCopyEngine, ThrottledCopyEngine, default_copy_threads
from conftest import assert_state_equal


class _Recording:
    """Wraps the engine's crew: keeps every helper future, to see which ones really ran."""

    def __init__(self, crew):
        self.crew, self.futures = crew, []

    def submit(self, fn, *args):
        f = self.crew.submit(fn, *args)
        self.futures.append(f)
        return f

    def shutdown(self, wait=True):
        self.crew.shutdown(wait=wait)


def _copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pccheck-copy")]


@pytest.mark.parametrize("threads", [0, -1, 65, 1.5, True, "2"])
def test_bad_thread_count(threads):
    with pytest.raises(pccheck.ConfigError, match="threads must be an integer"):
        CpuCopyEngine(threads=threads)


def test_default_threads_follow_the_cpus():
    assert CpuCopyEngine().threads == default_copy_threads() >= 1
    assert ThrottledCopyEngine(1e9).threads == 1  # one emulated link, paced chunk by chunk


@pytest.mark.parametrize("threads", [2, 3])
def test_helpers_copy_chunks_of_one_snapshot(store_dir, threads):
    rng = np.random.default_rng(3)
    state = {f"a{i}": rng.random(n) for i, n in enumerate([1 << 18, 70_001, 3, 1 << 17])}
    engine = CpuCopyEngine(threads=threads)
    with pccheck.Checkpointer(state, path=store_dir, interval=1, chunk_size=16 << 10, copy_engine=engine) as ck:
        engine._crew = rec = _Recording(engine._crew)
        step = 0
        # At least 5 snapshots of ~200 chunks; on a busy machine the helpers may not be scheduled
        # before the caller has claimed every chunk of one, so go on (bounded) until one has run.
        while step < 5 or (step < 200 and all(f.cancelled() for f in rec.futures)):
            step += 1
            for a in state.values():
                a += 1.0
            assert ck.maybe_checkpoint(step)
            r_state = {k: v.copy() for k, v in state.items()}
        ck.wait()
        assert len(rec.futures) == step * (threads - 1)
        assert all(f.done() for f in rec.futures)  # copy() never returns with a helper still running
        # helpers started at once claim chunks beside the caller
        assert any(not f.cancelled() for f in rec.futures)
    r = pccheck.load_latest(store_dir)
    assert r.step == step
    assert_state_equal(r.state, r_state)


def test_helpers_stop_at_close_and_restart_on_reuse(store_dir):
    before = len(_copy_threads())
    engine = CpuCopyEngine(threads=3)
    assert len(_copy_threads()) == before + 2  # started with the engine, before any chunk pool
    state = {"x": np.arange(1 << 16, dtype=np.float64)}
    with pccheck.Checkpointer(state, path=store_dir / "a", interval=1, copy_engine=engine) as ck:
        ck.maybe_checkpoint(1)
    assert len(_copy_threads()) == before
    with pccheck.Checkpointer(state, path=store_dir / "b", interval=1, copy_engine=engine) as ck:
        assert len(_copy_threads()) == before + 2
        ck.maybe_checkpoint(2)
    assert pccheck.load_latest(store_dir / "b").step == 2
    assert len(_copy_threads()) == before


def test_soft_cow_with_helpers_saves_the_state_before_the_step(store_dir):
    """The background copy runs on several threads; the optimizer step that follows the
    checkpoint call must still not reach the snapshot."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step():
        opt.zero_grad()
        model(torch.randn(8, 256)).sum().backward()
        opt.step()

    step()
    engine = CpuCopyEngine(threads=3)
    with pccheck.Checkpointer(model, opt, path=store_dir, interval=1, chunk_size=16 << 10,
                              copy_engine=engine) as ck:
        for s in range(1, 4):
            ck.maybe_checkpoint(s)
            expect = {k: v.clone() for k, v in model.state_dict().items()}
            step()  # the pre-hook waits until no copy thread reads the parameters
        ck.wait()
    back = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    assert pccheck.load_latest(store_dir, model=back).step == 3
    for k, v in back.state_dict().items():
        assert torch.equal(v, expect[k]), k


def test_helpers_outlive_a_pool_remade_for_a_grown_state(store_dir):
    """Adam's state appears at its first step: the default-sized pool is remade inside that
    checkpoint's start. The helpers stay (restarting them there would wait for the new pool's
    prefaulter), and stop only at close."""
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = {t.ident for t in _copy_threads()}
    with pccheck.Checkpointer(model, opt, path=store_dir, interval=1, copy_engine=CpuCopyEngine(threads=2)) as ck:
        ck.maybe_checkpoint(1)
        ck.wait()
        crew = {t.ident for t in _copy_threads()} - before
        model(torch.randn(4, 512)).sum().backward()
        opt.step()  # the state triples
        ck.maybe_checkpoint(2)
        ck.wait()
        assert {t.ident for t in _copy_threads()} - before == crew and len(crew) == 1
        assert ck.stats().checkpoints[-1].nbytes > 2 * ck.stats().checkpoints[0].nbytes
    assert {t.ident for t in _copy_threads()} == before
