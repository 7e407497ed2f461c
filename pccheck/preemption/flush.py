"""One flush: the newest consistent state made durable on the disk, then committed on the tiers
after it, before a deadline. It runs on a thread of pccheck's (the controller's), never in a
signal handler.

Steps, each bounded by the deadline (``StepGate`` holds the training thread's
``maybe_checkpoint`` calls meanwhile)::

    1. gate.begin          no maybe_checkpoint call is inside; floor = the step of the last
                           one that returned
    2. (group) floors      every rank's floor; a rank behind the newest lets its calls up to it
                           run (let_through), so every rank's floor is the group's
    3. flush_beside        the memory tier commits its checkpoint in flight: its newest step
    4. candidate           the newest step this rank holds: the memory tier's, or the newest disk
                           checkpoint started; (group) the oldest of every rank's, so every rank
                           flushes the same step
    5. boundary            nothing holds the floor's state (no memory tier, or its interval
                           skipped it): the next maybe_checkpoint call takes a disk checkpoint
    6. disk                the step is durable already or in flight (wait for it), or is
                           persisted from the memory tier's committed slot, if the measured
                           rate says it fits (planner)
    7. after the disk      the remote tier uploads and commits it (whatever its ``every``), if
                           it fits; the history keeps it if its rule does
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .agree import Exchange
from .gate import StepGate
from .planner import measure, verdict
from .result import FlushResult, TierReach
from .source import held_checkpoint

__all__ = ["Notice", "run_flush"]

log = logging.getLogger("pccheck")


@dataclass(frozen=True)
class Notice:
    """What started a flush: ``cause``, and when (``t0``: time.monotonic(); ``wall``: time.time())."""

    cause: str
    t0: float
    wall: float
    signum: int | None = None


def _state_bytes(stack: Any) -> int:
    fin = stack.finished()
    return fin[-1].nbytes if fin else 0


def run_flush(stack: Any, gate: StepGate, notice: Notice, deadline: float, index: int,
              serve: Callable[[int], bool] | None = None) -> FlushResult:
    """Runs one flush of ``stack`` (a TierStack) and returns what each tier reached; ``index``:
    the how-many-th flush of this Checkpointer (the group's key namespace); ``serve``: the
    caller is the training thread, which takes a boundary checkpoint itself."""
    reach: dict[str, TierReach] = {}

    def done(step: int | None, floor: int | None, source: str) -> FlushResult:
        order = ["memory", "disk", *[t.name for t in stack.tiers if t.after_disk]]
        tiers = tuple(reach[n] if n in reach else TierReach(n, None, False, None, "not attempted")
                      for n in order if n == "disk" or stack.tier(n) is not None)
        return FlushResult(step, floor, source, notice.cause, tiers, notice.wall, time.monotonic() - notice.t0)

    def mark(name: str, step: int | None, target: int | None, note: str = "") -> None:
        ok = step is not None and target is not None and step >= target
        reach[name] = TierReach(name, step, ok, time.monotonic() - notice.t0 if ok else None, note)

    if stack.disk is None:  # a replica that never writes (replicated="rank0", rank != 0)
        return done(None, gate.last_returned, "none")
    if not gate.begin(deadline):
        log.warning("pccheck: flush: maybe_checkpoint still running at the deadline")
    floor = gate.last_returned
    ex = Exchange(stack.ctx.group, stack.epoch, index) if stack.coord is not None else None
    rates = measure(stack.finished(), getattr(stack.tier("remote"), "progress", None))
    nbytes = _state_bytes(stack)
    disk_need = verdict(nbytes, rates.disk_bps, deadline).need_s or 0.0

    # 2. the group's floor
    if ex is not None:
        floors = ex.all("floor", floor, deadline)
        if floors is None:
            log.warning("pccheck: flush: not every rank answered by the deadline; flushing alone")
            ex = None
        else:
            top = max((f for f in floors if f is not None), default=None)
            if top is not None and (floor is None or floor < top):
                gate.let_through(top, deadline - disk_need)
            floor = top

    # 3-4. the newest step held
    beside = stack.flush_beside(deadline)
    mem = beside.get("memory")
    held = [s for s in (mem, stack.started_step) if s is not None]
    step = max(held) if held else None
    if ex is not None:
        steps = ex.all("step", step, deadline)
        if steps is None:
            ex = None
        else:
            step = None if any(s is None for s in steps) else min(steps)
    source = "in flight"

    # 5. a checkpoint at the next step boundary
    if step is None or (floor is not None and step < floor):
        b = gate.ask_boundary(floor, deadline - disk_need, serve)
        if b is not None:
            step, source = b, "boundary"
        elif step is None:
            for name, s in beside.items():
                mark(name, s, None, "nothing to flush")
            return done(None, floor, "none")
    for name, s in beside.items():
        mark(name, s, step)

    # 6. the disk
    durable, started = stack.disk.last_durable_step, stack.started_step
    if durable is not None and durable >= step:
        note, wait = "durable before the notice", True
    elif started is not None and started >= step:
        note, wait = ("taken at the next step boundary" if source == "boundary" else "in flight at the notice"), True
    else:
        memory = stack.tier("memory")
        copy = held_checkpoint(memory.dir, step) if memory is not None else None
        v = verdict(copy.nbytes, rates.disk_bps, deadline) if copy is not None else None
        if copy is None:
            note, wait = f"no copy of step {step} on this rank", False
        elif not v.attempt:
            note, wait = v.note, False
        elif stack.persist(step, copy.arrays, copy.manifest.metadata, copy.manifest.tree, copy.crcs):
            source, nbytes = "memory", copy.nbytes
            note, wait = f"persisted from the memory tier ({v.note})", True
        else:
            note, wait = "skipped: every in-flight permit was busy (when_busy='skip')", False
        del copy
    reached = wait and stack.disk_reached(step, deadline)
    if wait and not reached:
        note += "; not durable by the deadline"
    mark("disk", stack.disk.last_durable_step, step if reached else None, note)

    # 7. after the disk
    if reached:
        after = [t.name for t in stack.tiers if t.after_disk]
        go = []
        for name in after:
            v = verdict(nbytes, rates.remote_bps if name == "remote" else None, deadline)
            (go.append(name) if v.attempt else mark(name, None, None, v.note))
        for name, s in stack.flush_after(deadline, step, go).items():
            progress = getattr(stack.tier(name), "progress", None)
            err = getattr(progress, "error", None)
            mark(name, s, step, "" if s is not None and s >= step else f"not committed by the deadline{': ' + err if err else ''}")
    result = done(step, floor, source)
    log.warning("pccheck: flush of step %s (%s, %s): %s in %.2f s", step, source, notice.cause,
                ", ".join(f"{t.tier} {'reached' if t.reached else 'missed'}" for t in result.tiers), result.took_s)
    return result
