"""A Checkpointer's GoCkpt mode: when to spread, over how many steps, and what it hands the
orchestrator (the front-end's side of :mod:`.driver`)."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from .driver import Spreader, SpreadResult, identity
from .plan import RECORDS, auto_steps, modelled_stall, split_budget
from .replay import check_replayable

__all__ = ["SpreadMode", "budget_split", "check_spread", "grad_bytes", "substitute"]

log = logging.getLogger("pccheck")


def check_spread(source: Any, optimizer: Any) -> None:
    """ConfigError unless ``spread_steps`` can work for this state: a model with an optimizer
    pccheck can replay exactly, not sharded (yet)."""
    from ..torch_state import TorchState

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
        if setting == "auto" and not self._grads_fit():
            self.k = 1  # the budget leaves no room for captured gradients: never spread
        elif setting == "auto" and tuned is not None:
            log.info("pccheck: spread_steps=\"auto\" starts from the tuned %d", tuned)
        self._learned_last: Any = None  # the newest finished checkpoint "auto" chose from
        self.spreader = Spreader(optimizer, getattr(copy_engine, "pace", None))
        self._calls: deque[float] = deque(maxlen=16)  # perf_counter of recent maybe_checkpoint calls
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
        self.spreader.begin(k)

    def finish(self) -> SpreadResult:
        return self.spreader.finish()

    def abandon(self) -> None:
        self.spreader.abandon()

    def close(self) -> None:
        self.spreader.close()

    # -- how many steps -----------------------------------------------------------------------------

    def steps_for_next(self, finished: Sequence[Any], interval: int) -> int:
        """k for the checkpoint about to begin: the ``spread_steps`` given, or "auto"'s, which is
        at most half the interval (a spread finishing and the next one beginning in the same call
        would make that call wait for the first one's replay). "auto": 1 until a checkpoint has
        finished and two iterations were timed (or the tuned k); then the stall model's choice
        from what was measured, chosen again whenever another checkpoint has finished (the
        online tuner's side of k)."""
        if self.setting != "auto":
            return int(self.setting)
        self._learn(finished)
        return min(self.k or 1, max(1, interval // 2))

    def _grads_fit(self) -> bool:
        return self.grad_budget is None or RECORDS * grad_bytes(self.optimizer) <= self.grad_budget

    def _learn(self, finished: Sequence[Any]) -> None:
        if not self._grads_fit():
            self.k = 1
            return
        done = [st for st in finished if st.outcome != "failed" and st.copied_s > 0]
        if not done or done[-1] is self._learned_last or len(self._calls) < 2:
            return
        self._learned_last = done[-1]
        # The link's bandwidth: the spread's own part copies, else a whole copy's wall time.
        bandwidth = self.spreader.copy_bandwidth()
        if bandwidth is None:
            whole = [st for st in done if st.spread_steps <= 1]
            if not whole:
                return
            bandwidth = whole[-1].nbytes / whole[-1].copied_s
        nbytes = done[-1].nbytes
        gaps = [b - a for a, b in zip(self._calls, list(self._calls)[1:])]
        iter_time = statistics.median(gaps)
        grads = grad_bytes(self.optimizer)
        step_time = self.spreader.step_time()
        fwd_bwd = max(0.0, iter_time - step_time)
        overlapped = not self.spreader.sync_grads
        k = auto_steps(nbytes, grads, bandwidth, fwd_bwd, step_time, self.grad_budget, overlapped=overlapped)
        why = (f"state {nbytes} B, gradients {grads} B, copy {bandwidth / 1e9:.2f} GB/s, forward/backward "
               f"{fwd_bwd:.3f} s, optimizer step {step_time:.3f} s")
        if self.k is None:
            self.k = k
            log.info("pccheck: spread_steps=\"auto\" picked %d (%s)", k, why)
            return
        if k == self.k:
            return
        # Hysteresis: move only for a clear gain (10% and 1 ms of modelled stall), not on noise.
        args = (nbytes, grads, bandwidth, fwd_bwd, step_time, overlapped)
        if modelled_stall(k, *args) < 0.9 * modelled_stall(self.k, *args) - 1e-3:
            log.info("pccheck: spread_steps=\"auto\" moves from %d to %d (%s)", self.k, k, why)
            self.k = k
