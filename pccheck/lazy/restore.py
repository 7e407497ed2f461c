"""Soft on-demand restore (PhoenixOS §5): training starts while the tensors are still loading.

``pccheck.load_latest(path, model=..., optimizer=..., lazy=True)``:

1. Picks the checkpoint by recovery's rule on meta records and manifests (no array data read),
   reads the small parts (extra state, RNG states) and puts them back, and loads the optimizer's
   structure and hyperparameters with placeholder tensors. It returns a :class:`LazyRestore`.
2. A loader thread (:mod:`.loader`) reads the tensors in first-use order (the ``order`` the
   Checkpointer recorded: each module's own parameters and buffers in the order the modules first
   ran forward, then the rest) and copies each into its place: the model's own parameter or
   buffer, the optimizer state tensor.
3. A forward pre-hook on each module that owns parameters or buffers waits for those only; an
   optimizer step pre-hook waits for everything (the step mutates every parameter and the state).
   ``r.wait()`` waits for everything and removes the hooks; ``r.done`` says whether all is in.
4. A crc32c mismatch stops the loader; the next wait point (a forward, the step, ``r.wait()``)
   raises CorruptCheckpointError saying to load again eagerly (which falls back to the previous
   valid checkpoint), and keeps raising: a half-loaded model is never used silently.

Not covered: a parameter or buffer read outside a module's forward or the optimizer step (e.g.
by a custom function, an EMA copy, a state_dict() export) before ``r.wait()`` returns may see
the value it had before the restore. Call ``r.wait()`` before such code.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..arrays import torch_dtype
from ..errors import ConfigError, CorruptCheckpointError
from ..ops.inventory import Located
from ..persist.recovery import array_bases, mark_validated, slot_base
from ..state.torch_state import TorchState, rebuild, unwrap_extra
from .loader import Loader, read_entry

__all__ = ["LazyRestore", "restore_lazily", "restoring", "wait_for_pending"]

# model -> the loader of a lazy restore into it (Checkpointer snapshots wait for it)
_pending: "weakref.WeakKeyDictionary[Any, Loader]" = weakref.WeakKeyDictionary()
# models a lazy restore is being set up into (before their loader is in _pending): the optimizer's
# load_state_dict runs then, and a Checkpointer's hook on it asks restoring()
_starting: "weakref.WeakSet[Any]" = weakref.WeakSet()


@dataclass
class LazyRestore:
    """A checkpoint being put back in place in the background. ``state`` holds the step and the
    extra state; the model and the optimizer are restored in place."""

    step: int
    state: dict[str, Any]
    metadata: dict[str, Any]
    counter: int
    generation: int
    slot: int
    path: Path
    _loader: Loader
    _handles: list[Any]

    @property
    def done(self) -> bool:
        """Whether every tensor is in place (False while loading, and after a failure)."""
        return self._loader.finished.is_set() and self._loader.error is None

    def wait(self) -> None:
        """Blocks until every tensor is in place, then removes the hooks. Raises
        CorruptCheckpointError if a tensor failed to load (call from the training thread)."""
        self._loader.wait_all()
        self._remove_hooks()

    async def wait_async(self) -> None:
        """``wait`` for asyncio hosts: the event loop keeps running while the tensors load. The
        hooks, which no longer wait, remove themselves at their next call."""
        await asyncio.to_thread(self._loader.wait_all)

    def _remove_hooks(self) -> None:
        handles, self._handles[:] = list(self._handles), []
        for h in handles:
            h.remove()


def restore_lazily(located: Located, source: TorchState, read: Any = None) -> LazyRestore:
    """Starts a lazy restore of ``located`` into ``source``'s model, optimizer and extra state.
    Everything that can fail is checked before the model, optimizer or extra objects change.
    ``read(entry, crc32c, into)`` reads one array, checked (the remote tier's ranged GETs);
    None: from the slot ``located`` names."""
    import torch

    man = located.manifest
    if not isinstance(man.tree, dict):
        raise ConfigError(f"the checkpoint at step {man.step} holds arrays, not a PyTorch model; "
                          "load it without model=")
    entries = {e.name: (e, crc) for e, crc in zip(man.arrays, man.crcs)}
    path = located.image.path
    local = read is None
    if local and man.references(located.slot):  # an incremental checkpoint: each array from its cell
        read = _cell_reader(path, dict(zip(entries, array_bases(located.image, located.slot, man))))
    base = slot_base(located.image, located.slot) if read is None else 0
    tree = {k: v for k, v in man.tree.items() if k not in ("order", "order_forward")}
    lazy = _lazy_names(tree) & set(entries)
    try:  # everything else (extra state, RNG, tensors in param_groups, nested state) now
        now = [n for n in entries if n not in lazy]
        small = _read_now(path, base, entries, now) if read is None else {n: read(*entries[n], None) for n in now}
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{path} slot {located.slot} (step {man.step}): {exc}; load with "
                                     "lazy=False to fall back to the previous valid checkpoint") from None
    placeholders: dict[str, Any] = {}

    def as_tensor(name: str) -> Any:
        if name in small:
            return _tensor(torch, small[name], entries[name][0].torch_dtype)
        e = entries[name][0]
        dt = torch_dtype(e.torch_dtype) if e.torch_dtype else torch.from_numpy(np.empty(0, e.dtype)).dtype
        return placeholders.setdefault(name, torch.empty(e.shape, dtype=dt))

    state = unwrap_extra(rebuild({"d": tree}, {**{n: None for n in entries}, **small}, as_tensor))
    _check_fits(source, state)
    dests = _model_destinations(source.model, tree.get("model"), state["model"])
    if source.optimizer is not None and "optimizer" in state:
        _place_like_params(torch, source.optimizer, state["optimizer"], {id(t) for t in placeholders.values()})
    _starting.add(source.model)
    try:
        source.apply_optimizer(state)  # structure and hyperparameters now; tensors hold placeholders
    finally:
        _starting.discard(source.model)
    if source.optimizer is not None:
        _optimizer_destinations(source.optimizer, state["optimizer"], tree["optimizer"], dests)
    source.apply_extra(state)
    order = [n for n in _order(man.tree, entries) if n in dests]
    complete = set(order) | set(small) == set(entries)  # then a clean load validated every array
    loader = Loader(path, base, entries, order, _deliverer(torch, dests, entries),
                    f"{path} slot {located.slot} (step {man.step})", _targeter(torch, dests, entries),
                    lambda: mark_validated(located.image, located.slot, man.counter) if complete and local
                    else None, read=read)
    handles = _hooks(source, loader, tree.get("model"), _unrun_model_names(man.tree, order))
    _pending[source.model] = loader
    loader.start()
    return LazyRestore(man.step, {"step": man.step, "extra": state["extra"]}, man.metadata, man.counter,
                       located.generation, located.slot, path, loader, handles)


def restoring(model: Any) -> bool:
    """Whether a lazy restore into ``model`` is being set up or still loading: a Checkpointer
    then leaves its chunk pool and store for later (their prefault and verification would
    compete with the loader for the disk, the memory bus and the CPUs)."""
    loader = _pending.get(model)
    return model in _starting or (loader is not None and not loader.finished.is_set())


def wait_for_pending(model: Any) -> None:
    """Blocks until a lazy restore into ``model`` (if any) has every tensor in place; raises its
    error. A Checkpointer calls it before a snapshot, so a half-loaded model is never saved."""
    loader = _pending.get(model)
    if loader is not None:
        loader.wait_all()
        _pending.pop(model, None)  # done: later snapshots need not look again


def _lazy_names(tree: Mapping[str, Any]) -> set[str]:
    """The arrays a lazy restore may load in the background: the model's tensors and each
    optimizer parameter's own state tensors (what the hooks guard); the rest is read at once."""
    names = set(_leaf_names(tree.get("model")).values())
    opt = tree.get("optimizer")
    state_node = opt.get("d", {}).get("state", {}) if isinstance(opt, dict) else {}
    for item in state_node.get("dk", []) if isinstance(state_node, dict) else []:
        if isinstance(item, list) and len(item) == 2:
            names |= set(_leaf_names(item[1]).values())
    return names


def _unrun_model_names(tree: Mapping[str, Any], order: list[str]) -> set[str]:
    """Model tensors of modules that had not run forward when the checkpoint was taken (all of
    them when the order was never recorded): the root's forward waits for these."""
    model = set(_leaf_names(tree.get("model")).values())
    ran = tree.get("order_forward")
    ran = ran if type(ran) is int and ran >= 0 else 0
    recorded = tree.get("order") if isinstance(tree.get("order"), list) else []
    return model - set(recorded[:ran]) if ran else set(n for n in order if n in model)


def _check_fits(source: TorchState, state: Mapping[str, Any]) -> None:
    """What apply_optimizer / apply_extra would refuse, refused before anything changes."""
    if source.optimizer is not None and "optimizer" not in state:
        raise ConfigError("the checkpoint holds no optimizer state; pass optimizer=None")
    missing = [n for n in source.extra if n not in state.get("extra", {})]
    if missing:
        raise ConfigError(f"the checkpoint holds no extra_state {missing[0]!r}")


def _order(tree: Mapping[str, Any], entries: Mapping[str, Any]) -> list[str]:
    """The recorded first-use order (checked against the manifest), then any array it misses."""
    recorded = tree.get("order")
    first = [n for n in recorded if isinstance(n, str) and n in entries] if isinstance(recorded, list) else []
    return list(dict.fromkeys(first + list(entries)))


def _cell_reader(path: Path, bases: Mapping[str, int]) -> Any:
    """``read(entry, crc32c, into)`` for a slot whose arrays lie in several cells (FORMAT.md §14):
    each array from the file offset of its own cell, checked against its crc32c."""
    def read(entry: Any, crc: int, into: Any) -> np.ndarray:
        with open(path, "rb", buffering=0) as f:
            return read_entry(f.fileno(), bases[entry.name], entry, crc, into=into)
    return read


def _read_now(path: Path, base: int, entries: Mapping[str, Any], names: list[str]) -> dict[str, np.ndarray]:
    """These arrays, read and checked now (a mismatch raises here)."""
    with open(path, "rb", buffering=0) as f:
        return {n: read_entry(f.fileno(), base, *entries[n]) for n in names}


def _tensor(torch: Any, arr: np.ndarray, tdt: str | None) -> Any:
    t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return t.view(torch_dtype(tdt)) if tdt else t


def _leaf_names(node: Any) -> dict[str, str]:
    """key -> array name of a ``{"d": {key: {"T": name}}}`` tree node."""
    d = node.get("d", {}) if isinstance(node, dict) else {}
    return {k: v["T"] for k, v in d.items() if isinstance(v, dict) and isinstance(v.get("T"), str)}


def _model_destinations(model: Any, model_tree: Any, saved: Mapping[str, Any]) -> dict[str, list[Any]]:
    """array name -> the model's own tensors it goes into; the same checks as a strict
    ``load_state_dict`` (keys and shapes), before anything is changed."""
    live = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(live) - set(saved)), sorted(set(saved) - set(live))
    if missing or unexpected:
        raise ConfigError(f"the checkpoint does not match the model: missing keys {missing[:5]}, "
                          f"unexpected keys {unexpected[:5]}")
    for k, t in live.items():
        if tuple(t.shape) != tuple(saved[k].shape):
            raise ConfigError(f"the checkpoint does not match the model: {k!r} has shape "
                              f"{tuple(saved[k].shape)} there and {tuple(t.shape)} here")
    dests: dict[str, list[Any]] = {}
    for k, name in _leaf_names(model_tree).items():
        dests.setdefault(name, []).append(live[k])
    return dests


