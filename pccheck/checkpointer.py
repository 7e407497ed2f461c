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
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Union

import numpy as np

from .errors import ConfigError, PCCheckError, StorageError
from .orchestrator.copy_engine import CopyEngine
from .orchestrator.engine_choice import select_copy_engine
from .distributed import EPOCH_KEY, GroupCoordinator, detect_group
from .orchestrator.orchestrator import CommitInfo, Orchestrator
from .persist.layout import plan
from .persist.files import default_path, rank_dir
from .persist.store import STORAGE_CHOICES, SlotStore
from .stats import StatsReport
from .tune import report_from_checkpointer
from .torch_state import TREE_KEY, Snapshot, TorchState
from .tuner.config import AUTO, resolve_auto
from .tuner.online import IntervalChange, OnlineTuner

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
        return Snapshot(dict(self.state), len(self.state), {})

    def may_grow(self) -> bool:
        return False


def _is_module(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


class Checkpointer:
    """Persists a mapping of numpy arrays concurrently and crash-safely (PCcheck, ASPLOS'25).

    Args:
        state: a ``torch.nn.Module``, or a mapping name -> array (numpy, cupy or torch; any dtype
            but object, any shape, any strides), read at every checkpoint.
        optimizer: the model's ``torch.optim.Optimizer`` (for a mapping, the second positional
            argument may be the path instead).
        path: store directory; default ``$PCCHECK_DIR`` or ``./checkpoints``.
        extra_state: name -> object with ``state_dict()``/``load_state_dict()`` (LR scheduler,
            GradScaler, a sampler) or a plain JSON-able value.
        interval: ``maybe_checkpoint(step)`` checkpoints when ``step % interval == 0``. "auto":
            start from the interval in ``PATH/pccheck-tune.json`` (``pccheck-tune --write-config``;
            10 without one) and adapt it online: each ``maybe_checkpoint`` call marks the end of
            one iteration, the measured iteration time t and write time T_w re-derive the interval
            (eq. (3) under the tuned overhead bound q) when they drift by more than 20%, every
            change is logged and kept in :attr:`interval_changes`, and a checkpoint is taken once
            ``interval`` steps have passed since the previous one. In a torch.distributed group the
            tuned interval is used as is (the ranks must checkpoint the same steps).
        max_concurrent: N, checkpoints in flight at once. The store holds N+1 slots, so storage
            use is (N+1) x the state size. "auto" (default): the tuned N, else 2.
        when_busy: when N are in flight: "block" (wait, recorded as stall) or "skip" (count it).
        writer_threads: threads persisting chunks. "auto" (default): the tuned p, else 2.
        dram_budget: bytes of DRAM staging chunks, allocated and touched once (default 2x state).
        chunk_size: bytes per chunk (pipelining unit; a multiple of 4096). "auto" (default): the
            tuned b, else 64 MiB.
        storage: "auto" (PMEM if libpmem says the file is on PMEM, else "ssd"), "ssd" (O_DIRECT,
            or mmap+msync where O_DIRECT is unsupported), "odirect", "mmap" or "pmem".
        on_error: what happens when a background checkpoint fails: "raise" (default: the next
            ``maybe_checkpoint``/``checkpoint``/``wait``/``close`` raises it), "log" (logged,
            training goes on), or a callable given the exception (called on the writer thread).
            In every case the last committed checkpoint stays loadable.
        soft_cow: (PyTorch) copy the tensors in the background while the next forward/backward
            runs; an optimizer step pre-hook finishes the copy before the update mutates them.
            Default: on when an optimizer is given. Off: copy before maybe_checkpoint returns.
            Anything that mutates parameters outside ``optimizer.step()`` must call
            :meth:`wait_copied` first.
        capture_rng: (PyTorch) save and restore the Python, numpy, torch and CUDA RNG states.
        eager: (PyTorch) state_dict names to copy before maybe_checkpoint returns, besides the
            module buffers (which forward itself changes, e.g. BatchNorm running stats).
        distributed: in an initialised torch.distributed group of > 1 ranks (detected), each rank
            writes ``path/rank-<r>/`` and the ranks agree on globally committed steps
            (pccheck.distributed). Every rank must construct its Checkpointer at the same point.
        replicated: "rank0" for data-parallel replicas: only rank 0 writes (to ``path``).
        metadata: JSON-serialisable dict stored with every checkpoint.
        keep_every: if set, every k-th committed checkpoint is also copied, in the background, to
            ``PATH/history/step-XXXXXX.safetensors`` (+ a JSON sidecar) for debugging history.
        max_history: keep at most this many history files (oldest deleted first; never a slot).
        device_reserve: (PyTorch, soft copy-on-write) bytes of spare device memory, allocated once,
            into which the optimizer step pre-hook clones the parts of an in-flight snapshot not
            yet copied to the host (device to device, ordered before the update on the training
            stream), so the step waits only for what does not fit; the copy to the host goes on
            from the clone. "auto": up to the state size, within a quarter of the free device
            memory and an eighth of the card (none on the CPU). None (default): no reserve.
            ``stats()`` records the bytes staged per checkpoint (``reserve_bytes``).
        copy_engine: the engine that copies the state into DRAM chunks (default: chosen by where
            the tensors live: CUDA, cupy or the CPU).
    """

    def __init__(self, state: Any, optimizer: Any = None, path: str | os.PathLike[str] | None = None, *,
                 extra_state: Mapping[str, Any] | None = None, interval: int | str = 10,
                 max_concurrent: int | str = AUTO, when_busy: str = "block", writer_threads: int | str = AUTO,
                 dram_budget: int | None = None, chunk_size: int | str = AUTO, storage: str = "auto",
                 on_error: OnError = "raise",
                 metadata: Mapping[str, Any] | None = None, soft_cow: bool | None = None,
                 capture_rng: bool = True, eager: Iterable[str] = (), keep_every: int | None = None,
                 max_history: int | None = None, distributed: bool = True, replicated: str | None = None,
                 device_reserve: int | str | None = None, copy_engine: CopyEngine | None = None) -> None:
        if isinstance(optimizer, (str, os.PathLike)):  # Checkpointer(arrays, "ckpt")
            if path is not None:
                raise ConfigError("path given twice (positionally and as path=)")
            optimizer, path = None, optimizer
        tunable = {"interval": (interval, 1, None), "max_concurrent": (max_concurrent, 1, 254),
                   "writer_threads": (writer_threads, 1, 256), "chunk_size": (chunk_size, 4096, None)}
        for name, (value, lo, hi) in tunable.items():
            if isinstance(value, str):
                if value != AUTO:
                    raise ConfigError(f'{name} must be an integer or "auto", got {value!r}')
            else:
                _check_int(name, value, lo, hi)
        if dram_budget is not None:
            _check_int("dram_budget", dram_budget, 4096)
        if keep_every is not None:
            _check_int("keep_every", keep_every, 1)
        if max_history is not None:
            _check_int("max_history", max_history, 1)
        if isinstance(device_reserve, str):
            if device_reserve != AUTO:
                raise ConfigError(f'device_reserve must be a number of bytes, "auto" or None, got {device_reserve!r}')
        elif device_reserve is not None:
            _check_int("device_reserve", device_reserve, 0)
        if when_busy not in ("block", "skip"):
            raise ConfigError(f"when_busy must be 'block' or 'skip', got {when_busy!r}")
        if storage not in STORAGE_CHOICES:
            raise ConfigError(f"storage must be one of {', '.join(STORAGE_CHOICES)}; got {storage!r}")
        if not (on_error in ("raise", "log") or callable(on_error)):
            raise ConfigError("on_error must be 'raise', 'log' or a callable taking the exception")
        if _is_module(state):
            self._source: Any = TorchState(state, optimizer, extra_state, capture_rng=capture_rng, eager=eager)
            self.soft_cow = optimizer is not None if soft_cow is None else bool(soft_cow)
            if self.soft_cow and optimizer is None:
                raise ConfigError("soft_cow needs the optimizer: its step pre-hook guards the copy")
        else:
            if optimizer is not None or extra_state:
                raise ConfigError("optimizer and extra_state go with a torch.nn.Module state")
            self._source = _ArraysState(state)
            self.soft_cow = False
        if device_reserve and not self.soft_cow:
            raise ConfigError("device_reserve works with soft copy-on-write: pass a model with its optimizer "
                              "(soft_cow on); a mapping of arrays is copied before maybe_checkpoint returns")
        self.state = state
        self.optimizer = optimizer
        self.when_busy = when_busy
        self.metadata = _check_metadata(metadata)
        self.path = Path(path) if path is not None else default_path()
        self._on_error_policy = on_error
        self._errors: list[PCCheckError] = []
        self._err_lock = threading.Lock()
        self._hook: Any = None
        self._orch: Orchestrator | None = None

        snap = self._source.snapshot()  # validates names, dtypes and values before touching the disk
        layout = plan(snap.arrays)
        self._initial_bytes = layout.data_len
        group = detect_group() if distributed else None
        if replicated not in (None, "rank0"):
            raise ConfigError(f"replicated must be None or 'rank0', got {replicated!r}")
        # "auto": the choice `pccheck-tune --write-config` stored in PATH/pccheck-tune.json, or the
        # defaults. The optimizer's state may not exist yet (Adam's appears at its first step), so
        # the size check against the tuned size is left out then.
        self.settings: dict[str, Any] = resolve_auto(
            self.path, interval, max_concurrent, writer_threads, chunk_size,
            state_bytes=None if self._source.may_grow() else layout.data_len)
        max_concurrent = self.settings["max_concurrent"]
        writer_threads = self.settings["writer_threads"]
        chunk_size = self.settings["chunk_size"]
        self.interval: int = self.settings["interval"]
        # Online mode: the tuner re-derives the interval from what it measures while training runs.
        # Ranks of a group must checkpoint the same steps, so they keep the tuned interval.
        self._tuner: OnlineTuner | None = None
        self._last_taken: int | None = None  # step of the newest checkpoint maybe_checkpoint took
        if interval == AUTO:
            if group is not None:
                log.info("pccheck: interval=\"auto\" in a group of %d ranks: the tuned interval %d is used "
                         "without online adaptation (every rank must checkpoint the same steps)",
                         group.world_size, self.interval)
            else:
                self._tuner = OnlineTuner(self.interval, self.settings["max_overhead"], max_concurrent,
                                          iter_time=self.settings["iter_time_s"], tw=self.settings["tw_s"])
        # Data-parallel replicas hold the same state: with replicated="rank0" only rank 0 writes
        # (a plain store at `path`), and every rank loads from it.
        self._passive = group is not None and replicated == "rank0" and group.rank != 0
        self._coord: GroupCoordinator | None = None
        if group is not None and replicated is None:
            self._coord = GroupCoordinator(self.path, group)
        self._history = None
        if keep_every is not None and not self._passive:
            from .history import HistoryKeeper

            self._history = HistoryKeeper(self.path, keep_every, max_history)
        if self._passive:
            self._store = self._orch = None
            return
        store_dir = self.path
        if self._coord is not None:
            store_dir = rank_dir(self.path, group.rank)
            protect = self._coord.prepare(store_dir)  # collective: every rank constructs together
        self._store = SlotStore(store_dir, storage, group.world_size if self._coord else 1,
                                group.rank if self._coord else 0)
        if self._coord is not None:
            self._store.hold_replaced, self._store.protect, self._store.retire_on_global = True, protect, True
        try:
            self._orch = Orchestrator(self._store, layout, max_concurrent=max_concurrent,
                                      writer_threads=writer_threads, chunk_size=chunk_size,
                                      dram_budget=dram_budget,
                                      copy_engine=copy_engine or select_copy_engine(snap.arrays),
                                      on_error=self._background_error, on_commit=self._on_commit,
                                      extra_slots=1 if self._coord else 0,
                                      on_finished=self._tuner.on_checkpoint if self._tuner else None,
                                      device_reserve=device_reserve)
            if not self._source.may_grow():
                self._store.open(self._orch.num_slots, self._orch.slot_bytes(layout, self._meta(snap, None)))
            # else: the store is sized at the first checkpoint, once the optimizer has its state
            # (Adam creates it lazily, at its first step), instead of a generation that is
            # replaced at once.
            if self._coord is not None:
                self._coord.start(self._store)
        except BaseException:
            if self._orch is not None:
                self._orch.close()
            if self._history is not None:
                self._history.close()
            if self._coord is not None:
                self._coord.close()
            self._store.close()
            raise
        if self.soft_cow:
            self._hook = optimizer.register_step_pre_hook(self._before_optimizer_step)

    # -- the training loop's API -----------------------------------------------------------------

    def maybe_checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints if ``step % interval == 0``; returns whether it did. With
        ``interval="auto"``, call it once per training iteration: the call times the iteration,
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
        if self._tuner is None:
            if step % self.interval != 0:
                return False
            return self.checkpoint(step, metadata)
        self._tuner.on_iteration(time.perf_counter())  # the iteration ends here, before any blocking
        self.interval = self._tuner.interval
        last = self._last_taken
        if last is None or step <= last:  # the first call, or the steps restarted (a new loop)
            due = step % self.interval == 0
        else:
            due = step - last >= self.interval
        if not due or not self.checkpoint(step, metadata):
            return False
        self._last_taken = step
        return True

    def checkpoint(self, step: int, metadata: Mapping[str, Any] | None = None) -> bool:
        """Checkpoints now, regardless of the interval. False if skipped (``when_busy="skip"``)."""
        self._raise_pending()
        _check_step(step)
        if self._passive:
            return False
        snap = self._source.snapshot()
        meta = self._meta(snap, _check_metadata(metadata))
        try:
            return self._orch.start(int(step), snap.arrays, meta,
                                    n_eager=snap.n_eager if self.soft_cow else None,
                                    validate=snap.validate if self.soft_cow else None,
                                    when_busy=self.when_busy)
        except StorageError as exc:
            # An I/O fault while preparing the slot or a new generation: the same policy as a
            # fault in the background part of the checkpoint.
            if self._on_error_policy == "raise":
                raise
            self._background_error(exc)
            return False

    def _state_bytes(self) -> int:
        """Bytes of the newest checkpoint, or of the state as first planned (before any)."""
        stats = self._orch.stats if self._orch is not None else None
        return stats[-1].nbytes if stats else self._initial_bytes

    def wait_copied(self) -> None:
        """Returns once no checkpoint in flight still reads live tensors (soft copy-on-write).
        Call it before mutating parameters or optimizer state outside ``optimizer.step()``."""
        if self._orch is not None:
            self._orch.ensure_copied()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._orch.ensure_copied()

    def _meta(self, snap: Snapshot, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        meta = {**self.metadata, **(extra or {})}
        for key in (TREE_KEY, EPOCH_KEY):
            if key in meta:
                raise ConfigError(f"metadata key {key!r} is reserved")
        if snap.tree:
            meta[TREE_KEY] = snap.tree
        if self._coord is not None:
            meta[EPOCH_KEY] = self._coord.epoch
        return meta

    def _on_commit(self, info: CommitInfo) -> None:
        if self._coord is not None:
            self._coord.on_commit(info.step, info.slot)
        if self._history is not None:
            self._history(info)

    def wait(self) -> None:
        """Blocks until every checkpoint in flight has committed; raises a pending error."""
        if self._orch is not None:
            self._orch.wait()
        self._raise_pending()

    @property
    def interval_changes(self) -> list[IntervalChange]:
        """Every change the online tuner made to the interval (``interval="auto"``), oldest first."""
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
        return StatsReport(tuple(o.stats), o.skipped, o.last_durable_step, o.last_durable_time)

    @property
    def storage(self) -> str:
        """The write mode in use: "odirect", "mmap" or "pmem"."""
        return self._store.native.mode if self._store is not None and self._store.native else "closed"

    @property
    def copy_engine(self) -> CopyEngine | None:
        """The engine copying the state into DRAM chunks (``name``; GPU engines: ``pinned``)."""
        return self._orch.copy_engine if self._orch is not None else None

    @property
    def generation(self) -> int:
        return self._store.generation if self._store is not None else 0

    def close(self) -> None:
        """Waits for checkpoints in flight, stops the writers and releases the store lock."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._orch is None:
            return
        try:
            self._orch.close()
        finally:
            if self._coord is not None:
                self._coord.close()
            if self._history is not None:
                self._history.close()  # finishes copies of committed checkpoints first
            self._store.close()
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


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")
