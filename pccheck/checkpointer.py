"""The front-end: ``Checkpointer`` for a PyTorch model + optimizer, or a mapping of arrays.

    ck = pccheck.Checkpointer(model, optimizer, extra_state={"sched": sched}, path="ckpt")
    for step in range(start + 1, total + 1):
        train_step()                  # forward, backward, optimizer.step(), sched.step()
        ck.maybe_checkpoint(step)     # returns at once; the copy overlaps the next forward/backward
    ck.close()                        # waits for every checkpoint in flight

    ck = pccheck.Checkpointer({"w": w, "m": m}, "ckpt")   # numpy / cupy arrays, updated in place
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Union

import numpy as np

from . import shutdown
from .group.distributed import GroupCoordinator, detect_group
from .errors import ConfigError, PCCheckError, StorageError
from .lazy import wait_for_pending
from .options import Options
from .orchestrator.args import StartArgs
from .orchestrator.copy_engine import CopyEngine
from .orchestrator.engine_choice import select_copy_engine
from .orchestrator.options import AUTO, EngineOptions
from .orchestrator.orchestrator import CommitInfo, Orchestrator
from .orchestrator.stats import StatsReport
from .persist.files import default_path, rank_dir
from .persist.layout import Layout, plan
from .prepare import Preparation
from .spread.mode import SpreadMode, budget_split, check_spread, substitute
from .state.torch_state import Snapshot, TorchState
from .tuner.config import resolve_auto
from .tuner.online import IntervalChange, OnlineTuner, report_from_checkpointer
from .tuner.policy import FixedInterval, OnlineTuned, SavePolicy
from .tiers.memory.shm_store import build_memory_tier
from .tiers.remote.group import build_remote_tier

__all__ = ["Checkpointer", "OnError"]

log = logging.getLogger("pccheck")

OnError = Union[str, Callable[[PCCheckError], None]]


class _ArraysState:
    """A mapping of arrays, read at every checkpoint and copied before maybe_checkpoint returns."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"state must be a torch.nn.Module or a mapping of name -> array, "
                              f"got {type(state).__name__}")
        self.state = state

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self.state), len(self.state), None)

    def may_grow(self) -> bool:
        return False


def _is_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


