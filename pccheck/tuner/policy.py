"""When a checkpoint is due: the save-decision policies ``Checkpointer.maybe_checkpoint`` asks
(as Orbax's ``save_decision_policy.py`` does for its CheckpointManager).

- :class:`FixedInterval` (``DiskOptions(every=int)``, and ``"auto"`` in a group): every
  ``interval`` steps, ``step % interval == 0``.
- :class:`OnlineTuned` (``DiskOptions(every="auto")`` in one process): the online tuner's interval
  (:class:`~pccheck.tuner.online.OnlineTuner`, re-derived while training runs), counted from
  the last checkpoint taken.

A policy owns the current ``interval`` (``Checkpointer.interval`` reads and sets it). ``due(step)``
is asked once per ``maybe_checkpoint`` call; ``taken(step)`` is told once that call's checkpoint
started.
"""

from __future__ import annotations

import time
from typing import Protocol

from .online import OnlineTuner

__all__ = ["FixedInterval", "OnlineTuned", "SavePolicy"]


class SavePolicy(Protocol):
    """What ``maybe_checkpoint`` asks: is ``step`` due, and which steps were taken."""

    interval: int

    def due(self, step: int) -> bool: ...

    def taken(self, step: int) -> None: ...


class FixedInterval:
    """Due when ``step % interval == 0`` (the paper's fixed interval)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def taken(self, step: int) -> None:
        """Nothing to remember: the rule depends on the step alone."""


class OnlineTuned:
    """``DiskOptions(every="auto")``: each call ends a training iteration for the tuner, which may change the
    interval; a checkpoint is due once ``interval`` steps have passed since the last one taken (the
    first, or after the steps restarted, when ``step % interval == 0``)."""

    def __init__(self, tuner: OnlineTuner, interval: int) -> None:
        self.tuner = tuner
        self.interval = interval
        self.last_taken: int | None = None  # step of the newest checkpoint maybe_checkpoint took

    def due(self, step: int) -> bool:
        self.tuner.on_iteration(time.perf_counter())  # the iteration ends here, before any blocking
        self.interval = self.tuner.interval
        last = self.last_taken
        if last is None or step <= last:  # the first call, or the steps restarted (a new loop)
            return step % self.interval == 0
        return step - last >= self.interval

    def taken(self, step: int) -> None:
        self.last_taken = step
