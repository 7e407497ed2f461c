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
                           rate says it fits (planner). Where the memory tier holds the step
                           and the disk does not yet, the remote tier (single process) starts
                           uploading it from the memory tier's slot first, if it fits, so the
                           upload runs beside the disk write instead of after it
    7. after the disk      the remote tier uploads and commits it (whatever its ``every``), if
                           it fits, from the disk's slot unless it started in 6; the history
                           keeps it if its rule does. A remote upload started in 6 is waited
                           for even if the disk missed: each tier's failure is its own line in
                           the result, never raised over the other
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import PCCheckError
from .agree import Exchange
from .gate import StepGate
from .planner import measure, verdict
from .result import FlushResult, TierReach
from .source import Held, held_checkpoint

__all__ = ["Notice", "run_flush"]

log = logging.getLogger("pccheck")


@dataclass(frozen=True)
class Notice:
    """What started a flush: ``cause``, and when (``t0``: time.monotonic(); ``wall``: time.time())."""

    cause: str
    t0: float
    wall: float
    signum: int | None = None


def run_flush(stack: Any, gate: StepGate, notice: Notice, deadline: float, index: int,
              serve: Callable[[int], bool] | None = None) -> FlushResult:
    """Runs one flush of ``stack`` (a TierStack) and returns what each tier reached; ``index``:
    the how-many-th flush of this Checkpointer (the group's key namespace); ``serve``: the
    caller is the training thread, which takes a boundary checkpoint itself."""
    return _Flush(stack, gate, notice, deadline, index, serve).run()


