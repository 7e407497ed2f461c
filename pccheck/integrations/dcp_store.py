"""The rank stores a DCP Writer writes through: one tier stack per (directory, rank) per process,
opened lazily in the process that writes (a PROCESS-mode daemon opens its own), and the retention
rule that keeps the newest finished save loadable.

Each rank store opens its disk store and its tiers through :class:`pccheck.tiers.stack.TierStack`,
as every entry point does, as a :class:`~pccheck.tiers.stack.SetMember` (DCP's planner pairs the
ranks, so no GroupCoordinator): with an object store its remote tier is the shared one's set
mode (``tiers/remote/sets.py``), fed by the stack's commits; a memory tier is refused
(ConfigError; ``tiers.stack.refuse_memory`` says why).

A DCP save of W ranks is a *set* (FORMAT.md §9): every rank commits its slot for the same
(epoch, step); the set is complete once the last rank's local commit is durable. The coordinator's
``finish`` then records it as *finished*, durably, in ``PATH/GLOBAL`` (FORMAT.md §8's format).

Retention invariant (:class:`SetRetention`): a rank never reuses the slot holding the newest
finished step F it knows, nor any slot holding a step newer than F (that save may still complete,
or be complete and not yet finished); it frees a replaced slot once F has moved past its step.
With at most N saves unfinished, N in flight need N slots, plus the latest unfinished, plus F:
each rank store has N+2 slots. So a crash at any point, including between ``write_data`` and
``finish``, leaves F complete on every rank.

incremental=True (a slot's checkpoint may reference arrays in other slots' cells, FORMAT.md §14):
the cells of every local commit are held (``Incremental.hold_commits``, as it ends committed) as
long as the same rule keeps its slot, and released just before the slot is given back; on open,
the slot of F is held too (``protected_slots``). So F stays complete although newer commits
become the disk's base, and a part's upload reads the bytes its manifest names (its slot is kept
until its save finished, which waits for the part).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..group.distributed import read_global
from ..errors import ConfigError, CorruptCheckpointError, PCCheckError
from ..options import Options
from ..orchestrator.args import StartArgs
from ..orchestrator.incremental import Incremental
from ..orchestrator.options import EngineOptions
from ..orchestrator.orchestrator import CommitInfo
from ..orchestrator.retention import HeldSlots, Retention
from ..orchestrator.stats import CheckpointStats
from ..persist.files import GLOBAL, rank_dir, write_durably
from ..persist.layout import plan
from ..persist.recovery import read_manifest, scan
from ..state.torch_state import Snapshot
from ..tiers.base import TierContext
from ..tiers.stack import SetMember, TierStack

__all__ = ["SetRetention", "RankStore", "Started", "rank_store", "next_save", "record_finished", "close_stores"]

log = logging.getLogger("pccheck")

_registry: dict[tuple[Path, int, int], "RankStore"] = {}
_steps: dict[Path, list[int]] = {}  # root -> [epoch, next step], the coordinator's allocator
_registry_lock = threading.Lock()
_finished: dict[Path, int] = {}  # root -> newest step recorded in GLOBAL by this process
_finish_lock = threading.Lock()  # one GLOBAL write at a time (saves in flight finish in threads)


def _slot_keys(directory: Path) -> list[tuple[int, int, int, int]]:
    """(generation, slot, epoch, step) of every slot of ``directory`` whose manifest checks out."""
    out = []
    for gen in scan(directory) if directory.is_dir() else []:
        if gen.image is None:
            continue
        with open(gen.path, "rb", buffering=0) as f:
            for st in gen.image.slots:
                if st.meta is None:
                    continue
                try:
                    man = read_manifest(gen.image, st.slot, f.fileno())
                except CorruptCheckpointError:
                    continue
                out.append((gen.image.header["generation"], st.slot, man.epoch or 0, man.step))
    return out


def next_save(root: Path, world_size: int) -> tuple[int, int]:
    """(epoch, step) for the next save under ``root`` (coordinator). The epoch is fixed per process
    and root: the wall clock in microseconds, above any epoch in rank 0's store, so a slot left
    by an earlier incarnation never pairs with a new one; steps start above any step rank 0 holds,
    so a new set is newer than every complete set (each includes rank 0)."""
    with _registry_lock:
        st = _steps.get(root)
        if st is None:
            keys = _slot_keys(rank_dir(root, 0) if world_size > 1 else root)
            epoch = max([time.time_ns() // 1000] + [k[2] + 1 for k in keys])
            st = _steps[root] = [epoch, max([k[3] for k in keys] + [0]) + 1]
        out = (st[0], st[1])
        st[1] += 1
        return out


def record_finished(root: Path, epoch: int, step: int, world_size: int) -> None:
    """Coordinator, in ``finish``: the set (epoch, step) is complete; record it durably in
    ``root/GLOBAL`` (temp, fsync, rename, fsync dir), then tell this process's rank stores."""
    import json

    doc = {"step": step, "epoch": epoch, "world_size": world_size, "unix_time": time.time()}
    with _finish_lock:
        if _finished.get(root, -1) >= step:  # a newer save finished first: GLOBAL only moves forward
            return
        write_durably(root / GLOBAL, lambda f: f.write(json.dumps(doc).encode()))
        _finished[root] = step
    _publish_finished(root, step)
    with _registry_lock:
        stores = [s for (d, _, _), s in _registry.items() if s.root == root]
    for s in stores:
        s.retention.set_finished(step)


