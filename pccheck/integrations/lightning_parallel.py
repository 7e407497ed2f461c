"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallel) with its distributed checkpoints
in a pccheck store (public as ``pccheck.lightning.ModelParallelStrategy``).

    strategy = pccheck.lightning.ModelParallelStrategy(data_parallel_size=2)
    trainer = L.Trainer(strategy=strategy, callbacks=[ModelCheckpoint(dirpath="ckpt", ...)])
    trainer.fit(model, ckpt_path="last")

Lightning's strategy bypasses ``CheckpointIO`` for a distributed checkpoint: it calls ``dcp.save``
with a new directory per checkpoint (DCP's ``FileSystemWriter``), plus a pickle of the rest of the
dict on rank 0. This subclass overrides ``save_checkpoint``/``load_checkpoint``, its documented
methods, and keeps everything in one :class:`pccheck.dcp.Writer` store (``store=``, default
``.pccheck-dcp`` beside the first checkpoint): each rank's shards checksummed in preallocated
slots and committed crash-safely, a save complete once every rank committed (FORMAT.md §9.1).

- The rest of the checkpoint dict (loops, callbacks, epoch, hyper-parameters) goes into the same
  save as tensors: its JSON tree (``pccheck.state.torch_state``) as bytes, its arrays, and values JSON
  cannot hold as ``torch.save`` bytes that are loaded only with ``torch.load(weights_only=True)``.
  Nothing is pickled by the strategy itself.
- At the name Lightning gives, rank 0 leaves a pointer (FORMAT.md §10) naming the save's step
  (a Lightning DCP directory already at that name is replaced, as Lightning's own save does), so
  ``ckpt_path="last"`` and top-k retention (``remove_checkpoint``) work unchanged. A load reads
  that step (every crc32c checked); for ``last*`` a step that is gone, or a pointer a power cut
  left empty, falls back to the newest complete save.
- Retention: the store keeps the newest saves (``max_concurrent`` + 1 slots per rank), whatever
  names Lightning keeps; an older name (a top-k "best" one) whose save was overwritten gets a
  clear NoCheckpointError. Keep such a checkpoint with ``save_distributed_checkpoint=False``.
- With ``save_distributed_checkpoint=False`` (one full checkpoint, written on rank 0 through the
  strategy's ``CheckpointIO``) saves are Lightning's own. Lightning's own load reads only a
  ``torch.save`` file there, so a name left by :class:`pccheck.lightning.CheckpointIO` is loaded
  here: every rank reads the full state from that store and torch's ``set_model_state_dict`` /
  ``set_optimizer_state_dict`` (``full_state_dict=True``) shard it into the model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallel

from ..errors import ConfigError, NoCheckpointError
from ..sharded.index import find_sets
from ..state.torch_state import Flattener, load_serialized, rebuild
from .dcp import Reader, Writer
from .lightning import FRAMEWORK as _FULL
from .lightning import CheckpointIO
from .named import Pointers, pointer_bytes, read_pointer

__all__ = ["ModelParallelStrategy"]

log = logging.getLogger("pccheck")

FRAMEWORK = "lightning-dcp"
_META = "pccheck_meta"  # the rest of the checkpoint dict: "<_META>.tree" (JSON bytes), "<_META>.<i>" arrays


class ModelParallelStrategy(_LightningModelParallel):
    """Lightning's ``ModelParallelStrategy`` with distributed checkpoints kept by ``pccheck.dcp``.

    Args:
        *args: Lightning's positional arguments (``data_parallel_size``, ``tensor_parallel_size``).
        store: the pccheck store directory (default: ``.pccheck-dcp`` beside the first checkpoint
            Lightning saves).
        engine: :class:`pccheck.EngineOptions` fields for the :class:`pccheck.dcp.Writer`.
        **kwargs: Lightning's keyword arguments (``save_distributed_checkpoint``, ...).
    """

    def __init__(self, *args: Any, store: str | Path | None = None, engine: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = Path(store) if store is not None else None
        self.engine = dict(engine or {})
        self._writer: Writer | None = None
        self._names = Pointers()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Saves this rank's shards and the rest of the dict as one pccheck DCP save, and leaves
        a pointer at ``filepath`` (rank 0)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        path = Path(self.broadcast(str(filepath)))
        if path.is_dir() and not (path / ".metadata").is_file():
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        if self._writer is None:
            self.store = self.store or path.parent / ".pccheck-dcp"
            self._writer = Writer(self.store, **self.engine)
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if self.global_rank == 0:  # the rest is rank 0's, as in Lightning's own save
            state.update(_encode_rest(checkpoint))
        dcp.save(state, storage_writer=self._writer)
        if self.global_rank == 0:
            step = find_sets(self.store)[0].step  # saves are synchronous: the newest complete is this one
            if path.is_dir():  # Lightning's own DCP checkpoint of the same name (an earlier run)
                shutil.rmtree(path)
            self._names.leave(path, pointer_bytes(path, self.store, path.name, step, FRAMEWORK))
        self.barrier("pccheck_checkpoint_named")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the model's and optimizers' shards in place and returns the rest of the dict."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self._names.flush()
        empty = path.is_file() and not path.stat().st_size  # a pointer a power cut left empty
        ptr = read_pointer(path) if path.is_file() and not empty else None
        full = self.checkpoint_io if isinstance(self.checkpoint_io, CheckpointIO) else None
        if ptr is not None and ptr.framework == _FULL:
            return self._load_full(path, full or CheckpointIO(ptr.store))
        if empty and path.name.startswith("last") and full is not None and not self._save_distributed_checkpoint:
            return self._load_full(path, full)  # the plugin falls back to its newest valid one
        if ptr is None or ptr.framework != FRAMEWORK:
            store = self.store or path.parent / ".pccheck-dcp"
            if empty and path.name.startswith("last") and store.is_dir():
                log.warning("pccheck: %s is empty; loading the newest complete save in %s", path, store)
                return self._load(store, None)
            return super().load_checkpoint(checkpoint_path, weights_only)
        step: int | None = ptr.step
        if not any(s.step == step for s in find_sets(ptr.store)):
            if not ptr.name.startswith("last"):
                raise NoCheckpointError(f"{ptr.store} no longer holds the save {path.name} names (step {step}): "
                                        "newer saves have taken its slots; load last.ckpt instead")
            log.warning("pccheck: the save %s named (step %d) is gone; loading the newest complete one", path, step)
            step = None
        return self._load(ptr.store, step)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Removes the pointer at ``filepath`` (Lightning's top-k retention), on rank 0; the
        save's slots are reused by later saves. A name that is not this strategy's goes to
        Lightning's own removal."""
        path = Path(filepath)
        if self.is_global_zero and path.is_file() and (ptr := read_pointer(path)) is not None \
                and ptr.framework == FRAMEWORK:
            self._names.remove(path)
            return
        super().remove_checkpoint(filepath)

    def _load(self, store: Path, step: int | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        assert self.model is not None and self.lightning_module is not None
        if not find_sets(store):
            raise NoCheckpointError(f"{store} holds no complete save (every rank's part committed); "
                                    "start without ckpt_path")
        model_state = {"state_dict": get_model_state_dict(self.model)}
        dcp.load(model_state, storage_reader=Reader(store, step=step))
        self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            opt_state = {f"optimizer_{i}": get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(opt_state, storage_reader=Reader(store, step=step))
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=opt_state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        return _decode_rest(store, step)

    def _load_full(self, path: Path, io: CheckpointIO) -> dict[str, Any]:
        """A full checkpoint :class:`pccheck.lightning.CheckpointIO` saved (``save_distributed_
        checkpoint=False``): read on every rank, sharded into the model by torch's state-dict API."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        assert self.model is not None and self.lightning_module is not None
        checkpoint = io.load_checkpoint(path)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            if any(isinstance(k, int) for k in state.get("state", {})):  # Lightning saves it keyed by id
                from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

                state = FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME,
                                                                        self.model)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=state, options=options)
        return checkpoint

    def teardown(self) -> None:
        """Closes the store (every save is already committed: saves are synchronous) and makes
        the pointers left so far durable, then Lightning's own teardown."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._names.flush()
        super().teardown()


def _encode_rest(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The rest of the checkpoint dict as DCP state entries that are all tensors."""
    fl = Flattener(serialize_other=True)
    tree = fl.encode("ckpt", checkpoint)
    names = list(fl.arrays)
    out: dict[str, Any] = {f"{_META}.tree": _bytes_tensor(json.dumps({"tree": tree, "names": names}).encode())}
    for i, name in enumerate(names):
        a = fl.arrays[name]
        out[f"{_META}.{i}"] = a.detach().cpu() if isinstance(a, torch.Tensor) else torch.from_numpy(a)
    return out


def _decode_rest(store: Path, step: int | None) -> dict[str, Any]:
    """The rest of the checkpoint dict, read back from the save (shapes from its metadata)."""
    reader = Reader(store, step=step)
    md = reader.read_metadata()
    template = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                for k, m in md.state_dict_metadata.items() if k.startswith(f"{_META}.")}
    if f"{_META}.tree" not in template:
        raise ConfigError(f"{store}: the save holds no Lightning checkpoint (written by another pccheck.dcp user)")
    dcp.load(template, storage_reader=Reader(store, step=step))
    doc = json.loads(template.pop(f"{_META}.tree").numpy().tobytes())
    arrays = {name: template[f"{_META}.{i}"] for i, name in enumerate(doc["names"])}

    def as_serialized(name: str) -> Any:
        return load_serialized(name.removeprefix("ckpt/"), arrays[name].numpy().tobytes(), None)

    return rebuild(doc["tree"], arrays, arrays.__getitem__, as_serialized=as_serialized)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