def _place_like_params(torch: Any, optimizer: Any, saved: Mapping[str, Any], placeholder_ids: set[int]) -> None:
    """Replaces each placeholder of ``saved``'s per-parameter state by an empty tensor already
    where (device) and as (dtype) ``optimizer.load_state_dict`` would cast it, so that cast is a
    no-op. Else a device model's load copies every placeholder host-to-device before returning
    (0.22 s for 1 GiB onto an H200), and the first forward waits for that."""
    ids = [i for g in saved.get("param_groups", []) for i in g["params"]]
    groups = [(p, g) for g in optimizer.param_groups for p in g["params"]]
    for idx, (param, group) in zip(ids, groups):
        per_param = saved.get("state", {}).get(idx)
        if param.device.type == "cpu" or not isinstance(per_param, dict):
            continue  # on the CPU the cast is a no-op already (same device, placeholders are lazy)
        for k, v in per_param.items():
            if id(v) not in placeholder_ids:
                continue
            if k == "step":  # torch's rule: kept as is unless fused or capturable
                if group.get("fused") or group.get("capturable"):
                    per_param[k] = torch.empty(v.shape, dtype=torch.float32, device=param.device)
                continue
            dtype = param.dtype if param.is_floating_point() else v.dtype
            per_param[k] = torch.empty(v.shape, dtype=dtype, device=param.device)


