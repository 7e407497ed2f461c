"""``Checkpointer.wait_ready``: the store opened and the chunk pool faulted in ahead of the first
checkpoint, and the native ``Engine.wait_prefaulted`` under it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import pccheck
from pccheck.errors import ConfigError
from pccheck.native import _native

KW = dict(max_concurrent=2, chunk_size=1 << 20)
LONG = 120.0  # generous: a noisy machine may fault pages in slowly; never a timing assertion


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _step(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_engine_wait_prefaulted_counts_every_chunk():
    e = _native.Engine(1 << 20, 3, 1)
    try:
        assert e.wait_prefaulted(LONG)
        assert e.prefaulted_chunks == e.num_chunks == 3
        assert e.wait_prefaulted(0.0)  # already done: at once
    finally:
        e.close()
    assert e.wait_prefaulted(0.0)  # closed after finishing: still reports what was done


def test_engine_close_wakes_a_waiter():
    e = _native.Engine(1 << 20, 64, 1)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(e.wait_prefaulted()))  # no limit
    t.start()
    e.close()  # stops the prefaulter; the waiter returns (True only if it had finished first)
    t.join(LONG)
    assert not t.is_alive() and len(got) == 1
    assert got[0] == (e.prefaulted_chunks == e.num_chunks)


def test_arrays_checkpointer_is_ready(tmp_path):
    state = {"w": np.arange(1 << 18, dtype=np.float32)}
    with pccheck.Checkpointer(state, tmp_path, **KW) as ck:
        assert ck.wait_ready(LONG)
        assert ck.storage != "closed"  # the store is open before any checkpoint
        assert ck.checkpoint(1)
    assert pccheck.load_latest(tmp_path).step == 1


def test_not_ready_before_the_optimizer_has_state(tmp_path):
    m, opt = _model()
    with pccheck.Checkpointer(m, opt, tmp_path, **KW) as ck:
        assert ck.wait_ready(0) is False  # Adam's state appears at its first step
        assert ck.storage == "closed"     # and asking did not open the store for the smaller state
        _step(m, opt)
        assert ck.wait_ready(LONG)
        assert ck.checkpoint(1)
        gen = ck.generation
        ck.wait()
        assert ck.generation == gen  # sized for the final state: no new generation at the checkpoint


def test_built_before_load_latest_is_ready_after_it(tmp_path):
    m, opt = _model()
    _step(m, opt)
    with pccheck.Checkpointer(m, opt, tmp_path, **KW) as ck:
        ck.checkpoint(1)
    m2, opt2 = _model()
    with pccheck.Checkpointer(m2, opt2, tmp_path, **KW) as ck:
        assert ck.wait_ready(0) is False
        pccheck.load_latest(tmp_path, model=m2, optimizer=opt2)
        assert ck.wait_ready(LONG)
        assert ck.checkpoint(2)
    r = pccheck.load_latest(tmp_path)
    assert r.step == 2


def test_wait_ready_on_another_thread_while_training(tmp_path):
    m, opt = _model()
    results: list[bool] = []  # what the other thread saw; any answer is right, none may raise
    with pccheck.Checkpointer(m, opt, tmp_path, **KW) as ck:
        stop = threading.Event()

        def poll() -> None:  # races the prepare hook and the first checkpoint for the store
            while not stop.is_set():
                results.append(ck.wait_ready(0.01))

        t = threading.Thread(target=poll)
        t.start()
        try:
            for step in range(1, 6):
                _step(m, opt)
                ck.checkpoint(step)
            ck.wait()
        finally:
            stop.set()
            t.join(LONG)
        assert ck.wait_ready(LONG)
        want = {k: v.clone() for k, v in m.state_dict().items()}
    m3, opt3 = _model()
    assert pccheck.load_latest(tmp_path, model=m3, optimizer=opt3).step == 5
    for k, v in m3.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_closed_checkpointer_refuses(tmp_path):
    ck = pccheck.Checkpointer({"w": np.zeros(1024, np.float32)}, tmp_path, **KW)
    ck.close()
    with pytest.raises(ConfigError, match="closed"):
        ck.wait_ready(0)
