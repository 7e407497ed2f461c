"""``pccheck.load_latest``: the newest valid checkpoint, put back in place when given the objects.

Without ``model`` it returns the arrays (numpy) of an arrays checkpoint, or the nested state with
tensors of a PyTorch checkpoint. With ``model`` (and ``optimizer``, ``extra_state``) it restores
them in place, including the RNG states, so training resumes bit for bit at ``r.step + 1``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from pathlib import Path

from .group.distributed import Group, agree_and_load, detect_group
from .errors import ConfigError, PCCheckError
from .ops.inventory import locate
from .lazy import LazyRestore, restore_lazily
from .persist import recovery
from .persist.files import default_path, rank_dir
from .persist.recovery import Restored
from .sharded.dtensor import has_dtensors
from .sharded.load import load_sharded, newest_is_sharded
from .state.torch_state import TorchState, nested_state

__all__ = ["load_latest"]


def load_latest(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                extra_state: Mapping[str, Any] | None = None, map_location: Any = None,
                zero_copy: bool = False, verify: bool = True, distributed: bool = True,
                lazy: bool = False, memory_dir: str | os.PathLike[str] | bool | None = None) -> Restored | LazyRestore:
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

    With ``memory_dir`` (a path, or True for the default ``/dev/shm/pccheck/<store>``) the memory
    tier is searched too (pccheck.tiers.memory.nearest): the ranks agree on the newest step each
    can obtain from its own memory, a peer's replica or its own disk, and each loads from the
    nearest; ``Restored.tier`` says which. Every rank must pass it.
    """
    if (optimizer is not None or extra_state) and model is None:
        raise ConfigError("pass model= together with optimizer= / extra_state=")
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
        if memory_dir is not None and memory_dir is not False:
            raise ConfigError("the memory tier does not hold sharded (DTensor) state yet: load without memory_dir=")
        state = TorchState(model, optimizer, extra_state) if model is not None else None
        return load_sharded(directory, group, state, map_location, decode=nested_state)
    if memory_dir is not None and memory_dir is not False:
        from .tiers.memory import default_memory_dir, load_nearest

        if lazy or zero_copy:
            raise ConfigError("memory_dir= loads eagerly and copies: drop lazy= / zero_copy=")
        root = default_memory_dir(directory) if memory_dir is True else Path(memory_dir)
        r = load_nearest(directory, root, group, verify=verify)
    elif group is not None and rank_dir(directory, group.rank).is_dir():
        r = agree_and_load(directory, group, verify=verify)
    else:
        r = recovery.load_newest(directory, zero_copy=zero_copy and model is None, verify=verify)
        if group is not None:  # replicated="rank0": everyone read rank 0's store; same step?
            _check_same_step(group, r.step)
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


def _check_same_step(group: Group, step: int) -> None:
    import torch.distributed as dist

    steps: list[Any] = [None] * group.world_size
    dist.all_gather_object(steps, step, group=group.pg)
    if len(set(steps)) != 1:
        raise PCCheckError(f"ranks loaded different steps {steps} from the shared store; load while no "
                           "Checkpointer is writing to it")
