"""``pccheck.load_latest``: the newest valid checkpoint, put back in place when given the objects.

Without ``model`` it returns the arrays (numpy) of an arrays checkpoint, or the nested state with
tensors of a PyTorch checkpoint. With ``model`` (and ``optimizer``, ``extra_state``) it restores
them in place, including the RNG states, so training resumes bit for bit at ``r.step + 1``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping

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
from .tiers.remote.objstore import is_remote

__all__ = ["load_latest"]

log = logging.getLogger("pccheck")


def load_latest(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                extra_state: Mapping[str, Any] | None = None, map_location: Any = None,
                zero_copy: bool = False, verify: bool = True, distributed: bool = True,
                lazy: bool = False, remote: str | None = None,
                memory_dir: str | os.PathLike[str] | bool | None = None) -> Restored | LazyRestore:
    """Loads the newest valid checkpoint under ``path`` (default ``$PCCHECK_DIR`` or ./checkpoints).

    Returns a :class:`Restored` with ``step``, ``state`` and ``metadata``. Raises
    NoCheckpointError when there is none. See :func:`pccheck.persist.recovery.load_newest` for
    how the checkpoint is picked and validated. In a torch.distributed group (every rank calls
    this at the same point) the ranks agree on the newest step all of them hold valid and each
    loads its own part (pccheck.group.distributed); every rank returns the same ``step``.

    With ``lazy=True`` (needs ``model``) it returns a :class:`pccheck.lazy.LazyRestore` once the
    metadata is read: the tensors load in the background, in first-use order, and each module's
    forward (and the optimizer's step) waits only for what it needs; ``r.wait()`` waits for all
    (pccheck/lazy/restore.py says what it does not cover). The array checksums are checked as
    the tensors arrive; a mismatch raises at the next wait point.

    The remote tier (pccheck/tiers/remote, FORMAT.md §12): ``path="s3://bucket/prefix"`` loads the
    newest committed remote step whose every checksum holds (falling back to older ones);
    ``remote="s3://..."`` beside a local ``path`` loads from the remote when the local store is
    missing or holds nothing valid. ``r.tier`` says which. A sharded step (FORMAT.md §9) loads
    from the remote on any world size, each rank fetching only the chunks its shards need;
    ``lazy=True`` from an s3:// path works in a group too (each rank restores its own part).

    With ``memory_dir`` (a path, or True for the default ``/dev/shm/pccheck/<store>``) the memory
    tier is searched too (pccheck.tiers.memory.nearest): the ranks agree on the newest step each
    can obtain from its own memory, a peer's replica or its own disk, and each loads from the
    nearest (with ``remote=`` too: the remote tier when none of those holds a valid step); ``Restored.tier`` says which. Every rank must pass it.
    """
    if (optimizer is not None or extra_state) and model is None:
        raise ConfigError("pass model= together with optimizer= / extra_state=")
    use_memory = memory_dir is not None and memory_dir is not False
    if use_memory and (lazy or zero_copy):
        raise ConfigError("memory_dir= loads eagerly and copies: drop lazy= / zero_copy=")
    if lazy and (is_remote(path) or (remote is not None and not use_memory)):
        return _remote_lazily(path, remote, detect_group() if distributed else None, model, optimizer, extra_state,
                              zero_copy, verify, map_location)
    if is_remote(path) or (remote is not None and not use_memory):
        if zero_copy or not verify:
            raise ConfigError("a remote load reads and checks every byte: it takes no zero_copy= or verify=False")
        group = detect_group() if distributed else None
        return _remote_or_local(path, remote, group, model, optimizer, extra_state, map_location)
    directory = Path(path) if path is not None else default_path()
    group = detect_group() if distributed else None
    if lazy:
        return _load_lazily(directory, group, model, optimizer, extra_state, zero_copy, verify, map_location)
    # A sharded checkpoint (FORMAT.md §9) loads on any number of ranks: each rank builds what its
    # own model holds from every saved rank's shards (pccheck.sharded.load).
    # A model with DTensor parameters takes any checkpoint the same way (its own box of each).
    if (model is not None and has_dtensors(model)) or newest_is_sharded(directory):
        if zero_copy or not verify:
            raise ConfigError("a sharded checkpoint (or a sharded model) is read and checked chunk by chunk: "
                              "load it without zero_copy= or verify=False")
        state = TorchState(model, optimizer, extra_state) if model is not None else None
        if use_memory:
            return _sharded_from_memory(directory, memory_dir, group, state, map_location)
        return load_sharded(directory, group, state, map_location, decode=nested_state)
    if use_memory:
        r = _from_memory(directory, memory_dir, group, remote, verify)
    elif group is not None and rank_dir(directory, group.rank).is_dir():
        r = agree_and_load(directory, group, verify=verify)
    else:
        r = recovery.load_newest(directory, zero_copy=zero_copy and model is None, verify=verify)
        if group is not None:  # replicated="rank0": everyone read rank 0's store; same step?
            _check_same_step(group, r.step)
    return _as_loaded(r, model, optimizer, extra_state, map_location)


def _from_memory(directory: Path, memory_dir: Any, group: Group | None, remote: str | None,
                 verify: bool) -> Restored:
    """Each rank's own part of the newest step every rank can obtain (pccheck.tiers.memory), the
    remote tier when none is (with ``remote=``)."""
    from .tiers.memory import default_memory_dir, load_nearest

    root = default_memory_dir(directory) if memory_dir is True else Path(memory_dir)
    try:
        return load_nearest(directory, root, group, verify=verify)
    except (NoCheckpointError, CorruptCheckpointError) as exc:
        if remote is None:
            raise
        from .tiers.remote.load import load_remote

        log.warning("pccheck: no step every rank can obtain from memory, peers or disk (%s); loading "
                    "from the remote tier %s", exc, remote)
        return load_remote(str(remote), group)


def _sharded_from_memory(directory: Path, memory_dir: Any, group: Group | None, state: TorchState | None,
                         map_location: Any) -> Restored:
    """A sharded (DTensor) state through the memory tier: every rank's own slot from its nearest
    tier, the chunks it lacks from the ranks that stored them (pccheck.tiers.memory.sharded);
    when no step can be built that way (another world size, every tier gone), the disk store's
    resharded load (pccheck.sharded.load)."""
    from .tiers.memory.sharded import build_sharded

    try:
        r = _from_memory(directory, memory_dir, group, None, True)
        return build_sharded(r, group, state, map_location, decode=nested_state)
    except (NoCheckpointError, CorruptCheckpointError) as exc:  # every rank alike: the plans and the vote agree
        log.warning("pccheck: no sharded step from the memory tier (%s); loading the disk store %s", exc, directory)
        return load_sharded(directory, group, state, map_location, decode=nested_state)


def _remote_or_local(path: Any, remote: str | None, group: Group | None, model: Any, optimizer: Any,
                     extra_state: Mapping[str, Any] | None, map_location: Any) -> Restored:
    """``path`` itself when it is s3://, else the local store at ``path`` (a group: every rank's
    store, agreed; a sharded one through pccheck.sharded), falling back to ``remote`` when
    nothing there is valid. Loaded into the objects when given."""
    if is_remote(path):
        return _from_remote(path, group, model, optimizer, extra_state, map_location)
    directory = Path(path) if path is not None else default_path()
    try:
        if (model is not None and has_dtensors(model)) or newest_is_sharded(directory):
            state = TorchState(model, optimizer, extra_state) if model is not None else None
            return load_sharded(directory, group, state, map_location, decode=nested_state)
        if group is not None and rank_dir(directory, group.rank).is_dir():  # collective, as load_latest's
            r = agree_and_load(directory, group)
        else:
            r = recovery.load_newest(directory)
    except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
        log.warning("pccheck: no valid local checkpoint under %s (%s); loading from the remote tier %s",
                    directory, exc, remote)
        return _from_remote(str(remote), group, model, optimizer, extra_state, map_location)
    return _as_loaded(r, model, optimizer, extra_state, map_location)


def _from_remote(url: str, group: Group | None, model: Any, optimizer: Any,
                 extra_state: Mapping[str, Any] | None, map_location: Any) -> Restored:
    """The remote tier: a sharded step (or any step into a sharded model) through the local
    resharding planner on remote sets (each rank GETs the byte ranges its shards need, any
    world size; FORMAT.md §12.7), else each rank's part whole (pccheck.tiers.remote.load)."""
    from .tiers.remote.load import load_remote
    from .tiers.remote.sharded import newest_remote_is_sharded, remote_sets

    if (model is not None and has_dtensors(model)) or newest_remote_is_sharded(url, group):
        state = TorchState(model, optimizer, extra_state) if model is not None else None
        return load_sharded(url, group, state, map_location, decode=nested_state, sets=remote_sets(url, group))
    return _as_loaded(load_remote(url, group), model, optimizer, extra_state, map_location)


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


