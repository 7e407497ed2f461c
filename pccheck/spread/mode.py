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
from .plan import RECORDS, auto_steps
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


MIN_POOL = 4096  # the smallest chunk pool (one chunk of one block)


def budget_split(setting: int | str, optimizer: Any, dram_budget: int | None) -> tuple[int | None, int | None]:
    """``dram_budget`` shared between the chunk pool and a spread's captured gradients:
    (the pool's budget, the gradients' budget).

    A spread holds the captured gradients of at most RECORDS steps at once (driver.py), so it
    takes RECORDS x one step's gradient bytes off the pool's budget. An explicit ``spread_steps``
    whose gradients leave less than MIN_POOL raises ConfigError; "auto" takes them only if the
    pool keeps at least half the budget, else it never spreads (gradient budget 0). No
    ``dram_budget`` (the default pool, 2x the state): (None, None), the gradients come on top."""
    if dram_budget is None or setting == 1:
        return dram_budget, None
    need = RECORDS * grad_bytes(optimizer)
    pool = dram_budget - need
    if setting == "auto":
        return (pool, need) if pool >= max(MIN_POOL, dram_budget // 2) else (dram_budget, 0)
    if pool < MIN_POOL:
        raise ConfigError(f"spread_steps={setting} holds up to {need} bytes of captured gradients ({RECORDS} steps), "
                          f"which leave {max(0, pool)} of dram_budget={dram_budget} bytes for the chunk pool "
                          f"(at least {MIN_POOL} needed); raise dram_budget to at least {need + MIN_POOL} "
                          "or use spread_steps=1")
    return pool, need


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

    def __init__(self, setting: int | str, optimizer: Any, grad_budget: int | None, copy_engine: Any = None) -> None:
        self.setting = setting
        self.k: int | None = None if setting == "auto" else int(setting)
        self.optimizer = optimizer
        self.grad_budget = grad_budget  # budget_split's: bytes of captured gradients "auto" may use
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
        """k for the checkpoint about to begin. "auto": 1 until a checkpoint has finished and two
        iterations were timed; then the stall model's choice from them, kept from then on, and
        at most half the interval (a spread finishing and the next one beginning in the same
        call would make that call wait for the first one's replay)."""
        if self.k is not None:
            return self.k if self.setting != "auto" else min(self.k, max(1, interval // 2))
        done = [st for st in finished if st.outcome != "failed" and st.copied_s > 0]
        if not done or len(self._calls) < 2:
            return 1
        st = done[-1]
        bandwidth = st.nbytes / st.copied_s  # the whole copy's wall time: the link's pace
        gaps = [b - a for a, b in zip(self._calls, list(self._calls)[1:])]
        iter_time = statistics.median(gaps)
        grads = grad_bytes(self.optimizer)
        step_time = self.spreader.step_time()
        fwd_bwd = max(0.0, iter_time - step_time)
        self.k = auto_steps(st.nbytes, grads, bandwidth, fwd_bwd, step_time, self.grad_budget,
                            overlapped=not self.spreader.sync_grads)
        log.info("pccheck: spread_steps=\"auto\" picked %d (state %d B, gradients %d B, copy %.2f GB/s, "
                 "forward/backward %.3f s, optimizer step %.3f s)", self.k, st.nbytes, grads, bandwidth / 1e9,
                 fwd_bwd, step_time)
        return min(self.k, max(1, interval // 2))