def _store_key(root: Path) -> str:
    return f"pccheck.dcp/{root}/finished"


def _publish_finished(root: Path, step: int) -> None:
    """Puts the finished step into the process group's key-value store (if any), so a rank that
    waits for a slot learns it before its next plan arrives."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            c10d._get_default_store().set(_store_key(root), str(step))
    except Exception:  # noqa: BLE001 - an optimisation only: plans carry it too
        log.debug("pccheck: could not publish the finished step", exc_info=True)


def _poll_finished(root: Path) -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            if store.check([_store_key(root)]):
                return int(store.get(_store_key(root)).decode())
    except Exception:  # noqa: BLE001
        log.debug("pccheck: could not read the finished step", exc_info=True)
    return None


class SetRetention(Retention):
    """The retention policy of one rank store of a DCP job (see the invariant in the module
    docstring). Call order: :meth:`prepare` (before the store opens) → :meth:`attach` →
    :meth:`on_commit` per local commit, :meth:`set_finished` as finished steps become known."""

    extra_slots = 1       # the newest finished save, beside N in flight and the latest
    hold_replaced = True  # replaced slots come back through take_held; this class frees them

    def __init__(self, root: Path) -> None:
        self.root = root
        self.finished: int | None = None
        self._slots = HeldSlots()
        self._protect: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self.orch: Any = None  # the Orchestrator of the rank store (the stack's disk)
        self._held_cells: dict[int, int] = {}  # incremental: counter -> step of the commits whose cells are held

    def prepare(self, directory: Path) -> None:
        """Finds the slot of the newest generation holding the finished set GLOBAL names, and
        keeps it from reuse (the reopened store keeps its CHECK_ADDR slot by itself)."""
        doc = read_global(self.root)
        keys = _slot_keys(directory)
        self._slots.generation = max([k[0] for k in keys] + [1])
        if doc is not None:
            self.finished = doc["step"]
            for gen, slot, epoch, step in keys:
                if gen == self._slots.generation and (epoch, step) == (doc.get("epoch"), doc["step"]):
                    self._protect = (slot,)
                    self._slots.step_of[slot] = step

    def protected_slots(self) -> tuple[int, ...]:
        return self._protect

    def may_free_slots(self) -> bool:
        """A writer short of a slot waits while held slots may come back: it looks for a newer
        finished step in the process group's store meanwhile."""
        polled = _poll_finished(self.root)
        if polled is not None:
            self.set_finished(polled)
        with self._lock:
            return bool(self._slots.held)

    def may_retire(self, generation: int) -> bool:
        """Older generations may go once the finished step lives in ``generation``."""
        with self._lock:
            return self._slots.holds(generation, self.finished)

    def attach(self, orch: Any) -> None:
        """The rank store's orchestrator (before its store opens). incremental: every commit's
        cells are held as it ends committed, and the finished step's slot on open (see the module
        docstring)."""
        self.orch = orch
        cells = getattr(orch, "cells", None)
        if isinstance(cells, Incremental):
            cells.hold_commits = True
            cells.protected = self.protected_slots

    def on_commit(self, step: int, slot: int, counter: int | None = None) -> None:
        with self._lock:
            if self.orch is not None:
                self._slots.record(self.orch, slot, step)
                if counter is not None and isinstance(getattr(self.orch, "cells", None), Incremental):
                    self._held_cells[counter] = step  # held by Incremental.end (hold_commits)
            self._settle_locked()

    def set_finished(self, step: int) -> None:
        with self._lock:
            if self.finished is not None and step <= self.finished:
                return
            self.finished = step
            self._settle_locked()
        if self.orch is not None:
            self.orch.retire_if_allowed()  # outside our lock: it takes ours (may_retire)

    def _settle_locked(self) -> None:
        """Frees held slots whose step is older than the finished one (the invariant above); an
        incremental store's commits older than it release their cells first (a slot is reused
        only once no commit it may still be asked for pins its cells)."""
        if self.orch is None:
            return
        cells = getattr(self.orch, "cells", None)
        if isinstance(cells, Incremental):
            self._held_cells.update(cells.take_held_on_open())
            if self.finished is not None:
                for counter, step in list(self._held_cells.items()):
                    if step < self.finished:
                        del self._held_cells[counter]
                        cells.release(counter)
        self._slots.settle(self.orch, self.finished)