def _load_lazily(directory: Path, group: Group | None, model: Any, optimizer: Any,
                 extra_state: Mapping[str, Any] | None, zero_copy: bool, verify: bool,
                 map_location: Any) -> LazyRestore:
    if model is None:
        raise ConfigError("lazy=True restores a model in place: pass model= (and optimizer=)")
    if zero_copy or not verify or map_location is not None:
        raise ConfigError("lazy=True loads into the model's own tensors and checks every array: "
                          "it takes no zero_copy=, verify=False or map_location=")
    if group is not None:
        raise ConfigError("lazy=True is not supported in a torch.distributed group yet; load eagerly")
    located = locate(directory)  # recovery's rule, on meta records and manifests
    if isinstance(located.manifest.tree, dict) and "shards" in located.manifest.tree or has_dtensors(model):
        raise ConfigError("lazy=True does not restore sharded (DTensor) state yet; load it eagerly")
    return restore_lazily(located, TorchState(model, optimizer, extra_state))


def _remote_lazily(path: Any, remote: str | None, group: Group | None, model: Any, optimizer: Any,
                   extra_state: Mapping[str, Any] | None, zero_copy: bool, verify: bool,
                   map_location: Any) -> LazyRestore:
    """lazy=True from the remote tier: ``path`` itself when s3://, else the local store, falling
    back to ``remote`` when it holds nothing (the arrays then arrive by ranged GETs). In a group
    only from an s3:// ``path``: the ranks agree on the step (locate_remote), each restores its
    own part."""
    from .tiers.remote.load import locate_remote

    if group is not None and not is_remote(path):
        raise ConfigError("lazy=True in a torch.distributed group restores from the remote tier only: pass the "
                          "s3:// URL as the path (load_latest(url, ..., lazy=True)), or load eagerly")
    if not is_remote(path):
        try:
            return _load_lazily(Path(path) if path is not None else default_path(), None, model, optimizer,
                                extra_state, zero_copy, verify, map_location)
        except NoCheckpointError as exc:
            log.warning("pccheck: no local checkpoint to restore lazily (%s); from the remote tier %s", exc, remote)
            path = remote
    if zero_copy or not verify or map_location is not None:
        raise ConfigError("lazy=True takes no zero_copy=, verify=False or map_location=")
    if model is None or has_dtensors(model):
        raise ConfigError("lazy=True restores a model (without DTensors) in place: pass model=")
    located = locate_remote(str(path), group)
    tree = located.manifest.tree
    if isinstance(tree, dict) and "shards" in tree:  # the same step, so the same answer, on every rank
        raise ConfigError("lazy=True does not restore sharded (DTensor) state yet; load it eagerly")
    return restore_lazily(located, TorchState(model, optimizer, extra_state), read=located.read)


def _check_same_step(group: Group, step: int) -> None:
    import torch.distributed as dist

    steps: list[Any] = [None] * group.world_size
    dist.all_gather_object(steps, step, group=group.pg)
    if len(set(steps)) != 1:
        raise PCCheckError(f"ranks loaded different steps {steps} from the shared store; load while no "
                           "Checkpointer is writing to it")
