"""The tuner's side while training runs: iteration reports for ``pccheck-tune``, and ``interval="auto"``.

The front-end reaches the tuner only through this module and :mod:`.config`. Two parts, both fed
by the training loop:

**Reports** (:func:`report_iteration`, :func:`state_bytes`; their public face is
:mod:`pccheck.tune`, which user scripts import). ``pccheck-tune -- python train.py`` runs the
script with ``$PCCHECK_TUNE_REPORT`` naming a file; each call appends one line
``<time.monotonic()> <state_bytes or -1>`` to it, from which the tuner measures the iteration time
t (and the checkpoint size m, when given). Without the variable, the call returns at once (one
dictionary lookup): it is safe to leave in a training script::

    import pccheck.tune
    for step in ...:
        train_step()
        pccheck.tune.report_iteration(state_bytes=pccheck.tune.state_bytes(model, optimizer))  # or no argument

A script that does not call it is timed by its Checkpointer instead: each ``maybe_checkpoint`` call
reports one iteration with the checkpoint size (:func:`report_from_checkpointer`), unless the
script reports for itself. Its checkpoints go on as usual; the tuner takes the median iteration
time, which the few iterations that checkpoint do not move.

**Online mode** (:class:`OnlineTuner`): keep measuring t and T_w during training and re-derive f.
The paper leaves this as future work (§3.4: "monitoring training throughput ... and adapt (3)
accordingly"). :class:`OnlineTuner` is fed the training loop's iteration timestamps and the
statistics of every finished checkpoint; when the measured iteration time t or write time T_w
drifts by more than ``threshold`` from the values the current interval was derived from, it
re-derives the interval with :func:`pccheck.tuner.model.min_interval` (eq. (3), plus the blocked-copy
term) and logs the change on the "pccheck" logger.

Estimates (robust to the iterations that contain a checkpoint, and to occasional pauses):

* t: over the last ``window`` iterations, (total time - time training was blocked by checkpoints
  that finished in that window) / iterations, but no more than the median iteration time (a pause,
  e.g. evaluation, does not count) and no less than a quarter of it.
* T_w: the median of the last ``ckpt_window`` checkpoints' ``persist_s - stall_s``.
* B, what a checkpoint costs training: the median of their ``blocked_copy_s + cow_wait_s``, or,
  when the interval is at least 3 (so the median iteration is a clean one), the iterations'
  excess over the median per checkpoint if that is larger: it also holds what the statistics do
  not (the snapshot, the copy's and the writers' interference with training). Each iteration
  counts at most 5 median iterations, so a pause (evaluation, a data-loader stall) does not pass
  for checkpoint cost. T_w and B are measured afresh when the interval changes (both depend on it).

Against flapping: a decision needs ``min_iterations`` iterations and ``min_checkpoints``
checkpoints since the previous one, and a change of more than ``threshold``. Once a drift is
seen, the samples are dropped and the new interval is derived from ``min_iterations`` /
``min_checkpoints`` fresh ones (so a change moves the interval once, not step by step, and a
momentary pause that is over by then changes nothing).
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from . import model

if TYPE_CHECKING:
    from ..orchestrator.stats import CheckpointStats

__all__ = ["ENV_VAR", "report_iteration", "report_from_checkpointer", "state_bytes", "OnlineTuner",
           "IntervalChange"]

log = logging.getLogger("pccheck")

ENV_VAR = "PCCHECK_TUNE_REPORT"


# -- iteration reports for pccheck-tune ------------------------------------------------------------

_lock = threading.Lock()
_fd: int = -1
_fd_path: str | None = None
_script_reports = False  # the script called report_iteration: the Checkpointer leaves it to it


def report_iteration(state_bytes: int | None = None) -> None:
    """Reports the end of one training iteration to ``pccheck-tune`` (no-op without
    ``$PCCHECK_TUNE_REPORT``). ``state_bytes``: the checkpoint size m, if the script knows it."""
    global _script_reports
    target = os.environ.get(ENV_VAR)
    if not target:
        return
    _script_reports = True
    _append(target, state_bytes)


def report_from_checkpointer(state_bytes: Callable[[], int | None]) -> None:
    """What ``Checkpointer.maybe_checkpoint`` calls once per iteration: reports it like
    :func:`report_iteration` while ``pccheck-tune`` times the script, unless the script reports
    its iterations itself (then this does nothing, so no iteration counts twice). ``state_bytes``
    is only called when the iteration is reported."""
    target = os.environ.get(ENV_VAR)
    if target and not _script_reports:
        _append(target, state_bytes())


def _append(target: str, state_bytes: int | None) -> None:
    global _fd, _fd_path
    line = f"{time.monotonic():.6f} {int(state_bytes) if state_bytes is not None else -1}\n".encode()
    with _lock:
        if target != _fd_path:
            if _fd >= 0:
                os.close(_fd)
            # O_APPEND: each short write lands whole at the end, whoever else appends.
            _fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            _fd_path = target
        os.write(_fd, line)


def state_bytes(module: Any, optimizer: Any = None) -> int:
    """Bytes of the tensors in ``module.state_dict()`` and ``optimizer.state_dict()`` (what a
    pccheck checkpoint of them holds, give or take the small JSON tree). Tied tensors count once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(x: Any) -> None:
        nonlocal total
        if hasattr(x, "untyped_storage") and hasattr(x, "element_size"):
            key = (x.untyped_storage().data_ptr(), x.storage_offset())
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                add(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)

    add(module.state_dict())
    if optimizer is not None:
        add(optimizer.state_dict().get("state", {}))
    return total


