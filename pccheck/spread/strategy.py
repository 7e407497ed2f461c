"""How a checkpoint's snapshot is made: at once (:class:`PlainSnapshots`), or spread over k
optimizer steps (:class:`SpreadSnapshots`, GoCkpt mode).

A step goes one way: the save policy decides whether the step is due, the strategy makes the
snapshots as :class:`Take` objects and hands each, in order, to ``sink`` (the tiers' start,
given at construction; it returns whether the disk started it). Its calls, from the Checkpointer:

    on_call(step, finished, metadata)   every maybe_checkpoint call: a spread that ends at this
                                        call (k steps since it began) is finished as ``step``
    due(step, finished, interval, metadata) -> bool
                                        a checkpoint of ``step`` is asked for; True once one
                                        started (or a spread began, finished k steps later)
    settle()                            wait/close: a spread still gathering is finished as the
                                        last call's step (abandoned if the optimizer stepped since)
    close()

Invariant: a finished spread is handed to ``sink`` before the next spread begins (``begin``
waits for the previous spread's bytes to be copied out of the shadow, which only the started
checkpoint does).

``finished`` is the disk's finished checkpoints' stats (what "auto" learns the link from).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..orchestrator.args import StartArgs
from .mode import SpreadMode, substitute

__all__ = ["Take", "PlainSnapshots", "SpreadSnapshots"]

log = logging.getLogger("pccheck")


@dataclass
class Take:
    """One snapshot for the tiers: ``arrays`` of ``step`` with its start arguments (``epoch`` is
    filled in by the tier stack's caller). ``abort`` runs when the disk did not start it (skipped
    or failed), so what the snapshot holds is given back."""

    step: int
    arrays: Mapping[str, Any]
    args: StartArgs
    metadata: Mapping[str, Any] | None = None  # the call's own, beside the Checkpointer's
    abort: Callable[[], None] = field(default=lambda: None)


class PlainSnapshots:
    """The whole snapshot at the due step; soft copy-on-write copies most of it later."""

    def __init__(self, source: Any, soft_cow: bool, sink: Callable[[Take], bool]) -> None:
        self.source, self.soft_cow, self.sink = source, soft_cow, sink

    def on_call(self, step: int, finished: Sequence[Any], metadata: Mapping[str, Any] | None) -> None:
        """Nothing ends at a call: a whole snapshot is taken when due."""

    def due(self, step: int, finished: Sequence[Any], interval: int, metadata: Mapping[str, Any] | None) -> bool:
        return self.sink(self.take(step, metadata))

    def take(self, step: int, metadata: Mapping[str, Any] | None, extra_stats: dict[str, Any] | None = None) -> Take:
        snap = self.source.snapshot()
        return Take(int(step), snap.arrays, StartArgs(
            tree=snap.tree, n_eager=snap.n_eager if self.soft_cow else None,
            validate=snap.validate if self.soft_cow else None, extra_stats=extra_stats), metadata)

    def settle(self) -> None:
        """Nothing gathers between calls."""

    def close(self) -> None:
        """Nothing to stop."""


class SpreadSnapshots(PlainSnapshots):
    """GoCkpt mode over :class:`~pccheck.spread.mode.SpreadMode`: a due step begins a spread of
    k steps (k from the stall model with ``spread_steps="auto"``), finished by the call k
    optimizer steps later; with k = 1 the snapshot is taken whole."""

    def __init__(self, source: Any, soft_cow: bool, sink: Callable[[Take], bool], mode: SpreadMode) -> None:
        super().__init__(source, soft_cow, sink)
        self.mode = mode

    def on_call(self, step: int, finished: Sequence[Any], metadata: Mapping[str, Any] | None) -> None:
        self.mode.on_call(step)
        self.mode.poll(finished)
        if self.mode.ready():  # k steps since it began: this call's step finishes it
            self.sink(self._finish(step, metadata))

    def due(self, step: int, finished: Sequence[Any], interval: int, metadata: Mapping[str, Any] | None) -> bool:
        self.mode.mark(step)
        if self.mode.active():  # not finished by a maybe_checkpoint call: finish it now
            self.sink(self._finish(step, metadata))
        k = self.mode.steps_for_next(list(finished), interval)
        if k > 1 and not self.source.may_grow():
            self.mode.begin(k)  # finished by the call after k optimizer steps
            return True
        decision = self.mode.decision
        return self.sink(self.take(step, metadata, {"spread_decision": decision} if decision is not None else None))

    def settle(self) -> None:
        if not self.mode.active():
            return
        last = self.mode.finishable_as()
        if last is None:
            log.warning("pccheck: the spread checkpoint in progress is abandoned: the optimizer stepped after the "
                        "last maybe_checkpoint call, so the step it would hold is unknown")
            self.mode.abandon()
        else:
            self.sink(self._finish(last, None))

    def close(self) -> None:
        self.mode.close()

    def _finish(self, step: int, metadata: Mapping[str, Any] | None) -> Take:
        """The active spread, ended as ``step``: the live part of the state (buffers, extra state,
        RNGs, anything outside the optimizer) is cloned now; all of it goes to DRAM chunks once the
        shadow's replay is done; then the usual write and commit."""
        res = self.mode.finish()
        try:
            snap = self.source.snapshot()
            arrays = substitute(snap.arrays, res)
        except BaseException:
            res.copied.set()  # the next spread still waits for the replay (hold) before reusing the shadow
            raise
        return Take(int(step), arrays, StartArgs(
            tree=snap.tree, n_eager=0, validate=res.failed, hold=res.hold, copied=res.copied, cow_wait=res.waited_s,
            extra_stats=res.stats), metadata, abort=res.copied.set)
