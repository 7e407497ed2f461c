"""Globally consistent checkpoints across the ranks of a torch.distributed job (paper §3.1, §4.1).

Each rank writes its own store under ``PATH/rank-<r>/``. A step is *globally committed* once
every rank has committed it locally (durably, CHECK_ADDR moved). The protocol runs beside
training, on the checkpoint threads, through the process group's key-value store (TCPStore or
FileStore), never through the training collectives:

1. After a local commit of step s, a rank adds 1 to ``e<epoch>/n/<s>``. The rank that brings it
   to the world size appends s to the completion log ``e<epoch>/c/<i>``.
2. Rank 0 follows the completion log; for each completed step newer than the last global one it
   records ``PATH/GLOBAL`` durably (write temp, fsync, rename, fsync the directory) and appends
   it to the global log ``e<epoch>/g/<j>``.
3. Every rank follows the global log. Invariant: a rank never frees the slot holding the newest
   global step it knows, nor any slot with a newer step (it may still become global); its native
   store holds replaced slots instead of freeing them, and this module frees the ones older than
   the global step. Storage: N+2 slots of m bytes per rank (N in flight, the latest, the global).

Every incarnation of the job gets a new *epoch* (one more than any found on disk), stored in each
manifest (its ``epoch`` field), so a step left behind by an earlier incarnation never pairs with a
new one.

The coordinator is the store's retention policy (:class:`~pccheck.orchestrator.retention.Retention`):
the orchestrator opens the store with its extra slot, held slots and protected slots, and asks it
before retiring older generations.

Recovery (:func:`agree_and_load`) does not trust GLOBAL alone: the ranks exchange the set of
(epoch, step) checkpoints each holds *valid* and take the newest one all hold, so a rank whose
newest slot is damaged makes the group fall back together.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import shutdown
from .keys import wait_key
from ..errors import CorruptCheckpointError, NoCheckpointError
from ..orchestrator.incremental import Incremental
from ..orchestrator.retention import HeldSlots, Retention
from ..persist.files import GLOBAL, rank_dir, write_durably
from ..persist.recovery import Restored, load_slot, read_manifest, read_store, scan, store_files

__all__ = ["Group", "detect_group", "GroupCoordinator", "agree_and_load", "read_global"]

log = logging.getLogger("pccheck")


@dataclass(frozen=True)
class Group:
    """This process's place in the job, plus a gloo group and a key-value store of its own."""

    rank: int
    world_size: int
    pg: Any     # a gloo process group for pccheck's own collectives
    store: Any  # a PrefixStore over the default group's store


# (default process group, pccheck's gloo group over it), both held weakly: new_group costs ~0.1 s,
# and a job calls detect_group at every Checkpointer and load. Invariant: every rank calls
# detect_group at the same points (new_group is collective), so every rank has a cached group or
# none, and reuses or creates it at the same call; a re-initialised default group (destroy + init)
# gets a new one. Invariant: the cache never keeps a process group alive. destroy_process_group
# then frees both while Python runs; a group kept into interpreter exit has gloo worker threads
# that drop their last collective's tensors there and abort the process (torch needs the GIL for
# that, and finalization refuses it).
_cached: tuple[weakref.ref[Any], weakref.ref[Any]] | None = None


def detect_group() -> Group | None:
    """The torch.distributed group, if one is initialised with more than one rank (never imports
    torch itself: a process that did not import it is not distributed). Collective the first time
    per default process group."""
    global _cached
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    dist = torch.distributed
    if dist.get_world_size() < 2:
        return None
    from torch.distributed import distributed_c10d as c10d

    default = dist.group.WORLD
    pg = _cached[1]() if _cached is not None and _cached[0]() is default else None
    if pg is None:
        pg = dist.new_group(backend="gloo")  # collective: every rank creates it at the same point
        _cached = (weakref.ref(default), weakref.ref(pg))
    store = dist.PrefixStore("pccheck/", c10d._get_default_store())
    return Group(dist.get_rank(), dist.get_world_size(), pg, store)


def _valid_checkpoints(directory: Path, full: bool,
                       world_size: int) -> tuple[dict[tuple[int, int], tuple[Path, int]], int]:
    """(epoch, step) -> (store file, slot) of every checkpoint in a rank's store that validates
    (meta + manifest; with ``full`` also every array's crc32c), and the highest epoch of any
    generation, including those a job of another world size wrote (they pair with no rank of
    this job: a sharded one is loaded through pccheck.sharded, and retired like any older
    generation once this job's first global step is in)."""
    found: dict[tuple[int, int], tuple[Path, int]] = {}
    top_epoch = 0
    for gen in scan(directory):
        image = gen.image
        if image is None:
            log.warning("pccheck: %s", gen.problem)
            continue
        ours = image.header["world_size"] == world_size
        with open(gen.path, "rb", buffering=0) as f:
            for st in image.slots:
                if st.meta is None:
                    continue
                try:
                    man = (load_slot(image, st.slot, fd=f.fileno()) if full and ours
                           else read_manifest(image, st.slot, f.fileno()))
                except CorruptCheckpointError as exc:
                    log.warning("pccheck: %s slot %d: %s", gen.path, st.slot, exc)
                    continue
                top_epoch = max(top_epoch, man.epoch or 0)
                key = (man.epoch or 0, man.step)
                if ours and (key not in found or found[key][0] < gen.path):
                    found[key] = (gen.path, st.slot)
    return found, top_epoch