class Checkpointer(Preparation):
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
            three storage tiers, ``disk`` (when ``maybe_checkpoint`` checkpoints: every
            ``disk.every`` steps, "auto": tuned online), ``memory`` and ``remote``.
        on_error: what happens when a background checkpoint fails: "raise" (default: the next
            ``maybe_checkpoint``/``checkpoint``/``wait``/``close`` raises it), "log" (logged,
            training goes on), or a callable given the exception (called on the writer thread).
            In every case the last committed checkpoint stays loadable.
        **settings: overrides of ``options``: the tiers as ``disk=pccheck.DiskOptions(...)``,
            ``memory=pccheck.MemoryOptions(...)``, ``remote=pccheck.RemoteOptions(...)`` (or
            ``remote="s3://bucket/prefix"``), and any field of the engine, snapshot and group
            options by its own name: engine ``max_concurrent``, ``writer_threads``,
            ``chunk_size`` (each an int or "auto": the tuned value, else 2, 2, 64 MiB),
            ``dram_budget``, ``storage``, ``when_busy``; snapshot ``soft_cow``, ``capture_rng``,
            ``eager``, ``device_reserve``, ``copy_engine``, ``spread_steps``; group
            ``distributed``, ``replicated`` (see :class:`pccheck.Options`). The tier keywords of
            pccheck 0.1.0 (``interval``, ``keep_every``, ``max_history``, ``memory_interval``,
            ``remote_every``, ...) are accepted too (``pccheck.options.LEGACY_KEYWORDS``). An
            unknown name raises ConfigError.
    """

    def __init__(self, state: Any, optimizer: Any = None, path: str | os.PathLike[str] | None = None, *,
                 extra_state: Mapping[str, Any] | None = None, metadata: Mapping[str, Any] | None = None,
                 options: Options | None = None, on_error: OnError = "raise",
                 **settings: Any) -> None:
        if isinstance(optimizer, (str, os.PathLike)):  # Checkpointer(arrays, "ckpt")
            if path is not None:
                raise ConfigError("path given twice (positionally and as path=)")
            optimizer, path = None, optimizer
        if options is not None and not isinstance(options, Options):
            raise ConfigError(f"options must be a pccheck.Options, got {type(options).__name__}")
        self.options: Options = (options or Options()).updated(**settings)
        if not (on_error in ("raise", "log") or callable(on_error)):
            raise ConfigError("on_error must be 'raise', 'log' or a callable taking the exception")
        self._source, self.soft_cow = _make_source(state, optimizer, extra_state, self.options)
        if self.options.snapshot.spread_steps != 1:
            check_spread(self._source, optimizer)  # before anything is opened
        self.state = state
        self.optimizer = optimizer
        self.when_busy = self.options.engine.when_busy
        self.metadata = _check_metadata(metadata)
        self.path = Path(path) if path is not None else default_path()
        self._on_error_policy = on_error
        self._errors: list[PCCheckError] = []
        self._err_lock = threading.Lock()
        self._hook: Any = None
        self._forget_exit: Callable[[], None] = lambda: None
        self._prep_hooks: list[Any] = []  # see _defer_prepare
        self._prepared = True
        self._prep_lock = threading.Lock()  # see Preparation._prepare
        self._orch: Orchestrator | None = None

        snap = self._source.snapshot()  # validates names, dtypes and values before touching the disk
        layout = plan(snap.arrays)
        self._initial_bytes = layout.data_len
        group = detect_group() if self.options.group.distributed else None
        engine = self._tune(self.options.disk.every, group, layout)
        # GoCkpt mode: the captured gradients come out of dram_budget, the chunk pool gets the rest.
        pool_budget, grad_budget = budget_split(self.options.snapshot.spread_steps, optimizer, engine.dram_budget)
        engine = replace(engine, dram_budget=pool_budget)
        # A data-parallel replica with replicated="rank0" and rank != 0 holds the same state as
        # rank 0, which alone writes (a plain store at `path`); this one never writes.
        self._writes = not (group is not None and self.options.group.replicated == "rank0" and group.rank != 0)
        self._coord: GroupCoordinator | None = None
        if group is not None and self.options.group.replicated is None:
            self._coord = GroupCoordinator(self.path, group)
        self._history = None
        disk = self.options.disk
        if disk.keeps_copies and self._writes:
            from .ops.history import HistoryKeeper

            legacy = disk.legacy_history  # pccheck 0.1.0's keep_every/max_history: counted in commits
            self._history = HistoryKeeper(self.path, keep_last=disk.keep_last, keep_every=disk.keep_every,
                                          legacy=(legacy.keep_every, legacy.max_history) if legacy else None)
        # The remote tier (pccheck.tiers.remote): probes the object store (RemoteConfigError).
        self._remote = build_remote_tier(self.options.remote, self._writes, self._coord, group, self._background_error)
        # The memory tier (pccheck.tiers.memory): collective in a group, before the disk tier's.
        self._memory = build_memory_tier(self, engine, layout, snap, group)
        if self._writes:
            self._prepared = not self._defer_prepare()
            self._orch = self._open(engine, layout, snap, group)
            self._memory.start(self._epoch(), layout, snap.arrays, *((group.world_size, group.rank) if group else (1, 0)))
            if self._prepared:  # the state's size is final: the memory store opens (and populates) now
                self._memory.prepare(layout, self.metadata, snap.tree)
            if self.soft_cow:
                self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        # GoCkpt mode: its step hooks come after the soft copy-on-write one (registered above).
        self._spread: SpreadMode | None = None
        if self.options.snapshot.spread_steps != 1 and self._orch is not None:
            self._spread = SpreadMode(self.options.snapshot.spread_steps, optimizer, grad_budget, self._orch.copy_engine,
                                      tuned=self.settings["spread_steps"])
        if not self._prepared:
            self._prep_hooks = self._prepare_hooks()
        # Left open at interpreter exit: closed then, before its threads could be cut off.
        self._forget_exit = shutdown.on_exit(self._close_at_exit)

    def _tune(self, interval: int | str, group: Any, layout: Layout) -> EngineOptions:
        """Resolves "auto" (the interval and the engine's tuned fields) and sets up the online
        tuner; returns the resolved engine options."""
        engine = self.options.engine
        # "auto": the choice `pccheck-tune --write-config` stored in PATH/pccheck-tune.json, or the
        # defaults. The optimizer's state may not exist yet (Adam's appears at its first step), so
        # the size check against the tuned size is left out then.
        self.settings: dict[str, Any] = resolve_auto(
            self.path, interval, engine.max_concurrent, engine.writer_threads, engine.chunk_size,
            state_bytes=None if self._source.may_grow() else layout.data_len,
            spread_steps=self.options.snapshot.spread_steps)
        engine = engine.with_values(self.settings)
        interval_now: int = self.settings["interval"]
        # Online mode: the tuner re-derives the interval from what it measures while training runs.
        # Ranks of a group must checkpoint the same steps, so they keep the tuned interval.
        self._tuner: OnlineTuner | None = None
        if interval == AUTO:
            if group is not None:
                log.info("pccheck: disk.every=\"auto\" in a group of %d ranks: the tuned interval %d is used "
                         "without online adaptation (every rank must checkpoint the same steps)",
                         group.world_size, interval_now)
            else:
                self._tuner = OnlineTuner(interval_now, self.settings["max_overhead"], int(engine.max_concurrent),
                                          iter_time=self.settings["iter_time_s"], tw=self.settings["tw_s"])
        # When maybe_checkpoint takes one (pccheck/tuner/policy.py).
        self._policy: SavePolicy = (OnlineTuned(self._tuner, interval_now) if self._tuner is not None
                                    else FixedInterval(interval_now))
        return engine

    @property
    def interval(self) -> int:
        """Steps between the checkpoints :meth:`maybe_checkpoint` takes; with ``disk.every="auto"``
        (one process) the online tuner's current choice. Setting it changes the interval from the
        next call on (the online tuner overrides it at its next call)."""
        return self._policy.interval

    @interval.setter
    def interval(self, value: int) -> None:
        self._policy.interval = value

    def _open(self, engine: EngineOptions, layout: Layout, snap: Snapshot, group: Any) -> Orchestrator:
        """The orchestrator over this process's store (``path``, or ``path/rank-<r>`` in a group),
        opened now unless the state may still grow."""
        store_dir, world_size, rank = self.path, 1, 0
        if self._coord is not None:
            store_dir, world_size, rank = rank_dir(self.path, group.rank), group.world_size, group.rank
            self._coord.prepare(store_dir)  # collective: every rank constructs together
        snapshot = self.options.snapshot
        orch = None
        try:
            orch = Orchestrator(store_dir, layout, engine,
                                copy_engine=snapshot.copy_engine or select_copy_engine(snap.arrays),
                                on_error=self._background_error,
                                retention=self._coord if self._coord is not None else
                                (self._remote.retention if self._remote is not None else None),
                                world_size=world_size, rank=rank, on_commit=self._on_commit,
                                on_finished=self._tuner.on_checkpoint if self._tuner else None,
                                device_reserve=snapshot.device_reserve, pool=self._prepared)
            if self._prepared:
                orch.open_store(orch.slot_bytes(layout, self.metadata, snap.tree, self._epoch()))
            # else (_defer_prepare): the store and the chunk pool are sized once the state is
            # final, instead of a generation and a pool replaced at the first checkpoint.
            if self._coord is not None:
                self._coord.start(orch)
            if self._remote is not None:
                self._remote.attach(orch)
        except BaseException:
            if self._remote is not None:
                self._remote.close(0)
            if orch is not None:
                orch.close()
            if self._history is not None:
                self._history.close()
            if self._coord is not None:
                self._coord.close()
            raise
        return orch

    # -- the training loop's API -----------------------------------------------------------------

    def maybe_checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints if ``step % interval == 0``; returns whether it did. With
        ``disk.every="auto"``, call it once per training iteration: the call times the iteration,
        and a checkpoint is due once ``interval`` steps have passed since the previous one (the
        first when ``step % interval == 0``).

        Returns as soon as the state may change again: for arrays, once their bytes are in DRAM
        chunks; for a model with soft copy-on-write, at once (buffers and RNG states copied),
        while the optimizer's next step waits for whatever is not copied yet. Never waits for an
        earlier checkpoint to persist, only for a free in-flight permit when ``max_concurrent``
        are running (``when_busy="block"``, recorded as ``stall_s``; "skip" returns False).
        """
        self._raise_pending()
        _check_step(step)
        # `pccheck-tune -- python train.py` times the iterations here when the script does not
        # report them itself (a no-op otherwise: one environment lookup).
        report_from_checkpointer(self._state_bytes)
        if self._memory.enabled:  # its own interval, from the same state at the same call
            self._memory.maybe(step, self._source.snapshot, {**self.metadata, **_check_metadata(metadata)}, self.soft_cow)
        if self._spread is not None:
            self._spread.on_call(step)
            self._spread.poll(self._orch.stats)
            if self._spread.ready():  # k steps since it began: this call's step finishes it
                self._finish_spread(step, metadata)
        # Whether this step is due is the policy's: every `interval` steps, or the online tuner's.
        if not self._policy.due(step) or not self.checkpoint(step, metadata):
            return False
        self._policy.taken(step)
        return True

    def checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints now, regardless of the interval. False if skipped (``when_busy="skip"``).
        With ``spread_steps`` > 1 it finishes a spread in progress as ``step`` and begins a new
        one (True), which the call k optimizer steps later finishes as that call's step."""
        self._raise_pending()
        _check_step(step)
        if self._orch is None:  # a replica that does not write
            return False
        if isinstance(self._source, TorchState):
            wait_for_pending(self.state)  # never snapshot a model a lazy restore is still filling
        with self._prep_lock:  # a wait_ready() on another thread finishes its prepare first
            self._prepared = True  # not prepared yet: start() opens the store and makes the pool
        self._drop_prepare_hooks()
        if self._spread is not None:
            self._spread.mark(step)
            if self._spread.active():  # not finished by a maybe_checkpoint call: finish it now
                self._finish_spread(step, metadata)
            k = self._spread.steps_for_next(list(self._orch.stats), self.interval)
            if k > 1 and not self._source.may_grow():
                self._spread.begin(k)  # finished by the call after k optimizer steps
                return True
        snap = self._source.snapshot()
        meta = {**self.metadata, **_check_metadata(metadata)}
        decision = self._spread.decision if self._spread is not None else None
        try:
            return self._orch.start(int(step), snap.arrays, meta, StartArgs(
                tree=snap.tree, epoch=self._epoch(), n_eager=snap.n_eager if self.soft_cow else None,
                validate=snap.validate if self.soft_cow else None,
                extra_stats={"spread_decision": decision} if decision is not None else None))
        except StorageError as exc:
            # An I/O fault while preparing the slot or a new generation: the same policy as a
            # fault in the background part of the checkpoint.
            if self._on_error_policy == "raise":
                raise
            self._background_error(exc)
            return False

    def _finish_spread(self, step: int, metadata: Mapping[str, Any] | None) -> bool:
        """Ends the active spread checkpoint as ``step``: the live part of the state (buffers,
        extra state, RNGs, anything outside the optimizer) is cloned now; all of it goes to DRAM
        chunks once the shadow's replay is done; then the usual write and commit."""
        res = self._spread.finish()
        try:
            snap = self._source.snapshot()
            arrays = substitute(snap.arrays, res)
            meta = {**self.metadata, **_check_metadata(metadata)}
            started = self._orch.start(int(step), arrays, meta, StartArgs(
                tree=snap.tree, epoch=self._epoch(), n_eager=0, validate=res.failed, hold=res.hold,
                copied=res.copied, cow_wait=res.waited_s, extra_stats=res.stats))
            if not started:  # skipped (when_busy="skip"): the shadow is free once the replay ends
                res.copied.set()
            return started
        except BaseException as exc:
            res.copied.set()  # the next spread still waits for the replay (hold) before reusing the shadow
            if isinstance(exc, StorageError) and self._on_error_policy != "raise":
                self._background_error(exc)
                return False
            raise

    def _state_bytes(self) -> int:
        """Bytes of the newest checkpoint, or of the state as first planned (before any)."""
        stats = self._orch.stats if self._orch is not None else None
        return stats[-1].nbytes if stats else self._initial_bytes

    def wait_copied(self) -> None:
        """Returns once no checkpoint in flight still reads live tensors (soft copy-on-write).
        Call it before mutating parameters or optimizer state outside ``optimizer.step()``."""
        if self._orch is not None:
            self._orch.ensure_copied()
        self._memory.ensure_copied()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Prepares the first checkpoint now and blocks until it is ready: the store open and
        every page of the DRAM chunk pool faulted in. Optional: without it the pool is faulted
        in on a native thread from the moment it is made (at construction, or once the state is
        final: after ``load_latest`` or the first optimizer step), and a checkpoint taken before
        that ends waits for the chunks it needs (``backpressure_s``). Call it (from any thread)
        where waiting costs nothing, e.g. while a data loader warms up.

        Returns True once ready (at once for a replica that never writes); False if ``timeout``
        seconds passed first (``timeout=0``: just ask), or if the state is not final yet: the
        optimizer has no state before its first step, or a lazy restore is still loading (the
        store and pool are then made at the end of the next optimizer step). Raises the
        :class:`StorageError` of a store that cannot be opened or a pool that cannot be made."""
        if self._orch is None:
            return True
        if not self._prepared:
            if self._defer_prepare():
                return False
            self._prepare(raise_errors=True)
        return self._orch.wait_ready(timeout)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._spread is not None:
            self._spread.step_begins()  # the step's window ends here, before this wait
        self.wait_copied()

    def _epoch(self) -> int | None:
        """The job incarnation recorded in each manifest (a group), else None."""
        return self._coord.epoch if self._coord is not None else None

    def _on_commit(self, info: CommitInfo) -> None:
        if self._coord is not None:
            self._coord.on_commit(info.step, info.slot)
        if self._history is not None:
            self._history(info)
        if self._remote is not None:
            self._remote.on_commit(info)  # only enqueues: the upload runs on its own thread

    def wait(self, remote: bool = False, timeout: float | None = None) -> bool:
        """Blocks until every checkpoint in flight has committed; raises a pending error. A spread
        checkpoint still gathering its parts is finished first, as the step of the last
        ``maybe_checkpoint`` call (abandoned, with a warning, if the optimizer stepped since).
        With ``remote=True`` it then waits (up to ``timeout`` s) until every checkpoint taken so
        far is committed remotely (or superseded there by a newer one); returns False on timeout."""
        self._settle_spread()
        self._memory.wait()
        if self._orch is not None:
            self._orch.wait()
        done = self._remote.wait(timeout) if remote and self._remote is not None else True
        self._raise_pending()
        return done

    def _settle_spread(self) -> None:
        if self._spread is None or not self._spread.active():
            return
        last = self._spread.finishable_as()
        if last is None:
            log.warning("pccheck: the spread checkpoint in progress is abandoned: the optimizer stepped after the "
                        "last maybe_checkpoint call, so the step it would hold is unknown")
            self._spread.abandon()
        else:
            self._finish_spread(last, None)

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
        o = self._orch
        if o is None:
            return StatsReport((), 0, None, None)
        tiers = {"disk": o.last_durable_step, **self._memory.newest()}
        remote = self._remote.progress.as_dict() if self._remote is not None else None
        if remote is not None:
            tiers["remote"] = remote["remote_step"]
        return StatsReport(tuple(o.stats), o.skipped, o.last_durable_step, o.last_durable_time, remote=remote,
                           tiers=tiers)

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
        self._remote_timeout = self.options.remote.close_timeout if remote_timeout == "default" \
            else remote_timeout
        try:
            if self._spread is not None:
                try:
                    self._settle_spread()
                finally:
                    self._spread.close()
                    self._spread = None
        finally:
            self._memory.close(then=self._close_engine)

    def _close_at_exit(self) -> None:
        """The interpreter exits with this Checkpointer open: closed as :meth:`close` closes it
        (checkpoints in flight commit; the remote tier gets ``remote_close_timeout``)."""
        log.info("pccheck: closing the Checkpointer of %s at interpreter exit", self.path)
        try:
            self.close()
        except PCCheckError as exc:
            log.error("pccheck: closing the Checkpointer of %s at exit: %s", self.path, exc)

    def _close_engine(self) -> None:
        with self._prep_lock:
            self._prepared = True
        self._drop_prepare_hooks()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._orch is None:
            return
        try:
            if self._remote is not None:  # local commits first (they queue uploads), then the remote
                try:
                    self._orch.wait()
                finally:
                    self._remote.close(getattr(self, "_remote_timeout", None))
            self._orch.close()
        finally:
            if self._coord is not None:
                self._coord.close()
            if self._history is not None:
                self._history.close()  # finishes copies of committed checkpoints first
        self._raise_pending()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:  # do not mask the exception in flight with a pending checkpoint error
            try:
                self.close()
            except PCCheckError as err:
                log.error("pccheck: %s (while handling %s)", err, exc_type.__name__)

    # -- errors ----------------------------------------------------------------------------------

    def _background_error(self, exc: PCCheckError) -> None:
        policy = self._on_error_policy
        if policy == "raise":
            with self._err_lock:
                self._errors.append(exc)
        elif policy == "log":
            log.error("pccheck: background checkpoint failed: %s", exc)
        else:
            try:
                policy(exc)  # type: ignore[operator]
            except Exception:
                log.exception("pccheck: the on_error callback raised")

    def _raise_pending(self) -> None:
        with self._err_lock:
            if not self._errors:
                return
            first, self._errors = self._errors[0], []
        raise first


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be an int, got {step!r} ({type(step).__name__})")


def _check_metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping (a JSON object), got {type(metadata).__name__}")
    return dict(metadata)


def _make_source(state: Any, optimizer: Any, extra_state: Mapping[str, Any] | None,
                 options: Options) -> tuple[Any, bool]:
    """What each checkpoint reads (a model with its optimizer, or a mapping of arrays), and
    whether soft copy-on-write is on."""
    snap = options.snapshot
    if _is_module(state):
        source: Any = TorchState(state, optimizer, extra_state, capture_rng=snap.capture_rng, eager=snap.eager,
                                 record_order=True)
        soft_cow = optimizer is not None if snap.soft_cow is None else snap.soft_cow
        if soft_cow and optimizer is None:
            raise ConfigError("soft_cow needs the optimizer: its step pre-hook guards the copy")
    else:
        if optimizer is not None or extra_state:
            raise ConfigError("optimizer and extra_state go with a torch.nn.Module state")
        source, soft_cow = _ArraysState(state), False
    if snap.device_reserve and not soft_cow:
        raise ConfigError("device_reserve works with soft copy-on-write: pass a model with its optimizer "
                          "(soft_cow on); a mapping of arrays is copied before maybe_checkpoint returns")
    return source, soft_cow
