"""The disk store and the tiers around it, for one process's state: built in one place, fed in
one order, torn down in one place.

:class:`TierStack` owns the disk tier (the :class:`~pccheck.orchestrator.Orchestrator` over
``path``, or ``path/rank-<r>`` in a group, with its :class:`~pccheck.group.GroupCoordinator`) and
the configured tiers of :mod:`pccheck.tiers.base` (history, remote, memory; an unconfigured one is
not in the list). Build order, each step collective in a group where it says so::

    history  → coordinator → remote (probes the object store) → memory (collective: room on
    every rank, replica links) → disk (the coordinator's prepare is collective; the store opens
    now unless the state may still grow) → every tier's start(disk, epoch) → prepare

Invariant (teardown): one ExitStack holds every close, pushed in the order that makes it unwind
as memory (its checkpoints in flight, the newest replicated) → the disk's commits in flight (they
queue the last uploads and copies) → remote (up to ``remote_timeout``) → the disk store → the
coordinator → the history's copies. The same stack unwinds a construction that fails half way
(remote timeout 0 then), so nothing built is left running.

Every entry point opens its disk store here: the Checkpointer, the named stores of the Lightning
and Accelerate plugins (``integrations/named.py``), and each rank store of a ``pccheck.dcp``
save, whose ranks DCP's planner pairs (a :class:`SetMember`: the caller's directory, rank and
retention in place of a GroupCoordinator; its remote tier is ``tiers/remote/sets.py``'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import ConfigError, ErrorSink, StorageError
from ..group.distributed import GroupCoordinator
from ..orchestrator.args import StartArgs
from ..orchestrator.copy_engine import CopyEngine
from ..orchestrator.engine_choice import select_copy_engine
from ..orchestrator.incremental import aligned, refuse_incremental
from ..orchestrator.options import EngineOptions
from ..orchestrator.orchestrator import CommitInfo, Orchestrator
from ..orchestrator.retention import Retention
from ..orchestrator.stats import StatsReport
from ..persist.files import rank_dir
from ..persist.layout import Layout
from .base import Tier, TierContext
from .memory.shm_store import build_memory_tier
from .remote.group import build_remote_tier

__all__ = ["TierStack", "SetMember"]

log = logging.getLogger("pccheck")

# The incremental default stays off for a state of many small arrays: each array of an incremental
# checkpoint starts on a 4 KiB block (its cells, FORMAT.md §14), and where that grows the state by
# more than this share the padding written and the per-array work cost more than the references
# save (2,400 arrays in 7.4 MiB: the slot doubles).
MAX_ALIGNMENT_GROWTH = 0.02


@dataclass(frozen=True)
class SetMember:
    """One rank's disk store in a set its caller pairs (``pccheck.dcp``: the planner hands every
    rank the save's (epoch, step), the coordinator's ``finish`` records the set), given to
    :class:`TierStack` in place of the GroupCoordinator it would make.

    Attributes:
        directory: this rank's store directory.
        world_size, rank: the set's size and this rank, written to each manifest.
        retention: the caller's policy (it holds the slots its sets and their uploads need).
        on_commit: called at each local commit, before the tiers after the disk are told.
    """

    directory: Path
    world_size: int
    rank: int
    retention: Retention
    on_commit: Callable[[CommitInfo], None]


def refuse_memory(options: Any) -> None:
    """ConfigError when a memory tier is asked of a set's rank store (see docs/guide/memory.md):
    the memory tier takes its checkpoints at steps (``on_step``, every ``memory.every``) from a
    state source whose layout it sizes once, and restores through ``load_latest``; a DCP save
    has neither (its planner hands each save's write items to ``write_data``, and
    ``pccheck.dcp.Reader`` reads the set on disk or on the object store)."""
    if options.memory.every is not None:
        raise ConfigError("pccheck.dcp saves have no memory tier: DCP's planner hands each save's items to the "
                          "storage writer (no steps, no state source to snapshot every memory.every steps), and "
                          "pccheck.dcp.Reader reads sets from disk or s3://; drop memory=, or checkpoint with "
                          "pccheck.Checkpointer(..., memory=pccheck.MemoryOptions(every=k)) for a RAM tier")


class TierStack:
    """Builds and runs the disk tier and the configured tiers of one process (see the module
    docstring). ``writes=False`` (a data-parallel replica whose rank 0 writes): no disk, no tier.

    Args:
        ctx: what the tiers are built from, without ``coord`` (the stack makes the coordinator).
        engine: the disk tier's resolved engine options.
        layout, snap: the state's first snapshot (its layout, arrays and tree).
        prepared: make the disk's pool now, and open its store (else :meth:`prepare`, once the
            state is final).
        open_now: with ``prepared``, open the store now, sized for ``snap``'s manifest (False:
            at the first checkpoint, sized for its own manifest: the integrations' named saves).
        on_finished: called with each finished disk checkpoint's stats (the online tuner).
        copy_engine, device_reserve: the snapshot options of the disk tier.
        member: one rank of a set its caller pairs (no group in ``ctx``): its directory, rank
            and retention, and no memory tier (ConfigError, :func:`refuse_memory`).
    """

    def __init__(self, ctx: TierContext, engine: EngineOptions, layout: Layout, snap: Any, *, writes: bool,
                 prepared: bool, on_finished: Callable[[Any], None] | None = None,
                 copy_engine: CopyEngine | None = None, device_reserve: Any = None, open_now: bool = True,
                 member: SetMember | None = None) -> None:
        ctx = _resolve_incremental(ctx, layout, copy_engine, device_reserve)
        group, opts = ctx.group, ctx.options
        if member is not None:
            if group is not None:
                raise ConfigError("a set's rank store is paired by its caller: give no torch.distributed group too")
            refuse_memory(opts)
        self.member = member
        self.disk: Orchestrator | None = None
        self.coord: GroupCoordinator | None = None
        self.tiers: list[Tier] = []
        self._remote_timeout: float | None = 0.0  # until close() says otherwise (a failed construction)
        if opts.disk.incremental:
            _check_incremental(layout, copy_engine)
        self.started_step: int | None = None  # the newest step a disk checkpoint was started for
        self.flushed: dict[str, Any] | None = None  # the last flush's FlushResult.as_dict() (stats())
        stack = contextlib.ExitStack()
        try:
            history = None
            disk = opts.disk
            if disk.keeps_copies and writes:
                from ..ops.history import HistoryKeeper

                legacy = disk.legacy_history  # pccheck 0.1.0's keep_every/max_history: counted in commits
                history = HistoryKeeper(ctx.path, keep_last=disk.keep_last, keep_every=disk.keep_every,
                                        legacy=(legacy.keep_every, legacy.max_history) if legacy else None)
                stack.callback(history.close)
            if group is not None and opts.group.replicated is None:
                self.coord = GroupCoordinator(ctx.path, group)
                stack.callback(self.coord.close)
            self.ctx = ctx = dataclasses.replace(ctx, coord=self.coord)
            stack.callback(self._close_disk)
            remote = build_remote_tier(ctx, writes, member)
            if remote is not None:
                stack.callback(lambda: remote.close(self._remote_timeout))
            stack.callback(self._drain_disk)  # the disk's last commits queue their uploads and copies
            memory = build_memory_tier(ctx, engine, layout, snap)
            if memory is not None:
                stack.callback(memory.close)
                if self.coord is not None:  # the disk tier's epoch is newer than any in memory
                    self.coord.seen_epoch = max(self.coord.seen_epoch, memory.seen_epoch)
            self.tiers = [t for t in (history, remote, memory) if t is not None]
            if writes:
                self.disk = self._open_disk(engine, layout, snap, prepared, on_finished, copy_engine, device_reserve,
                                            remote, open_now)
                for tier in self.tiers:
                    tier.start(self.disk, self.epoch)
                    if prepared:
                        tier.prepare(layout, ctx.metadata, snap.tree)
        except BaseException:
            stack.close()
            raise
        self._teardown = stack

    def _open_disk(self, engine: EngineOptions, layout: Layout, snap: Any, prepared: bool,
                   on_finished: Callable[[Any], None] | None, copy_engine: CopyEngine | None, device_reserve: Any,
                   remote: Any, open_now: bool) -> Orchestrator:
        """The orchestrator over this process's store (``path``, or ``path/rank-<r>`` in a group),
        its store opened now when ``prepared``."""
        ctx, group = self.ctx, self.ctx.group
        store_dir, world_size, rank = ctx.path, 1, 0
        retention: Any = self.coord if self.coord is not None else remote.retention if remote is not None else None
        if self.member is not None:
            m = self.member
            store_dir, world_size, rank, retention = m.directory, m.world_size, m.rank, m.retention
        elif self.coord is not None:
            store_dir, world_size, rank = rank_dir(ctx.path, group.rank), group.world_size, group.rank
            self.coord.prepare(store_dir)  # collective: every rank constructs together
        self.disk = orch = Orchestrator(
            store_dir, layout, engine, copy_engine=copy_engine or select_copy_engine(snap.arrays),
            on_error=ctx.on_error, retention=retention, world_size=world_size, rank=rank, on_commit=self._on_commit,
            on_finished=on_finished, device_reserve=device_reserve, pool=prepared,
            incremental=ctx.options.disk.incremental)
        if prepared and open_now:
            orch.open_store(orch.slot_bytes(layout, ctx.metadata, snap.tree, self.epoch))
        # else: the store and the chunk pool are sized once the state is final (prepare), instead
        # of a generation and a pool replaced at the first checkpoint.
        if self.coord is not None:
            self.coord.start(orch)
        return orch

    @property
    def epoch(self) -> int | None:
        """The job incarnation recorded in each manifest (a group), else None."""
        return self.coord.epoch if self.coord is not None else None

    def tier(self, name: str) -> Any:
        """The configured tier of that name, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    # -- the steps ---------------------------------------------------------------------------------

    def on_step(self, step: int, snapshot: Callable[[], Any], metadata: Mapping[str, Any], soft_cow: bool) -> None:
        """Every maybe_checkpoint call, before the disk's own checkpoint: the tiers beside the
        disk take theirs on their own schedule."""
        for tier in self.tiers:
            if not tier.after_disk:
                tier.on_step(step, snapshot, metadata, soft_cow)

    def _on_commit(self, info: CommitInfo) -> None:
        """A disk checkpoint became the durable latest (a commit thread)."""
        if self.member is not None:
            self.member.on_commit(info)  # the set's retention records the slot first
        if self.coord is not None:
            self.coord.on_commit(info.step, info.slot, info.counter)
        for tier in self.tiers:
            if tier.after_disk:
                tier.on_commit(info)  # only enqueues: the copies run on the tiers' own threads

    def start(self, step: int, arrays: Mapping[str, Any], metadata: Mapping[str, Any], args: StartArgs) -> bool:
        """The disk checkpoint of ``step`` (the orchestrator's start)."""
        assert self.disk is not None
        started = self.disk.start(step, arrays, metadata, args)
        if started and (self.started_step is None or step > self.started_step):
            self.started_step = step
        return started

    def start_take(self, take: Any, metadata: Callable[[Any], Mapping[str, Any]], errors: ErrorSink) -> bool:
        """The disk checkpoint of one snapshot (a ``spread.strategy.Take``), its manifest's
        metadata ``metadata(take.metadata)`` (checked there: a bad one gives the take back too);
        the take is given back if the disk did not start it. An I/O fault
        while preparing the slot or a new generation follows ``errors``' policy, as a fault in
        the background part of the checkpoint does."""
        try:
            started = self.start(take.step, take.arrays, metadata(take.metadata),
                                 dataclasses.replace(take.args, epoch=self.epoch))
        except BaseException as exc:
            take.abort()
            if isinstance(exc, StorageError) and not errors.raises:
                errors(exc)
                return False
            raise
        if not started:  # skipped (when_busy="skip")
            take.abort()
        return started

    def prepare(self, layout: Layout, metadata: Mapping[str, Any], tree: Any) -> float:
        """Opens the stores and makes the pools for the state as it is now; returns the disk's
        time. Raises the StorageError of a store that cannot be opened."""
        assert self.disk is not None
        took = self.disk.prepare(layout, metadata, tree, self.epoch)
        for tier in self.tiers:
            tier.prepare(layout, metadata, tree)
        return took

    def ensure_copied(self) -> None:
        """Soft copy-on-write: returns once no checkpoint of any tier still reads live tensors."""
        if self.disk is not None:
            self.disk.ensure_copied()
        for tier in self.tiers:
            tier.ensure_copied()

    def wait(self, tiers: tuple[str, ...] = (), timeout: float | None = None) -> bool:
        """Blocks until every checkpoint in flight beside the disk and on it has committed; then,
        for the tiers after the disk named in ``tiers``, until they hold everything taken so far
        (up to ``timeout`` s; False on timeout)."""
        for tier in self.tiers:
            if not tier.after_disk:
                tier.wait()
        if self.disk is not None:
            self.disk.wait()
        return all([tier.wait(timeout) for tier in self.tiers if tier.after_disk and tier.name in tiers])

    def finished(self) -> Sequence[Any]:
        """The disk's finished checkpoints' stats, oldest first (the live sequence: no copy)."""
        return self.disk.stats if self.disk is not None else ()

    def state_bytes(self, initial: int) -> int:
        """Bytes of the newest finished disk checkpoint, else ``initial`` (the state as first planned)."""
        stats = self.finished()
        return stats[-1].nbytes if stats else initial

    def newest(self) -> dict[str, Any]:
        """The newest step per tier (``stats().tiers``)."""
        out: dict[str, Any] = {"disk": self.disk.last_durable_step if self.disk is not None else None}
        for tier in self.tiers:
            out.update(tier.newest())
        return out

    def report(self) -> StatsReport:
        """``Checkpointer.stats()``: the disk's checkpoints, and the newest step of every tier."""
        o = self.disk
        if o is None:
            return StatsReport((), 0, None, None)
        remote = self.tier("remote")
        return StatsReport(tuple(o.stats), o.skipped, o.last_durable_step, o.last_durable_time,
                           remote=remote.progress.as_dict() if remote is not None else None, tiers=self.newest(),
                           flush=self.flushed)

    # -- a flush (pccheck.preemption; the Tier protocol's step 8) --------------------------------

    def flush_beside(self, deadline: float) -> dict[str, int | None]:
        """The tiers beside the disk commit their checkpoints in flight; their newest steps."""
        return {t.name: t.flush(deadline, None) for t in self.tiers if not t.after_disk}

    def persist(self, step: int, arrays: Mapping[str, Any], metadata: Mapping[str, Any], tree: Any,
                crcs: Mapping[str, int]) -> bool:
        """A disk checkpoint of ``step`` from arrays that are not live memory (another tier's
        committed slot): copied before this returns, committed only if the writers' crc32c of
        every array matches ``crcs`` (no pass of its own over the bytes)."""
        return self.start(step, arrays, metadata, StartArgs(tree=tree, epoch=self.epoch, expect_crcs=crcs))

    def disk_reached(self, step: int, deadline: float) -> bool:
        """Waits until the disk's durable latest is ``step`` or newer (True), its checkpoint of
        ``step`` failed or no checkpoint of it runs (False), or ``deadline``."""
        disk = self.disk
        assert disk is not None

        def failed() -> int:  # the newest few only (deque ends: O(1)); no other checkpoint ends meanwhile
            return sum(disk.stats[-i].step == step and disk.stats[-i].outcome == "failed"
                       for i in range(1, min(8, len(disk.stats)) + 1))
        before = failed()
        while True:
            newest = disk.last_durable_step
            if newest is not None and newest >= step:
                return True
            if failed() > before:
                return False
            if self.started_step is None or self.started_step < step or time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def flush_after(self, deadline: float, step: int, names: Sequence[str]) -> dict[str, int | None]:
        """The tiers after the disk named in ``names`` take the disk's commit of ``step``; the
        newest step of each."""
        return {t.name: t.flush(deadline, step) for t in self.tiers if t.after_disk and t.name in names}

    def drain_after(self, deadline: float, names: Sequence[str]) -> dict[str, int | None]:
        """The tiers after the disk named in ``names``, whose flush did not fit, finish the
        upload they have in progress, up to ``deadline``; the newest step of each."""
        return {t.name: t.drain(deadline) for t in self.tiers
                if t.after_disk and t.name in names and hasattr(t, "drain")}

    # -- the end -----------------------------------------------------------------------------------

    def close(self, remote_timeout: float | None = None) -> None:
        """Every close, in the module docstring's order; ``remote_timeout``: how long the remote
        tier may still wait for the newest checkpoint. Idempotent."""
        self._remote_timeout = remote_timeout
        self._teardown.close()

    def _drain_disk(self) -> None:
        if self.disk is not None:
            self.disk.wait()

    def _close_disk(self) -> None:
        if self.disk is not None:
            self.disk.close()



