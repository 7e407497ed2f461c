"""GoCkpt mode for a Checkpointer: one snapshot spread over several optimizer steps.

A spread checkpoint begun after step k copies part j of the parameters and their optimizer state
(:mod:`.plan`) into pccheck's own CPU buffers (the *shadow*) while step k+j's forward and backward
run; step k+j's update waits only for part j. From then on, each optimizer step's gradients of
every part already copied, and each param group's hyperparameters, are captured in the step
pre-hook (after GradScaler's unscale and any clipping: what the update really uses; copied beside
the step, as GoCkpt-O does, and checked against the gradient's version counter) and replayed
on the shadow by the CPU shadow optimizer (:mod:`.replay`) on a checkpoint thread, in step order.
After k steps every part stands at the live version; the user's next ``maybe_checkpoint`` /
``checkpoint`` call (which comes after the scheduler's step and carries the data position)
finishes it: the small live state (buffers, extra state, RNGs) is copied then, and the shadow
goes through the orchestrator's usual write and CAS commit as that call's step.

Invariants:
- A part is copied from live memory only between optimizer steps: its copy starts after step
  k+j-1's update (post-hook) and step k+j's update waits for it (pre-hook), like soft
  copy-on-write.
- The replay thread sees, in this order: part j's tensors, then step k+j's record (which holds
  the gradients of parts 1..j). So a part is updated by exactly the steps after its copy.
- A step that GradScaler skips never calls ``optimizer.step()``: no hook runs, nothing is
  recorded, nothing replayed, as in the live state.
- The shadow is written only by the copier and the replay thread of the active spread; the
  orchestrator reads it only after ``hold`` is set (the replay is done). A new spread reuses the
  shadow only after the previous one's bytes are all in DRAM chunks (``copied``).
"""

from __future__ import annotations

import logging
import os
import queue
import statistics
from collections import deque
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import shutdown
from .plan import RECORDS, Unit, split, units
from .replay import ShadowOptimizer, StepRecord, check_replayable

__all__ = ["Spreader", "SpreadResult", "identity"]

log = logging.getLogger("pccheck")

REPLAY_NICE = 0  # the replay thread's nice value: see _replay_loop
COPY_THREADS = 2  # two threads reach ~20 GB/s memcpy on touched pages here, one ~11 GB/s
# The training thread's waits of a spread, by cause (_Spread.waits; CheckpointStats.spread_waits)
WAITS = ("previous", "parts", "replay", "grads")


class _Modified(Exception):
    """A gradient changed in place under its background copy."""


def _stream_event(optimizer: Any) -> Any:
    """An event recorded on the current CUDA stream when the parameters live on a GPU (copy
    threads wait on it: the hooks run once the kernels are queued, not done), else None."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.device.type == "cuda":
                import torch

                return torch.cuda.current_stream(p.device).record_event()
            return None
    return None


def identity(t: Any) -> tuple:
    """What names a tensor's memory (a parameter and its detached view share it)."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


@dataclass
class SpreadResult:
    """What a finished spread hands the orchestrator: the arrays to substitute, and the events."""

    substitute: dict[tuple, Any]  # identity(live tensor) -> its shadow tensor at the final version
    hold: threading.Event        # set once the replay is done (the shadow may be read)
    copied: threading.Event      # set by the orchestrator once the shadow's bytes are in chunks
    stats: dict[str, Any]        # spread_steps, grad_bytes, replay_s (replay_s filled when done)
    waited_s: float              # what the training thread waited for this spread (its cow_wait_s)
    problem: list[str] = field(default_factory=list)  # a capture, copy or replay failure

    def failed(self) -> str | None:
        """The spread's failure, if any (the orchestrator's validate: it fails the checkpoint)."""
        return "; ".join(self.problem) or None


@dataclass
class _Spread:
    """One spread checkpoint in progress (owned by the training thread, except where noted)."""

    parts: list[list[Unit]]
    copies: list[Future]          # part j's copy into the shadow (done before step k+j updates)
    shadow: ShadowOptimizer       # used by the replay thread only
    handed: int = 0               # parts handed to the replay thread (0..handed-1)
    pending: list = field(default_factory=list)  # this step's gradient copies (the post-hook waits)
    stepped: int = 0              # optimizer steps taken since it began
    grad_bytes: int = 0
    replay_s: float = 0.0         # written by the replay thread (wall time)
    replay_cpu_s: float = 0.0     # written by the replay thread (its own CPU time)
    # Where the training thread's waits went, parts of the spread's cow_wait_s (the rest is the
    # capture loop itself and finish's hand-over): the previous spread (begin), part copies
    # (pre-hook and finish), the replay's back-pressure (RECORDS steps of gradients already
    # waiting), this step's gradient copies (post-hook).
    waits: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WAITS, 0.0))
    failure: list[str] = field(default_factory=list)  # written by the replay thread