def _agree(group: Group, mine: dict[tuple[int, int], Any], seen_epoch: int = 0) -> tuple[tuple[int, int] | None, int]:
    """The newest (epoch, step) every rank holds, and the highest epoch any rank has seen."""
    import torch.distributed as dist

    everyone: list[Any] = [None] * group.world_size
    dist.all_gather_object(everyone, (sorted(mine), seen_epoch), group=group.pg)
    common = set(map(tuple, everyone[0][0]))
    for keys, _ in everyone[1:]:
        common &= set(map(tuple, keys))
    top_epoch = max([k[0] for keys, _ in everyone for k in keys] + [e for _, e in everyone] + [0])
    best = max(common, key=lambda k: (k[1], k[0])) if common else None
    return best, top_epoch


def agree_and_load(path: Path, group: Group, *, verify: bool = True) -> Restored:
    """Every rank loads its part of the newest checkpoint that every rank holds valid."""
    directory = rank_dir(path, group.rank)
    mine, seen = _valid_checkpoints(directory, full=verify, world_size=group.world_size) \
        if directory.is_dir() else ({}, 0)
    best, _ = _agree(group, mine, seen)
    if best is None:
        raise NoCheckpointError(f"no checkpoint under {path} is valid on all {group.world_size} ranks")
    newest = max(mine, key=lambda k: (k[1], k[0]))
    if newest != best:
        log.warning("pccheck: rank %d: newest local checkpoint is step %d but the group agreed on step %d",
                    group.rank, newest[1], best[1])
    file, slot = mine[best]
    image = read_store(file)
    with open(file, "rb", buffering=0) as f:
        return load_slot(image, slot, fd=f.fileno(), verify=verify)


def read_global(path: Path) -> dict[str, Any] | None:
    """The last globally committed step recorded in PATH/GLOBAL, or None."""
    try:
        doc = json.loads((path / GLOBAL).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("step"), int) else None