# -- online mode -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IntervalChange:
    """One re-derivation that changed the interval."""

    iteration: int        # iterations seen when it happened
    old: int
    new: int
    iter_time_s: float    # t estimate used
    tw_s: float           # T_w estimate used
    blocked_s: float      # B estimate used
    reason: str


class OnlineTuner:
    """Adapts the checkpoint interval while training runs.

    Args:
        interval: the interval in use now (iterations), e.g. from ``pccheck-tune.json``.
        q: the slowdown bound (>= 1), e.g. the stored ``max_overhead`` or 1.03.
        n: max_concurrent of the Checkpointer.
        threshold: relative drift of t or T_w that triggers a re-derivation (0.2 = 20%).
        iter_time, tw: the t and T_w (seconds) the current interval was derived from, if known
            (from the config); else the first estimates become the reference, and the interval
            is derived from them as soon as there are enough samples.
        window: iterations in the t estimate. ckpt_window: checkpoints in the T_w estimate.
        min_iterations, min_checkpoints: samples needed since the last decision.
        max_interval: upper bound on the derived interval.

    Call protocol (one thread drives the loop; ``on_checkpoint`` may come from another)::

        tuner.on_iteration(time.perf_counter())   # after every training iteration
        tuner.on_checkpoint(stats)                # for every finished checkpoint, once
        ck.interval = tuner.interval              # the interval to use from now on
    """

    def __init__(self, interval: int, q: float, n: int, threshold: float = 0.2, *,
                 iter_time: float | None = None, tw: float | None = None, window: int = 64,
                 ckpt_window: int = 8, min_iterations: int = 20, min_checkpoints: int = 3,
                 max_interval: int = 1_000_000) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"interval must be an integer >= 1, got {interval!r}")
        if not q >= 1:
            raise ConfigError(f"q must be >= 1 (a slowdown factor: 1.03 = 3%), got {q!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n must be an integer >= 1, got {n!r}")
        if not threshold > 0:
            raise ConfigError(f"threshold must be > 0 (0.2 = 20%), got {threshold!r}")
        if min_iterations < 2 or min_checkpoints < 1 or window < min_iterations or ckpt_window < 1:
            raise ConfigError("need window >= min_iterations >= 2, min_checkpoints >= 1 and ckpt_window >= 1")
        self._interval = interval
        self.q, self.n, self.threshold = float(q), n, float(threshold)
        self.min_iterations, self.min_checkpoints, self.max_interval = min_iterations, min_checkpoints, max_interval
        self._t_ref = iter_time if iter_time and iter_time > 0 else None
        self._tw_ref = tw if tw and tw > 0 else None
        self._lock = threading.Lock()
        self._last: float | None = None
        self._iters = 0
        self._dts: deque[float] = deque(maxlen=window)
        self._overhead: deque[tuple[int, float]] = deque()  # (iteration when reported, seconds blocked)
        self._tws: deque[float] = deque(maxlen=ckpt_window)
        self._blocked: deque[float] = deque(maxlen=ckpt_window)
        self._since_iters = 0
        self._since_ckpts = 0
        self._pending: str | None = None  # a drift seen; waiting for fresh samples
        self.changes: list[IntervalChange] = []

    @property
    def interval(self) -> int:
        """The interval (iterations) to use from now on."""
        return self._interval

    def estimates(self) -> dict[str, float | None]:
        """The current estimates of t, T_w and B in seconds (None until there are samples)."""
        with self._lock:
            return {"iter_time_s": self._t_est(), "tw_s": self._median(self._tws), "blocked_s": self._b_est()}

    def on_iteration(self, now: float) -> None:
        """Records the end of one training iteration at ``now`` (seconds, a monotonic clock such
        as ``time.perf_counter()``), and re-derives the interval when due."""
        with self._lock:
            if self._last is not None:
                dt = now - self._last
                if dt > 0:
                    self._dts.append(dt)
                    self._iters += 1
                    self._since_iters += 1
            self._last = now
            self._maybe_update()

    def on_checkpoint(self, stats: CheckpointStats) -> None:
        """Records one finished checkpoint (a :class:`pccheck.CheckpointStats`). Failed ones only
        count for the time they blocked training."""
        with self._lock:
            blocked = stats.blocked_copy_s + stats.cow_wait_s
            self._overhead.append((self._iters, stats.stall_s + blocked))
            if stats.outcome != "failed":
                self._tws.append(max(0.0, stats.persist_s - stats.stall_s))
                self._blocked.append(blocked)
                self._since_ckpts += 1

    # -- internals (called with the lock held) ---------------------------------------------------

    @staticmethod
    def _median(xs: deque[float]) -> float | None:
        return statistics.median(xs) if xs else None

    def _trim(self) -> None:
        """Drops the checkpoint costs reported before the iteration window starts."""
        first = self._iters - len(self._dts)
        while self._overhead and self._overhead[0][0] < first:
            self._overhead.popleft()

    def _t_est(self) -> float | None:
        if not self._dts:
            return None
        self._trim()
        blocked = sum(s for _, s in self._overhead)
        med = statistics.median(self._dts)
        mean_pure = (sum(self._dts) - blocked) / len(self._dts)
        return max(min(mean_pure, med), 0.25 * med)

    def _b_est(self) -> float | None:
        b = self._median(self._blocked)
        if b is None or self._interval < 3 or len(self._dts) < self.min_iterations:
            return b
        med = statistics.median(self._dts)
        excess = sum(min(d, 5.0 * med) for d in self._dts) - len(self._dts) * med
        return max(b, excess * self._interval / len(self._dts))  # per checkpoint issued in the window

    def _maybe_update(self) -> None:
        if (self._since_iters < self.min_iterations or len(self._dts) < self.min_iterations
                or self._since_ckpts < self.min_checkpoints or len(self._tws) < self.min_checkpoints):
            return
        t, tw, b = self._t_est(), self._median(self._tws), self._b_est()
        assert t is not None and tw is not None and b is not None
        if self._pending is not None:
            reason = self._pending  # re-measured from samples taken after the drift only
            self._pending = None
        elif self._t_ref is None or self._tw_ref is None:
            reason = "first estimates"
        else:
            dt_rel, dtw_rel = t / self._t_ref - 1.0, tw / self._tw_ref - 1.0
            if abs(dt_rel) <= self.threshold and abs(dtw_rel) <= self.threshold:
                return
            # Drift: the windows mix samples from before and after the change. Start them afresh
            # and decide once they hold only new samples, so the interval moves once, not in steps.
            self._pending = (f"t {self._t_ref:.4g} -> {t:.4g} s ({dt_rel:+.0%}), "
                             f"T_w {self._tw_ref:.4g} -> {tw:.4g} s ({dtw_rel:+.0%}) drifted")
            self._restart()
            log.debug("pccheck: online tuner: %s; re-measuring", self._pending)
            return
        self._t_ref, self._tw_ref = t, tw
        self._since_iters = self._since_ckpts = 0
        if self.q > 1:
            new = model.min_interval(tw, self.n, self.q, t, b)
        else:
            new = model.interval_eq3(tw, self.n, self.q, t)
        new = max(1, min(new, self.max_interval))
        if new == self._interval:
            log.debug("pccheck: online tuner: %s; interval stays %d", reason, new)
            return
        old, self._interval = self._interval, new
        self._restart()  # T_w and B depend on the interval: measure them afresh
        self.changes.append(IntervalChange(self._iters, old, new, t, tw, b, reason))
        log.info("pccheck: online tuner: checkpoint interval %d -> %d iterations (%s; t %.4g s, T_w %.4g s, "
                 "blocked %.4g s, N %d, q %g)", old, new, reason, t, tw, b, self.n, self.q)

    def _restart(self) -> None:
        """Forget the samples; the next decision waits for min_iterations / min_checkpoints new ones."""
        self._dts.clear()
        self._overhead.clear()
        self._tws.clear()
        self._blocked.clear()
        self._since_iters = self._since_ckpts = 0