class Spreader:
    """Drives spread checkpoints for one model and optimizer (``Checkpointer(spread_steps=k)``)."""

    def __init__(self, optimizer: Any, pace: Callable[[int, float], None] | None = None) -> None:
        check_replayable(optimizer)
        self.optimizer = optimizer
        self._pace = pace  # the copy engine's rate (an emulated link), applied to part and gradient copies
        self.active: _Spread | None = None
        self._buffers: dict[tuple[int, int, str | None], Any] = {}  # (group, index, key) -> CPU tensor
        self._last_done: tuple[threading.Event, ...] = ()  # the previous spread's hold and copied
        self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="pccheck-spread-copy")
        # Parts and step records for the replay thread, in order. At most RECORDS steps'
        # gradients wait for it (the pre-hook blocks, and that wait counts as stall, when it lags).
        self._queue: queue.Queue[Any] = queue.Queue()
        self._records = threading.Semaphore(RECORDS)
        # Gradients are copied in the pre-hook itself, before the update, for SGD (its foreach
        # Nesterov path adds the momentum into .grad in place during the update) and once a
        # gradient changed under its background copy; else beside the update.
        self.sync_grads = type(optimizer).__name__ == "SGD"
        self._replayer = shutdown.thread(self._replay_loop, "pccheck-spread-replay")
        self.waited_s = 0.0           # pre-hook waits of the active spread
        self.steps_total = 0          # optimizer steps since this Spreader was made
        self._step_began: float | None = None
        self._step_ended: float | None = None
        self._step_times: deque[float] = deque(maxlen=16)  # recent optimizer steps' durations ("auto")
        # Recent windows between optimizer steps: a step's end (post-hook) to the next step's begin,
        # before any checkpoint wait in the pre-hooks: the forward/backward a copy hides in ("auto").
        self._windows: deque[float] = deque(maxlen=16)
        # (bytes, seconds) of recent part copies into buffers that were already touched: a copy
        # that first allocated (page-faulted) its buffers measures the kernel, not the link.
        self._part_copies: deque[tuple[int, float]] = deque(maxlen=32)
        self._buffers_lock = threading.Lock()  # _buffers and _grad_pool: the copy, warm and replay threads
        # (group, index) -> free CPU gradient buffers (at most RECORDS each): captures reuse them
        self._grad_pool: dict[tuple[int, int], list[Any]] = {}
        # Keys that ever had a gradient buffer made (by a capture or by _warm). Invariant: _warm
        # fills only keys not in it, so buffers in use by a record are never doubled by a warm-up
        # (free + in use stays <= RECORDS per parameter, the bytes the budget counts).
        self._grad_made: set[tuple[int, int]] = set()
        self._warming: Future | None = None
        self._pre = optimizer.register_step_pre_hook(self._before_step)
        self._post = optimizer.register_step_post_hook(self._after_step)

    # -- a spread checkpoint's life --------------------------------------------------------------

    def begin(self, k: int) -> None:
        """Starts a spread over ``k`` steps: part 1's copy begins now (the caller holds no other
        spread)."""
        assert self.active is None
        t0 = time.perf_counter()
        for done in self._last_done:  # the previous spread's replay is over and its shadow in DRAM chunks
            done.wait()
        previous = time.perf_counter() - t0
        items = units(self.optimizer)
        parts = split(items, k)
        self.waited_s = previous
        self.active = _Spread(parts, [self._copier.submit(self._copy_part, parts[0], _stream_event(self.optimizer))],
                              ShadowOptimizer(self.optimizer))
        self.active.waits["previous"] = previous

    def ready(self) -> bool:
        """True once every part is copied and stepped to the live version (finish may run)."""
        sp = self.active
        return sp is not None and sp.stepped >= len(sp.parts)

    def finish(self) -> SpreadResult:
        """Ends the active spread at the live version: parts not copied yet are copied now (the
        caller waits for them), and the replay of what was captured goes on in the background."""
        sp = self.active
        assert sp is not None
        t0 = time.perf_counter()
        for j in range(len(sp.copies), len(sp.parts)):  # finished early (checkpoint(), wait(), close())
            sp.copies.append(self._copier.submit(self._copy_part, sp.parts[j]))
        while sp.handed < len(sp.parts):                # parts not handed to the replay yet
            self._hand(sp)
        self.waited_s += time.perf_counter() - t0
        hold, copied = threading.Event(), threading.Event()
        with self._buffers_lock:
            buffers = dict(self._buffers)
        shadow = {identity(t): buffers.get((u.group, u.index, key))
                  for part in sp.parts for u in part for key, t in u.tensors(self.optimizer.state)}
        result = SpreadResult({k: v for k, v in shadow.items() if v is not None}, hold, copied,
                              {"spread_steps": len(sp.parts), "grad_bytes": sp.grad_bytes, "replay_s": 0.0,
                               "replay_cpu_s": 0.0, "spread_waits": sp.waits},
                              self.waited_s, sp.failure)
        self._queue.put(("done", sp, result))
        self._last_done = (hold, copied)
        self.active = None
        return result

    def abandon(self) -> None:
        """Drops the active spread (its step is unknown); the shadow is free once the replay
        thread has passed what was queued."""
        sp = self.active
        if sp is None:
            return
        for f in sp.copies:
            f.exception()  # wait; a failed copy does not matter to a dropped spread
        done = threading.Event()
        self._queue.put(("flush", done))
        self._last_done = (done,)
        self.active = None

    # -- the optimizer hooks (training thread) ----------------------------------------------------

    def step_time(self) -> float:
        """The median of the last optimizer steps' durations (pre-hook to post-hook), 0 if none."""
        times = sorted(self._step_times)
        return times[len(times) // 2] if times else 0.0

    def window_time(self) -> float | None:
        """The median of the last windows between optimizer steps (a step's end to the next one's
        begin, checkpoint waits left out): the forward/backward a copy can hide in. None if none."""
        return statistics.median(self._windows) if self._windows else None

    def copy_bandwidth(self) -> tuple[float, int] | None:
        """(bytes per second, copies) of the recent part copies into touched buffers: the median
        of their rates (the link, with what shares it); None if there are none."""
        rates = [n / s for n, s in self._part_copies if s > 0]
        return (statistics.median(rates), len(rates)) if rates else None

    def step_begins(self) -> None:
        """An optimizer step begins: closes the window since the previous one ended. The soft
        copy-on-write pre-hook calls it before it waits, the spread's pre-hook again (a no-op then)."""
        if self._step_ended is not None:
            self._windows.append(time.perf_counter() - self._step_ended)
            self._step_ended = None

    def warm(self) -> None:
        """Allocates and touches the shadow buffers of a spread and its gradient buffers on a copy
        thread, beside training, so that the first spread's part copies neither fault pages on the way
        (a stall) nor read as a slow link. Idempotent; a no-op while one is running."""
        if self._warming is not None and not self._warming.done():
            return
        self._warming = self._copier.submit(self._warm, units(self.optimizer))

    def _warm(self, items: list[Unit]) -> None:
        import torch

        for u in items:
            for key, t in u.tensors(self.optimizer.state):
                if self._buffer(u, key, t, create=False) is None:
                    buf = torch.zeros(t.shape, dtype=t.dtype, device="cpu")  # touched: every page faulted in now
                    with self._buffers_lock:
                        old = self._buffers.get((u.group, u.index, key))
                        if old is None or old.shape != t.shape or old.dtype != t.dtype:
                            self._buffers[(u.group, u.index, key)] = buf
            key = (u.group, u.index)
            if u.param.requires_grad:  # and the gradient pool: RECORDS buffers (what the budget counts)
                with self._buffers_lock:
                    if key in self._grad_made:
                        continue
                    self._grad_made.add(key)
                fresh = [torch.zeros(u.param.shape, dtype=u.param.dtype, device="cpu") for _ in range(RECORDS)]
                with self._buffers_lock:
                    self._grad_pool.setdefault(key, []).extend(fresh)

    def _buffer(self, u: Unit, key: str | None, t: Any, create: bool = True) -> Any:
        """The shadow buffer of ``u``'s tensor ``key`` (like ``t``): the one held, else a new one
        (``create``) or None."""
        import torch

        with self._buffers_lock:
            buf = self._buffers.get((u.group, u.index, key))
            if buf is not None and buf.shape == t.shape and buf.dtype == t.dtype:
                return buf
            if not create:
                return None
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            self._buffers[(u.group, u.index, key)] = buf
            return buf

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step_begins()
        sp = self.active
        if sp is not None:
            t0 = time.perf_counter()
            try:
                # torch passes the step's own arguments, self first; a closure recomputes the gradients inside
                if kwargs.get("closure") is not None or (len(args) > 1 and args[1] is not None):
                    raise ValueError("optimizer.step(closure) is not supported with spread_steps > 1")
                self._capture(sp, optimizer)
            except Exception as exc:  # never break the training step: this checkpoint fails instead
                log.exception("pccheck: capturing a step for a spread checkpoint failed")
                sp.failure.append(f"capturing a step failed: {exc!r}")
            self.waited_s += time.perf_counter() - t0
        self._step_began = time.perf_counter()  # the update itself is timed from here ("auto")

    def _capture(self, sp: _Spread, optimizer: Any) -> None:
        if sp.handed <= sp.stepped and sp.handed < len(sp.parts):
            self._hand(sp)  # the part copied during this step's forward/backward
        copied = sp.parts[:sp.handed]
        ready = _stream_event(optimizer)
        grads: dict[tuple[int, int], Future] = {}
        t0 = time.perf_counter()
        self._records.acquire()  # at most RECORDS steps' gradients wait for the replay
        sp.waits["replay"] += time.perf_counter() - t0
        try:
            for part in copied:
                for u in part:
                    g = u.param.grad
                    if g is None:
                        continue
                    g = g.detach()  # shares the gradient's version counter
                    if self.sync_grads:
                        f: Future = Future()
                        f.set_result(self._copy_grad(g, g._version, ready, (u.group, u.index)))
                    else:  # copied beside the update (GoCkpt-O); the post-hook waits for it
                        f = self._copier.submit(self._copy_grad, g, g._version, ready, (u.group, u.index))
                    grads[(u.group, u.index)] = f
                    sp.grad_bytes += g.numel() * g.element_size()
        except BaseException:
            self._records.release()
            raise
        sp.pending = list(grads.values())
        hparams = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        self._queue.put(("step", sp, hparams, grads))

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_total += 1
        if self._step_began is not None:
            self._step_times.append(time.perf_counter() - self._step_began)
        sp = self.active
        if sp is None:
            self._step_ended = time.perf_counter()  # the window to the next step opens
            return
        # Invariant: this step's gradient copies end before the user's code runs again (the next
        # zero_grad or backward may change gradients in place); the update itself reads them only.
        t0 = time.perf_counter()
        for f in sp.pending:
            f.exception()
        sp.pending = []
        sp.waits["grads"] += time.perf_counter() - t0
        self.waited_s += time.perf_counter() - t0
        sp.stepped += 1
        if len(sp.copies) < len(sp.parts) and sp.stepped < len(sp.parts):
            sp.copies.append(self._copier.submit(self._copy_part, sp.parts[sp.stepped], _stream_event(optimizer)))
        self._step_ended = time.perf_counter()  # after the waits above: they are stall, not window

    # -- copies and replay (checkpoint threads) ---------------------------------------------------

    def _hand(self, sp: _Spread) -> None:
        """Waits for the next part's copy and hands its shadow tensors to the replay thread."""
        j = sp.handed
        sp.handed += 1
        t0 = time.perf_counter()
        try:
            sp.copies[j].result()
        except Exception as exc:  # e.g. a device fault: this checkpoint fails, training goes on
            log.exception("pccheck: copying part %d of a spread checkpoint failed", j + 1)
            sp.failure.append(f"copying part {j + 1} of the spread checkpoint failed: {exc!r}")
            return
        finally:
            sp.waits["parts"] += time.perf_counter() - t0
        with self._buffers_lock:
            buffers = dict(self._buffers)
        entries = [(u.group, u.index, buffers[(u.group, u.index, None)],
                    {k: buffers[(u.group, u.index, k)] for k in u.state_keys}) for u in sp.parts[j]]
        self._queue.put(("part", sp, entries))

    def _copy_grad(self, g: Any, version: int, ready: Any = None, key: tuple[int, int] | None = None) -> Any:
        """A CPU copy of gradient ``g`` as the step that captured it used it, in a buffer of
        ``key``'s gradient pool (a new one only when none is free). Invariant: a
        gradient changed in place before its copy ended (its version counter moved: e.g.
        ``zero_grad(set_to_none=False)``, accumulation, an optimizer writing into ``.grad``) is
        never replayed; the checkpoint fails and later spreads copy gradients in the pre-hook."""
        if ready is not None:
            ready.synchronize()  # the backward that wrote it ran on the training stream
        t0 = time.perf_counter()
        out = self._grad_buffer(key, g)
        out.copy_(g)
        if self._pace is not None:
            self._pace(g.numel() * g.element_size(), t0)
        if g._version != version:
            raise _Modified("a gradient was modified in place while it was being captured; this spread "
                            "checkpoint is dropped, and later ones capture gradients before the step runs")
        return out

    def _grad_buffer(self, key: tuple[int, int] | None, like: Any) -> Any:
        """A free CPU buffer for a gradient like ``like``: a pooled one of its layout, else a new one.
        Reusing them spares each capture the allocation and page faults of a fresh tensor (~G·(k+1)/2
        bytes per spread); the pool never holds more than RECORDS per parameter (_recycle)."""
        import torch

        with self._buffers_lock:
            self._grad_made.add(key)
            free = self._grad_pool.get(key, [])
            while free:
                buf = free.pop()
                if buf.shape == like.shape and buf.dtype == like.dtype:
                    return buf
        return torch.empty(like.shape, dtype=like.dtype, device="cpu")

    def _recycle(self, grads: dict[tuple[int, int], Any] | None) -> None:
        """Gives a replayed record's gradient buffers back to the pool (replay thread). Invariant:
        only after the replay of their step is over; at most RECORDS records are alive at once,
        so the pool holds at most RECORDS buffers per parameter."""
        if not grads:
            return
        with self._buffers_lock:
            for key, buf in grads.items():
                free = self._grad_pool.setdefault(key, [])
                if len(free) < RECORDS:
                    free.append(buf)

    def _copy_part(self, part: list[Unit], ready: Any = None) -> None:
        """Copies a part's live tensors into the shadow (reusing buffers of the same layout),
        after ``ready`` (the training stream's event recorded behind the last update, on CUDA)."""
        import torch

        if ready is not None:
            ready.synchronize()
        state = self.optimizer.state
        t_part, nbytes, fresh = time.perf_counter(), 0, False
        for u in part:
            for key, t in u.tensors(state):
                nbytes += t.numel() * t.element_size()
                buf = self._buffer(u, key, t, create=False)
                if buf is None:  # not warmed (yet): its pages are faulted in by this copy
                    buf, fresh = self._buffer(u, key, t), True
                t0 = time.perf_counter()
                buf.copy_(t.detach())
                if self._pace is not None:
                    self._pace(t.numel() * t.element_size(), t0)
        if not fresh:  # invariant: the link estimate never holds a first-touch copy
            self._part_copies.append((nbytes, time.perf_counter() - t_part))

    def _replay_loop(self) -> None:
        # The replay runs at the training's own priority (REPLAY_NICE 0; a higher value only ever
        # raises a thread's nice, Linux keeps it per thread). It was nice 10, meant to leave the
        # CPU to training, but the training thread waits for it anyway once RECORDS steps are
        # queued (back-pressure), and at nice 10 any other busy process (a data loader, a
        # neighbour) takes the CPU first: with one CPU hog on 2 vCPUs the replay got ~1/10 of a
        # CPU and training sat in the pre-hook (bench/README.md, "Spreading a snapshot", has the measurements).
        try:
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, max(REPLAY_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        except (AttributeError, OSError):
            log.debug("pccheck: could not lower the spread replay thread's priority", exc_info=True)
        while True:
            kind, *rest = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                rest[0].set()
                continue
            if kind == "done":
                sp, result = rest
                result.stats["replay_s"] = sp.replay_s
                result.stats["replay_cpu_s"] = sp.replay_cpu_s
                result.hold.set()
                continue
            sp, *item = rest
            try:
                if kind == "part":
                    if not sp.failure:
                        t0, c0 = time.perf_counter(), time.thread_time()
                        sp.shadow.add_part(item[0])
                        sp.replay_s += time.perf_counter() - t0
                        sp.replay_cpu_s += time.thread_time() - c0
                    continue
                hparams, futures = item
                try:
                    grads = {key: f.result() for key, f in futures.items()}
                except _Modified as exc:
                    self.sync_grads = True
                    log.warning("pccheck: %s", exc)
                    sp.failure.append(str(exc))
                if not sp.failure:
                    t0, c0 = time.perf_counter(), time.thread_time()
                    sp.shadow.replay(StepRecord(hparams, grads))
                    sp.replay_s += time.perf_counter() - t0
                    sp.replay_cpu_s += time.thread_time() - c0
                    self._recycle(grads)
            except Exception as exc:  # a bug or a device fault: fail this checkpoint, never save a wrong state
                log.exception("pccheck: replaying a spread checkpoint failed")
                sp.failure.append(f"the spread checkpoint's replay failed: {exc!r}")
            finally:
                if kind == "step":
                    # Invariant (budget_split counts RECORDS steps): this step's gradient copies
                    # are dropped before the pre-hook may capture another step's.
                    item = grads = futures = rest = None
                    self._records.release()

    def close(self) -> None:
        """Removes the hooks and stops the threads (an active spread is abandoned)."""
        self.abandon()
        self._pre.remove()
        self._post.remove()
        self._queue.put(("stop", None))
        self._replayer.join()
        self._copier.shutdown(wait=True)