def _optimizer_destinations(optimizer: Any, saved: Mapping[str, Any], opt_tree: Any,
                            dests: dict[str, list[Any]]) -> None:
    """Adds the optimizer's state tensors (as load_state_dict left them) to ``dests``."""
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    by_id = dict(zip(ids, params))
    state_node = opt_tree.get("d", {}).get("state", {}) if isinstance(opt_tree, dict) else {}
    for idx, per_param in state_node.get("dk", []):
        for k, name in _leaf_names(per_param).items():
            dests.setdefault(name, []).append(optimizer.state[by_id[idx]][k])


def _targeter(torch: Any, dests: Mapping[str, list[Any]], entries: Mapping[str, Any]) -> Any:
    """Where the loader may read an array straight into: the first destination's own bytes, when
    it is a contiguous CPU tensor of the stored dtype and size (no staging buffer to fault in and
    copy from). Else None: the array is staged and copied (other devices, dtype casts)."""
    def target(name: str) -> np.ndarray | None:
        d = dests[name][0].detach()
        e = entries[name][0]
        stored = torch_dtype(e.torch_dtype) if e.torch_dtype else torch.from_numpy(np.empty(0, e.dtype)).dtype
        if (d.device.type != "cpu" or d.dtype != stored or not d.is_contiguous()
                or d.numel() * d.element_size() != e.nbytes or not e.nbytes):
            return None
        return d.view(-1).view(torch.uint8).numpy()
    return target


