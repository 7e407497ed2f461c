"""The CPU shadow optimizer of spread mode (pccheck/spread/replay.py).

A small model trains on the CPU with two param groups of different lr, an LR scheduler that
changes lr every step and gradient clipping. At step k its parameters are copied in n parts, part j
at version k+j-1 (before step k+j), exactly as spread mode does; the live optimizer's step pre-hook
records the gradients of the copied parts and the group hyperparameters, the shadow replays them,
and after step k+n every copied parameter and optimizer state tensor (``step`` included) must be
torch.equal to the live one, in the very tensors that were handed to the shadow.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from pccheck.errors import ConfigError
from pccheck.spread.replay import ShadowOptimizer, StepRecord, check_replayable

K = 2  # the checkpointed step


class _Net(nn.Module):
    """8 parameters in 4 layers, plus ``extra``: it has a gradient only on steps divisible by 3,
    so its state starts empty at K and its ``step`` counter lags the others."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 12),
                                     nn.Linear(12, 3)])
        self.extra = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < 3:
                x = torch.tanh(x)
        return x + self.extra if t % 3 == 0 else x


def _groups(model: _Net, lr: float) -> list[dict[str, Any]]:
    first = [p for layer in model.layers[:2] for p in layer.parameters()]
    rest = [p for layer in model.layers[2:] for p in layer.parameters()] + [model.extra]
    return [{"params": first, "lr": lr}, {"params": rest, "lr": lr / 2}]


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum_maximize": lambda g, fe: torch.optim.SGD(g, lr=0.1, momentum=0.9, dampening=0.1,
                                                           weight_decay=1e-2, maximize=True,
                                                           foreach=fe),
    "sgd_nesterov": lambda g, fe: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True,
                                                  weight_decay=1e-2, foreach=fe),
    # no weight decay: foreach nesterov then adds the momentum into p.grad in place
    "sgd_nesterov_nowd": lambda g, fe: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True,
                                                       foreach=fe),
    "adam": lambda g, fe: torch.optim.Adam(g, lr=1e-2, weight_decay=1e-2, foreach=fe),
    "adam_amsgrad_maximize": lambda g, fe: torch.optim.Adam(g, lr=1e-2, amsgrad=True,
                                                            maximize=True, foreach=fe),
    "adamw": lambda g, fe: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, foreach=fe),
    "adamw_amsgrad": lambda g, fe: torch.optim.AdamW(g, lr=1e-2, weight_decay=0.1, amsgrad=True,
                                                     foreach=fe),
}


def _train(name: str, foreach: bool | None, n: int, *, skip: int | None = None,
           drop: int | None = None, cosine: bool = False):
    """Trains K+n steps with parts copied as spread mode does; returns (live model, live optimizer,
    the copies handed to the shadow: key -> (param, state dict, tensors held at add time))."""
    torch.manual_seed(0)
    model = _Net()
    live_params = {(g, i): p for g, grp in enumerate(_groups(model, 1.0)) for i, p in
                   enumerate(grp["params"])}
    opt = OPTIMIZERS[name](_groups(model, 0.1 if name.startswith("sgd") else 1e-2), foreach)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12) if cosine
             else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8))
    keys = sorted(live_params)
    parts = [keys[j::n] for j in range(n)]
    copied: set[tuple[int, int]] = set()
    records: dict[int, StepRecord] = {}
    shadow: ShadowOptimizer | None = None
    held: dict[tuple[int, int], tuple[torch.Tensor, dict, dict]] = {}
    t = 0

    def pre_hook(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if copied:  # grads after GradScaler unscale and clipping: the ones the step uses
            grads = {k: live_params[k].grad.detach().clone() for k in copied
                     if live_params[k].grad is not None}
            hparams = [{k: v for k, v in grp.items() if k != "params"} for grp in o.param_groups]
            records[t] = StepRecord(hparams, grads)

    opt.register_step_pre_hook(pre_hook)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    for t in range(1, K + n + 1):  # optimizer step t makes version t
        if K < t:  # part j = t - K is copied at version t - 1, before step t
            if shadow is None:
                shadow = ShadowOptimizer(opt)
            entries = []
            for key in parts[t - K - 1]:
                p = live_params[key].detach().clone()
                state = {s: v.clone() for s, v in opt.state[live_params[key]].items()}
                entries.append((key[0], key[1], p, state))
                held[key] = (p, state, dict(state))
            shadow.add_part(entries)
            copied.update(parts[t - K - 1])
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x, t), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        if t != skip:  # a skipped step (GradScaler found inf): no pre-hook, no record
            opt.step()
        sched.step()
        if t in records and t != drop:
            shadow.replay(records.pop(t))
    return live_params, opt, held


