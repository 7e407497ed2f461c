"""spread_steps="auto": what it decided and from what, recorded per checkpoint; the link
it measures leaves first-touch copies out; the window between optimizer steps is measured, not
derived. No timing is asserted: the inputs are set, or only their presence and signs are checked."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import pytest
import torch

import pccheck
from pccheck.orchestrator.stats import SpreadDecision
from pccheck.spread.driver import Spreader
from pccheck.spread.mode import SpreadMode
from pccheck.spread.plan import RECORDS, auto_steps, modelled_stall, replay_backpressure

from test_spread import make, train_auto, train_step


@contextlib.contextmanager
def _spreader(opt):
    sp = Spreader(opt)
    try:
        yield sp
    finally:
        sp.close()


def _adamw(n: int = 4, elems: int = 4096):
    params = [torch.nn.Parameter(torch.full((elems,), 0.5)) for _ in range(n)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()  # the state exists
    return opt


def _stat(nbytes: int, copy_s: float, k: int = 1, prepare_s: float = 0.0, stall_s: float = 0.0,
          replay_s: float = 0.0):
    return SimpleNamespace(nbytes=nbytes, copied_s=copy_s + prepare_s + stall_s, prepare_s=prepare_s,
                           stall_s=stall_s, spread_steps=k, outcome="committed", replay_s=replay_s)


def test_every_checkpoint_records_autos_decision_and_its_inputs(tmp_path):
    ck = train_auto(tmp_path)
    cks = ck.stats().as_dict()["checkpoints"]
    assert len(cks) == 3
    first = cks[0]["spread_decision"]
    assert first["k"] == 1 and first["reason"] == "warm-up" and first["link_bps"] == 0
    for c in cks[1:]:
        d = c["spread_decision"]
        assert d["k"] == c["spread_steps"]
        assert d["reason"] in ("model", "hysteresis", "interval cap")
        assert d["state_bytes"] == cks[0]["nbytes"] and d["grad_bytes"] > 0
        assert d["link_bps"] > 0 and d["link_source"] in ("whole", "parts") and d["link_samples"] >= 1
        assert d["window_s"] > 0 and d["step_s"] > 0 and d["iter_s"] > 0
        assert 1 <= d["best_k"] and d["model_stall_s"] >= 0 and d["model_stall_k1_s"] >= 0
        assert "gain" in d
    assert ck.stats().to_json()  # the decision serializes


def test_a_fixed_spread_steps_records_no_decision(tmp_path):
    model, opt, sched, scaler = make("adamw")
    ck = pccheck.Checkpointer(model, opt, path=tmp_path, extra_state={"sched": sched, "scaler": scaler},
                              interval=5, spread_steps=2)
    for s in range(1, 13):
        train_step(model, opt, sched, scaler, s)
        ck.maybe_checkpoint(s)
    ck.close()
    cks = ck.stats().as_dict()["checkpoints"]
    assert cks and all(c["spread_decision"] is None for c in cks)


def test_decision_gain_is_the_modelled_stall_over_k1():
    d = SpreadDecision(4, "model", model_stall_s=0.03, model_stall_k1_s=0.15)
    assert d.gain == pytest.approx(0.2)
    assert SpreadDecision(1, "warm-up").gain is None


def _spread_once(sp: Spreader, opt, k: int) -> None:
    sp.begin(k)
    for _ in range(k):
        opt.step()
    res = sp.finish()
    res.hold.wait(30)
    res.copied.set()


def test_a_copy_that_first_touches_its_buffers_is_not_a_link_sample():
    opt = _adamw()
    with _spreader(opt) as sp:
        _spread_once(sp, opt, 2)  # the shadow's buffers are allocated by these copies
        assert sp.copy_bandwidth() is None
        _spread_once(sp, opt, 2)  # now they are touched: both parts measure the copy itself
        rate, n = sp.copy_bandwidth()
        assert n == 2 and rate > 0


def test_warming_the_shadow_makes_the_first_spreads_copies_link_samples():
    opt = _adamw()
    with _spreader(opt) as sp:
        sp.warm()
        sp._warming.result(30)
        assert len(sp._buffers) == 4 * 4  # every parameter, its step and both of AdamW's moments
        _spread_once(sp, opt, 2)
        assert sp.copy_bandwidth()[1] == 2


def test_the_window_is_from_a_steps_end_to_the_next_steps_begin_without_checkpoint_waits():
    opt = _adamw()
    with _spreader(opt) as sp:
        assert sp.window_time() is None
        for _ in range(3):
            opt.step()
            time.sleep(0.01)
        assert sp.window_time() >= 0.01
        # the soft copy-on-write pre-hook closes the window before it waits; that wait is not window
        sp._windows.clear()
        opt.step()
        time.sleep(0.01)
        sp.step_begins()
        time.sleep(0.5)  # a checkpoint wait in an earlier pre-hook
        opt.step()
        assert len(sp._windows) == 2 and sp._windows[-1] < 0.5  # (with the wait it would be >= 0.51)


def test_the_link_is_the_median_one_step_copy_without_preparation_and_the_first_checkpoint():
    mode = SpreadMode("auto", _adamw(), None)
    try:
        s = 1 << 30
        first = _stat(s, 1.0)  # the first copy: the pool still faulting in, a "slow link"
        later = [_stat(s, 0.2, prepare_s=0.3, stall_s=0.5), _stat(s, 0.25), _stat(s, 0.2)]
        assert mode._link([first]) == (pytest.approx(s), "whole", 1)
        bps, source, n = mode._link([first] + later)
        assert (source, n) == ("whole", 3) and bps == pytest.approx(s / 0.2)
    finally:
        mode.close()


@pytest.mark.parametrize("noisy_step", [0.5, 0.9])
def test_auto_spreads_at_four_iterations_a_snapshot_whatever_the_step_costs(noisy_step):
    """S/(B t) = 4 with the window measured directly: the decision does not hang on an iteration
    minus an optimizer step (two long, noisy medians whose difference is t)."""
    opt = _adamw()
    mode = SpreadMode("auto", opt, None)
    try:
        s, t = 1 << 30, 0.05
        b = s / (4 * t)
        mode.spreader._windows.extend([t] * 5)
        mode.spreader._step_times.extend([noisy_step] * 5)
        mode._calls.extend([0.0, noisy_step])  # the iteration as the calls see it: about the step alone
        k = mode.steps_for_next([_stat(s, 1.0), _stat(s, s / b)], interval=30)
        d = mode.decision
        assert k > 1 and d.k == k and d.reason == "model" and d.link_source == "whole"
        assert d.window_s == t and d.link_bps == pytest.approx(b)
        assert d.gain is not None and d.gain < 0.5
        assert d.replay_source == "live step" and d.replay_step_s == noisy_step  # CPU parameters
        assert d.model_stall_s == pytest.approx(modelled_stall(k, s, d.grad_bytes, b, t, noisy_step,
                                                               replay_step_s=noisy_step))
        # the interval caps it, and says so
        mode._learned_last = None
        assert mode.steps_for_next([_stat(s, 1.0), _stat(s, s / b)], interval=2) == 1
        assert mode.decision.reason == "interval cap" and mode.decision.best_k == k
    finally:
        mode.close()


def test_the_replay_backpressure_model_queues_the_steps_behind_one_replay_thread():
    # t = 0.05, u = 0.45: a step captured every 0.5 s; the replay of step j costs j/k of R
    assert replay_backpressure(5, 0.05, 0.45, 0.4) == 0.0  # it keeps up
    assert replay_backpressure(1, 0.05, 0.45, 100.0) == 0.0  # k = 1 replays nothing
    # R = 5 (1, 2, 3, 4, 5 s): captures at 0.05, 0.55, 1.05, then step 4 waits for step 2's replay
    # (done at 3.05: 1.5 s), which pushes step 5 to 3.55, where it waits for step 3's (6.05: 2.5 s)
    assert RECORDS == 2
    assert replay_backpressure(5, 0.05, 0.45, 5.0) == pytest.approx(4.0)
    s, t = 1 << 30, 0.05
    b = s / (4 * t)
    assert modelled_stall(5, s, s / 3, b, t, 0.45, replay_step_s=5.0) == pytest.approx(
        modelled_stall(5, s, s / 3, b, t, 0.45) + 4.0)
    # a replay that cannot keep up: "auto" takes no more steps than may wait for it (never held up)
    assert auto_steps(s, s / 3, b, t, 0.45) > RECORDS
    assert auto_steps(s, s / 3, b, t, 0.45, replay_step_s=50.0) == RECORDS


def test_auto_takes_the_replay_cost_from_the_last_spreads():
    mode = SpreadMode("auto", _adamw(), None)
    try:
        s, t = 1 << 30, 0.05
        b = s / (4 * t)
        mode.spreader._windows.extend([t] * 5)
        mode.spreader._step_times.extend([0.45] * 5)
        spread = _stat(s, s / b, k=5, replay_s=9.0)  # 3 whole-state steps replayed: R = 3 s
        mode.steps_for_next([_stat(s, s / b), spread], interval=30)
        d = mode.decision
        assert (d.replay_source, d.replay_step_s) == ("spread", pytest.approx(3.0))
        assert d.model_stall_s == pytest.approx(modelled_stall(d.k, s, d.grad_bytes, d.link_bps, t, 0.45,
                                                               replay_step_s=3.0))
    finally:
        mode.close()


def _spy_on_gradient_buffers(sp: Spreader) -> dict:
    """{parameter key: data pointers of the buffers its gradient captures went into}, from now on."""
    captured: dict = {}
    real = sp._copy_grad

    def spy(g, version, ready=None, key=None):
        out = real(g, version, ready, key)
        captured.setdefault(key, set()).add(out.data_ptr())
        return out
    sp._copy_grad = spy
    return captured


def test_a_spread_records_where_the_training_thread_waited_and_reuses_gradient_buffers():
    opt = _adamw()
    with _spreader(opt) as sp:
        sp.begin(3)
        for _ in range(3):
            opt.step()
        res = sp.finish()
        assert res.hold.wait(30)
        res.copied.set()
        waits = res.stats["spread_waits"]
        assert sorted(waits) == ["grads", "parts", "previous", "replay"]
        assert all(w >= 0 for w in waits.values()) and sum(waits.values()) <= res.waited_s + 1e-9
        assert res.stats["replay_cpu_s"] >= 0 and res.stats["replay_s"] > 0
        assert sp._grad_pool and all(len(free) <= RECORDS for free in sp._grad_pool.values())
        captured = _spy_on_gradient_buffers(sp)
        for k in (3, 2, 3):
            _spread_once(sp, opt, k)
        # however fast the replay ran (it decides how many buffers a key needed), free + in use
        # never exceeds RECORDS per parameter: captures reuse what the pool holds
        assert captured and all(len(ptrs) <= RECORDS for ptrs in captured.values())


def test_warming_fills_the_gradient_pool_once_and_captures_then_allocate_nothing():
    opt = _adamw()
    with _spreader(opt) as sp:
        sp.warm()
        sp._warming.result(30)
        pooled = {key: {b.data_ptr() for b in free} for key, free in sp._grad_pool.items()}
        assert pooled and all(len(ptrs) == RECORDS for ptrs in pooled.values())
        captured = _spy_on_gradient_buffers(sp)
        _spread_once(sp, opt, 3)
        sp._warming = None
        sp.warm()  # a second warm-up adds nothing: every key already has its buffers
        sp._warming.result(30)
        _spread_once(sp, opt, 3)
        assert captured and all(ptrs <= pooled[key] for key, ptrs in captured.items())
        assert all(len(free) <= RECORDS for free in sp._grad_pool.values())