def _deliverer(torch: Any, dests: Mapping[str, list[Any]], entries: Mapping[str, Any]) -> Any:
    def deliver(name: str, arr: np.ndarray, direct: bool) -> None:
        targets = dests[name][1:] if direct else dests[name]  # direct: the first one holds it already
        if not targets:
            return
        src = dests[name][0] if direct else _tensor(torch, arr, entries[name][0].torch_dtype)
        with torch.no_grad():
            for d in targets:
                d.copy_(src)
    return deliver


def _hooks(source: TorchState, loader: Loader, model_tree: Any, unrun: set[str]) -> list[Any]:
    """A forward pre-hook per module owning tensors (waits for those; the root's also for the
    tensors of modules that had not run forward at save time, which may be read by others), and
    a step pre-hook (waits for all). Once everything is in, a forward pre-hook removes them all:
    torch iterates a copy of the forward hooks, but not of the step hooks, so the step hook
    never removes anything itself."""
    handles: list[Any] = []
    names = _leaf_names(model_tree)

    def waiter(wanted: list[str], remove: bool) -> Any:
        def hook(*_: Any) -> None:
            if loader.finished.is_set() and loader.error is None:
                if remove:
                    for h in list(handles):
                        h.remove()
                    handles.clear()
                return
            loader.wait(wanted)
        return hook

    for mod_name, module in source.model.named_modules():
        own = [k for k, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        wanted = [names[key] for k in own if (key := f"{mod_name}.{k}" if mod_name else k) in names]
        if module is source.model:
            wanted += sorted(unrun)
        wanted = list(dict.fromkeys(n for n in wanted if n in loader.events))
        if wanted:
            handles.append(module.register_forward_pre_hook(waiter(wanted, remove=True)))
    if source.optimizer is not None:
        handles.append(source.optimizer.register_step_pre_hook(waiter(list(loader.events), remove=False)))
    return handles
