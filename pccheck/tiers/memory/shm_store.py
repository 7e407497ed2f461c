"""The memory tier: a store (FORMAT.md §1-§5, unchanged) on tmpfs, written every k iterations.

``MemoryTier`` owns a second :class:`~pccheck.orchestrator.Orchestrator`, over
``/dev/shm/pccheck/<store>`` (``MemoryOptions.dir``), that writes in ``mmap`` mode (tmpfs refuses
O_DIRECT; a barrier there is an ``msync`` of tmpfs pages, so a memory checkpoint survives the
process, not the machine). It is fed the same snapshots as the disk tier: the same
``TorchState``, at the same ``maybe_checkpoint`` call, with the same soft copy-on-write guard
(the optimizer step pre-hook waits for both tiers' copies).

It is a :class:`pccheck.tiers.base.Tier` beside the disk (its call order): ``build_memory_tier``
(collective in a group: before the disk coordinator prepares) → :meth:`start` (once the job's
epoch is known) → :meth:`prepare` (once the state's size is final; else the first checkpoint
opens the store) → :meth:`on_step` per iteration → :meth:`ensure_copied` before each optimizer
step → :meth:`close`.

Memory, per rank, on tmpfs (``memory_need``, FORMAT.md §13), with ``k`` = ``MemoryOptions.keep_last``
(0 or 1: older memory checkpoints kept): own store ``own_slots`` = 2 + k slots of the state
single-process and with replication (1 in flight and the newest, or with replication the newest
replicated everywhere: MemoryCoordinator; plus k older), 3 + k in a group without replication
(§8's global step too), plus ``replica_slots`` = 2 + k per source rank whose replicas this rank
holds (replicas - 1 of them: the newest committed replica, k older, and the one being received):
4x the state at replicas=2 by default, 6x with k = 1; in process memory a chunk pool per store (one
``MEM_CHUNK`` for host state, which is copied in place; a whole snapshot's for device state, in the
own store only) and one receive buffer of the state per source.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

from ...group.distributed import Group, GroupCoordinator
from ...errors import ConfigError, NoSpaceError, PCCheckError, StorageError
from ...orchestrator.args import StartArgs
from ...orchestrator.engine_choice import select_copy_engine
from ...orchestrator.options import EngineOptions
from ...orchestrator.orchestrator import CommitInfo, Orchestrator
from ...orchestrator.retention import KeepOlder, Retention
from ...persist.layout import Layout
from ...persist.recovery import store_files
from ..base import TierContext
from .paths import MEMORY_ROOT, default_memory_dir, memory_rank_dir, replica_dir

__all__ = ["MemoryTier", "MemoryCoordinator", "build_memory_tier", "default_memory_dir", "memory_rank_dir", "replica_dir",
           "memory_need", "own_slots", "replica_slots", "check_room", "MEMORY_ROOT", "MEM_CHUNK"]

log = logging.getLogger("pccheck")

BLOCK = 4096
MEM_CHUNK = 16 << 20   # chunk of the memory tier's pool: memcpy into tmpfs pages, no device to feed
MAX_WRITERS = 16       # the memory tier's writer threads: at most this many (half the host's cores)


def replica_slots(keep_last: int) -> int:
    """Slots of one replica store: the slot being received, the newest committed replica and
    ``keep_last`` (0 or 1) older ones. Invariant (the store's free queue hands out the slot freed
    longest ago): while one replica is received, the newest 1 + keep_last committed stay valid."""
    return 2 + keep_last


def own_slots(keep_last: int, group: bool, replicating: bool) -> int:
    """Slots of a rank's own memory store: 1 in flight, the newest (with replication: the newest
    replicated everywhere, R, which the peers' replicas pair with; MemoryCoordinator), §8's global
    step in a group without replication, and ``keep_last`` older ones."""
    return 2 + (1 if group and not replicating else 0) + keep_last


def memory_need(slot_bytes: int, own: int, sources: int, per_source: int) -> int:
    """tmpfs bytes: own store of ``own`` slots (header, meta records, slots) plus ``per_source``
    slots for each of ``sources`` replica stores."""
    return (1 + own) * BLOCK + own * slot_bytes + sources * ((1 + per_source) * BLOCK + per_source * slot_bytes)


def check_room(root: Path, need: int) -> None:
    """NoSpaceError unless the file system of ``root`` has ``need`` bytes (counting the store
    files already there, which a reopen reuses)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise StorageError(exc.errno or errno.EIO, f"cannot use the memory tier directory {root}: "
                           f"{exc.strerror or exc}; pass memory=pccheck.MemoryOptions(dir=...) on a tmpfs with room") from None
    have = sum(f.stat().st_size for d in [root, *root.glob("*")] if d.is_dir() for _, f in store_files(d))
    if free + have < need:
        raise NoSpaceError(errno.ENOSPC, f"the memory tier needs {need / 2**20:.1f} MiB on {root} (own slots and "
                           f"replicas of the state) but only {(free + have) / 2**20:.1f} MiB are free there: "
                           f"enlarge /dev/shm (docker --shm-size), pass MemoryOptions(dir=...) elsewhere, or lower "
                           f"replicas (or memory.keep_last)")


