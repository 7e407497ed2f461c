"""GoCkpt mode through the Checkpointer: ``spread_steps=k`` checkpoints equal the live
state of the step that finishes them, bit for bit; a kill mid-spread keeps the previous one; a run
resumed from a spread checkpoint continues bit for bit. The replay itself: test_spread_replay.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pccheck
from pccheck.orchestrator.copy_engine import ThrottledCopyEngine
from pccheck.spread.mode import budget_split, grad_bytes
from pccheck.spread.plan import RECORDS, Unit, auto_steps, split, stall, stall_overlapped
from pccheck.spread.replay import ShadowOptimizer

HERE = Path(__file__).resolve()


def make(opt_name: str, seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
                                torch.nn.Linear(24, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    groups = [{"params": list(model[0].parameters()) + list(model[2].parameters())},
              {"params": list(model[4].parameters()) + list(model[5].parameters()) + list(model[6].parameters()),
               "lr": 3e-3}]
    if opt_name == "sgd":
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)
    elif opt_name == "adam-amsgrad":
        opt = torch.optim.Adam(groups, lr=1e-2, amsgrad=True)
    elif opt_name == "adamw":
        opt = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
    else:
        opt = torch.optim.AdamW(groups, lr=1e-2, amsgrad=True, foreach=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=3)
    return model, opt, sched, scaler


def train_step(model, opt, sched, scaler, s: int, set_to_none: bool = True) -> float:
    g = torch.Generator().manual_seed(1000 + s)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 4, generator=g)
    opt.zero_grad(set_to_none=set_to_none)
    loss = torch.nn.functional.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if s % 7 == 0:  # an inf gradient: GradScaler skips this step (no optimizer.step)
        model[0].weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.item()


def state_of(model, opt, sched, scaler) -> dict:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": v.clone() for k, v in st.items()})
    out["sched"] = sched.state_dict()
    out["scaler"] = scaler.state_dict()
    return out


def assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    bad = [k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])]
    assert not bad, f"differ: {bad}"


def run(path: Path, opt_name: str, k: int, steps: int, interval: int = 10, stop_after_finish: bool = True):
    model, opt, sched, scaler = make(opt_name)
    ck = pccheck.Checkpointer(model, opt, path=path, extra_state={"sched": sched, "scaler": scaler},
                              interval=interval, spread_steps=k)
    states = {}
    for s in range(1, steps + 1):
        train_step(model, opt, sched, scaler, s)
        ck.maybe_checkpoint(s)
        states[s] = state_of(model, opt, sched, scaler)
    ck.close()
    return states, ck.stats().as_dict()["checkpoints"]


def loaded(path: Path, opt_name: str):
    model, opt, sched, scaler = make(opt_name, seed=1)
    r = pccheck.load_latest(path, model=model, optimizer=opt, extra_state={"sched": sched, "scaler": scaler})
    return r.step, state_of(model, opt, sched, scaler)


@pytest.mark.parametrize("opt_name", ["sgd", "adam-amsgrad", "adamw", "adamw-amsgrad-foreach"])
@pytest.mark.parametrize("k", [2, 3, 7])
def test_a_spread_checkpoint_is_the_live_state_of_the_step_that_finishes_it(tmp_path, opt_name, k):
    # Begun at step 10 (a multiple of 7 lies inside for k = 7: step 14 is a skipped step, so that
    # spread ends one call later), finished by the call after k optimizer steps.
    states, stats = run(tmp_path, opt_name, k, 10 + k + (k == 7))
    spread = stats[-1]
    assert spread["outcome"] == "committed" and spread["spread_steps"] == k
    assert spread["grad_bytes"] > 0 and spread["replay_s"] > 0
    step, got = loaded(tmp_path, opt_name)
    assert step == 10 + k + (k == 7)
    assert_same(got, states[step])


def test_dropping_one_steps_gradients_breaks_the_equality(tmp_path, monkeypatch):
    """The negative control: the equality above can fail."""
    real, calls = ShadowOptimizer.replay, []

    def lossy(self, record):
        calls.append(1)
        if len(calls) != 2:
            real(self, record)
    monkeypatch.setattr(ShadowOptimizer, "replay", lossy)
    states, _ = run(tmp_path, "adamw", 3, 13)
    step, got = loaded(tmp_path, "adamw")
    assert step == 13
    with pytest.raises(AssertionError, match="differ"):
        assert_same(got, states[13])


def test_checkpoint_or_close_before_k_steps_finish_the_spread_early(tmp_path):
    model, opt, sched, scaler = make("adamw")
    ck = pccheck.Checkpointer(model, opt, path=tmp_path, extra_state={"sched": sched, "scaler": scaler},
                              interval=100, spread_steps=5)
    for s in range(1, 4):
        train_step(model, opt, sched, scaler, s)
    ck.checkpoint(3)                       # a spread over 5 steps begins
    train_step(model, opt, sched, scaler, 4)
    ck.maybe_checkpoint(4)
    ck.checkpoint(4)                       # finishes the first as step 4 (parts 3-5 copied now), begins another
    want4 = state_of(model, opt, sched, scaler)
    ck.wait()                              # finishes the second as step 4 too: no step since the last call
    stats = ck.stats().as_dict()["checkpoints"]
    # both are step 4: the second may commit first, and the first is then superseded (CHECK_ADDR
    # never moves back), never lost or failed
    outcomes = [c["outcome"] for c in stats]
    assert [c["step"] for c in stats] == [4, 4] and "committed" in outcomes, outcomes
    assert set(outcomes) <= {"committed", "superseded"}, outcomes
    train_step(model, opt, sched, scaler, 5)
    ck.checkpoint(5)
    train_step(model, opt, sched, scaler, 6)  # the optimizer steps, and no call follows: step unknown
    ck.close()                             # the spread of step 5 is abandoned with a warning
    assert [c["step"] for c in ck.stats().as_dict()["checkpoints"]] == [4, 4]
    step, got = loaded(tmp_path, "adamw")
    assert step == 4
    assert_same(got, want4)


def test_a_gradient_changed_under_its_background_copy_fails_that_checkpoint_only(tmp_path, caplog):
    """A step post-hook of the user's, which runs before pccheck's (registered first), zeroes the
    gradients in place while their copy over a slow link is still running (20 kB/s: the first
    part's gradients take ~0.14 s, far longer than the update and the hook): that spread is dropped
    (never saved wrong), later ones capture in the pre-hook and are exact. (zero_grad and the next
    backward come after pccheck's post-hook, which waits for the copies.)"""
    from pccheck.orchestrator.copy_engine import ThrottledCopyEngine

    model, opt, sched, scaler = make("adamw")
    opt.register_step_post_hook(lambda o, a, k: [p.grad.zero_() for p in model.parameters() if p.grad is not None])
    ck = pccheck.Checkpointer(model, opt, path=tmp_path, extra_state={"sched": sched, "scaler": scaler},
                              interval=10, spread_steps=2, on_error="log", copy_engine=ThrottledCopyEngine(20e3))
    for s in range(1, 23):
        train_step(model, opt, sched, scaler, s, set_to_none=False)
        ck.maybe_checkpoint(s)
    want = state_of(model, opt, sched, scaler)
    ck.close()
    outcomes = [(c["step"], c["outcome"]) for c in ck.stats().as_dict()["checkpoints"]]
    assert outcomes == [(12, "failed"), (22, "committed")], outcomes
    assert "modified in place while it was being captured" in caplog.text
    step, got = loaded(tmp_path, "adamw")
    assert step == 22
    assert_same(got, want)


def test_a_closure_step_or_bad_metadata_fail_only_that_spread(tmp_path, caplog):
    model, opt, sched, scaler = make("adamw")
    ck = pccheck.Checkpointer(model, opt, path=tmp_path, extra_state={"sched": sched, "scaler": scaler},
                              interval=5, spread_steps=2, on_error="log")
    for s in range(1, 8):
        if s == 6:  # inside the spread begun at 5: the closure recomputes gradients pccheck cannot see
            def closure():
                loss = model(torch.randn(8, 12)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                return loss
            opt.step(closure)
        else:
            train_step(model, opt, sched, scaler, s)
        ck.maybe_checkpoint(s)
    assert "step(closure) is not supported" in caplog.text
    for s in range(8, 13):
        train_step(model, opt, sched, scaler, s)
        with pytest.raises(pccheck.ConfigError) if s == 12 else contextlib.nullcontext():
            ck.maybe_checkpoint(s, metadata="not a mapping" if s == 12 else None)  # 12 finishes the spread of 10
    for s in range(13, 18):  # the spread of 15 is not held up by the one that failed at 12
        train_step(model, opt, sched, scaler, s)
        ck.maybe_checkpoint(s)
    want = state_of(model, opt, sched, scaler)
    ck.close()
    outcomes = [(c["step"], c["outcome"]) for c in ck.stats().as_dict()["checkpoints"]]
    assert outcomes == [(8, "failed"), (17, "committed")], outcomes  # step 7 is a GradScaler skip
    assert loaded(tmp_path, "adamw")[0] == 17
    assert_same(loaded(tmp_path, "adamw")[1], want)


def test_unsupported_optimizers_are_refused_before_anything_is_created(tmp_path):
    model = torch.nn.Linear(3, 3)
    for opt, what in ((torch.optim.Adagrad(model.parameters()), "Adagrad"),
                      (torch.optim.AdamW(model.parameters(), fused=True), "fused")):
        with pytest.raises(pccheck.ConfigError, match=f"(?s){what}.*spread_steps=1"):
            pccheck.Checkpointer(model, opt, path=tmp_path / "ck", spread_steps=3)
    with pytest.raises(pccheck.ConfigError, match="optimizer"):
        pccheck.Checkpointer(model, path=tmp_path / "ck", spread_steps=3)
    with pytest.raises(pccheck.ConfigError, match="auto"):
        pccheck.Checkpointer(model, torch.optim.SGD(model.parameters(), lr=0.1), path=tmp_path / "ck",
                             spread_steps="many")
    assert not (tmp_path / "ck").exists()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`:UserWarning")  # _spread_run's warm-up
def test_captured_gradients_count_against_dram_budget(tmp_path):
    model, opt, sched, scaler = make("adamw")
    g = grad_bytes(opt)
    assert g == sum(p.numel() * 4 for p in model.parameters())
    # An explicit k: RECORDS steps of gradients come off the pool's budget, or ConfigError.
    assert budget_split(3, opt, 1 << 20) == ((1 << 20) - RECORDS * g, RECORDS * g)
    assert budget_split(1, opt, 1 << 20) == (1 << 20, None)
    assert budget_split(3, opt, None) == (None, None)
    with pytest.raises(pccheck.ConfigError, match=f"raise dram_budget to at least {RECORDS * g + 4096}"):
        pccheck.Checkpointer(model, opt, path=tmp_path / "ck", spread_steps=3, dram_budget=RECORDS * g)
    assert not (tmp_path / "ck").exists()
    # "auto": only if the pool keeps half the budget; else it never spreads.
    assert budget_split("auto", opt, 4 * RECORDS * g) == (3 * RECORDS * g, RECORDS * g)
    assert budget_split("auto", opt, RECORDS * g + 4096) == (RECORDS * g + 4096, 0)
    # A link that needs 3 iterations for the state: unbounded, "auto" spreads; held to the budget, not.
    assert max(_spread_run(tmp_path / "free", "auto", 3.0, 1 << 20)) > 1  # (k from the first commit on)
    assert _spread_run(tmp_path / "tight", "auto", 3.0, RECORDS * g + 4096) == [1, 1, 1]


def _spread_run(path: Path, setting, link_iters: float | None, budget=None) -> list[int]:
    """30 iterations of 20 ms + a step, a checkpoint every 10; ``link_iters``: the copy link
    needs that many iterations for a snapshot, None: the CPU engine. The link (ThrottledCopyEngine)
    follows the iterations measured so far, so that a busy machine, whose iterations are longer,
    does not turn it into a fast link. (AdamW's gradients are 1/5 of the state here: at 3
    iterations the modelled stall of the best k is ~0.6x that of k = 1, clear of "auto"'s 0.9
    hysteresis. A fixed rate for ~6 iterations of an idle machine sat at ~0.86x: a link measured
    a little slower once kept k = 1.)"""
    model, opt, sched, scaler = make("adamw")
    extra = {"sched": sched, "scaler": scaler}
    for w in range(10):  # until AdamW's state exists (GradScaler skips the first, overflowing step)
        train_step(model, opt, sched, scaler, -w)
        if opt.state:
            break
    # full, as the spread Checkpointer below (an incremental slot's block-aligned nbytes is larger)
    with pccheck.Checkpointer(model, opt, path=path.with_name(path.name + "-probe"), extra_state=extra,
                              interval=1, spread_steps=1, incremental=False) as probe:
        probe.checkpoint(0)
    nbytes = probe.stats().as_dict()["checkpoints"][0]["nbytes"]  # what "auto" measures a copy by
    engine = ThrottledCopyEngine(1e9) if link_iters else None
    ck = pccheck.Checkpointer(model, opt, path=path, extra_state=extra, interval=10, spread_steps=setting,
                              dram_budget=budget, copy_engine=engine)
    iters: list[float] = []
    for s in range(1, 31):
        t0 = time.perf_counter()
        time.sleep(0.02)
        train_step(model, opt, sched, scaler, s)
        iters.append(time.perf_counter() - t0)
        if engine is not None:
            engine.bytes_per_s = nbytes / (link_iters * statistics.median(iters))
        ck.maybe_checkpoint(s)
    ck.close()
    return [c["spread_steps"] for c in ck.stats().as_dict()["checkpoints"]]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`:UserWarning")  # _spread_run's warm-up
def test_auto_starts_from_the_tuned_k_and_keeps_learning(tmp_path, caplog):
    from pccheck.tuner import config

    def tuned(path: Path, k: int) -> Path:
        chosen = {"interval": 10, "max_concurrent": 2, "writer_threads": 2, "chunk_size": 1 << 20, "spread_steps": k}
        config.write_config(path, {"format": config.FORMAT, "version": config.VERSION, "chosen": chosen})
        return path

    caplog.set_level("INFO", logger="pccheck")
    # pccheck-tune stored 3: the first checkpoint spreads at once (no k = 1 warm-up); a fast link
    # gives no clear reason to move
    assert _spread_run(tuned(tmp_path / "a", 3), "auto", None)[0] == 3
    assert 'starts from the tuned 3' in caplog.text
    # a tuned k, but the DRAM budget leaves no room for captured gradients: never spreads
    g = grad_bytes(make("adamw")[1])
    assert _spread_run(tuned(tmp_path / "c", 3), "auto", None, RECORDS * g + 4096) == [1, 1, 1]
    # stored 1, but the link measured while training needs 3 iterations per snapshot: k moves up
    ks = _spread_run(tuned(tmp_path / "b", 1), "auto", 3.0)
    assert ks[0] == 1 and max(ks[1:]) > 1, ks
    assert 'moves from 1 to' in caplog.text


def train_auto(path) -> pccheck.Checkpointer:
    """30 AdamW steps with spread_steps="auto", a checkpoint every 10; closed, for its stats."""
    model, opt, sched, scaler = make("adamw")
    ck = pccheck.Checkpointer(model, opt, path=path, extra_state={"sched": sched, "scaler": scaler},
                              interval=10, spread_steps="auto")
    for s in range(1, 31):
        train_step(model, opt, sched, scaler, s)
        ck.maybe_checkpoint(s)
        if s == 10:
            ck.wait()  # "auto" learns from finished checkpoints: step 10's, before step 20 begins
    ck.close()
    return ck


def test_auto_starts_with_one_then_picks_from_the_stall_model(tmp_path, caplog):
    caplog.set_level("INFO", logger="pccheck")
    stats = train_auto(tmp_path).stats().as_dict()["checkpoints"]
    assert stats[0]["spread_steps"] == 1
    assert "spread_steps=\"auto\" picked" in caplog.text
    # then the model's choices, as it picked and (on a clear gain) moved, within half the interval
    chosen = {int(k) for k in re.findall(r'"auto" (?:picked|moves from \d+ to) (\d+)', caplog.text)}
    # (steps_for_next caps k at interval // 2 = 5 for run()'s interval of 10)
    assert {c["spread_steps"] for c in stats[1:-1]} <= {min(k, 10 // 2) for k in chosen}, (stats, chosen)


def test_parts_are_balanced_by_bytes_on_tensor_boundaries():
    items = [Unit(0, i, None, (), n) for i, n in enumerate([100, 1, 1, 1, 50, 50, 1])]
    parts = split(items, 3)
    assert [[u.index for u in p] for p in parts] == [[0], [1, 2, 3, 4], [5, 6]]
    assert len(split(items[:2], 5)) == 2  # never more parts than units
    assert sum(len(p) for p in split(items, 7)) == len(items)


def test_stall_model_and_auto():
    gib = float(1 << 30)
    # S/(B t) = 4: k = 1 stalls S/B - t; spreading hides the copy and pays the gradients.
    assert stall(1, gib, gib / 3, gib / 0.2, 0.05) == pytest.approx(0.15)
    assert stall(4, gib, gib / 3, gib / 0.2, 0.05) == pytest.approx(0.2 / 3 * 5 / 2)
    # Mixed precision (r = 1/7) with a slow link: the paper's long spreads win.
    assert auto_steps(gib, gib / 7, gib / 1.0, 0.12) >= 5
    # A link fast enough for one iteration: no spreading.
    assert auto_steps(gib, gib / 3, gib / 0.01, 0.05) == 1
    # pccheck's overlapped gradient copies: the parts fit their steps from k = 4 on, and the
    # gradients ride beside the update (u = 0.09 s): no stall, so "auto" takes the smallest such k.
    assert stall_overlapped(4, gib, gib / 3, gib / 0.2, 0.05, 0.09) == 0.0
    assert stall_overlapped(3, gib, gib / 3, gib / 0.2, 0.05, 0.09) == pytest.approx(3 * (0.2 / 3 - 0.05))
    assert stall_overlapped(4, gib, gib / 3, gib / 0.2, 0.05, 0.05) == pytest.approx(0.2 / 3 - 0.05)
    assert auto_steps(gib, gib / 3, gib / 0.2, 0.05, 0.09) == 4
    # Two steps of gradients that do not fit the budget: no spreading.
    assert auto_steps(gib, gib / 7, gib / 1.0, 0.12, grad_budget=gib / 7) == 1


CHILD = """
import os, signal, sys, torch, pccheck
sys.path.insert(0, {tests!r})
from test_spread import make, train_step, state_of
path, mode = sys.argv[1], sys.argv[2]
model, opt, sched, scaler = make("adamw")
extra = {{"sched": sched, "scaler": scaler}}
start = 0
if mode == "resume":
    start = pccheck.load_latest(path, model=model, optimizer=opt, extra_state=extra).step
ck = pccheck.Checkpointer(model, opt, path=path, extra_state=extra, interval=10, spread_steps=3)
for s in range(start + 1, 31):
    loss = train_step(model, opt, sched, scaler, s)
    print("LOSS", s, repr(loss), flush=True)
    ck.maybe_checkpoint(s)
    if mode == "kill" and s == 13:
        ck.wait()
        torch.save(state_of(model, opt, sched, scaler), os.path.join(path, "..", "ref13.pt"))
    if mode == "kill" and s == 22:  # the spread begun at step 20 has two of its three parts
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
"""


def _child(path: Path, mode: str) -> subprocess.CompletedProcess:
    script = path.parent / "child.py"
    script.write_text(CHILD.format(tests=str(HERE.parent)))
    return subprocess.run([sys.executable, str(script), str(path), mode], capture_output=True, text=True,
                          timeout=240)


def test_sigkill_mid_spread_keeps_the_previous_checkpoint_and_a_resume_is_bitwise(tmp_path):
    path = tmp_path / "ck"
    full = _child(tmp_path / "full", "plain")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = _child(path, "kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    step, got = loaded(path, "adamw")
    assert step == 13
    assert_same(got, torch.load(tmp_path / "ref13.pt", weights_only=True))
    resumed = _child(path, "resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    losses = lambda out: {l.split()[1]: l.split()[2] for l in out.splitlines() if l.startswith("LOSS")}
    after = losses(resumed.stdout)
    assert sorted(after, key=int) == [str(s) for s in range(14, 31)]
    assert after == {s: v for s, v in losses(full.stdout).items() if int(s) >= 14}