class _Flush:
    """The steps of the module docstring, one method each; ``reach`` collects each tier's end."""

    def __init__(self, stack: Any, gate: StepGate, notice: Notice, deadline: float, index: int,
                 serve: Callable[[int], bool] | None) -> None:
        self.stack, self.gate, self.notice, self.deadline, self.serve = stack, gate, notice, deadline, serve
        self.ex = Exchange(stack.ctx.group, stack.epoch, index) if stack.coord is not None else None
        self.reach: dict[str, TierReach] = {}
        self.floor: int | None = None
        self.source = "in flight"
        self.early: dict[str, float] = {}  # tiers after the disk started in step 6: when (s after the notice)

    def run(self) -> FlushResult:
        stack, gate, deadline = self.stack, self.gate, self.deadline
        if stack.disk is None:  # a replica that never writes (replicated="rank0", rank != 0)
            return self.done(None)
        if not gate.begin(deadline):
            log.warning("pccheck: flush: maybe_checkpoint still running at the deadline")
        self.floor = gate.last_returned
        self.say(f"held the training thread; floor {self.floor}")
        self.rates = measure(stack.finished(), getattr(stack.tier("remote"), "progress", None))
        self.nbytes = stack.state_bytes(0)
        self.disk_need = verdict(self.nbytes, self.rates.disk_bps, deadline).need_s or 0.0
        self.agree_floor()
        self.say(f"floor agreed: {self.floor}")
        step, beside = self.newest_held()
        self.say(f"step {step}; beside the disk: {beside}")
        if step is None or (self.floor is not None and step < self.floor):  # 5. the next step boundary
            b = gate.ask_boundary(self.floor, deadline - self.disk_need, self.serve)
            if b is not None:
                step, self.source = b, "boundary"
        for name, s in beside.items():
            self.mark(name, s, step, "" if step is not None else "nothing to flush")
        if step is None:
            return self.done(None)
        on_disk = self.to_disk(step)
        if on_disk:
            self.say(f"disk holds step {step}")
        if on_disk or self.early:
            self.after_disk(step, on_disk)
        result = self.done(step)
        log.warning("pccheck: flush of step %s (%s, %s): %s in %.2f s", step, self.source, self.notice.cause,
                    ", ".join(f"{t.tier} {'reached' if t.reached else 'missed'}" for t in result.tiers), result.took_s)
        return result

    def done(self, step: int | None) -> FlushResult:
        stack = self.stack
        order = ["memory", "disk", *[t.name for t in stack.tiers if t.after_disk]]
        tiers = tuple(self.reach[n] if n in self.reach else TierReach(n, None, False, None, "not attempted")
                      for n in order if n == "disk" or stack.tier(n) is not None)
        source = self.source if step is not None else "none"
        return FlushResult(step, self.floor if stack.disk is not None else self.gate.last_returned, source,
                           self.notice.cause, tiers, self.notice.wall, time.monotonic() - self.notice.t0)

    def say(self, what: str) -> None:
        log.debug("pccheck: flush: %s (%.3f s after the notice)", what, time.monotonic() - self.notice.t0)

    def mark(self, name: str, step: int | None, target: int | None, note: str = "",
             at_wall: float | None = None) -> None:
        """Records tier ``name``'s end: it holds ``step``, ``target`` wanted; ``at_wall``: the
        time.time() it committed (else: now, when the flush saw it)."""
        ok = step is not None and target is not None and step >= target
        at = None
        if ok:
            now = time.monotonic() - self.notice.t0
            at = now if at_wall is None else min(now, max(0.0, at_wall - self.notice.wall))
        self.reach[name] = TierReach(name, step, ok, at, note, self.early.get(name))

    def agree_floor(self) -> None:
        """2. In a group, every rank's floor becomes the newest one: a rank behind catches up."""
        if self.ex is None:
            return
        floors = self.ex.all("floor", self.floor, self.deadline)
        if floors is None:
            log.warning("pccheck: flush: not every rank answered by the deadline; flushing alone")
            self.ex = None
            return
        top = max((f for f in floors.values() if f is not None), default=None)
        if top is not None and (self.floor is None or self.floor < top):
            self.gate.let_through(top, self.deadline - self.disk_need)
        self.floor = top

    def newest_held(self) -> tuple[int | None, dict[str, int | None]]:
        """3-4. The tiers beside the disk commit; the newest step held here (a group: by all)."""
        beside = self.stack.flush_beside(self.deadline)
        held = [s for s in (beside.get("memory"), self.stack.started_step) if s is not None]
        step = max(held) if held else None
        if self.ex is not None:
            steps = self.ex.all("step", step, self.deadline)
            if steps is None:
                self.ex = None
            else:
                step = None if any(s is None for s in steps.values()) else min(steps.values())
        return step, beside

    def to_disk(self, step: int) -> bool:
        """6. The disk holds ``step`` durably (True), or why not is marked."""
        stack, deadline = self.stack, self.deadline
        durable, started = stack.disk.last_durable_step, stack.started_step
        if durable is not None and durable >= step:
            note, wait = "durable before the notice", True
        else:
            memory = stack.tier("memory")
            copy = held_checkpoint(memory.dir, step) if memory is not None else None
            if copy is not None:  # the disk does not hold it yet: the upload need not wait for it
                self.remote_from(copy, step)
            v = verdict(copy.nbytes, self.rates.disk_bps, deadline) if copy is not None else None
            if started is not None and started >= step:
                wait = True
                note = "taken at the step boundary" if self.source == "boundary" else "in flight at the notice"
            elif copy is None or v is None:
                note, wait = f"no copy of step {step} on this rank", False
            elif not v.attempt:
                note, wait = v.note, False
            else:
                try:
                    began = stack.persist(step, copy.arrays, copy.manifest.metadata, copy.manifest.tree, copy.crcs)
                except PCCheckError as exc:  # the disk's failure is the disk's line; the remote goes on
                    began, note = None, f"the disk write failed: {exc}"
                    log.warning("pccheck: flush: the disk write of step %d failed: %s", step, exc)
                if began:
                    self.source, self.nbytes = "memory", copy.nbytes
                    note, wait = f"persisted from the memory tier ({v.note})", True
                elif began is None:
                    wait = False
                else:
                    note, wait = "skipped: every in-flight permit was busy (when_busy='skip')", False
            del copy
        reached = wait and stack.disk_reached(step, deadline)
        if wait and not reached:
            note += "; not durable by the deadline"
        self.mark("disk", stack.disk.last_durable_step, step if reached else None, note,
                  stack.disk.last_durable_time if reached else None)
        return reached

    def remote_from(self, copy: Held, step: int) -> None:
        """6. The remote tier starts uploading ``step`` from the memory tier's committed slot
        ``copy`` now, beside the disk write, if its upload is expected to fit on its own (it
        does not wait for the disk). A group's remote tier uploads what rank 0 announces, from
        the disk's slots, once every rank committed the step: it is not started here."""
        remote = self.stack.tier("remote")
        if remote is None or "remote" in self.early or not getattr(remote, "uploads_from_memory", False):
            return
        from ..tiers.remote.upload import SlotRef  # the remote tier's own reference to a committed slot

        v = verdict(copy.nbytes, self.rates.remote_bps, self.deadline)
        if not v.attempt:
            return  # step 7 decides again (and lets an older upload finish)
        self.early["remote"] = time.monotonic() - self.notice.t0
        remote.flush_from(SlotRef(copy.file, copy.slot, copy.counter, step, disk=False), self.deadline)
        self.say(f"remote upload of step {step} started from the memory tier ({v.note})")

    def after_disk(self, step: int, on_disk: bool = True) -> None:
        """7. The tiers after the disk that fit take the disk's commit of ``step`` (``on_disk``
        False: the disk missed it; only the tiers started in step 6 are waited for)."""
        stack, go, skipped = self.stack, [], {}
        for t in stack.tiers:
            if t.after_disk and (on_disk or t.name in self.early):
                if t.name in self.early:
                    go.append(t.name)
                    continue
                v = verdict(self.nbytes, self.rates.remote_bps if t.name == "remote" else None, self.deadline)
                if v.attempt:
                    go.append(t.name)
                else:
                    skipped[t.name] = v.note
                    self.mark(t.name, None, None, v.note)
        for name, s in stack.flush_after(self.deadline, step, go).items():
            progress = getattr(stack.tier(name), "progress", None)
            err = getattr(progress, "error", None)
            began = getattr(stack.tier(name), "upload_started", lambda _: None)(step)
            if began is not None and name in self.early:  # when its upload itself began
                self.early[name] = max(0.0, began - self.notice.t0)
            how = "uploaded from the memory tier's slot beside the disk write" if name in self.early else ""
            self.mark(name, s, step, how if s is not None and s >= step else
                      "not committed by the deadline" + (f": {err}" if err else ""), getattr(progress, "time", None))
        # a tier whose flush does not fit finishes the older upload it has in progress, if it
        # can before the deadline: the machine may go, but a newer step than before is remote
        for name, s in stack.drain_after(self.deadline, list(skipped)).items():
            self.mark(name, s, step, skipped[name] + ("" if s is None else f"; it holds step {s}"))