class MemoryCoordinator(GroupCoordinator):
    """The group protocol of pccheck.distributed for the memory stores (its own key prefix and
    GLOBAL under the memory root), keeping ``keep_last`` (0 or 1) older steps besides.

    With replication the store has N + 1 + keep_last slots (``own_slots``), and a slot a commit
    replaced is held until it is older than the oldest of the 1 + keep_last newest steps
    *replicated everywhere* (every rank's replica committed on each of its peers:
    replicate.Replicator follows that log). Invariant: every rank's own store holds the newest
    step replicated everywhere, R (and with keep_last=1 the one before, R'), which every peer's
    replica store holds too (it keeps its 1 + keep_last newest committed replicas while it
    receives the next, and no rank sends R + 2 before R + 1 is replicated everywhere:
    Replicator.throttle), so a lost peer's replicas pair with a step the survivors hold (with
    keep_last=1 even when its newest replica is damaged). The next memory checkpoint starts only
    once the previous one is replicated everywhere, which frees the slot of the oldest kept step;
    when it cannot be (a peer dropped, a replica or a commit failed), the Replicator stops taking
    memory checkpoints instead, so the kept steps stay held (never waits for a slot that will not
    come back). Without replication, §8's rule and slots (N + 2: the global step beside the
    latest), plus keep_last slots for the global steps before it."""

    def __init__(self, path: Path, group: Group, shared_store: Any = None, prefix: str = "memory/",
                 keep_last: int = 0) -> None:
        super().__init__(path, group)
        # where a follower thread's KeyWaiter connects: the job's store (the group's is prefixed
        # already) under the same prefix as the group's store (_prefixed)
        self.shared_store, self.prefix = shared_store if shared_store is not None else group.store, prefix
        self._local = threading.local()
        self.keep_last = keep_last
        self.replicating = False
        self.replicated: list[int] = []  # the 1 + keep_last newest steps replicated everywhere
        self._globals: list[int] = []    # without replication: the 1 + keep_last newest global steps

    def _settle_locked(self) -> None:
        """Gives back the held slots older than the oldest step kept: with replication the oldest
        of the 1 + keep_last newest replicated everywhere (None before the first: nothing
        committed in this incarnation is given back), else of the 1 + keep_last newest global."""
        if self.orch is not None:
            if self.replicating:
                kept = self.replicated
            else:
                if self.global_step is not None and (not self._globals or self.global_step > self._globals[-1]):
                    self._globals = [*self._globals, self.global_step][-(1 + self.keep_last):]
                kept = self._globals
            self._slots.settle(self.orch, kept[0] if kept else None)

    def protected_slots(self) -> tuple[int, ...]:
        """With replication and keep_last=0, none: a reopened store of 2 slots whose latest step
        is newer than the agreed one would have no slot left for the first checkpoint (a
        deadlock), so the agreed step is given up to that checkpoint (FORMAT.md §13, "after a
        restart"); with keep_last=1 the third slot leaves room, and the agreed step is kept."""
        return () if self.replicating and self.keep_last == 0 else super().protected_slots()

    def _wait_key(self, key: str) -> str | None:
        """Blocks (KeyWaiter) until ``key`` is set; each follower thread has a connection of its
        own, so neither the other follower nor on_commit's adds wait behind it."""
        from .wire import KeyWaiter

        w = getattr(self._local, "waiter", None)
        if w is None:
            w = self._local.waiter = KeyWaiter.connect(self.shared_store, self.prefix, 120.0)
        return w.wait(key, self._stop)

    def set_replicated(self, step: int) -> None:
        """``step`` is replicated everywhere (the Replicator's log follower): the slots of steps
        older than the kept ones come back."""
        with self._lock:
            if not self.replicated or step > self.replicated[-1]:
                self.replicated = [*self.replicated, step][-(1 + self.keep_last):]
                self._settle_locked()


