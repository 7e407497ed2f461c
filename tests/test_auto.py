"""``Checkpointer(..., "auto")``: the tuned choice from ``pccheck-tune.json`` reaches the engine, and
``interval="auto"`` adapts the interval online while a real training loop runs."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import pccheck
from pccheck.tuner import config, model

MiB = 1 << 20


def _doc(**chosen):
    base = {"interval": 7, "max_concurrent": 3, "writer_threads": 1, "chunk_size": 2 * MiB,
            "max_overhead": 1.05, "iter_time": 0.12, "tw_s": 0.8}
    return {"format": config.FORMAT, "version": config.VERSION, "host": "here", "created": "x",
            "inputs": {"state_bytes": 4 * MiB}, "chosen": {**base, **chosen}}


def _arrays(nbytes: int = 4 * MiB) -> dict[str, np.ndarray]:
    return {"w": np.arange(nbytes // 4, dtype=np.float32)}


def test_defaults_without_a_config(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="pccheck"):
        ck = pccheck.Checkpointer(_arrays(), tmp_path / "ck", interval="auto")
    with ck:
        assert ck.settings["source"] == "defaults"
        assert ck.interval == 10
        assert (ck._orch.max_concurrent, ck._orch._writer_threads, ck._orch._chunk_size) == (2, 2, 64 * MiB)
    assert "pccheck-tune" in caplog.text  # says how to tune


def test_the_stored_choice_reaches_the_engine(tmp_path):
    config.write_config(tmp_path / "ck", _doc())
    arrays = _arrays()
    with pccheck.Checkpointer(arrays, tmp_path / "ck", interval="auto") as ck:
        assert ck.settings["source"].endswith(config.CONFIG_NAME)
        assert ck.interval == 7
        o = ck._orch
        assert (o.max_concurrent, o._writer_threads, o._chunk_size, o.num_slots) == (3, 1, 2 * MiB, 4)
        assert ck._tuner is not None and (ck._tuner.q, ck._tuner.n) == (1.05, 3)
        taken = [s for s in range(1, 30) if ck.maybe_checkpoint(s)]
    # the first on step % interval == 0, then `interval` steps later (the online tuner cannot decide
    # before 20 iterations and 3 finished checkpoints)
    assert taken[:2] == [7, 14]
    assert pccheck.load_latest(tmp_path / "ck").step == taken[-1]


def test_explicit_values_win_over_the_config(tmp_path):
    config.write_config(tmp_path / "ck", _doc())
    with pccheck.Checkpointer(_arrays(), tmp_path / "ck", interval=4, max_concurrent=1, writer_threads=2,
                              chunk_size=1 * MiB) as ck:
        assert ck.interval == 4 and ck._tuner is None
        assert (ck._orch.max_concurrent, ck._orch._writer_threads, ck._orch._chunk_size) == (1, 2, 1 * MiB)
        assert [s for s in range(1, 13) if ck.maybe_checkpoint(s)] == [4, 8, 12]
    with pccheck.Checkpointer(_arrays(), tmp_path / "ck", interval=5) as ck:  # the rest default to "auto"
        assert (ck._orch.max_concurrent, ck._orch._writer_threads, ck._orch._chunk_size) == (3, 1, 2 * MiB)


def test_a_malformed_config_is_refused_and_the_last_checkpoint_stays(tmp_path):
    arrays = _arrays()
    with pccheck.Checkpointer(arrays, tmp_path / "ck", interval=1) as ck:
        ck.maybe_checkpoint(3)
    (tmp_path / "ck" / config.CONFIG_NAME).write_text('{"format": "pccheck-tune", "version": 1, "chosen": {}}')
    with pytest.raises(pccheck.ConfigError, match="pccheck-tune --write-config"):
        pccheck.Checkpointer(arrays, tmp_path / "ck", interval="auto")
    r = pccheck.load_latest(tmp_path / "ck")
    assert r.step == 3 and np.array_equal(r.state["w"], arrays["w"])


@pytest.mark.parametrize("kw", [{"interval": "fast"}, {"max_concurrent": "Auto"}, {"writer_threads": ""},
                                {"chunk_size": "64MiB"}, {"interval": 0}, {"max_concurrent": 255}])
def test_bad_values_raise_config_error(tmp_path, kw):
    with pytest.raises(pccheck.ConfigError, match=next(iter(kw))):
        pccheck.Checkpointer(_arrays(), tmp_path / "ck", **kw)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_online_interval_follows_the_iteration_time(tmp_path, caplog):
    # A real loop: 8 MiB of arrays copied before maybe_checkpoint returns (B of a few ms), an
    # emulated iteration (sleep) of 40 ms, then of 2 ms. With q = 1.03 the interval must keep
    # B <= 0.03 f t, so shorter iterations need a longer interval. The exact values depend on the
    # machine; the direction and the formula do not.
    arrays = _arrays(8 * MiB)
    config.write_config(tmp_path / "ck", _doc(interval=10, max_concurrent=2, writer_threads=2,
                                              chunk_size=8 * MiB, max_overhead=1.03, iter_time=None, tw_s=None))
    taken: list[int] = []
    interval_at: dict[int, int] = {}  # step -> the interval maybe_checkpoint decided with
    with caplog.at_level(logging.DEBUG, logger="pccheck"):
        with pccheck.Checkpointer(arrays, tmp_path / "ck", interval="auto") as ck:
            step = 0
            for sleep, iters in ((0.04, 60), (0.002, 400)):
                for _ in range(iters):
                    step += 1
                    time.sleep(sleep)
                    arrays["w"][:1024] += 1  # the update
                    if ck.maybe_checkpoint(step):
                        taken.append(step)
                    interval_at[step] = ck.interval
                if sleep == 0.04:
                    slow_interval, slow_changes = ck.interval, len(ck.interval_changes)
            fast_interval = ck.interval
            changes = ck.interval_changes
    # the first estimates decide during the first phase: a new interval, or (rarely, when B lands
    # where eq. (3) gives 10 again) the same one, logged at debug level
    if "first estimates; interval stays 10" in caplog.text:
        assert slow_interval == 10 and (not changes or changes[0].reason != "first estimates")
    else:
        assert slow_changes >= 1 and changes[0].reason == "first estimates" and changes[0].old == 10
    assert len(changes) > slow_changes  # the change of t was seen during the second phase
    assert fast_interval > 2 * slow_interval
    for c in changes:  # each change is eq. (3) + the blocked term of the estimates it logged
        assert c.new == model.min_interval(c.tw_s, 2, 1.03, c.iter_time_s, c.blocked_s)
    assert any(c.iter_time_s < 0.02 for c in changes[slow_changes:])
    assert taken[0] == 10
    for a, b in zip(taken, taken[1:]):  # the next checkpoint once `interval` steps have passed
        f = interval_at[b]
        assert b - a >= f
        if len({interval_at[s] for s in range(a, b + 1)}) == 1:
            assert b - a == f  # not a step later than due
    assert f"checkpoint interval {changes[-1].old} -> {changes[-1].new}" in caplog.text
    assert pccheck.load_latest(tmp_path / "ck").step == taken[-1]
