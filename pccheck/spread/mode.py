"""A Checkpointer's GoCkpt mode: when to spread, over how many steps, and what it hands the
orchestrator (the front-end's side of :mod:`.driver`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import replace
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..orchestrator.stats import SpreadDecision
from .driver import Spreader, SpreadResult, identity
from .plan import RECORDS, auto_steps, modelled_stall, split_budget
from .replay import check_replayable

__all__ = ["SpreadMode", "budget_split", "check_spread", "grad_bytes", "substitute"]

log = logging.getLogger("pccheck")

LINK_SAMPLES = 5  # one-step checkpoints whose copy rates "auto" takes the median of


def check_spread(source: Any, optimizer: Any) -> None:
    """ConfigError unless ``spread_steps`` can work for this state: a model with an optimizer
    pccheck can replay exactly, not sharded (yet)."""
    from ..state.torch_state import TorchState

    if not isinstance(source, TorchState) or optimizer is None:
        raise ConfigError("spread_steps needs a torch.nn.Module with its optimizer (the later steps are replayed "
                          "from its captured gradients); use spread_steps=1")
    if source.sharded:
        raise ConfigError("spread_steps does not support sharded (DTensor) state yet; use spread_steps=1")
    check_replayable(optimizer)


def grad_bytes(optimizer: Any) -> int:
    """Bytes of one step's gradients: every parameter the optimizer updates."""
    return sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"] if p.requires_grad)


def budget_split(setting: int | str, optimizer: Any, dram_budget: int | None) -> tuple[int | None, int | None]:
    """:func:`.plan.split_budget` for this optimizer's gradients: (the chunk pool's budget, the
    captured gradients' budget)."""
    if dram_budget is None or setting == 1:
        return dram_budget, None
    return split_budget(setting, grad_bytes(optimizer), dram_budget)


def substitute(arrays: Mapping[str, Any], res: SpreadResult) -> dict[str, Any]:
    """The snapshot's arrays with every live parameter and optimizer state tensor of the spread
    replaced by its shadow tensor, and every other live tensor (buffers, extra state, parameters
    outside the optimizer) cloned now: nothing of the result is live memory, so the orchestrator
    may copy any of it, in any chunk, once the replay is done (Orchestrator.start's ``hold``)."""
    sub = res.substitute
    out = {}
    for name, a in arrays.items():
        key = identity(a) if hasattr(a, "untyped_storage") else None
        if key is not None and key in sub:
            out[name] = sub[key]
        else:
            out[name] = a.detach().clone() if hasattr(a, "detach") else a.copy()
    return out