def _resolve_incremental(ctx: TierContext, layout: Layout, copy_engine: CopyEngine | None = None,
                         device_reserve: Any = None) -> TierContext:
    """``ctx`` with ``disk.incremental`` decided where it was left to pccheck (None, the default):
    on unless :func:`_default_off` names a reason, with a log line then. Every tier built below
    reads the decided value. The memory tier's None then means full: on its own RAM slot the
    fingerprint pass costs about what the copy it avoids costs (docs/guide/incremental.md), so it
    is incremental only when asked."""
    opts = ctx.options
    if opts.disk.incremental is not None:
        return ctx
    why = _default_off(opts, layout, copy_engine, device_reserve)
    if why is not None:
        log.info("pccheck: incremental checkpoints off for this state (%s); every checkpoint writes every array", why)
    memory = opts.memory if opts.memory.incremental is not None else dataclasses.replace(opts.memory, incremental=False)
    return dataclasses.replace(ctx, options=opts.updated(disk=dataclasses.replace(opts.disk, incremental=why is None),
                                                         memory=memory))


def _default_off(opts: Any, layout: Layout, copy_engine: CopyEngine | None, device_reserve: Any) -> str | None:
    """Why the incremental default is off for this state, or None: what incremental=True refuses
    (state on a device, a device copy engine, spread steps), a device reserve (its staging clones
    whole layouts), and a state of arrays so small that their block-aligned cells would grow it by
    more than MAX_ALIGNMENT_GROWTH."""
    why = _not_incremental(layout, copy_engine)
    if why is None and device_reserve is not None:
        why = "device_reserve"
    if why is None and opts.snapshot.spread_steps != 1:
        why = "spread_steps != 1"
    grown = aligned(layout, True).data_len / max(layout.data_len, 1) - 1
    if why is None and grown > MAX_ALIGNMENT_GROWTH:
        why = f"{len(layout.entries)} arrays: their block-aligned cells would grow the state by {grown:.0%}"
    return why


def _check_incremental(layout: Layout, copy_engine: CopyEngine | None) -> None:
    """incremental=True: refuses (ConfigError) what it does not support yet, before anything is
    built (options.py refuses the tiers and spread_steps; this, what only the state shows).

    Groups are supported: each rank's store references only its own earlier cells, and the group
    coordinator holds each commit's cells while it keeps the commit's slot (group/distributed.py),
    so the group's step keeps what it reads. DTensor state is each rank's local shards, arrays like
    any other."""
    why = _not_incremental(layout, copy_engine)
    if why is not None:
        raise refuse_incremental(why)


def _not_incremental(layout: Layout, copy_engine: CopyEngine | None) -> str | None:
    """What in the state or its copy engine an incremental disk tier does not support yet, or None."""
    devices = sorted({i.device for i in layout.infos if i.device != "cpu"})
    if devices:
        return f"state on {', '.join(devices)} (its fingerprint would run on the device)"
    if copy_engine is not None and not copy_engine.incremental:
        return f"copy_engine={copy_engine.name!r} (it copies whole layouts)"
    return None
