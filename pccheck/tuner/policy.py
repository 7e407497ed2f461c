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

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from ..orchestrator.options import AUTO, EngineOptions
from .config import resolve_auto
from .online import OnlineTuner

__all__ = ["FixedInterval", "OnlineTuned", "SavePolicy", "Tuned", "choose_policy"]

log = logging.getLogger("pccheck")


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


@dataclass
class Tuned:
    """What :func:`choose_policy` resolved: the engine options with every "auto" replaced, the
    settings it came from, the online tuner (``interval="auto"`` in one process) and the policy."""

    engine: EngineOptions
    settings: dict[str, Any]
    tuner: OnlineTuner | None
    policy: SavePolicy


def choose_policy(path: Any, interval: int | str, engine: EngineOptions, group: Any, state_bytes: int | None,
                  spread_steps: int | str) -> Tuned:
    """Resolves "auto" (the interval and the engine's tuned fields: the choice
    ``pccheck-tune --write-config`` stored in ``PATH/pccheck-tune.json``, or the defaults) and
    picks the save policy. ``state_bytes`` None: the state may still grow (Adam's state appears
    at its first step), so the size check against the tuned size is left out."""
    settings = resolve_auto(path, interval, engine.max_concurrent, engine.writer_threads, engine.chunk_size,
                            state_bytes=state_bytes, spread_steps=spread_steps)
    engine = engine.with_values(settings)
    interval_now: int = settings["interval"]
    # Online mode: the tuner re-derives the interval from what it measures while training runs.
    # Ranks of a group must checkpoint the same steps, so they keep the tuned interval.
    tuner: OnlineTuner | None = None
    if interval == AUTO:
        if group is not None:
            log.info("pccheck: interval=\"auto\" in a group of %d ranks: the tuned interval %d is used without "
                     "online adaptation (every rank must checkpoint the same steps)", group.world_size, interval_now)
        else:
            tuner = OnlineTuner(interval_now, settings["max_overhead"], int(engine.max_concurrent),
                                iter_time=settings["iter_time_s"], tw=settings["tw_s"])
    policy: SavePolicy = OnlineTuned(tuner, interval_now) if tuner is not None else FixedInterval(interval_now)
    return Tuned(engine, settings, tuner, policy)
