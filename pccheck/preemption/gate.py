"""The boundary between the training thread's ``maybe_checkpoint`` calls and a flush.

While no flush runs, :meth:`StepGate.call` only records the step of each call that returned
(the flush's floor). During a flush it holds every call at its start, so no checkpoint the
training thread starts can interleave with the flush's (invariant: a flush inspects and writes
the tiers only while the training thread is outside ``maybe_checkpoint``), except:

- calls up to a step the flush lets through (:meth:`let_through`: in a group, a rank that was a
  step behind when the notice came catches up with the others), and
- the first call after a step the flush asks a checkpoint at (:meth:`ask_boundary`: no tier
  held the newest state, so the next step boundary takes one); that call is told to take it
  (``forced``) and the flush is told its step.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["StepGate", "Boundary"]


class Boundary:
    """What :meth:`StepGate.call` yields: truthy when this call must take the flush's checkpoint
    (then report whether it did with :meth:`took`)."""

    def __init__(self, forced: bool) -> None:
        self.forced = forced
        self.started: bool | None = None

    def __bool__(self) -> bool:
        return self.forced

    def took(self, started: bool) -> bool:
        self.started = bool(started)
        return self.started


class StepGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._inside = False
        self._flushing = False
        self._through: int | None = None     # during a flush: calls up to this step pass
        self._ask_after: int | None = None   # during a flush: the first call after this step takes one
        self.boundary: int | None = None     # the step that call checkpointed (-1: it could not)
        self.last_returned: int | None = None
        self.trainer: int | None = None      # the thread that calls maybe_checkpoint

    # -- the training thread ---------------------------------------------------------------------

    def call(self, step: int) -> "_Call":
        return _Call(self, step)

    def _enter(self, step: int) -> Boundary:
        with self._cv:
            self.trainer = threading.get_ident()
            while self._flushing:
                if self._through is not None and step <= self._through:
                    break
                if self._ask_after is not None and step > self._ask_after and self.boundary is None:
                    self._inside = True
                    return Boundary(True)
                self._cv.wait()
            self._inside = True
            return Boundary(False)

    def _leave(self, step: int, b: Boundary, returned: bool) -> None:
        with self._cv:
            self._inside = False
            if returned and (self.last_returned is None or step > self.last_returned):
                self.last_returned = step
            if b.forced:
                self.boundary = step if b.started else -1
            self._cv.notify_all()

    # -- the flush thread ------------------------------------------------------------------------

    def begin(self, deadline: float) -> bool:
        """Holds new calls; returns once no call is inside (False: one still was at ``deadline``)."""
        with self._cv:
            self._flushing, self._through, self._ask_after, self.boundary = True, None, None, None
            return self._cv.wait_for(lambda: not self._inside, _left(deadline))

    def let_through(self, step: int, deadline: float) -> bool:
        """Lets calls up to ``step`` run until one of them returned (or ``deadline``), then
        holds calls again; True if the floor reached ``step``."""
        with self._cv:
            self._through = step
            self._cv.notify_all()
            ok = self._cv.wait_for(lambda: self.last_returned is not None and self.last_returned >= step,
                                   _left(deadline))
            self._through = None
            self._cv.wait_for(lambda: not self._inside, _left(deadline))
            return ok

    def ask_boundary(self, after: int | None, deadline: float,
                     serve: Callable[[int], bool] | None = None) -> int | None:
        """Asks the first call after ``after`` to take a checkpoint, and returns its step (None:
        no call came by ``deadline``, or it could not start one). ``serve``: the flush was asked
        for on the training thread itself, which is waiting for it: take it there, now, as
        ``after``'s step (the state is that step's: the loop is between two calls)."""
        if serve is not None:
            return after if after is not None and serve(after) else None
        with self._cv:
            self._ask_after = -1 if after is None else after
            self._cv.notify_all()
            self._cv.wait_for(lambda: self.boundary is not None, _left(deadline))
            self._ask_after = None
            self._cv.wait_for(lambda: not self._inside, _left(deadline))
            return self.boundary if self.boundary is not None and self.boundary >= 0 else None

    def end(self) -> None:
        with self._cv:
            self._flushing, self._through, self._ask_after = False, None, None
            self._cv.notify_all()


class _Call:
    def __init__(self, gate: StepGate, step: int) -> None:
        self.gate, self.step = gate, step

    def __enter__(self) -> Boundary:
        self.b = self.gate._enter(self.step)
        return self.b

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.gate._leave(self.step, self.b, exc_type is None)


def _left(deadline: float) -> float | None:
    return None if deadline == float("inf") else max(0.0, deadline - time.monotonic())
