"""The front-end: ``Checkpointer`` for a PyTorch model + optimizer, or a mapping of arrays.

    ck = pccheck.Checkpointer(model, optimizer, extra_state={"sched": sched}, path="ckpt")
    for step in range(start + 1, total + 1):
        train_step()                  # forward, backward, optimizer.step(), sched.step()
        ck.maybe_checkpoint(step)     # returns at once; the copy overlaps the next forward/backward
    ck.close()                        # waits for every checkpoint in flight

A thin face: a step goes one way, from the save policy (pccheck.tuner.policy: is it due?) to the
snapshot strategy (pccheck.spread.strategy: a whole snapshot now, or spread over k steps) to the
tier stack (pccheck.tiers.stack: the disk store and the memory, remote and history tiers, built,
fed and closed in one place).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

from . import shutdown
from .errors import ErrorSink, PCCheckError
from .group.distributed import detect_group
from .lazy import wait_for_pending
from .options import Options, checkpointer_arguments
from .orchestrator.copy_engine import CopyEngine
from .orchestrator.stats import StatsReport
from .persist.files import default_path
from .persist.layout import plan
from .preemption import FlushResult, Preemption
from .prepare import Preparation, defer_prepare
from .spread.mode import SpreadMode, budget_split, check_spread
from .spread.strategy import PlainSnapshots, SpreadSnapshots, Take
from .state.sources import check_metadata, check_step, make_source
from .state.torch_state import TorchState
from .tiers.base import TierContext
from .tiers.stack import TierStack
from .tuner.online import IntervalChange, report_from_checkpointer
from .tuner.policy import choose_policy

__all__ = ["Checkpointer", "OnError"]

log = logging.getLogger("pccheck")

OnError = Union[str, Callable[[PCCheckError], None]]


class Checkpointer:
    """Persists a model's (or a mapping of arrays') state concurrently and crash-safely
    (PCcheck, ASPLOS'25).

    Args:
        state: a ``torch.nn.Module``, or a mapping name -> array (numpy, cupy or torch; any dtype
            but object, any shape, any strides), read at every checkpoint.
        optimizer: the model's ``torch.optim.Optimizer`` (for a mapping, the second positional
            argument may be the path instead).
        path: store directory; default ``$PCCHECK_DIR`` or ``./checkpoints``.
        extra_state: name -> object with ``state_dict()``/``load_state_dict()`` (LR scheduler,
            GradScaler, a sampler) or a plain JSON-able value.
        metadata: JSON-serialisable dict stored with every checkpoint.
        options: a :class:`pccheck.Options`: the engine, snapshot and group settings and the
            three storage tiers, ``disk`` (``maybe_checkpoint`` checkpoints every ``disk.every``
            steps; "auto": from ``PATH/pccheck-tune.json``, adapted online as the iteration and
            write times drift, each change kept in :attr:`interval_changes`), ``memory`` and ``remote``.
        on_error: what happens when a background checkpoint fails: "raise" (default: the next
            ``maybe_checkpoint``/``checkpoint``/``wait``/``close`` raises it), "log" (logged,
            training goes on), or a callable given the exception (called on the writer thread).
            In every case the last committed checkpoint stays loadable.
        **settings: overrides of ``options``: a tier as ``disk=pccheck.DiskOptions(...)``,
            ``memory=...``, ``remote=...`` (or ``remote="s3://bucket/prefix"``), any engine,
            snapshot or group field by its own name (``max_concurrent=2``), and pccheck 0.1.0's tier
            keywords (``interval``, ``memory_interval``, ...; ``pccheck.options.LEGACY_KEYWORDS``).
            An unknown name raises ConfigError.
    """

    def __init__(self, state: Any, optimizer: Any = None, path: str | os.PathLike[str] | None = None, *,
                 extra_state: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
                 options: Options | None = None, on_error: OnError = "raise",
                 **settings: Any) -> None:
        optimizer, path, self.options = checkpointer_arguments(optimizer, path, options, settings)
        self._errors = ErrorSink(on_error)
        snapshot_opts = self.options.snapshot
        self._source, self.soft_cow = make_source(state, optimizer, extra_state, snapshot_opts)
        if snapshot_opts.spread_steps != 1:
            check_spread(self._source, optimizer)  # before anything is opened
        self.state, self.optimizer, self.when_busy = state, optimizer, self.options.engine.when_busy
        self.metadata = check_metadata(metadata)
        self.path = Path(path) if path is not None else default_path()

        snap = self._source.snapshot()  # validates names, dtypes and values before touching the disk
        layout = plan(snap.arrays)
        self._initial_bytes = layout.data_len
        group = detect_group() if self.options.group.distributed else None
        tuned = choose_policy(self.path, self.options.disk.every, self.options.engine, group,
                              None if self._source.may_grow() else layout.data_len, snapshot_opts.spread_steps)
        self.settings, self._tuner, self._policy = tuned.settings, tuned.tuner, tuned.policy
        # GoCkpt mode: the captured gradients come out of dram_budget, the chunk pool gets the rest.
        pool_budget, grad_budget = budget_split(snapshot_opts.spread_steps, optimizer, tuned.engine.dram_budget)
        # A data-parallel replica with replicated="rank0" and rank != 0 holds the same state as
        # rank 0, which alone writes (a plain store at `path`); this one never writes.
        writes = not (group is not None and self.options.group.replicated == "rank0" and group.rank != 0)
        prepared = not (writes and defer_prepare(self._source, optimizer, state))
        ctx = TierContext(self.path, self.options, self._source, self.metadata, group, None, self._errors)
        self._stack = TierStack(ctx, replace(tuned.engine, dram_budget=pool_budget), layout, snap, writes=writes,
                                prepared=prepared, on_finished=self._tuner.on_checkpoint if self._tuner else None,
                                copy_engine=snapshot_opts.copy_engine, device_reserve=snapshot_opts.device_reserve)
        # the tiers by the names the tests and benches look them up by
        self._orch, self._coord = self._stack.disk, self._stack.coord
        self._memory, self._remote, self._history = (self._stack.tier(n) for n in ("memory", "remote", "history"))
        try:
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step) \
                if self.soft_cow and self._orch is not None else None
            # GoCkpt mode: its step hooks come after the soft copy-on-write one (registered above).
            def start(take: Take) -> bool:  # one snapshot to the tier stack
                return self._stack.start_take(take, lambda m: {**self.metadata, **check_metadata(m)}, self._errors)
            self._spread: SpreadMode | None = None
            self._snapshots = PlainSnapshots(self._source, self.soft_cow, start)
            if snapshot_opts.spread_steps != 1 and self._orch is not None:
                self._spread = SpreadMode(snapshot_opts.spread_steps, optimizer, grad_budget,
                                          self._orch.copy_engine, tuned=self.settings["spread_steps"])
                self._snapshots = SpreadSnapshots(self._source, self.soft_cow, start, self._spread)
            # its hooks last: the optimizer step's own hooks (copy-on-write, GoCkpt) run before it prepares
            self._prep = Preparation(self._stack, self._source, optimizer, state, self.metadata, prepared)
        except BaseException:
            if getattr(self, "_hook", None) is not None:
                self._hook.remove()
            self._stack.close(0)  # nothing built is left running
            raise
        # Left open at interpreter exit: closed then as close() would (before its threads could be
        # cut off); held strongly until close(): its threads run whether the script keeps it or not.
        self._forget_exit = shutdown.on_exit(lambda: self.close())
        self._preempt = Preemption(self._stack)

    @property
    def interval(self) -> int:
        """Steps between the checkpoints :meth:`maybe_checkpoint` takes (``disk.every="auto"``: the
        online tuner's current choice). Set: from the next call on (until the tuner's next change)."""
        return self._policy.interval

    @interval.setter
    def interval(self, value: int) -> None:
        self._policy.interval = value

    # -- the training loop's API -----------------------------------------------------------------

    def maybe_checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints if ``step % interval == 0``; returns whether it did. With
        ``disk.every="auto"``, call it once per training iteration: the call times the iteration,
        and a checkpoint is due once ``interval`` steps have passed since the previous one (the
        first when ``step % interval == 0``).

        Returns as soon as the state may change again (arrays: once in DRAM chunks; a model with
        soft copy-on-write: at once, the optimizer's next step waits for the rest). Never waits
        for an earlier checkpoint to persist, only for a free in-flight permit when
        ``max_concurrent`` are running (``when_busy="block"``: ``stall_s``; "skip" returns False).
        """
        self._errors.raise_pending()
        check_step(step)
        with self._preempt.gate.call(step) as boundary:  # a flush holds the call here (preemption.gate)
            if boundary:  # the flush's checkpoint, at this step boundary
                return boundary.took(self.checkpoint(step, metadata))
            report_from_checkpointer(lambda: self._stack.state_bytes(self._initial_bytes))  # under pccheck-tune only
            if self._memory is not None:  # its own interval, from the same state at the same call
                self._stack.on_step(step, self._source.snapshot, {**self.metadata, **check_metadata(metadata)},
                                    self.soft_cow)
            self._snapshots.on_call(step, self._stack.finished(), metadata)  # a spread ending at this call
            # Whether this step is due is the policy's: every `interval` steps, or the online tuner's.
            if not self._policy.due(step) or not self.checkpoint(step, metadata):
                return False
            self._policy.taken(step)
            return True

    def on_preemption(self, grace_s: float = 30.0, signals: Sequence[int] = (signal.SIGTERM,),
                      notice_url: str | None = None, poll_s: float = 5.0) -> None:
        """Flushes (:meth:`flush`) within ``grace_s`` s of a notice: one of ``signals`` (handled from the
        main thread; the handler replaced runs after the flush: a default SIGTERM ends the process),
        or a 200 from ``notice_url``, polled every ``poll_s`` s (404, or GCE's "FALSE": no notice).
        :attr:`preempted` is True from the notice on. See docs/guide/preemption.md."""
        self._preempt.install(grace_s, signals, notice_url, poll_s)

    def flush(self, timeout: float | None = None) -> FlushResult:
        """Makes the newest consistent state (at least the last returned ``maybe_checkpoint``'s
        step) durable on disk, then committed on the remote tier, within ``timeout`` s (None: no
        limit); returns what each tier reached. Collective in a group. Call it between steps."""
        return self._preempt.flush(timeout, lambda step: self.checkpoint(step))

    @property
    def preempted(self) -> bool:
        """True once a preemption notice arrived (:meth:`on_preemption`)."""
        return self._preempt.preempted

    def checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints now, regardless of the interval. False if skipped (``when_busy="skip"``).
        With ``spread_steps`` > 1 it finishes a spread in progress as ``step`` and begins a new
        one (True), which the call k optimizer steps later finishes as that call's step."""
        self._errors.raise_pending()
        check_step(step)
        if self._orch is None:  # a replica that does not write
            return False
        if isinstance(self._source, TorchState):
            wait_for_pending(self.state)  # never snapshot a model a lazy restore is still filling
        self._prep.claim()  # not prepared yet: start() opens the store and makes the pool
        return self._snapshots.due(step, self._stack.finished(), self.interval, metadata)

    def wait_copied(self) -> None:
        """Returns once no checkpoint in flight still reads live tensors (soft copy-on-write).
        Call it before mutating parameters or optimizer state outside ``optimizer.step()``."""
        self._stack.ensure_copied()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Prepares the first checkpoint now and blocks until it is ready: the store open and the
        DRAM chunk pool faulted in (optional: a checkpoint taken earlier waits only for the chunks
        it needs). Call it, from any thread, where waiting costs nothing. True once ready (at once
        for a replica that never writes); False after ``timeout`` s (0: just ask), or while the
        state is not final (no optimizer state before its first step, a lazy restore loading: then
        the end of the next optimizer step prepares). Raises a store's :class:`StorageError`."""
        if self._orch is None:
            return True
        return self._prep.ready() and self._orch.wait_ready(timeout)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._spread is not None:
            self._spread.step_begins()  # the step's window ends here, before this wait
        self.wait_copied()

    def wait(self, remote: bool = False, timeout: float | None = None) -> bool:
        """Blocks until every checkpoint in flight has committed (a spread one still gathering is
        finished as the last ``maybe_checkpoint`` call's step); raises a pending error. With
        ``remote=True`` it then waits up to ``timeout`` s until every checkpoint taken so far is
        committed remotely (or superseded there); returns False on timeout."""
        self._snapshots.settle()
        done = self._stack.wait(("remote",) if remote else (), timeout)
        self._errors.raise_pending()
        return done

    @property
    def interval_changes(self) -> list[IntervalChange]:
        """Every change the online tuner made to the interval (``disk.every="auto"``), oldest first."""
        return list(self._tuner.changes) if self._tuner is not None else []

    @property
    def last_durable_step(self) -> int | None:
        """The step of the newest checkpoint known durable, or None."""
        return self._orch.last_durable_step if self._orch is not None else None

    def stats(self) -> StatsReport:
        """Per-checkpoint stall, copy and persist times, bytes and bandwidth, the skip counter and
        the age of the latest durable checkpoint (``.as_dict()``, ``.to_json()``)."""
        return self._stack.report()

    @property
    def storage(self) -> str:
        """The write mode in use: "odirect", "mmap" or "pmem" ("closed" when not open)."""
        return self._orch.storage_mode if self._orch is not None else "closed"

    @property
    def copy_engine(self) -> CopyEngine | None:
        """The engine copying the state into DRAM chunks (``name``; GPU engines: ``pinned``)."""
        return self._orch.copy_engine if self._orch is not None else None

    @property
    def generation(self) -> int:
        """The store generation being written (0 before the store opens)."""
        return self._orch.generation if self._orch is not None else 0

    def close(self, remote_timeout: float | None | str = "default") -> None:
        """Waits for checkpoints in flight, stops the writers and releases the store lock. With a
        remote tier it first waits for the newest checkpoint to be committed remotely, up to
        ``remote_timeout`` s (default: the ``remote.close_timeout`` option; None: no limit)."""
        self._forget_exit()
        self._preempt.close()  # a flush in progress ends first
        timeout = self.options.remote.close_timeout if remote_timeout == "default" else remote_timeout
        try:
            try:
                self._snapshots.settle()
            finally:
                self._snapshots.close()
        finally:
            self._prep.claim()
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._stack.close(timeout)
        self._errors.raise_pending()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except PCCheckError as err:  # never masks the exception in flight with a pending checkpoint error
            if exc_type is None:
                raise
            log.error("pccheck: %s (while handling %s)", err, exc_type.__name__)