class SpreadMode:
    """Spread checkpoints for one Checkpointer (``spread_steps`` an int > 1 or "auto")."""

    def __init__(self, setting: int | str, optimizer: Any, grad_budget: int | None, copy_engine: Any = None,
                 tuned: int | None = None) -> None:
        self.setting = setting
        # "auto": None until learned (or the k pccheck-tune stored, ``tuned``), then re-learned
        # as checkpoints finish (steps_for_next).
        self.optimizer = optimizer
        self.grad_budget = grad_budget  # budget_split's: bytes of captured gradients "auto" may use
        self.k: int | None = (tuned if setting == "auto" else int(setting))
        # "auto": the newest choice and why (k None: the warm-up's k = 1); ``decision``: the one
        # the latest steps_for_next returned (interval cap applied), None for a fixed setting.
        self._decision = SpreadDecision(1, "warm-up")
        if setting == "auto" and not self._grads_fit():
            self.k = 1  # the budget leaves no room for captured gradients: never spread
            self._decision = SpreadDecision(1, "no budget")
        elif setting == "auto" and tuned is not None:
            log.info("pccheck: spread_steps=\"auto\" starts from the tuned %d", tuned)
            self._decision = SpreadDecision(tuned, "tuned")
        self.decision: SpreadDecision | None = None
        self._learned_last: Any = None  # the newest finished checkpoint "auto" chose from
        self._warmed = False  # the shadow buffers were warmed once (poll)
        self._polled: Any = None  # the newest finished checkpoint poll has seen
        self._active_decision: SpreadDecision | None = None  # the active spread's (begin)
        self.spreader = Spreader(optimizer, getattr(copy_engine, "pace", None))
        self._calls: deque[float] = deque(maxlen=16)  # perf_counter of recent maybe_checkpoint calls (reported)
        self._last_step: int | None = None
        self._steps_at_call = 0

    # -- the calls ----------------------------------------------------------------------------------

    def on_call(self, step: int) -> None:
        """A maybe_checkpoint call: the end of an iteration (timed for "auto")."""
        self._calls.append(time.perf_counter())
        self.mark(step)

    def mark(self, step: int) -> None:
        """Any checkpoint call: the state stands at ``step`` now (what wait/close finish as)."""
        self._last_step = step
        self._steps_at_call = self.spreader.steps_total

    def active(self) -> bool:
        return self.spreader.active is not None

    def ready(self) -> bool:
        return self.spreader.ready()

    def finishable_as(self) -> int | None:
        """The step an unfinished spread would hold if finished now: the last call's, if the
        optimizer has not stepped since; else None."""
        if self._last_step is None or self.spreader.steps_total != self._steps_at_call:
            return None
        return self._last_step

    def begin(self, k: int) -> None:
        self._active_decision = self.decision
        self.spreader.begin(k)

    def finish(self) -> SpreadResult:
        """Ends the active spread; its stats carry the decision it began with."""
        res = self.spreader.finish()
        res.stats["spread_decision"] = self._active_decision
        return res

    def step_begins(self) -> None:
        """An optimizer step begins (the soft copy-on-write pre-hook, before it waits)."""
        self.spreader.step_begins()

    def abandon(self) -> None:
        self.spreader.abandon()

    def close(self) -> None:
        self.spreader.close()

    # -- how many steps -----------------------------------------------------------------------------

    def steps_for_next(self, finished: Sequence[Any], interval: int) -> int:
        """k for the checkpoint about to begin: the ``spread_steps`` given, or "auto"'s, which is
        at most half the interval (a spread finishing and the next one beginning in the same call
        would make that call wait for the first one's replay). "auto": 1 until a checkpoint has
        finished and an optimizer step's window was timed (or the tuned k); then the stall model's
        choice from what was measured, chosen again whenever another checkpoint has finished (the
        online tuner's side of k). :attr:`decision` says why."""
        if self.setting != "auto":
            self.decision = None
            return int(self.setting)
        self._learn(finished)
        d = self._decision
        k = min(d.k, max(1, interval // 2))
        self.decision = d if k == d.k else replace(d, k=k, reason="interval cap")
        return k

    def poll(self, finished: Sequence[Any]) -> None:
        """Between checkpoints (each maybe_checkpoint call): "auto" learns from a checkpoint as
        soon as it has finished, and a k > 1 (learned or given) warms the shadow buffers beside
        training, so that the first spread neither faults its pages in while training waits nor
        measures that as the link."""
        if self.setting == "auto" and finished and finished[-1] is not self._polled:
            self._polled = finished[-1]  # (once per finished checkpoint: this runs every iteration)
            self._learn(finished)
        if not self._warmed and (self.k or 1) > 1 and self.optimizer.state:
            self._warmed = True
            self.spreader.warm()

    def _grads_fit(self) -> bool:
        return self.grad_budget is None or RECORDS * grad_bytes(self.optimizer) <= self.grad_budget

    def _link(self, finished: Sequence[Any]) -> tuple[float, str, int] | None:
        """(bytes/s, source, samples): the copy link as the newest checkpoints measured it. After a
        spread, the median rate of its part copies into touched buffers; after a one-step
        checkpoint, the median rate of the last few one-step copies (the copy alone: the wait for a
        permit and the preparation left out), the first checkpoint's left out once there is
        another (the chunk pool may still have been faulting its pages in)."""
        last = finished[-1]
        parts = self.spreader.copy_bandwidth()
        if last.spread_steps > 1 and parts is not None:
            return parts[0], "parts", parts[1]
        whole = [st for st in list(finished)[-LINK_SAMPLES - 1:]
                 if st.outcome != "failed" and st.spread_steps <= 1 and st.copied_s > 0]
        if len(whole) > 1 and whole[0] is finished[0]:
            whole = whole[1:]
        rates = [st.nbytes / max(1e-9, st.copied_s - st.prepare_s - st.stall_s) for st in whole[-LINK_SAMPLES:]]
        if rates:
            return statistics.median(rates), "whole", len(rates)
        return (parts[0], "parts", parts[1]) if parts is not None else None

    def _replay_step(self, finished: Sequence[Any], step_time: float) -> tuple[float, str]:
        """(seconds, source): R, the CPU replay of one optimizer step over the whole state, for
        :func:`.plan.replay_backpressure`. "spread": the median over the last spreads of their
        replay wall time over the (k+1)/2 whole-state steps it replayed (part j replays k-j+1 of
        the k steps); before any, "live step": the live optimizer step when the parameters are on
        the CPU (the replay runs the same kernels over the same bytes); else "none" (0: a GPU's
        step says nothing about the CPU's; the first spread measures it)."""
        spreads = [st.replay_s / ((st.spread_steps + 1) / 2) for st in list(finished)[-LINK_SAMPLES:]
                   if st.spread_steps > 1 and st.outcome != "failed" and st.replay_s > 0]
        if spreads:
            return statistics.median(spreads), "spread"
        on_cpu = all(p.device.type == "cpu" for g in self.optimizer.param_groups for p in g["params"])
        return (step_time, "live step") if on_cpu and step_time > 0 else (0.0, "none")

    def _learn(self, finished: Sequence[Any]) -> None:
        if not self._grads_fit():
            self.k = 1
            self._decision = SpreadDecision(1, "no budget")
            return
        last = next((st for st in reversed(finished) if st.outcome != "failed" and st.copied_s > 0), None)
        window = self.spreader.window_time()
        if last is None or last is self._learned_last or window is None:
            return
        link = self._link(finished)
        if link is None:
            return
        self._learned_last = last
        bandwidth, source, samples = link
        grads = grad_bytes(self.optimizer)
        step_time = self.spreader.step_time()
        overlapped = not self.spreader.sync_grads
        replay, replay_source = self._replay_step(finished, step_time)
        args = (last.nbytes, grads, bandwidth, window, step_time, overlapped, replay)
        best = auto_steps(*args[:5], self.grad_budget, overlapped=overlapped, replay_step_s=replay)
        k, reason = best, "model"
        # Hysteresis: move only for a clear gain (10% and 1 ms of modelled stall), not on noise.
        if self.k is not None and best != self.k and not (
                modelled_stall(best, *args) < 0.9 * modelled_stall(self.k, *args) - 1e-3):
            k, reason = self.k, "hysteresis"
        iters = list(self._calls)
        self._decision = SpreadDecision(
            k, reason, best_k=best, state_bytes=last.nbytes, grad_bytes=grads, link_bps=bandwidth,
            link_source=source, link_samples=samples, window_s=window, step_s=step_time,
            iter_s=statistics.median(b - a for a, b in zip(iters, iters[1:])) if len(iters) > 1 else 0.0,
            replay_step_s=replay, replay_source=replay_source,
            model_stall_s=modelled_stall(k, *args), model_stall_k1_s=modelled_stall(1, *args))
        if k != self.k:
            why = (f"state {last.nbytes} B, gradients {grads} B, copy {bandwidth / 1e9:.2f} GB/s ({source}, "
                   f"{samples} copies), window {window:.3f} s, optimizer step {step_time:.3f} s, "
                   f"replay of a step {replay:.3f} s ({replay_source})")
            if self.k is None:
                log.info("pccheck: spread_steps=\"auto\" picked %d (%s)", k, why)
            else:
                log.info("pccheck: spread_steps=\"auto\" moves from %d to %d (%s)", self.k, k, why)
            self.k = k
