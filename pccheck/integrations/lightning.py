"""pccheck as PyTorch Lightning's ``CheckpointIO`` plugin (public as ``pccheck.lightning``).

    trainer = lightning.Trainer(plugins=[pccheck.lightning.CheckpointIO()], callbacks=[
        ModelCheckpoint(dirpath="ckpt", every_n_train_steps=50, save_last=True)])
    trainer.fit(model, ckpt_path="last")      # resumes from pccheck's newest valid checkpoint

Write path: Lightning hands ``save_checkpoint`` the checkpoint dict (rank 0 only). Its tensors
alias the live model and optimizer: nothing is cloned on the device. The optimizers' state and
the parameters they step are copied into the DRAM chunk pool in the background, and a global
optimizer step pre-hook makes the next ``optimizer.step()`` wait only for what is not yet copied
(soft copy-on-write; a tensor changed meanwhile fails that checkpoint, never silently). The rest
(buffers, which forward changes; anything else) is copied before ``save_checkpoint`` returns.
The same hook tells which storages are parameters. Persist and commit (the CAS) go on behind
training, up to ``max_concurrent`` at once.

Names: the store lives in ``path`` (default: ``.pccheck`` beside the first checkpoint file
Lightning names), and at each file name Lightning gives pccheck leaves a small JSON pointer
(:mod:`.named`), so Lightning's own file logic (``ckpt_path="last"``, top-k, version counters,
``save_last="link"``) works unchanged. ``load_checkpoint`` follows the pointer to the newest valid
checkpoint carrying that name; for ``last*.ckpt``, one that never became durable (a crash right
after it was handed over) falls back to the newest valid checkpoint of any name. A file that is
not a pointer (a torch.save checkpoint from before) is loaded by Lightning's own reader with
``weights_only=True``. ``remove_checkpoint`` removes the pointer; the store's slots are reused
only by newer commits, so the newest valid checkpoint is never at risk.

The dict becomes pccheck's JSON tree (``pccheck.state.torch_state``); values JSON cannot hold
(``hyper_parameters`` objects and the like) are stored with torch's serializer and loaded only
with ``torch.load(weights_only=True)``; one it refuses raises a ConfigError naming its key.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable

from ..errors import ConfigError, NoCheckpointError, PCCheckError
from ..orchestrator.args import StartArgs
from ..orchestrator.options import EngineOptions
from ..tiers.stack import TierStack
from ..orchestrator.stats import CheckpointStats
from ..persist.recovery import load_newest
from ..state.torch_state import Flattener, load_serialized, rebuild, tensor_from
from .named import Pointers, load_named, open_store, pointer_bytes, read_pointer

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pccheck.lightning needs PyTorch Lightning: pip install 'pccheck[lightning]'") from exc

__all__ = ["CheckpointIO", "encode_checkpoint", "decode_checkpoint"]

log = logging.getLogger("pccheck")

FRAMEWORK = "lightning"
KEY = "lightning"          # the metadata object and the tree key of a Lightning checkpoint
_OPTIMIZER = "ckpt/optimizer_states/"  # arrays copied in the background (only optimizer.step changes them)


def encode_checkpoint(checkpoint: dict[str, Any], params: frozenset[int] = frozenset()) -> \
        tuple[dict[str, Any], dict[str, Any], int]:
    """The checkpoint dict as (arrays, tree, n_eager): arrays by name, the eager ones first.

    Background (copied while training goes on, until the next optimizer step): the optimizers'
    state, and tensors whose storage is a parameter some optimizer steps (``params``: storage
    addresses). Everything else (buffers, which forward changes; anything unknown) is eager."""
    fl = Flattener(serialize_other=True)
    tree = {KEY: fl.encode("ckpt", checkpoint)}

    def later(name: str, t: Any) -> bool:
        return name.startswith(_OPTIMIZER) or (hasattr(t, "untyped_storage") and t.numel() > 0
                                               and t.untyped_storage().data_ptr() in params)

    background = {k: later(k, v) for k, v in fl.arrays.items()}
    order = sorted(background, key=background.__getitem__)  # stable: eager first, each in tree order
    return {k: fl.arrays[k] for k in order}, tree, sum(not b for b in background.values())


def decode_checkpoint(r: Any, map_location: Any = None) -> dict[str, Any]:
    """The checkpoint dict of a loaded Lightning checkpoint (:class:`pccheck.Restored`)."""
    import torch

    tree = r.tree.get(KEY) if isinstance(r.tree, dict) else None
    if tree is None:
        raise ConfigError(f"{r.path}: step {r.step} is not a Lightning checkpoint (written by pccheck.lightning); "
                          "load it with pccheck.load_latest")
    device = map_location if isinstance(map_location, (str, torch.device)) else None

    def as_tensor(name: str) -> Any:
        return tensor_from(r.state, r.torch_dtypes, name, device)

    def as_serialized(name: str) -> Any:
        return load_serialized(name.removeprefix("ckpt/"), r.state[name].tobytes(), device)

    return rebuild(tree, r.state, as_tensor, as_serialized=as_serialized)


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's ``CheckpointIO`` through pccheck.

    Args:
        path: the store directory (default: ``.pccheck`` in the directory of the first checkpoint
            Lightning saves; a load follows the pointer file, wherever its store is).
        **engine: the engine's options, by name (``max_concurrent``, ``writer_threads``,
            ``chunk_size``, ``dram_budget``, ``storage``, ``when_busy``: :class:`pccheck.EngineOptions`);
            "auto" takes ``pccheck-tune``'s choice stored in the store directory, or the defaults.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, **engine: Any) -> None:
        super().__init__()
        self.path = Path(path) if path is not None else None
        try:
            self.engine = EngineOptions(**engine)
        except TypeError as exc:
            raise ConfigError(f"pccheck.lightning.CheckpointIO: {exc}; the options are those of "
                              "pccheck.EngineOptions") from None
        self._stack: TierStack | None = None
        self._past_stats: list[CheckpointStats] = []
        self._errors: list[PCCheckError] = []
        self._reported = 0
        self._hook: Any = None
        self._optimizers: set[int] = set()     # ids of the optimizers seen stepping
        self._params: frozenset[int] = frozenset()  # their parameters' storage addresses
        self._lock = threading.Lock()
        self._names = Pointers()

    # -- Lightning's interface ---------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Copies the checkpoint into DRAM (the optimizer state until its next step) and returns;
        persist and commit go on in the background. Leaves a pointer file at ``path``."""
        if storage_options is not None:
            raise ConfigError("pccheck.lightning.CheckpointIO takes no storage_options")
        self._raise_pending()
        target = Path(os.fspath(path))
        self._watch_optimizers()
        arrays, tree, n_eager = encode_checkpoint(checkpoint, self._params)
        step = checkpoint.get("global_step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"the checkpoint's global_step must be an int >= 0, got {step!r}")
        meta = {KEY: {"name": target.name, "global_step": step, "epoch": checkpoint.get("epoch")}}
        with self._lock:
            stack = self._open_stack(target, arrays)
            versions = [(k, t, t._version) for k, t in list(arrays.items())[n_eager:] if hasattr(t, "_version")]
            started = stack.start(step, arrays, meta,
                                  StartArgs(tree=tree, n_eager=n_eager, validate=_unchanged(versions)))
        if not started:  # when_busy="skip": nothing was saved, so no name may point at it
            log.warning("pccheck: skipped the checkpoint %s (step %d): max_concurrent checkpoints are in flight",
                        target, step)
            return
        self._names.leave(target, pointer_bytes(target, self.store, target.name, step, FRAMEWORK))

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint named by ``path``: its newest valid copy in the store (every crc32c
        checked). ``weights_only`` is accepted for Lightning's signature; pccheck never unpickles
        more than ``torch.load(weights_only=True)`` does, whatever it says."""
        target = Path(os.fspath(path))
        if not target.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        if target.stat().st_size == 0:  # a pointer a power cut left empty before it was durable
            store = self.path if self.path is not None else target.parent / ".pccheck"
            if target.name.startswith("last") and store.is_dir():
                log.warning("pccheck: %s is empty (a power cut before it was durable); loading the newest valid "
                            "checkpoint in %s", target, store)
                return decode_checkpoint(load_newest(store), map_location)
            raise NoCheckpointError(f"{target} is empty: a power cut left the name before it was durable; load "
                                    "last.ckpt (the newest valid checkpoint) instead")
        ptr = read_pointer(target)
        if ptr is None:  # not pccheck's: a torch.save checkpoint, read by Lightning's own reader
            return TorchCheckpointIO().load_checkpoint(target, map_location=map_location, weights_only=True)
        with self._lock:
            if self._stack is not None and Path(ptr.store).resolve() == self.store.resolve():
                self._stack.wait()  # this process's own checkpoints in flight: let them commit first
        r = load_named(ptr.store, ptr.name, KEY, newest_if_gone=ptr.name.startswith("last"))
        return decode_checkpoint(r, map_location)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes the pointer at ``path`` (Lightning's top-k retention); the checkpoint's slot is
        reused by a later commit, never before one."""
        target = Path(os.fspath(path))
        if target.is_file() and read_pointer(target) is not None:
            self._names.remove(target)
            log.debug("pccheck: removed the checkpoint name %s", target)
        elif target.exists():  # not ours: do what Lightning's default plugin does
            TorchCheckpointIO().remove_checkpoint(target)

    def teardown(self) -> None:
        """Waits until every checkpoint in flight is committed (or failed), then closes the store."""
        with self._lock:
            stack, self._stack = self._stack, None
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._optimizers, self._params = set(), frozenset()  # a later fit has new ones
        if stack is not None:
            stack.close()  # waits for the checkpoints in flight
            self._past_stats = list(stack.finished())
        self._names.flush()
        for exc in self._errors[self._reported:]:
            log.error("pccheck: a Lightning checkpoint failed in the background (the last committed one stays "
                      "loadable): %s", exc)
        self._reported = len(self._errors)

    # -- pccheck's side ----------------------------------------------------------------------------

    @property
    def store(self) -> Path:
        """The store directory (set by the first save when ``path`` was not given)."""
        if self.path is None:
            raise ConfigError("pccheck.lightning.CheckpointIO has no store yet: nothing was saved, and no path given")
        return self.path

    @property
    def errors(self) -> list[PCCheckError]:
        """Checkpoints that failed in the background; the last committed one survived each."""
        return list(self._errors)

    def stats(self) -> list[CheckpointStats]:
        """Per checkpoint since the store was opened (kept after teardown): the stall, the copy,
        the optimizer step's wait for it (``cow_wait_s``), the persist and the outcome."""
        with self._lock:
            return list(self._stack.finished()) if self._stack is not None else list(self._past_stats)

    def wait(self) -> None:
        """Waits until every checkpoint handed over is committed (or failed)."""
        with self._lock:
            if self._stack is not None:
                self._stack.wait()

    def _open_stack(self, target: Path, arrays: dict[str, Any]) -> TierStack:
        if self._stack is None:
            if self.path is None:
                self.path = target.parent / ".pccheck"
            self._stack = open_store(self.path, self.engine, arrays, self._errors.append)
        return self._stack

    def _watch_optimizers(self) -> None:
        """Soft copy-on-write: every optimizer's step first waits for what a checkpoint still
        copies, and tells which storages are parameters (Lightning gives the plugin the dict, not
        the optimizer: the hook is global). Registered once Lightning first saves; Lightning
        saves after an optimizer step, so a model's parameters are known from its second save."""
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        stack = self._stack
        if stack is not None:
            stack.ensure_copied()
        if id(optimizer) not in self._optimizers:  # its parameters may be copied in the background
            self._optimizers.add(id(optimizer))
            self._params = self._params | {_local(p).untyped_storage().data_ptr() for g in optimizer.param_groups
                                           for p in g["params"] if p.numel()}

    def _raise_pending(self) -> None:
        if len(self._errors) > self._reported:
            exc = self._errors[self._reported]
            self._reported = len(self._errors)
            raise exc


def _local(param: Any) -> Any:
    """A parameter's own storage: a DTensor's (FSDP2, tensor parallel) is its local shard's."""
    to_local = getattr(param, "to_local", None)
    return to_local() if callable(to_local) else param


def _unchanged(versions: list[tuple[str, Any, int]]) -> Callable[[], str | None]:
    """The check run once the background copy is done: no tensor it read was changed meanwhile."""
    def check() -> str | None:
        changed = [k for k, t, v in versions if t._version != v]
        if changed:
            return (f"{len(changed)} parameter or optimizer tensor(s) changed while being copied (first: "
                    f"{changed[0]!r}) outside optimizer.step(); this checkpoint is dropped, the last committed "
                    "one stays")
        return None
    return check