class RankStore:
    """One rank's store of a DCP checkpoint directory, in the process that writes it: its tier
    stack (opened at the first write), the order of its starts, and each save's outcome."""

    def __init__(self, root: Path, world_size: int, rank: int, engine: EngineOptions, options: Options) -> None:
        self.root = root
        self.world_size, self.rank = world_size, rank
        self.directory = rank_dir(root, rank) if world_size > 1 else root
        self.engine, self.options = engine, options
        self.retention = SetRetention(root)
        self.stack: TierStack | None = None
        self.lock = threading.Lock()  # orders starts: counters follow steps on this rank
        self._last_started: int | None = None
        self._last_order: int | None = None
        self._pending: dict[int, Future] = {}
        # Guards _pending only. Never self.lock: a start holding it may wait for a slot or a
        # permit that this commit thread's _on_finished gives back.
        self._pending_lock = threading.Lock()
        self._errors = threading.local()

    def _open(self, arrays: dict[str, Any], tree: Any) -> TierStack:
        """The stack over this rank's store; the store itself opens at the first start, sized
        for that save's manifest (its epoch included)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.retention.prepare(self.directory)  # before the store opens: the slot to keep
        ctx = TierContext(self.root, self.options, None, {}, None, None, self._on_error)
        member = SetMember(self.directory, self.world_size, self.rank, self.retention, self._on_commit)
        stack = TierStack(ctx, self.engine, plan(arrays), Snapshot(arrays, len(arrays), tree), writes=True,
                          prepared=True, open_now=False, on_finished=self._on_finished, member=member)
        self.retention.attach(stack.disk)
        return stack

    def write(self, epoch: int | None, step: int | None, arrays: dict[str, Any], tree: Any,
              order: int | None = None, generation: int | None = None, base: int | None = None) -> Started | None:
        """Starts the checkpoint of ``arrays`` (copied into DRAM chunks before this returns).
        With ``step`` None (a job of one rank) the step is taken here, under the lock that
        orders the starts; with ``generation`` (an s3:// save) the remote tier uploads this
        rank's part of it once it commits (incremental: only what changed since its part of the
        committed step ``base``). Returns None, writing nothing, for a save older than
        one already started here (a lower stage ``order``, or a lower planned step): an older
        save never replaces a newer one, and counters must follow steps on this rank (else the
        native store would free the newer slot as superseded)."""
        with self.lock:
            if order is not None and self._last_order is not None and order < self._last_order:
                return None
            if step is None:
                epoch, step = next_save(self.root, 1)
            assert epoch is not None
            if self._last_started is not None and step <= self._last_started:
                return None
            if self.stack is None:
                self.stack = self._open(arrays, tree)
            remote = self.stack.tier("remote")
            if generation is not None and remote is None:
                raise ConfigError("an s3:// save reached a rank store opened without the remote tier: give every "
                                  "rank the same pccheck.dcp.Writer, and one location per checkpoint directory")
            fut: Future = Future()
            part = remote.expect(step, generation, base) if generation is not None else None
            with self._pending_lock:
                self._pending[step] = fut
            try:
                self.stack.start(step, arrays, None, StartArgs(tree=tree, epoch=epoch))
            except BaseException:
                with self._pending_lock:
                    self._pending.pop(step, None)
                if part is not None:
                    remote.forget(step)
                raise
            self._last_started = step
            if order is not None:
                self._last_order = order
        return Started(epoch, step, fut, part, remote)

    def _on_error(self, exc: PCCheckError) -> None:
        self._errors.exc = exc  # the same commit thread reports the outcome next (_on_finished)

    def _on_commit(self, info: CommitInfo) -> None:
        self.retention.on_commit(info.step, info.slot, info.counter)

    def _on_finished(self, st: CheckpointStats) -> None:
        exc = getattr(self._errors, "exc", None)
        self._errors.exc = None
        with self._pending_lock:
            fut = self._pending.pop(st.step, None)
        if fut is None:
            return
        if st.outcome in ("committed", "superseded"):
            # superseded: a newer save of this rank committed first (saves in flight commit in
            # parallel) and the native store freed this slot; the save is not kept (Written.kept)
            fut.set_result(st.outcome == "committed")
        else:
            fut.set_exception(exc or PCCheckError(f"the checkpoint of step {st.step} failed on rank {self.rank}"))

    def close(self) -> None:
        if self.stack is not None:
            self.stack.close(self.options.remote.close_timeout)
            self.stack = None


class Started:
    """A save this rank started: its (epoch, step), and its outcomes to wait for."""

    def __init__(self, epoch: int, step: int, committed: Future, part: Future | None, remote: Any) -> None:
        self.epoch, self.step = epoch, step
        self._committed, self._part, self._remote = committed, part, remote

    def result(self) -> bool:
        """Whether the save is kept: its local commit durable and kept (not superseded) and, for
        an s3:// save, this rank's part on the object store. Raises the first failure."""
        try:
            kept = self._committed.result()
            if kept and self._part is not None:
                self._part.result()
            return kept
        finally:
            if self._part is not None and not self._part.done():
                self._remote.forget(self.step)  # not committed here: nothing goes up


def rank_store(root: Path, world_size: int, rank: int, engine: EngineOptions,
               options: Options | None = None) -> RankStore:
    """This process's store for (root, rank), opened at its first write with ``options``' tiers
    (the first call's, for each (root, rank))."""
    key = (root, world_size, rank)
    with _registry_lock:
        for (r, w, k), s in _registry.items():
            if r == root and k == rank and w != world_size:
                raise ConfigError(f"{root} is written by a job of {w} ranks in this process; a save of "
                                  f"{world_size} ranks cannot write there too: use another checkpoint_id")
        s = _registry.get(key)
        if s is None:
            s = _registry[key] = RankStore(root, world_size, rank, engine, options or Options())
        return s


def close_stores(root: Path | None = None) -> None:
    """Waits for every checkpoint in flight and closes the stores (of ``root``, or all)."""
    with _registry_lock:
        keys = [k for k in _registry if root is None or k[0] == root]
        stores = [_registry.pop(k) for k in keys]
        if root is None:
            _steps.clear()
    for s in stores:
        try:
            s.close()
        except Exception:  # noqa: BLE001 - at exit, closing the others matters more
            log.exception("pccheck: closing %s failed", s.directory)


atexit.register(close_stores)
