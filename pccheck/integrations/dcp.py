"""``pccheck.dcp.Writer`` and ``pccheck.dcp.Reader``: torch.distributed.checkpoint (DCP) storage on
the pccheck store (FORMAT.md §9, "DCP").

    dcp.save(sd, storage_writer=pccheck.dcp.Writer("ckpt"))
    fut = dcp.async_save(sd, storage_writer=pccheck.dcp.Writer("ckpt", max_concurrent=2))
    dcp.load(sd, storage_reader=pccheck.dcp.Reader("ckpt"))

Each rank writes its own store, ``PATH/rank-<r>/`` (``PATH`` itself in a job of one rank), one
slot per save: the rank's write items as arrays, checksummed, committed with pccheck's protocol
(FORMAT.md §4). A save is complete once every rank's commit is durable; the coordinator's
``finish`` records it in ``PATH/GLOBAL``, after which the ranks let the save before it go
(pccheck/integrations/dcp_store.py has the retention invariant).

``checkpoint_id`` is a directory: ``Writer(path)`` and ``Writer()`` with ``dcp.save(...,
checkpoint_id=path)`` (which calls :meth:`Writer.reset`) write to the same place. Unlike
FileSystemWriter, a directory holds many saves: a new save into it does not replace the files of
the previous one, and a Reader loads the newest complete one (or ``step=``).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, SavePlan
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future as TorchFuture

from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..options import DiskOptions, Options, RemoteOptions
from ..orchestrator.options import EngineOptions
from ..sharded.index import CheckpointSet, find_sets
from ..state.torch_state import load_serialized
from ..tiers.remote.sets import SetCommitter
from ..tiers.stack import refuse_memory
from ..tuner.config import resolve_auto
from .dcp_format import Located, Written, set_metadata, slot_contents
from .dcp_remote import is_remote, older_steps, remote_set, staging_dir
from .dcp_stage import LEASE_KEY, ORDER_KEY, StagingPool, release_lease, staged_order
from .dcp_store import close_stores, next_save, rank_store, record_finished

__all__ = ["Writer", "Reader"]

log = logging.getLogger("pccheck")

# WriteResult index of a rank whose plan had no items (it still commits a slot; see write_data)
_SLOT_MARKER = "_pccheck_dcp_slot"


@dataclasses.dataclass(frozen=True)
class _PlanData:
    """``SavePlan.storage_data`` from the coordinator: the save's (epoch, step) for a job of more
    than one rank (None: one rank, which takes it when it writes), the world size, and the newest
    finished step the coordinator knows (the ranks free older slots)."""

    epoch: int | None
    step: int | None
    world_size: int
    finished: int | None
    generation: int | None = None  # an s3:// save: the coordinator's remote generation (FORMAT.md §12)
    base: int | None = None  # an incremental s3:// save: the committed step its parts reference (§12.8)


def _done(value: Any) -> TorchFuture:
    fut: TorchFuture = TorchFuture()
    fut.set_result(value)
    return fut


def _path(p: str | os.PathLike[str] | None, what: str) -> Path:
    if p is None:
        raise ConfigError(f"pccheck.dcp.{what} has no directory: pass Writer(path)/Reader(path) or checkpoint_id=")
    return Path(p).absolute()


def _engine(options: dict[str, Any], path: Path | None) -> EngineOptions:
    names = [f.name for f in dataclasses.fields(EngineOptions)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"unknown pccheck.dcp.Writer option(s) {', '.join(unknown)}; valid: {', '.join(names)}")
    engine = EngineOptions(**options)
    if engine.when_busy != "block":
        raise ConfigError("pccheck.dcp.Writer writes every save it is given: when_busy must be 'block'")
    return engine.with_values(resolve_auto(path, 10, engine.max_concurrent, engine.writer_threads,
                                           engine.chunk_size))


class Writer(StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) writing to the pccheck store at ``path``.

    Call protocol (DCP's): ``reset(checkpoint_id)`` → ``set_up_storage_writer`` →
    ``prepare_local_plan`` → (coordinator) ``prepare_global_plan`` → ``write_data`` → (coordinator)
    ``finish``. ``write_data`` returns once this rank's slot is durably committed; ``finish``
    records the complete save in ``PATH/GLOBAL`` (one fsync'd rename).

    As ``dcp.async_save``'s stager, :meth:`stage` copies the state_dict into at most
    ``max_concurrent`` reused shared-memory buffers (no host memory growth per save), each given
    back once its save's bytes are in pccheck's DRAM chunks. The writer pickles as its path and
    options only: a PROCESS-mode daemon opens its own stores.

    With an ``s3://bucket/prefix`` location (or ``remote=RemoteOptions(url=...)`` beside a
    local directory) each save is also committed on the object store (FORMAT.md §12 with §9.1)
    by the remote tier every entry point shares (``tiers/remote/sets.py``): each rank store's
    tier stack uploads its committed slot as the rank's part, ``write_data`` returns once it is
    up, and the coordinator's ``finish`` writes the step manifest (the commit), moves ``latest``
    and applies ``remote.keep_last``/``keep_every``. The store is probed here (RemoteConfigError).

    Args:
        path: the checkpoint directory, or ``"s3://bucket/prefix"`` (or give ``checkpoint_id=``
            to dcp.save).
        local: with an s3:// path, the local staging directory the ranks' stores live in
            (default: ``$TMPDIR/pccheck-dcp/<hash of the URL>``).
        remote: a :class:`pccheck.RemoteOptions`: its ``part_size``, ``concurrency``,
            ``keep_last``, ``keep_every``, ``close_timeout`` (``every`` must stay 1); its ``url``
            (or the s3:// ``path``) is where the saves go.
        memory: refused (ConfigError): DCP saves have no memory tier (docs/guide/memory.md).
        incremental: each rank's slot gets only the arrays whose bytes changed since its newest
            committed save, the rest referenced in other slots' cells (docs/guide/incremental.md);
            with an object store each rank's part uploads only the arrays that changed since the
            last save committed there, and references the rest (FORMAT.md §12.8). Host state only.
            False (default): every save writes every array (a DCP save's arrays are known only
            at its write, so the Writer does not decide for its caller as a Checkpointer does).
        **options: :class:`pccheck.EngineOptions` fields: ``max_concurrent`` (N saves in flight;
            each rank store has N+2 slots), ``writer_threads``, ``chunk_size``, ``dram_budget``,
            ``storage``.
    """

    _synchronize_after_execute = False

    def __init__(self, path: str | os.PathLike[str] | None = None, *, local: str | os.PathLike[str] | None = None,
                 remote: RemoteOptions | None = None, memory: Any = None, incremental: bool = False,
                 **options: Any) -> None:
        if memory is not None:
            refuse_memory(Options(memory=memory))  # ConfigError (or the MemoryOptions' own)
        if remote is not None and not isinstance(remote, RemoteOptions):
            raise ConfigError(f"pccheck.dcp.Writer's remote= must be a pccheck.RemoteOptions, got "
                              f"{type(remote).__name__}; give an s3:// location as the Writer's path")
        self.local, self.remote_options = local, remote
        self.incremental = DiskOptions(incremental=incremental).incremental  # checked there (ConfigError)
        self.options = dict(options)
        self._locate(path)
        self.engine = _engine(self.options, self.path)
        self._init_runtime()

    def _locate(self, where: str | os.PathLike[str] | None) -> None:
        """Sets ``path`` (the local root), ``url`` (an s3:// location given as the path) and the
        tiers' options, the remote one's store probed (its coordinator half, ``_remote``)."""
        self.url = where if is_remote(where) else None
        given = self.remote_options
        if self.url is not None and given is not None and given.url not in (None, self.url):
            raise ConfigError(f"pccheck.dcp.Writer({self.url!r}) was also given remote.url={given.url!r}: give one")
        remote = dataclasses.replace(given or RemoteOptions(), url=self.url or (given.url if given else None))
        self.tiers = Options(disk=DiskOptions(incremental=self.incremental), remote=remote)
        self._remote = SetCommitter(remote) if remote.url is not None else None
        if self.url is not None:
            self.path: Path | None = staging_dir(self.url, self.local)
        else:
            self.path = Path(where).absolute() if where is not None else None

    def _init_runtime(self) -> None:
        self.is_coordinator = False
        self.rank = 0
        self._pool: StagingPool | None = None
        self._generation: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.url or self.path, "local": self.local, "options": self.options,
                "remote": self.remote_options, "incremental": self.incremental}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.local, self.options = state.get("local"), state["options"]
        self.incremental = bool(state.get("incremental", False))
        self.remote_options = state.get("remote")
        self._locate(state["path"])
        self.engine = _engine(self.options, self.path)
        self._init_runtime()

    @property
    def checkpoint_id(self) -> Path | str | None:
        return self.url or self.path

    # -- StorageWriter --------------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and checkpoint_id != self.checkpoint_id:
            self._locate(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A local directory path, or an ``s3://`` location (no other URL)."""
        return isinstance(checkpoint_id, (str, os.PathLike)) and (
            is_remote(checkpoint_id) or "://" not in str(checkpoint_id))

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError("pccheck.dcp.Writer pairs the ranks' slots through the coordinator's plan: "
                              "save with use_collectives=True")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The staging lease and order (dcp_stage) ride in the staged state_dict; never saved.
        return dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn not in (LEASE_KEY, ORDER_KEY)])

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        root = _path(self.path, "Writer")
        world = len(plans)
        epoch, step = next_save(root, world) if world > 1 else (None, None)
        store = rank_store(root, world, 0, self.engine, self.tiers)
        base = None
        if self._remote is not None:  # one per URL in this process, taken at its first save
            self._generation = self._remote.generation()
            if self.incremental:  # kept from retention until this save's finish (sets.py)
                base = self._remote.lease()
        data = _PlanData(epoch, step, world, store.retention.finished, self._generation, base)
        return [dataclasses.replace(p, storage_data=data) for p in plans]

    def write_data(self, plan: SavePlan, planner: Any) -> TorchFuture:
        """Copies this rank's items into a slot and returns once its commit is durable."""
        root = _path(self.path, "Writer")
        data = plan.storage_data
        if not isinstance(data, _PlanData):
            raise ConfigError("the save plan was not prepared by pccheck.dcp.Writer's prepare_global_plan; "
                              "give the same Writer to every rank's dcp.save")
        store = rank_store(root, data.world_size, self.rank, self.engine, self.tiers)
        if data.finished is not None:
            store.retention.set_finished(data.finished)
        state = getattr(planner, "state_dict", None)
        try:
            items = [(item, planner.resolve_data(item)) for item in plan.items]
            arrays, tree, names = slot_contents(items, planner, self.rank)
            del items
            if self._remote is not None and data.generation is None:
                raise ConfigError("an s3:// save needs the plan of pccheck.dcp.Writer's prepare_global_plan; give "
                                  "the same Writer to every rank's dcp.save")
            started = store.write(data.epoch, data.step, arrays, tree, staged_order(state),
                                  data.generation if self._remote is not None else None, data.base)
        finally:
            release_lease(state)  # every byte is in DRAM chunks now (or the save failed)
        if started is None:  # a newer save started first: this one is not written (not kept)
            log.info("pccheck: rank %d: a newer save started first; this older one is not written", self.rank)
            epoch, step, kept = data.epoch or 0, data.step or 0, False
        else:
            # raises the commit's error, or (s3://) the part's upload's: the save is not kept
            # unless this rank's part is on the object store
            epoch, step, kept = started.epoch, started.step, started.result()
        results = [WriteResult(index=item.index, size_in_bytes=_nbytes(arrays[names[item.index]]),
                               storage_data=Written(epoch, step, self.rank, names[item.index], kept, data.base))
                   for item in plan.items]
        if not results:
            # A rank with nothing to write (an empty state_dict, or replicated items deduplicated
            # to another rank) still committed a slot: the coordinator's finish learns the save's
            # (epoch, step) from results only, so report the slot.
            results = [WriteResult(index=MetadataIndex(_SLOT_MARKER), size_in_bytes=0,
                                   storage_data=Written(epoch, step, self.rank, "", kept, data.base))]
        return _done(results)

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """Records the save as finished (complete on every rank) in ``PATH/GLOBAL``."""
        keys = {(w.storage_data.epoch, w.storage_data.step) for rs in results for w in rs
                if isinstance(w.storage_data, Written)}
        if len(keys) != 1:
            raise CorruptCheckpointError(f"the ranks report different saves {sorted(keys)}: nothing recorded")
        (epoch, step), = keys
        base = next((w.storage_data.base for rs in results for w in rs if isinstance(w.storage_data, Written)), None)
        if not all(w.storage_data.kept for rs in results for w in rs):
            if self._remote is not None:
                self._remote.release(base)  # nothing of this save is committed remotely
            # A newer save committed first on some rank and freed that rank's slot: this set is
            # incomplete, and must not be recorded as finished (the newer one will be).
            log.info("pccheck: save of step %d was superseded by a newer one; not recorded as finished", step)
            return
        record_finished(_path(self.path, "Writer"), epoch, step, len(results))
        if self._remote is not None:  # every rank's part is up (DCP calls finish after write_data)
            assert self._generation is not None
            self._remote.commit(self._generation, step, len(results), base)

    # -- AsyncStager ----------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state_dict`` in a reused shared host buffer (see the class docstring)."""
        if self._pool is None:
            self._pool = StagingPool(int(self.engine.max_concurrent))
        return self._pool.stage(state_dict)

    def synchronize_staging(self) -> None:
        """Staging copies synchronously: nothing to wait for."""

    def close(self) -> None:
        """Drops the staging buffers, waits for this process's saves under ``path`` to commit and
        closes their stores (the next save opens them again)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.path is not None:
            close_stores(self.path)


def _check_weights_only(fqn: str, data: bytes) -> None:
    """DCP's planner unpickles a byte item (``torch.load`` with ``weights_only=False``). pccheck only lets
    it have bytes that ``torch.load(weights_only=True)`` takes: the same stream, so the planner's
    load runs nothing the restricted unpickler refused."""
    load_serialized(fqn, data)


def _nbytes(x: Any) -> int:
    return int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())


class Reader(StorageReader):
    """A DCP ``StorageReader`` of the newest complete save under ``path`` (or the one of ``step``).

    Reads sets written by :class:`Writer` and sharded sets written by ``pccheck.Checkpointer``
    (their tree paths read as DCP fqns with "/" as ".": ``model/0.weight`` is
    ``model.0.weight``; optimizer state keeps the parameter index, ``optimizer.state.0.exp_avg``).
    Every array read is checked against its crc32c; a damaged one raises CorruptCheckpointError
    naming it (load an older save with ``step=``). The directory must be visible to every
    loading rank. An ``s3://bucket/prefix`` location reads the newest committed remote step
    (FORMAT.md §12), each array by ranged GETs of its own bytes: no shared filesystem needed.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, step: int | None = None) -> None:
        self.url = path if is_remote(path) else None
        self.path = Path(path).absolute() if path is not None and self.url is None else None
        self.step = step
        self._set: Any = None  # a CheckpointSet, or a RemoteSet (s3://)
        self._where: dict[tuple[str, tuple[int, ...] | None], Located] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_id if is_remote(checkpoint_id) else None
            self.path = Path(checkpoint_id).absolute() if self.url is None else None
        if self._set is not None:
            self._set.close()
        self._set, self._where = None, {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """A directory that holds at least one complete pccheck set, or an ``s3://`` location."""
        if is_remote(checkpoint_id):
            return True
        try:
            return bool(find_sets(checkpoint_id))
        except (OSError, TypeError, ValueError):
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP metadata of the chosen set, rebuilt from its manifests (called on every rank)."""
        if self.url is not None:
            self._set = remote_set(self.url, self.step)
            meta, self._where = set_metadata(self._set)
            return meta
        root = _path(self.path, "Reader")
        sets = find_sets(root)
        if self.step is not None:
            sets = [s for s in sets if s.step == self.step]
        if not sets:
            what = f"step {self.step}" if self.step is not None else "checkpoint"
            raise NoCheckpointError(f"no complete {what} under {root} (every rank of the job that wrote it must "
                                    "hold it); saves found: " + (", ".join(str(s.step) for s in find_sets(root))
                                                                  or "none"))
        self._set = sets[0]
        meta, self._where = set_metadata(self._set)
        return meta

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._set is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> TorchFuture:
        """Reads each item's array (once, crc32c-checked) and copies the requested region."""
        cand = self._set
        assert cand is not None
        uses: dict[Located, int] = {}
        for req in plan.items:
            loc = self._locate(req)
            uses[loc] = uses.get(loc, 0) + 1
        cache: dict[Located, Any] = {}
        for req in plan.items:
            loc = self._locate(req)
            if loc not in cache:
                cache[loc] = self._read(cand, loc)
            src = cache[loc]
            uses[loc] -= 1
            if not uses[loc]:
                del cache[loc]  # last use: free it
            if req.type == LoadItemType.BYTE_IO:
                data = src.numpy().tobytes()
                _check_weights_only(req.storage_index.fqn, data)
                planner.load_bytes(req, io.BytesIO(data))
                continue
            for d, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                src = src.narrow(d, int(o), int(n))
            target = planner.resolve_tensor(req).detach()
            if target.shape != src.shape:
                raise CorruptCheckpointError(f"{req.storage_index.fqn}: stored region {list(src.shape)} does not "
                                             f"match the requested {list(target.shape)}")
            target.copy_(src)
            planner.commit_tensor(req, target)
        return _done(None)

    def _locate(self, req: Any) -> Located:
        idx = req.storage_index
        key = (idx.fqn, None if idx.offset is None or req.type == LoadItemType.BYTE_IO else tuple(idx.offset))
        loc = self._where.get(key)
        if loc is None:
            raise CorruptCheckpointError(f"step {self._set.step if self._set else '?'} holds no chunk of "
                                         f"{idx.fqn!r} at {list(idx.offset or [])}")
        return loc

    def _read(self, cand: CheckpointSet, loc: Located) -> Any:
        import torch

        from ..arrays import torch_dtype

        try:
            arr = cand.read(loc.rank, loc.array)
        except CorruptCheckpointError as exc:
            older = (older_steps(self.url, cand.step) if self.url is not None else
                     [s.step for s in find_sets(_path(self.path, "Reader")) if s.step < cand.step])
            hint = (f"load an older save with pccheck.dcp.Reader(path, step={older[0]}) (complete: {older})"
                    if older else "no older complete save exists")
            raise CorruptCheckpointError(f"{exc}; this save cannot be loaded: {hint}") from None
        entry = cand.members[loc.rank].entries[loc.array][0]
        t = torch.from_numpy(arr)
        return t.view(torch_dtype(entry.torch_dtype)) if entry.torch_dtype else t