class GroupCoordinator(Retention):
    """The per-rank side of the protocol, and the store's retention policy. Call order:
    :meth:`prepare` (collective, before the orchestrator opens the store) → :meth:`start` →
    :meth:`on_commit` per local commit → :meth:`close`."""

    extra_slots = 1       # the global latest, beside N in flight and the local latest
    hold_replaced = True  # replaced slots come back through take_held; this class frees them

    def __init__(self, path: Path, group: Group) -> None:
        self.path = path
        self.group = group
        self.epoch = 0
        self.seen_epoch = 0  # an epoch found elsewhere (the memory tier's stores): ours is newer
        self.global_step: int | None = None
        self._slots = HeldSlots()             # what each slot holds; replaced slots kept (the invariant)
        self._recorded: int | None = None     # rank 0: the newest step written to GLOBAL
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._protect: tuple[int, ...] = ()   # slots of the newest generation holding the global step
        self.orch: Any = None  # the Orchestrator owning this rank's store
        # The remote tier's GroupUploader (pccheck/tiers/remote/group.py), if any: it pins the
        # slots of announced steps and, on rank 0, announces steps as they are published.
        self.remote: Any = None
        self._publish_lock = threading.Lock()  # rank 0: record + announce + publish, as one
        # incremental=True: counter -> step of the local commits whose cells are held. A commit that
        # can still become (or is) the global step may be loaded by the group, so the cells it
        # references stay pinned as long as its slot is held (the same rule, _settle_locked).
        self._held_cells: dict[int, int] = {}

    def prepare(self, directory: Path) -> None:
        """Agrees on this incarnation's epoch and the global step to keep, and finds the slots of
        this rank's newest store file that hold it (:meth:`protected_slots`). Collective."""
        mine, seen = _valid_checkpoints(directory, full=False, world_size=self.group.world_size) \
            if directory.is_dir() else ({}, 0)
        best, top_epoch = _agree(self.group, mine, max(seen, self.seen_epoch))
        self.epoch = top_epoch + 1
        files = store_files(directory)
        self._slots.generation = files[0][0] if files else 1  # the generation the store will open (or create)
        protect = []
        if best is not None:
            self.global_step = best[1]
            file, slot = mine[best]
            if files and file == files[0][1]:
                protect.append(slot)
                self._slots.step_of[slot] = best[1]
        self._protect = tuple(protect)

    # -- the retention policy (asked by the orchestrator) ---------------------------------------

    def protected_slots(self) -> tuple[int, ...]:
        return self._protect

    def may_free_slots(self) -> bool:
        """Held slots come back as the global step moves on: while the followers run, a rank
        that ran ahead of the others waits for them instead of failing."""
        return not self._stop.is_set()

    def may_retire(self, generation: int) -> bool:
        """Older generations may go once a globally committed step lives in ``generation``."""
        with self._lock:
            return self._slots.holds(generation, self.global_step)

    def start(self, orch: Any) -> None:
        """Starts the log followers. The orchestrator's store holds replaced slots for us."""
        self.orch = orch
        cells = getattr(orch, "cells", None)
        if isinstance(cells, Incremental):
            cells.hold_commits = True
            cells.protected = self.protected_slots
            if orch.store.native is not None and orch.store.file is not None:  # opened before start
                image = read_store(orch.store.file)
                with open(orch.store.file, "rb", buffering=0) as f:
                    cells.hold_slots(image, f.fileno(), self._protect)
        followers = [self._follow_globals] + ([self._follow_completions] if self.group.rank == 0 else [])
        for fn in followers:
            self._threads.append(shutdown.thread(fn, f"pccheck-{fn.__name__}"))

    # -- local commits --------------------------------------------------------------------------

    def on_commit(self, step: int, slot: int, counter: int | None = None) -> None:
        """After this rank's commit of ``step`` into ``slot`` (commit ``counter``) became durable
        (commit thread)."""
        with self._lock:
            self._slots.record(self.orch, slot, step)
            if counter is not None and isinstance(getattr(self.orch, "cells", None), Incremental):
                self._held_cells[counter] = step  # held by Incremental.end (hold_commits)
            self._settle_locked()
        st = self.group.store
        if st.add(f"e{self.epoch}/n/{step}", 1) == self.group.world_size:
            i = st.add(f"e{self.epoch}/c", 1)
            st.set(f"e{self.epoch}/c/{i}", str(step))

    def _settle_locked(self) -> None:
        """Frees held slots that can no longer be the global latest (older than it), except the
        ones the remote tier still uploads from. The cells of those commits go back first
        (incremental: a slot is reused only once no held commit pins its cells)."""
        if self.orch is not None:
            pinned = self.remote.pinned if self.remote is not None else None
            if isinstance(getattr(self.orch, "cells", None), Incremental):
                self._held_cells.update(self.orch.cells.take_held_on_open())
            if self.global_step is not None:
                for counter, step in list(self._held_cells.items()):
                    if step < self.global_step and not (pinned is not None and pinned(step)):
                        del self._held_cells[counter]
                        self.orch.cells.release(counter)
            self._slots.settle(self.orch, self.global_step, pinned)

    # -- the remote tier's side (pccheck/tiers/remote/group.py) ----------------------------------

    def attach_remote(self, uploader: Any) -> None:
        """The remote tier's GroupUploader: it pins the slots of announced steps, and on rank 0
        announces steps as they are published. One more slot is held: the one being uploaded."""
        self.remote = uploader
        self.extra_slots = 2

    def slot_of(self, step: int) -> int | None:
        """The slot of the open generation holding ``step`` (this incarnation's commits)."""
        with self._lock:
            slots = [s for s, st in self._slots.step_of.items() if st == step]
        return max(slots) if slots else None

    def release_unpinned(self) -> None:
        with self._lock:
            self._settle_locked()

    def announce_newest(self) -> None:
        """Rank 0: lets the remote tier announce the newest published global step."""
        with self._publish_lock:
            if self.remote is not None:
                self.remote.announce_newest(self._recorded)

    # -- the logs -------------------------------------------------------------------------------

    def _wait_key(self, key: str) -> str | None:
        # polls (non-blocking): a blocking wait would hold the job store's shared connection, and
        # every other request of this process (a flush's agreement, the commits) would queue behind it
        return wait_key(self.group.store, key, self._stop.is_set, blocking=False)

    def _follow_completions(self) -> None:
        """Rank 0: records every newly completed step as the global step, durably, then logs it."""
        i = 1
        while (v := self._wait_key(f"e{self.epoch}/c/{i}")) is not None:
            i += 1
            step = int(v)
            with self._publish_lock:
                if self._recorded is None or step > self._recorded:
                    self._write_global(step)
                    self._recorded = step
                    if self.remote is not None:  # before the step is published (group.py, step 1)
                        self.remote.on_global_published(step)
                    j = self.group.store.add(f"e{self.epoch}/g", 1)
                    self.group.store.set(f"e{self.epoch}/g/{j}", str(step))

    def _follow_globals(self) -> None:
        j = 1
        while (v := self._wait_key(f"e{self.epoch}/g/{j}")) is not None:
            j += 1
            step = int(v)
            with self._lock:
                newer = self.global_step is None or step > self.global_step
                if newer:
                    self.global_step = step
                    self._settle_locked()
            if newer and self.orch is not None:
                self.orch.retire_if_allowed()  # outside our lock: it takes ours (may_retire)

    def _write_global(self, step: int) -> None:
        doc = {"step": step, "epoch": self.epoch, "world_size": self.group.world_size, "unix_time": time.time()}
        write_durably(self.path / GLOBAL, lambda f: f.write(json.dumps(doc).encode()))

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
