"""What a PyTorch checkpoint holds, and how it goes back in place.

A snapshot flattens everything into named arrays (the tensors, saved as raw bytes with no
casting) and a JSON *tree* that mirrors the nested structure and refers to the arrays by name:

    {"model": <model.state_dict()>, "optimizer": <optimizer.state_dict()>,
     "extra": {name: <obj.state_dict() or a plain value>},
     "rng": {"python": ..., "numpy": ..., "torch": ..., "cuda": [...]}}

Tree encoding (JSON): str-keyed dicts as ``{"d": {...}}``, other dicts (the optimizer's integer
keys) as ``{"dk": [[key, value], ...]}``, tuples as ``{"t": [...]}``, lists as lists, tensors as
``{"T": name}``, numpy arrays as ``{"A": name}``, non-finite floats as ``{"f": "nan"}``, torch
dtypes/devices as ``{"dtype": "float32"}`` / ``{"device": "cuda:0"}``; ints, finite floats, str,
bool and None as themselves. Anything else is refused with a ConfigError naming its path, except
in a :class:`Flattener` made with ``serialize_other`` (pccheck.lightning: a framework's checkpoint
dict holds user objects): there it is stored with ``torch.save`` as a uint8 array, ``{"P": name}``,
and rebuilt only by ``torch.load(weights_only=True)`` (the ``as_serialized`` of :func:`rebuild`).

The tree also holds ``"order"``: the array names in the order a lazy restore should read them
(pccheck.lazy): each module's own parameters and buffers in the order the modules first ran
forward (recorded once, during the first forward after the TorchState is made; registration order
until then), then every other array; and ``"order_forward"``: how many leading names belong to
modules that ran forward (0 before it was recorded). Restoring ignores both.

Tensors that share storage (tied weights) are stored once; both paths refer to the same name.
Module buffers (BatchNorm running stats and the like, which forward itself changes) and any name
the user marks are *eager*: copied before ``maybe_checkpoint`` returns. Everything else is copied
in the background until the optimizer's next step (soft copy-on-write).
"""

from __future__ import annotations

import io
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..arrays import torch_dtype
from ..errors import ConfigError, CorruptCheckpointError
from ..sharded.dtensor import check_placements, global_rank, has_dtensors, is_dtensor, local_part
from ..sharded.geometry import full_box

__all__ = ["Snapshot", "TorchState", "Flattener", "tensor_from", "rebuild", "unwrap_extra", "state_tree"]


@dataclass
class Snapshot:
    """One checkpoint's content: arrays in layout order (eager ones first) and the tree."""

    arrays: dict[str, Any]
    n_eager: int                    # the first ``n_eager`` arrays must be copied synchronously
    tree: dict[str, Any] | None     # None for a mapping of arrays: nothing to rebuild
    versions: list[tuple[str, Any, int]] = field(default_factory=list)  # (name, tensor, _version)

    def validate(self) -> str | None:
        """Tensor version counters as a validator: a lazily copied tensor whose ``_version`` moved
        was modified in place during the copy. (Fused AdamW and BatchNorm do not bump
        ``_version``, so a clean result is not a proof; the optimizer pre-hook is.)"""
        changed = [name for name, t, v in self.versions if t._version != v]
        if changed:
            return (f"{len(changed)} tensor(s) were modified in place while being copied (first: {changed[0]!r}); "
                    "update parameters only inside optimizer.step(), or call ck.wait_copied() first")
        return None


def _identity(t: Any) -> tuple | None:
    """What names a tensor's bytes (tied tensors share it); None for an empty tensor."""
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()), t.dtype) if t.numel() else None