def _prefixed(group: Group, prefix: str) -> Group:
    from .wire import private_store

    return dataclasses.replace(group, store=private_store(group.store, prefix, 120.0))


def _room_everywhere(root: Path, need: int, group: Group | None) -> None:
    """check_room on every rank; in a group every rank raises if any lacks room (collective: a
    rank that raised alone would leave the others waiting in the next collective)."""
    from .wire import gather_json

    problem: StorageError | None = None
    try:
        check_room(root, need)
    except StorageError as exc:
        problem = exc
    if group is not None:
        oks = gather_json(group.pg, group.world_size, problem is None, 120.0)
        if problem is None and not all(oks):
            raise NoSpaceError(errno.ENOSPC, f"the memory tier has no room on ranks "
                               f"{[r for r, ok in enumerate(oks) if not ok]} (see their errors)")
    if problem is not None:
        raise problem


class MemoryTier:
    """Memory checkpoints of one rank every ``interval`` steps, replicated to ``replicas`` - 1
    peers (pccheck.tiers.memory.replicate). Built by :func:`build_memory_tier`; see the module
    docstring."""

    name = "memory"
    after_disk = False  # its own checkpoints, from the same snapshots as the disk's

    def __init__(self, root: Path, interval: int, replicas: int, engine: EngineOptions, slot_bytes: int,
                 group: Group | None, on_error: Callable[[PCCheckError], None], layout: Layout,
                 arrays: Mapping[str, Any], device_bytes: int = 0, keep_last: int = 0,
                 incremental: bool = False) -> None:
        from .replicate import ReplicaLinks  # collective when replicas > 1

        if interval < 1:
            raise ConfigError(f"memory.every must be a positive integer, got {interval}")
        self.root, self.interval, self.group, self.keep_last = root, interval, group, keep_last
        # incremental: each slot stays whole; a checkpoint copies into it (and a replica receives)
        # only the arrays it does not hold already (orchestrator/slot_records.py)
        self.incremental = incremental
        self._layout, self._arrays = layout, arrays  # the first snapshot's: the store's layout, the copy engine
        self.dir = memory_rank_dir(root, group.rank if group is not None else None)
        self._on_error = on_error
        self.epoch: int | None = None
        self.orch: Orchestrator | None = None
        # One in flight, copied in place, straight into the tmpfs slot (the Orchestrator begins its
        # jobs in_place on a populated mmap store): host state by the CPU engine, device state by
        # DMA into the slot's registered mapping (cuda_engine.py, "In place"), so no snapshot
        # crosses host memory twice and the pool is never used: one chunk, the least an engine has
        # (a device engine's chunk size: the slot's chunks are its DMA units).
        chunk = int(engine.chunk_size) if device_bytes else min(MEM_CHUNK, int(engine.chunk_size))
        budget = chunk
        if incremental:  # the changed arrays go through the pool (no in-place copy): a few chunks
            budget = 4 * chunk
        # Writers: tmpfs is written by memcpy, so the CPU, not a device queue, sets the pace. At
        # memory.every=1 on an H200 (8.8 GiB every 0.4 s) four writers reached ~11 GB/s and the
        # next iteration waited for them (bench/README.md, "On a GPU"): half the host's cores, at least the disk's.
        writers = max(int(engine.writer_threads), min(MAX_WRITERS, (os.cpu_count() or 2) // 2))
        self._engine = replace(engine, max_concurrent=1, storage="mmap", chunk_size=chunk, dram_budget=budget,
                               writer_threads=writers)
        # the last finished memory checkpoints' timings (CheckpointStats), newest last
        self.recent: collections.deque[Any] = collections.deque(maxlen=64)
        self.links = ReplicaLinks.connect(group, replicas) if group is not None else ReplicaLinks.single(replicas)
        # the slots (own_slots, replica_slots): 1 in flight, the newest (with replication the
        # newest replicated everywhere, MemoryCoordinator), §8's global step in a group without
        # replication, and keep_last older ones; the same keep_last in every replica store
        self.slots = own_slots(keep_last, group is not None, bool(self.links.peers))
        _room_everywhere(root, memory_need(slot_bytes, self.slots, len(self.links.sources), replica_slots(keep_last)),
                         group)
        self.coord: MemoryCoordinator | None = None
        if group is not None:
            self.coord = MemoryCoordinator(root, _prefixed(group, "memory/"), group.store, "memory/", keep_last)
            self.coord.extra_slots = self.slots - 2  # beyond 1 in flight + the latest
            self.coord.prepare(self.dir)  # collective: the memory stores' epochs and common step
        self.replicator: Any = None
        if self.coord is not None:
            self.coord.replicating = bool(self.links.peers)

    @property
    def seen_epoch(self) -> int:
        """The newest epoch found in the memory stores of the group (0 single-process)."""
        return self.coord.epoch - 1 if self.coord is not None else 0

    def start(self, disk: Any, epoch: int | None) -> None:
        """Makes the memory store's orchestrator (its store opens at :meth:`prepare`, or at the
        first memory checkpoint) and starts replication. ``disk`` is not used: the tier takes its
        own checkpoints."""
        from .replicate import Replicator

        self.epoch = epoch
        if self.coord is not None and epoch is not None:
            self.coord.epoch = epoch  # the disk tier's: both tiers' manifests pair by (epoch, step)
        world_size, rank = (self.group.world_size, self.group.rank) if self.group is not None else (1, 0)
        layout, arrays, self._arrays = self._layout, self._arrays, {}
        retention: Retention = self.coord if self.coord is not None else KeepOlder(self.keep_last)
        self.orch = Orchestrator(self.dir, layout, self._engine, copy_engine=select_copy_engine(arrays),
                                 on_error=self._on_error, retention=retention, world_size=world_size, rank=rank,
                                 on_commit=self._on_commit, on_finished=self._finished, pool=False,
                                 populate_store=True, in_slot=self.incremental)
        if self.coord is not None:
            self.coord.start(self.orch)
        if self.links.peers or self.links.sources:
            self.replicator = Replicator(self.links, self.root, self._engine, epoch or 0, self.coord,
                                         keep_last=self.keep_last, incremental=self.incremental)

    def prepare(self, layout: Layout, metadata: Mapping[str, Any], tree: Any) -> None:
        """Opens the memory store and makes its pool now, once the state's size is final (the
        Checkpointer's preparation), instead of inside the first memory checkpoint: the store's
        pages are then populated in the background from here on (native ``Store.populate``),
        before the loop's first iterations rather than beside them."""
        if self.orch is not None:
            took = self.orch.prepare(layout, metadata, tree, self.epoch)
            log.debug("pccheck: memory store prepared in %.3f s", took)

    def _finished(self, st: Any) -> None:
        self.recent.append(st)
        if self.replicator is not None:
            self.replicator.finished(st)  # a failed own commit: the other ranks stop at once

    def _on_commit(self, info: CommitInfo) -> None:
        if self.coord is not None:
            self.coord.on_commit(info.step, info.slot)
        if self.replicator is not None:
            self.replicator.offer(info)

    def on_commit(self, info: CommitInfo) -> None:
        """A disk commit: nothing to do (the memory tier takes its own checkpoints)."""

    def on_step(self, step: int, snapshot: Callable[[], Any], metadata: Mapping[str, Any], soft_cow: bool) -> bool:
        """A memory checkpoint of ``step`` if ``step % interval == 0``; returns whether one started."""
        if self.orch is None or step % self.interval:
            return False
        if self.replicator is not None:
            # the previous one committed (or failed) first, whatever when_busy says: throttle then
            # knows which it was, and a start never waits inside the store for a slot that only the
            # previous one's replication frees (MemoryCoordinator).
            # Invariant (2 + keep_last slots): the slot this start takes is never one committed and
            # needed (R and keep_last before it: held by the coordinator), queued or being sent
            # (sends go in step order, and the previous step, replicated everywhere, was sent last)
            self.orch.wait()
            if not self.replicator.throttle(int(step)):
                return False  # the previous one cannot be replicated everywhere: the tier stopped
        snap = snapshot()
        try:
            return self.orch.start(int(step), snap.arrays, metadata, StartArgs(
                tree=snap.tree, epoch=self.epoch, n_eager=snap.n_eager if soft_cow else None,
                validate=snap.validate if soft_cow else None))
        except StorageError as exc:
            self._on_error(exc)
            return False

    def ensure_copied(self) -> None:
        """Soft copy-on-write: returns once no memory checkpoint still reads live tensors."""
        if self.orch is not None:
            self.orch.ensure_copied()

    def wait(self, timeout: float | None = None) -> bool:
        """Returns once every memory checkpoint started has committed or failed (a local copy
        into RAM: ``timeout`` is not needed and not used)."""
        if self.orch is not None:
            self.orch.wait()
        return True

    def flush(self, deadline: float, step: int | None = None) -> int | None:
        """A preemption: the memory checkpoint in flight commits (a copy into RAM: ``deadline``
        is not needed); returns the newest step this process committed to its memory store."""
        self.wait()
        return self.orch.last_durable_step if self.orch is not None else None

    def newest(self) -> dict[str, Any]:
        """Newest step per tier this rank knows: its own memory commit, the newest step every
        peer acknowledged, and per source rank the newest replica it holds."""
        out: dict[str, Any] = {"memory": self.orch.last_durable_step if self.orch is not None else None}
        if self.incremental:  # per memory checkpoint: bytes copied into its slot and left in place
            out["memory_bytes"] = [{"step": st.step, "copied": st.bytes_written, "kept": st.bytes_referenced,
                                    "fingerprint_s": st.fingerprint_s, "outcome": st.outcome}
                                   for st in list(self.recent)]
        if self.replicator is not None:
            out.update(self.replicator.newest())
        return out

    def close(self, timeout: float | None = None) -> None:
        """Waits for the memory checkpoints in flight, sends the newest to the peers, waits for
        theirs (bounded by the replication's own timeouts), then closes the stores."""
        try:
            if self.orch is not None:
                self.orch.wait()
            if self.replicator is not None:
                self.replicator.close()
        finally:
            try:
                if self.orch is not None:
                    self.orch.close()
            finally:
                if self.coord is not None:
                    self.coord.close()


def build_memory_tier(ctx: TierContext, engine: EngineOptions, layout: Layout, snap: Any) -> MemoryTier | None:
    """The memory tier of ``ctx`` (None when ``memory.every`` is not set). Collective in a
    group; raises ConfigError for a combination it does not support, NoSpaceError when the
    memory directory's file system is too small for ``memory_need`` bytes."""
    from ...orchestrator.incremental import aligned, refuse_incremental
    from ...persist.layout import manifest_upper_bound

    t, opts = ctx.options.memory, ctx.options
    if t.every is None:
        return None
    if opts.group.replicated is not None:
        raise ConfigError("the memory tier needs every rank to write its own state: drop replicated='rank0'")
    if opts.snapshot.spread_steps != 1:
        raise ConfigError("the memory tier does not take spread checkpoints yet: use spread_steps=1")
    root = Path(t.dir) if t.dir is not None else default_memory_dir(ctx.path)
    incremental = opts.disk.incremental if t.incremental is None else t.incremental  # MemoryOptions says
    on_device = select_copy_engine(snap.arrays).name != "cpu"
    if incremental and on_device:
        devices = sorted({i.device for i in layout.infos if i.device != "cpu"})
        raise refuse_incremental(f"memory checkpoints of state on {', '.join(devices)} (its fingerprint would run "
                                 "on the device)")
    sized = aligned(layout, incremental)  # incremental: block-aligned arrays, each copied on its own
    data = sized.data_len
    if ctx.source.may_grow():  # Adam's state appears at its first step: two moments per parameter
        data *= 3
    man = manifest_upper_bound(sized, ctx.metadata, tree=snap.tree, epoch=2**62, incremental=incremental) + (64 << 10)
    slot = data + (man + BLOCK - 1) // BLOCK * BLOCK
    return MemoryTier(root, t.every, t.replicas, engine, slot, ctx.group, ctx.on_error, layout,
                      snap.arrays, device_bytes=data if on_device else 0, keep_last=t.keep_last,
                      incremental=incremental)
