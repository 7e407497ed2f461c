"""Accelerate's ``save_state``/``load_state`` with the models' weights kept by pccheck (public as
``pccheck.hf.register_accelerate``).

    accelerator = accelerate.Accelerator()
    model, optimizer = accelerator.prepare(model, optimizer)
    hooks = pccheck.hf.register_accelerate(accelerator, "ckpt/pccheck")
    accelerator.save_state("ckpt/step-100")   # weights: pccheck; the rest: Accelerate's own files
    accelerator.load_state("ckpt/step-100")   # the newest valid copy saved under that directory
    hooks.close()                             # at the end: waits for the checkpoints in flight

Accelerate's documented extension points are its state pre-hooks: the save hook sees the models
and their state dicts, and whatever weights it takes out of the list Accelerate does not write;
the load hook sees the models, and loads whatever it takes out. Through them pccheck keeps the
weights: ``save_state`` returns once they are copied into the DRAM chunk pool (the copy is a
memcpy, before the next optimizer step can change them), and persist and commit (the CAS) go on
in the background. ``output_dir`` gets a pointer file (:mod:`.named`) naming the checkpoint.

What the hooks cannot reach, Accelerate still writes itself, with its own ``torch.save``: the
optimizers, LR schedulers, grad scaler, dataloader samplers, RNG states and registered objects
(the hooks are not given them). Under FSDP and DeepSpeed Accelerate saves the models before the
hooks run, with DCP's ``FileSystemWriter`` or DeepSpeed's own engine, so the hooks see no weights
and change nothing there; use :mod:`pccheck.dcp` in a training loop of your own for sharded state.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PCCheckError
from ..orchestrator.args import StartArgs
from ..orchestrator.options import EngineOptions
from ..tiers.stack import TierStack
from ..orchestrator.stats import CheckpointStats
from ..persist.files import default_path
from ..state.torch_state import Flattener, rebuild, tensor_from
from .named import Pointers, load_named, open_store, pointer_bytes, read_pointer

__all__ = ["register_accelerate", "AccelerateHooks", "POINTER_NAME"]

log = logging.getLogger("pccheck")

FRAMEWORK = KEY = "accelerate"
POINTER_NAME = "pccheck-models.json"  # the pointer save_state leaves in its output_dir


def register_accelerate(accelerator: Any, path: str | os.PathLike[str] | None = None,
                        **engine: Any) -> "AccelerateHooks":
    """Routes ``accelerator.save_state``/``load_state`` of the models' weights through pccheck.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        path: the store directory (default ``$PCCHECK_DIR`` or ``./checkpoints``); keep it out of
            a directory Accelerate rotates (``ProjectConfiguration(total_limit=...)``). It must
            be visible to every process (or, with ``save_on_each_node=True``, to every process
            of a node). It keeps the newest ``max_concurrent`` + 1 saves: an older
            ``save_state`` directory's weights are gone once newer saves took their slot, and
            loading it raises a clear NoCheckpointError.
        **engine: the engine's options (:class:`pccheck.EngineOptions`).
    """
    return AccelerateHooks(accelerator, path, **engine)


class AccelerateHooks:
    """The registered save and load pre-hooks (see :func:`register_accelerate`)."""

    def __init__(self, accelerator: Any, path: str | os.PathLike[str] | None = None, **engine: Any) -> None:
        if not hasattr(accelerator, "register_save_state_pre_hook"):
            raise ConfigError(f"register_accelerate needs an accelerate.Accelerator, got {type(accelerator).__name__}")
        try:
            self.engine = EngineOptions(**engine)
        except TypeError as exc:
            raise ConfigError(f"pccheck.hf.register_accelerate: {exc}; the options are those of "
                              "pccheck.EngineOptions") from None
        self.accelerator = accelerator
        self.path = Path(path) if path is not None else default_path()
        self._stack: TierStack | None = None
        self._past_stats: list[CheckpointStats] = []
        self._errors: list[PCCheckError] = []
        self._reported = 0
        self._lock = threading.Lock()
        self._names = Pointers()
        self._handles = [accelerator.register_save_state_pre_hook(self._save),
                         accelerator.register_load_state_pre_hook(self._load)]

    # -- Accelerate's hooks ------------------------------------------------------------------------

    def _save(self, models: list[Any], weights: list[dict[str, Any]], output_dir: str) -> None:
        """Checkpoints ``weights`` (one state dict per model) and takes them out of the list."""
        if not weights:  # FSDP / DeepSpeed: Accelerate saved the models itself
            return
        self._raise_pending()
        if self._writes():  # the weights are replicated: one process (per node) keeps them
            target = Path(output_dir) / POINTER_NAME
            name = str(Path(output_dir).resolve())
            fl = Flattener()
            tree = {KEY: fl.encode("models", list(weights))}
            step = int(getattr(self.accelerator, "save_iteration", 0))
            with self._lock:
                stack = self._open_stack(fl.arrays)
                # n_eager=None: every byte is copied before this returns (the optimizer may step next).
                started = stack.start(step, fl.arrays, {KEY: {"name": name, "models": len(weights)}},
                                      StartArgs(tree=tree))
            if not started:
                raise ConfigError(f"pccheck: max_concurrent checkpoints are in flight and when_busy='skip': the "
                                  f"weights of {output_dir} were not saved; use when_busy='block'")
            self._names.leave(target, pointer_bytes(target, self.path, name, step, FRAMEWORK))
        weights.clear()  # Accelerate writes no weight files

    def _load(self, models: list[Any], input_dir: str) -> None:
        """Loads the weights pccheck kept for ``input_dir`` into ``models`` and takes them out of
        the list; a directory without pccheck's pointer is left to Accelerate."""
        target = Path(input_dir) / POINTER_NAME
        if not models:
            return
        # Invariant: no process reads the store before the checkpoints in flight are committed
        # (the main process, or each node's, writes them all): it waits for them, then every
        # process meets at the barrier (each calls load_state, so each comes here).
        with self._lock:
            if self._stack is not None:
                self._stack.wait()
        if int(getattr(self.accelerator, "num_processes", 1)) > 1:
            self.accelerator.wait_for_everyone()
        if not target.is_file():
            return
        ptr = read_pointer(target)
        if ptr is None:
            raise ConfigError(f"{target} is not a pccheck pointer file; remove it, or load {input_dir} without "
                              "pccheck.hf.register_accelerate")
        r = load_named(ptr.store, ptr.name, KEY)

        def as_tensor(name: str) -> Any:
            return tensor_from(r.state, r.torch_dtypes, name)

        tree = r.tree.get(KEY) if isinstance(r.tree, dict) else None
        if tree is None:
            raise ConfigError(f"{r.path}: step {r.step} was not written by pccheck.hf.register_accelerate")
        states = rebuild(tree, r.state, as_tensor)
        if len(states) != len(models):
            raise ConfigError(f"{input_dir} holds the weights of {len(states)} model(s), the Accelerator has "
                              f"{len(models)} prepared: prepare the same models as when it was saved")
        for i, (model, sd) in enumerate(zip(models, states)):
            try:
                model.load_state_dict(sd)
            except RuntimeError as exc:
                raise ConfigError(f"model {i} does not take the weights saved in {input_dir}: {exc}") from None
        log.info("pccheck: loaded the weights of %d model(s) for %s (checkpoint step %d)", len(models), input_dir,
                 r.step)
        models.clear()  # Accelerate loads no weight files

    def _writes(self) -> bool:
        """Whether this process keeps the weights: the main process, or each node's with
        ``ProjectConfiguration(save_on_each_node=True)`` (a store on each node's own disk)."""
        config = getattr(self.accelerator, "project_configuration", None)
        if getattr(config, "save_on_each_node", False):
            return bool(self.accelerator.is_local_main_process)
        return bool(self.accelerator.is_main_process)

    # -- pccheck's side ----------------------------------------------------------------------------

    def wait(self) -> None:
        """Waits until every checkpoint handed over is committed (or failed), and its pointer is
        durable."""
        with self._lock:
            if self._stack is not None:
                self._stack.wait()
        self._names.flush()

    def close(self) -> None:
        """Waits for the checkpoints in flight and closes the store; the hooks stay registered
        (a later ``save_state`` opens it again). Raises the first background failure not yet
        raised."""
        with self._lock:
            stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
            self._past_stats = list(stack.finished())
        self._names.flush()
        self._raise_pending()

    def remove(self) -> None:
        """Closes, and unregisters the hooks: ``save_state`` writes Accelerate's own files again."""
        try:
            self.close()
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []

    def stats(self) -> list[CheckpointStats]:
        """Per checkpoint since the store was opened: the copy, the persist and the outcome."""
        with self._lock:
            return list(self._stack.finished()) if self._stack is not None else list(self._past_stats)

    @property
    def errors(self) -> list[PCCheckError]:
        """Checkpoints that failed in the background; the last committed one survived each."""
        return list(self._errors)

    def _open_stack(self, arrays: dict[str, Any]) -> TierStack:
        if self._stack is None:
            self._stack = open_store(self.path, self.engine, arrays, self._errors.append)
        return self._stack

    def _raise_pending(self) -> None:
        if len(self._errors) > self._reported:
            exc = self._errors[self._reported]
            self._reported = len(self._errors)
            raise exc