class Flattener:
    """A nested state as named arrays (:attr:`arrays`) and the JSON tree :meth:`encode` returns.

    ``rank`` set: a sharded state (FORMAT.md §9): the model's and the optimizer's tensors
    become ``{"S": fqn}`` leaves with an entry in :attr:`shards`, each rank storing only its
    local shards, and a replicated tensor stored by the lowest rank holding it.
    ``serialize_other``: a value of no other kind becomes a ``{"P": path}`` leaf (torch.save bytes)."""

    def __init__(self, rank: int | None = None, *, serialize_other: bool = False) -> None:
        self.arrays: dict[str, Any] = {}
        self.rank = rank
        self.serialize_other = serialize_other
        self.shards: dict[str, Any] = {}
        self._seen: dict[tuple, dict[str, str]] = {}  # storage identity -> its leaf (tied tensors)

    def tensor(self, path: str, t: Any) -> dict[str, str]:
        if self.rank is not None and path.split("/", 1)[0] in ("model", "optimizer"):
            return self._shard(path, t.detach())
        t = t.detach()
        key = _identity(t)
        if key is not None and key in self._seen:
            return self._seen[key]
        self.arrays[path] = t
        leaf = {"T": path}
        if key is not None:
            self._seen[key] = leaf
        return leaf

    def _shard(self, path: str, t: Any) -> dict[str, str]:
        if is_dtensor(t):
            part = local_part(t, path)
            local, box, stores = part.local, part.box, part.stores
        else:  # a plain tensor of a sharded state is replicated on every rank: rank 0 stores it
            local, box, stores = t, full_box(tuple(t.shape)), self.rank == 0
        key = _identity(local)
        if key is not None and key in self._seen:
            return self._seen[key]
        entry: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "chunks": []}
        self.shards[path] = entry
        if stores:
            self.arrays[path] = local
            entry["chunks"].append([path, list(box.offsets)])
        leaf = {"S": path}
        if key is not None:
            self._seen[key] = leaf
        return leaf

    def encode(self, path: str, x: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            return self.tensor(path, x)
        if isinstance(x, np.ndarray):
            if x.dtype.hasobject:
                raise ConfigError(f"{path}: object arrays cannot be checkpointed")
            self.arrays[path] = x
            return {"A": path}
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"f": repr(x)}
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return self.encode(path, x.item())
        if isinstance(x, Mapping):
            if all(isinstance(k, str) for k in x):
                return {"d": {k: self.encode(f"{path}/{k}", v) for k, v in x.items()}}
            if all(isinstance(k, (int, str, bool)) or k is None for k in x):
                return {"dk": [[k, self.encode(f"{path}/{k}", v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"t": [self.encode(f"{path}/{i}", v) for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [self.encode(f"{path}/{i}", v) for i, v in enumerate(x)]
        if torch is not None and isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if torch is not None and isinstance(x, torch.device):
            return {"device": str(x)}
        if self.serialize_other and torch is not None:
            return self._serialized(path, x, torch)
        raise ConfigError(f"{path}: cannot checkpoint a {type(x).__name__}; state must hold tensors, "
                          "numpy arrays and plain values (int, float, str, bool, None, list, tuple, dict)")

    def _serialized(self, path: str, x: Any, torch: Any) -> dict[str, str]:
        buf = io.BytesIO()
        try:
            torch.save(x, buf)
        except Exception as exc:  # pickling a lambda, a lock, an open file, ...
            raise ConfigError(f"{path}: cannot checkpoint a {type(x).__name__}: neither the JSON tree nor "
                              f"torch.save can hold it ({type(exc).__name__}: {exc})") from None
        self.arrays[path] = np.frombuffer(buf.getbuffer(), dtype=np.uint8).copy()
        return {"P": path}


def tensor_from(arrays: Mapping[str, np.ndarray], torch_dtypes: Mapping[str, str], name: str,
                map_location: Any = None) -> Any:
    """The tensor of a loaded array (its own memory where it can; the saved torch dtype where
    numpy has none), on ``map_location`` if given."""
    import torch

    a = arrays[name]
    t = torch.from_numpy(a if a.flags.c_contiguous and a.flags.writeable else a.copy())
    if name in torch_dtypes:
        t = t.view(torch_dtype(torch_dtypes[name]))
    return t.to(map_location) if map_location is not None else t


def load_serialized(key: str, data: bytes, device: Any = None) -> Any:
    """A ``{"P": …}`` value: ``torch.load(weights_only=True)`` of its bytes, nothing more."""
    import torch

    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location=device)
    except Exception as exc:  # torch's unpickler refuses what weights_only does not allow
        raise ConfigError(f"checkpoint key {key!r} holds an object that torch.load(weights_only=True) refuses "
                          f"({_why(exc)}); pccheck "
                          "never unpickles more than that: store it as plain values, or allow its class with "
                          "torch.serialization.add_safe_globals before loading") from None


def _why(exc: Exception) -> str:
    """The line of torch's refusal that names what it refused (its first line is boilerplate)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if "global" in ln.lower() or "unpickler" in ln.lower()]
    return (named or lines or [type(exc).__name__])[0]


def rebuild(tree: Any, arrays: Mapping[str, Any], as_tensor: Callable[[str], Any],
            as_shard: Callable[[str], Any] | None = None, *,
            as_serialized: Callable[[str], Any] | None = None) -> Any:
    """Inverse of the tree encoding; ``as_tensor(name)`` makes the tensor for a ``{"T": name}``
    leaf, ``as_shard(fqn)`` the one for a ``{"S": fqn}`` leaf of a sharded state (FORMAT.md §9),
    ``as_serialized(name)`` the value of a ``{"P": name}`` leaf (a tree without the callback
    that has one is refused as malformed)."""
    if isinstance(tree, list):
        return [rebuild(v, arrays, as_tensor, as_shard, as_serialized=as_serialized) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) != 1:
        raise CorruptCheckpointError("malformed state tree")
    (tag, v), = tree.items()
    if tag == "d" and isinstance(v, dict):
        return {k: rebuild(x, arrays, as_tensor, as_shard, as_serialized=as_serialized) for k, x in v.items()}
    if tag == "dk" and isinstance(v, list):
        return {kv[0]: rebuild(kv[1], arrays, as_tensor, as_shard, as_serialized=as_serialized) for kv in v}
    if tag == "t" and isinstance(v, list):
        return tuple(rebuild(x, arrays, as_tensor, as_shard, as_serialized=as_serialized) for x in v)
    if tag == "T" and isinstance(v, str) and v in arrays:
        return as_tensor(v)
    if tag == "S" and isinstance(v, str) and as_shard is not None:
        return as_shard(v)
    if tag == "A" and isinstance(v, str) and v in arrays:
        return arrays[v]
    if tag == "P" and isinstance(v, str) and v in arrays and as_serialized is not None:
        return as_serialized(v)
    if tag == "f" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag == "dtype" and isinstance(v, str):
        import torch

        dt = getattr(torch, v, None)
        if isinstance(dt, torch.dtype):
            return dt
    if tag == "device" and isinstance(v, str):
        import torch

        return torch.device(v)
    raise CorruptCheckpointError(f"malformed state tree node {tag!r}")


class TorchState:
    """Takes snapshots of a model, an optimizer and extra state objects, and restores them."""

    def __init__(self, model: Any, optimizer: Any = None, extra_state: Mapping[str, Any] | None = None, *,
                 capture_rng: bool = True, eager: Iterable[str] = (), record_order: bool = False) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model = model
        self.optimizer = optimizer
        self.extra = dict(extra_state or {})
        for k in self.extra:
            if not isinstance(k, str):
                raise ConfigError(f"extra_state keys must be str, got {k!r}")
        self.capture_rng = capture_rng
        self.user_eager = set(eager)
        # A model with DTensor parameters (FSDP2, tensor parallel) is saved as shards (FORMAT.md
        # §9); a placement pccheck cannot store is refused here, before anything is written.
        self.sharded = has_dtensors(model)
        if self.sharded:
            check_placements(model)
        self._rank = global_rank() if self.sharded else None
        # Module names in first-forward order, recorded once (a Checkpointer records; a restore
        # does not), and the state_dict keys in load order, computed once recording is over.
        self.forward_order: list[str] = []
        self._order_hooks = _record_forward_order(model, self.forward_order) if record_order else []
        self._key_order: list[str] | None = None
        self._keys_ran = 0

    def may_grow(self) -> bool:
        """True while the optimizer has no state yet: it will appear at its first step."""
        return self.optimizer is not None and not self.optimizer.state

    def snapshot(self) -> Snapshot:
        import torch

        f = Flattener(self._rank)
        # Eager first: buffers (forward changes them) and user-marked tensors, then the RNG states.
        sd = self.model.state_dict()
        buffers = {name for name, _ in self.model.named_buffers(remove_duplicate=False)}  # one walk
        eager_names = [k for k, v in sd.items()
                       if isinstance(v, torch.Tensor) and (k in buffers or k in self.user_eager)]
        for k in eager_names:
            f.tensor(f"model/{k}", sd[k])
        n_eager = len(f.arrays)
        tree: dict[str, Any] = {"model": f.encode("model", sd)}
        if self.optimizer is not None:
            tree["optimizer"] = f.encode("optimizer", self.optimizer.state_dict())
        extra = {}
        for name, obj in self.extra.items():
            if hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict"):
                extra[name] = {"d": {"state_dict": f.encode(f"extra/{name}", obj.state_dict())}}
            else:
                extra[name] = {"d": {"value": f.encode(f"extra/{name}", obj)}}
        tree["extra"] = {"d": extra}
        if self.capture_rng:
            tree["rng"] = f.encode("rng", _rng_state(torch))
        if self.sharded:
            tree["shards"] = f.shards
        tree["order"], tree["order_forward"] = self._load_order(tree["model"], f.arrays)
        # Lazily copied tensors are validated by their version counters after the copy.
        versions = [(n, a, a._version) for i, (n, a) in enumerate(f.arrays.items())
                    if i >= n_eager and isinstance(a, torch.Tensor)]
        return Snapshot(f.arrays, n_eager, tree, versions)

    def _load_order(self, model_tree: Any, arrays: Mapping[str, Any]) -> tuple[list[str], int]:
        """Array names, first-use first: the model's, by module in first-forward order, then all
        other arrays (pccheck.lazy reads them in this order); and how many of the leading names
        belong to modules that ran forward (0 before the first forward was recorded)."""
        if self._key_order is None or self._order_hooks:
            keys, ran = _keys_by_first_use(self.model, self.forward_order)
            if not self._order_hooks:  # recording is over (or off): the order is final
                self._key_order, self._keys_ran = keys, ran
        else:
            keys, ran = self._key_order, self._keys_ran
        leaves = model_tree.get("d", {}) if isinstance(model_tree, dict) else {}
        names = [name if isinstance(leaf := leaves.get(k), dict) and (name := leaf.get("T", leaf.get("S"))) in arrays
                 else None for k in keys]
        n_ran = len({n for n in names[:ran] if n is not None})
        order = list(dict.fromkeys([n for n in names if n is not None] + list(arrays)))
        return order, n_ran

    def restore(self, tree: Mapping[str, Any], arrays: Mapping[str, np.ndarray], torch_dtypes: Mapping[str, str],
                map_location: Any = None) -> dict[str, Any]:
        """Puts a checkpoint back in place; returns the nested state (tensors on ``map_location``)."""
        def as_tensor(name: str) -> Any:
            return tensor_from(arrays, torch_dtypes, name, map_location)

        state = unwrap_extra(rebuild(state_tree(tree), arrays, as_tensor))
        self.apply(state)
        return state

    def apply(self, state: dict[str, Any]) -> None:
        """Loads a rebuilt state (:func:`rebuild`, :func:`unwrap_extra`) into the model, the
        optimizer, the extra objects and the RNGs."""
        self.model.load_state_dict(state["model"])
        self.apply_optimizer(state)
        self.apply_extra(state)

    def apply_optimizer(self, state: dict[str, Any]) -> None:
        """The optimizer's part of :meth:`apply`."""
        if self.optimizer is not None:
            if "optimizer" not in state:
                raise ConfigError("the checkpoint holds no optimizer state; pass optimizer=None")
            self.optimizer.load_state_dict(state["optimizer"])

    def apply_extra(self, state: dict[str, Any]) -> None:
        """The extra objects' and the RNGs' part of :meth:`apply`."""
        import torch

        for name, obj in self.extra.items():
            if name not in state["extra"]:
                raise ConfigError(f"the checkpoint holds no extra_state {name!r}")
            if hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state["extra"][name])
        if "rng" in state:
            _set_rng_state(torch, state["rng"])


def unwrap_extra(state: dict[str, Any]) -> dict[str, Any]:
    """``extra`` entries are stored as {"state_dict": ...} or {"value": ...}; return just that.
    The lazy-restore ``order`` is not part of the state."""
    state["extra"] = {k: v.get("state_dict", v.get("value")) for k, v in state.get("extra", {}).items()}
    state.pop("order", None)
    state.pop("order_forward", None)
    state.pop("shards", None)
    return state


def _record_forward_order(model: Any, order: list[str]) -> list[Any]:
    """Forward pre-hooks that append each module's name the first time it runs; all of them are
    removed when the model's first forward returns."""
    seen: set[str] = set()
    handles: list[Any] = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            if name not in seen:
                seen.add(name)
                order.append(name)
        return hook

    def done(module: Any, args: Any, output: Any) -> None:
        for h in handles:
            h.remove()
        handles.clear()

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name)))
    handles.append(model.register_forward_hook(done))
    return handles


