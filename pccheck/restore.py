"""``pccheck.load_latest``: the newest valid checkpoint, put back in place when given the objects.

Without ``model`` it returns the arrays (numpy) of an arrays checkpoint, or the nested state with
tensors of a PyTorch checkpoint. With ``model`` (and ``optimizer``, ``extra_state``) it restores
them in place, including the RNG states, so training resumes bit for bit at ``r.step + 1``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Mapping

from pathlib import Path

from .group.distributed import Group, agree_and_load, detect_group
from .errors import ConfigError, CorruptCheckpointError, NoCheckpointError, PCCheckError
from .ops.inventory import locate
from .lazy import LazyRestore, restore_lazily
from .persist import recovery
from .persist.files import default_path, rank_dir
from .persist.recovery import Restored
from .sharded.dtensor import has_dtensors
from .sharded.load import load_sharded, newest_is_sharded
from .state.torch_state import TorchState, nested_state
from .tiers.memory.paths import default_memory_dir
from .tiers.remote.objstore import is_remote

__all__ = ["load_latest"]

log = logging.getLogger("pccheck")


# Every combination load_latest refuses, and why (one table: the docstring shows it). Each is
# checked before anything is read or changed.
REFUSED: list[tuple[str, str]] = [
    ("optimizer= or extra_state= without model=", "pass model= together with optimizer= / extra_state="),
    ("memory_dir= with lazy= or zero_copy=", "memory_dir= loads eagerly and copies: drop lazy= / zero_copy="),
    ("memory_dir= with an s3:// path", "the memory tier sits beside a local disk store: pass that store as path= and "
     "the s3:// URL as remote= (or drop memory_dir=)"),
    ("remote= with an s3:// path", "the s3:// path is the remote tier already: pass the local disk store as path= "
     "beside remote=, or drop remote="),
    ("remote= that is not an s3:// URL", "remote= takes the remote tier's URL, s3://bucket/prefix (a local store "
     "goes in path=)"),
    ("an s3:// path or remote= with zero_copy= or verify=False",
     "a remote load reads and checks every byte: it takes no zero_copy= or verify=False"),
    ("a sharded checkpoint or model with zero_copy= or verify=False",
     "a sharded checkpoint (or a sharded model) is read and checked chunk by chunk: load it without zero_copy= or "
     "verify=False"),
    ("zero_copy= with model=", "zero_copy=True returns the arrays as read-only views of the store file; with model= "
     "they are copied into it anyway: drop zero_copy="),
    ("zero_copy= in a group's rank stores", "zero_copy=True maps one store file; in a group each rank loads its "
     "part: drop zero_copy="),
    ("lazy= without model=", "lazy=True restores a model in place: pass model= (and optimizer=)"),
    ("lazy= with zero_copy=, verify=False or map_location=", "lazy=True loads into the model's own tensors and "
     "checks every array: it takes no zero_copy=, verify=False or map_location="),
    ("lazy= with sharded (DTensor) state", "lazy=True does not restore sharded (DTensor) state yet; load it eagerly"),
    ("lazy= in a group from a local store", "lazy=True in a torch.distributed group restores from the remote tier "
     "only: pass the s3:// URL as the path (load_latest(url, ..., lazy=True)), or load eagerly"),
]
_WHY = dict(REFUSED)


def _refuse(case: str) -> ConfigError:
    return ConfigError(_WHY[case])


def load_latest(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                extra_state: Mapping[str, Any] | None = None, map_location: Any = None,
                zero_copy: bool = False, verify: bool = True, distributed: bool = True,
                lazy: bool = False, remote: str | None = None,
                memory_dir: str | os.PathLike[str] | bool | None = None) -> Restored | LazyRestore:
    """Loads the newest valid checkpoint under ``path`` (default ``$PCCHECK_DIR`` or ./checkpoints).

    Returns a :class:`Restored` with ``step``, ``state`` and ``metadata``; ``r.tier`` says which
    tier it came from. Raises NoCheckpointError when no tier holds one. In a torch.distributed
    group (every rank calls this at the same point) the ranks agree on the newest step all of them
    can load and each loads its own part; every rank returns the same ``step``.

    The tiers, nearest first: memory (``memory_dir``), a peer's replica, disk (``path``), remote
    (``path="s3://bucket/prefix"`` itself, or ``remote="s3://..."`` beside a local ``path``;
    FORMAT.md §12). Each source that holds no valid checkpoint (NoCheckpointError,
    CorruptCheckpointError or an OSError) falls back to the next:

    1. with ``memory_dir`` (a path, or True for ``/dev/shm/pccheck/<store>``): one per-rank plan
       over all four (pccheck.tiers.memory.nearest). Each rank offers the steps it can obtain from
       its own memory, a peer's replica, its own disk and its part on the remote tier (the newest
       few committed steps, manifests only); the ranks agree on the newest step every rank can
       obtain from some tier, and each loads it from its nearest: in a group one rank may take
       the remote while another takes its memory. ``r.tier`` says which, on each rank;
    2. the disk store at ``path`` (its own rank store in a group; a sharded set, FORMAT.md §9, on
       any number of ranks): without ``memory_dir``, or for a sharded set after it;
    3. the remote tier alone: every committed step, newest first, and a sharded step on any world
       size.

    The mode is the same on every tier: eager (every array read and checked, then put back), lazy
    (``lazy=True``, needs ``model``: returns a :class:`pccheck.lazy.LazyRestore` once the metadata
    is read; the tensors load in the background in first-use order, and each module's forward and
    the optimizer's step wait only for what they need; ``r.wait()`` waits for all), or sharded
    (a DTensor model, or a sharded checkpoint: each rank builds its own boxes).

    Every keyword is honoured on every path or refused. ``map_location`` moves the loaded tensors
    (eager and sharded); ``verify=False`` skips the crc32c of a local eager load; ``zero_copy``
    returns the arrays of a local arrays checkpoint as read-only views of its file;
    ``distributed=False`` loads as one process even in a group; ``memory_dir=False`` is no memory
    tier. Refused, with a ConfigError saying what to do (the table pccheck.restore.REFUSED),
    before anything is read or changed:

    - optimizer= or extra_state= without model=: nothing to put them back into;
    - memory_dir= with lazy= or zero_copy=: the memory tier loads eagerly and copies;
    - memory_dir= with an s3:// path: the memory tier sits beside a local disk store;
    - remote= with an s3:// path: the path is the remote tier already;
    - remote= that is not an s3:// URL: a local store goes in path=;
    - an s3:// path or remote= with zero_copy= or verify=False: a remote load checks every byte;
    - a sharded checkpoint or model with zero_copy= or verify=False: read and checked chunk by chunk;
    - zero_copy= with model=: the arrays would be copied into the model anyway;
    - zero_copy= in a group's rank stores: each rank loads its own part;
    - lazy= without model=: a lazy restore fills a model in place;
    - lazy= with zero_copy=, verify=False or map_location=: it fills the model's own tensors, checked;
    - lazy= with sharded (DTensor) state: not supported yet;
    - lazy= in a group from a local store: only from the remote tier.

    A ``model=`` given for a checkpoint of plain arrays is a ConfigError once the checkpoint is
    read (nothing is put back).
    """
    req, tiers = _plan(path, model, optimizer, extra_state, map_location, zero_copy, verify, distributed, lazy,
                       remote, memory_dir)
    for (tier, where), (after, _) in zip(tiers, tiers[1:]):  # every tier but the last falls back
        try:
            return _LOADERS[tier](where, req)
        except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
            log.warning("pccheck: no valid checkpoint in the %s tier (%s); trying the %s tier", tier, exc, after)
    tier, where = tiers[-1]
    return _LOADERS[tier](where, req)


@dataclasses.dataclass(frozen=True)
class _Request:
    """What load_latest was asked for, checked against REFUSED."""

    model: Any
    optimizer: Any
    extra_state: Mapping[str, Any] | None
    map_location: Any
    zero_copy: bool
    verify: bool
    lazy: bool
    sharded: bool
    group: Group | None
    directory: Path | None  # the disk store (None: the path is s3://)
    remote: str | None      # the remote tier's URL (the s3:// path, or remote=)

    def state(self) -> TorchState | None:
        return TorchState(self.model, self.optimizer, self.extra_state) if self.model is not None else None

    def loaded(self, r: Restored) -> Restored:
        return _as_loaded(r, self.model, self.optimizer, self.extra_state, self.map_location)


def _plan(path: Any, model: Any, optimizer: Any, extra_state: Mapping[str, Any] | None, map_location: Any,
          zero_copy: bool, verify: bool, distributed: bool, lazy: bool, remote: str | None,
          memory_dir: Any) -> tuple[_Request, list[tuple[str, Any]]]:
    """load_latest's request, checked against REFUSED (before anything is read), and its tiers,
    nearest first."""
    if (optimizer is not None or extra_state is not None) and model is None:
        raise _refuse("optimizer= or extra_state= without model=")
    use_memory = memory_dir is not None and memory_dir is not False
    on_remote = is_remote(path)
    if use_memory and (lazy or zero_copy):
        raise _refuse("memory_dir= with lazy= or zero_copy=")
    if use_memory and on_remote:
        raise _refuse("memory_dir= with an s3:// path")
    if remote is not None and on_remote:
        raise _refuse("remote= with an s3:// path")
    if remote is not None and not is_remote(remote):
        raise _refuse("remote= that is not an s3:// URL")
    if (on_remote or remote is not None) and (zero_copy or not verify):
        raise _refuse("an s3:// path or remote= with zero_copy= or verify=False")
    if zero_copy and model is not None:
        raise _refuse("zero_copy= with model=")
    if lazy:
        if model is None:
            raise _refuse("lazy= without model=")
        if zero_copy or not verify or map_location is not None:
            raise _refuse("lazy= with zero_copy=, verify=False or map_location=")
        if has_dtensors(model):
            raise _refuse("lazy= with sharded (DTensor) state")
    group = detect_group() if distributed else None
    directory = None if on_remote else Path(path) if path is not None else default_path()
    if lazy and group is not None and directory is not None:
        raise _refuse("lazy= in a group from a local store")
    sharded = directory is not None and not lazy and (
        (model is not None and has_dtensors(model)) or newest_is_sharded(directory))
    if sharded and (zero_copy or not verify):
        raise _refuse("a sharded checkpoint or model with zero_copy= or verify=False")
    # The tiers, nearest first. The memory tier's plan covers this rank's own disk and its part
    # on the remote tier already (each rank from its nearest), so the disk is not read a second
    # time; after it come what its per-rank plan cannot take: a sharded set built from every
    # rank's disk, and the remote tier alone (every committed step, any world size).
    url = str(path) if on_remote else remote
    tiers: list[tuple[str, Any]] = []
    if use_memory:
        tiers.append(("memory", default_memory_dir(directory) if memory_dir is True else Path(memory_dir)))
    if directory is not None and (not use_memory or sharded):
        tiers.append(("disk", directory))
    if url is not None:
        tiers.append(("remote", url))
    return _Request(model, optimizer, extra_state, map_location, zero_copy, verify, lazy, sharded, group,
                    directory, url), tiers


def _from_memory(root: Path, req: _Request) -> Restored:
    """Each rank's own part of the newest step every rank can obtain from memory, a peer's
    replica, its own disk or the remote tier (pccheck.tiers.memory.nearest), each rank from its
    nearest; sharded: the chunks it lacks from the ranks that stored them
    (pccheck.tiers.memory.sharded)."""
    from .tiers.memory import load_nearest

    assert req.directory is not None  # REFUSED: memory_dir= with an s3:// path
    r = load_nearest(req.directory, root, req.group, verify=req.verify, remote=req.remote)
    if req.sharded:
        from .tiers.memory.sharded import build_sharded

        return build_sharded(r, req.group, req.state(), req.map_location, decode=nested_state)
    return req.loaded(r)


def _from_disk(directory: Path, req: _Request) -> Restored | LazyRestore:
    """The disk store: its newest valid slot (a group: the newest step every rank holds valid, each
    its own part; a sharded set: resharded onto this job), eagerly or lazily."""
    group = req.group
    if req.lazy:
        located = locate(directory)  # recovery's rule, on meta records and manifests
        if isinstance(located.manifest.tree, dict) and "shards" in located.manifest.tree:
            raise _refuse("lazy= with sharded (DTensor) state")
        return restore_lazily(located, req.state())
    if req.sharded:
        return load_sharded(directory, group, req.state(), req.map_location, decode=nested_state)
    if group is not None and rank_dir(directory, group.rank).is_dir():  # collective
        if req.zero_copy:
            raise _refuse("zero_copy= in a group's rank stores")
        r = agree_and_load(directory, group, verify=req.verify)
    else:
        r = recovery.load_newest(directory, zero_copy=req.zero_copy, verify=req.verify)
        if group is not None:  # replicated="rank0": everyone read rank 0's store; same step?
            _check_same_step(group, r.step)
    return req.loaded(r)


def _from_remote(url: str, req: _Request) -> Restored | LazyRestore:
    """The remote tier: lazily (each rank its own part, by ranged GETs), a sharded step (or any
    step into a sharded model) through the resharding planner on remote sets (each rank GETs the
    byte ranges its shards need, any world size; FORMAT.md §12.7), else each rank's part whole
    (pccheck.tiers.remote.load)."""
    from .tiers.remote.load import load_remote, locate_remote
    from .tiers.remote.sharded import newest_remote_is_sharded, remote_sets

    group, model = req.group, req.model
    if req.lazy:
        located = locate_remote(url, group)
        tree = located.manifest.tree
        if isinstance(tree, dict) and "shards" in tree:  # the same step, so the same answer, on every rank
            raise _refuse("lazy= with sharded (DTensor) state")
        return restore_lazily(located, req.state(), read=located.read)
    if (model is not None and has_dtensors(model)) or newest_remote_is_sharded(url, group):
        return load_sharded(url, group, req.state(), req.map_location, decode=nested_state,
                            sets=remote_sets(url, group))
    return req.loaded(load_remote(url, group))


_LOADERS: dict[str, Callable[[Any, _Request], Any]] = {"memory": _from_memory, "disk": _from_disk,
                                                        "remote": _from_remote}


def _as_loaded(r: Restored, model: Any, optimizer: Any, extra_state: Mapping[str, Any] | None,
               map_location: Any) -> Restored:
    """Puts a loaded checkpoint's state back into the objects (or rebuilds the nested state)."""
    tree = r.tree
    if tree is None:
        if model is not None:
            raise ConfigError(f"the checkpoint at step {r.step} holds arrays, not a PyTorch model; "
                              "load it without model=")
        return r
    if model is not None:
        state = TorchState(model, optimizer, extra_state).restore(tree, r.state, r.torch_dtypes, map_location)
    else:
        import torch

        from .arrays import torch_dtype

        def as_tensor(name: str) -> Any:
            t = torch.from_numpy(r.state[name])
            if name in r.torch_dtypes:
                t = t.view(torch_dtype(r.torch_dtypes[name]))
            return t.to(map_location) if map_location is not None else t

        state = nested_state(tree, r.state, as_tensor)
    state["step"] = r.step
    return dataclasses.replace(r, state=state)


def _check_same_step(group: Group, step: int) -> None:
    import torch.distributed as dist

    steps: list[Any] = [None] * group.world_size
    dist.all_gather_object(steps, step, group=group.pg)
    if len(set(steps)) != 1:
        raise PCCheckError(f"ranks loaded different steps {steps} from the shared store; load while no "
                           "Checkpointer is writing to it")