def _mismatches(live_params, opt, held) -> list[str]:
    bad = []
    assert len(held) == len(live_params)
    for key, (p, state, at_add) in held.items():
        live_p = live_params[key]
        if not torch.equal(p, live_p.detach()):
            bad.append(f"{key} param")
        live_state = opt.state[live_p]
        if set(state) != set(live_state):
            bad.append(f"{key} state keys {sorted(state)} != {sorted(live_state)}")
            continue
        for s, v in state.items():
            if not torch.equal(v, live_state[s]):
                bad.append(f"{key} state {s}")
        # in place: the tensors handed to the shadow are still the state's tensors
        bad += [f"{key} state {s} replaced" for s, v in at_add.items() if state[s] is not v]
    return bad


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_replay_matches_live_state_bit_for_bit(name, foreach, n):
    live_params, opt, held = _train(name, foreach, n, cosine=(n % 2 == 1))
    assert _mismatches(live_params, opt, held) == []
    if name.startswith("adam"):  # step counters differ per parameter (extra lags) and matched
        steps = {float(opt.state[p]["step"]) for p in live_params.values()}
        assert len(steps) == 2


@pytest.mark.parametrize("name", ["sgd_nesterov", "adamw_amsgrad"])
def test_foreach_none_matches(name):
    assert _mismatches(*_train(name, None, 3)) == []


@pytest.mark.parametrize("name", ["sgd_momentum_maximize", "adam", "adamw_amsgrad"])
@pytest.mark.parametrize("foreach", [False, True])
def test_skipped_step_has_no_record_and_still_matches(name, foreach):
    assert _mismatches(*_train(name, foreach, 3, skip=K + 2)) == []


@pytest.mark.parametrize("name", ["sgd_momentum_maximize", "adamw"])
def test_dropping_one_records_step_breaks_the_match(name):
    """Negative control: the comparison can fail."""
    bad = _mismatches(*_train(name, False, 3, drop=K + 2))
    assert any(b.endswith("param") for b in bad)


def test_replay_leaves_no_grads_and_refuses_unknown_parameters():
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(_groups(model, 1e-2))
    shadow = ShadowOptimizer(opt)
    p = model.layers[0].weight.detach().clone()
    shadow.add_part([(0, 0, p, {})])
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    shadow.replay(StepRecord(hparams, {(0, 0): torch.ones_like(p)}))
    assert p.grad is None and shadow.keys == {(0, 0)}
    with pytest.raises(ConfigError, match="no part added"):
        shadow.replay(StepRecord(hparams, {(1, 0): torch.ones(12, 12)}))
    with pytest.raises(ConfigError, match="already added"):
        shadow.add_part([(0, 0, p.clone(), {})])
    with pytest.raises(ConfigError, match="no parameter 9"):
        shadow.add_part([(1, 9, p.clone(), {})])
    with pytest.raises(ConfigError, match="missing"):
        shadow.replay(StepRecord([{"lr": 0.1}, {"lr": 0.1}], {}))


def test_global_step_hooks_do_not_run_on_the_shadow():
    calls = []
    handle = register_optimizer_step_pre_hook(lambda o, a, k: calls.append(type(o).__name__))
    try:
        live_params, opt, held = _train("adam", False, 3)
    finally:
        handle.remove()
    assert len(calls) == K + 3  # the live steps only
    assert _mismatches(live_params, opt, held) == []


class _MyAdamW(torch.optim.AdamW):
    pass


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("make, expected", [
    (lambda: torch.optim.Adagrad(_params()), "torch.optim.adagrad.Adagrad"),
    (lambda: torch.optim.RMSprop(_params()), "only torch.optim.SGD, Adam and AdamW"),
    (lambda: torch.optim.LBFGS(_params()), "LBFGS"),
    (lambda: _MyAdamW(_params()), "_MyAdamW on the CPU: it subclasses AdamW"),
    (lambda: torch.optim.Adam(_params(), capturable=True), "capturable=True"),
    (lambda: torch.optim.Adam(_params(), lr=torch.tensor(0.01)), "lr is a Tensor: LR schedulers"),
    (lambda: torch.optim.AdamW(_params(), fused=True), "fused=True: under a GradScaler"),
    (lambda: torch.optim.SGD(_params(), lr=0.1, fused=True), "fused=True"),
    (lambda: torch.optim.SGD(_params(), lr=0.1, differentiable=True), "differentiable=True"),
])
def test_check_replayable_refuses(make, expected):
    opt = make()
    with pytest.raises(ConfigError, match="spread_steps=1") as info:
        check_replayable(opt)
    assert expected in str(info.value)
    with pytest.raises(ConfigError):
        ShadowOptimizer(opt)


def test_check_replayable_accepts_the_replayed_classes():
    for opt in (torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True, maximize=True),
                torch.optim.Adam(_params(), decoupled_weight_decay=True, foreach=True),
                torch.optim.AdamW(_params(), amsgrad=True, foreach=False)):
        check_replayable(opt)