def _keys_by_first_use(model: Any, forward_order: list[str]) -> tuple[list[str], int]:
    """state_dict keys of each module's own parameters and buffers, modules in first-forward
    order, then the modules that did not run, in registration order; and how many keys belong to
    modules that ran."""
    modules = dict(model.named_modules())
    ran = [n for n in forward_order if n in modules]
    out: list[str] = []
    n_ran = 0
    for i, mod_name in enumerate(dict.fromkeys(ran + list(modules))):
        module = modules[mod_name]
        for k, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            out.append(f"{mod_name}.{k}" if mod_name else k)
        if i < len(ran):
            n_ran = len(out)
    return out, n_ran


def state_tree(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The top level as an encoded dict; the shards section is not part of the state."""
    return {"d": {k: v for k, v in tree.items() if k != "shards"}}


def nested_state(tree: Mapping[str, Any], arrays: Mapping[str, Any], as_tensor: Callable[[str], Any],
                 as_shard: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """A checkpoint's nested state from its tree's top level (what ``load_latest`` returns):
    :func:`rebuild` without the shards section, the ``extra`` entries unwrapped. Handed to
    :func:`pccheck.sharded.load.load_sharded`, which sits below this layer."""
    return unwrap_extra(rebuild(state_tree(tree), arrays, as_tensor, as_shard))


def rng_state() -> dict[str, Any]:
    """The Python, numpy, torch (and CUDA, once initialized) RNG states, as a checkpoint saves them."""
    import torch

    return _rng_state(torch)


def _rng_state(torch: Any) -> dict[str, Any]:
    st: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                          "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(torch: Any, st: Mapping[str, Any]) -> None:
    version, internal, gauss = st["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(st["numpy"]))
    torch.set_rng_state(st["torch"].cpu())
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.cpu() for t in st["cuda"]])

