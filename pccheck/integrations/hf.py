"""pccheck as a Hugging Face ``Trainer`` callback (public as ``pccheck.hf.Callback``).

    cb = pccheck.hf.Callback("ckpt", interval=10)
    trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.latest())   # None on the first run: starts fresh

Write path: every ``interval`` optimizer steps (and at the last one, also when training stops
early) the callback checkpoints the model, the optimizer, the LR scheduler, the grad scaler (if
any), the RNG states and the Trainer's state through a :class:`pccheck.Checkpointer`: buffers
are copied before the callback returns, parameters and optimizer state while training goes on,
and the next optimizer step waits only for what is not copied yet (soft copy-on-write). The
Trainer's own step and epoch saves are turned off (``control.should_save = False``).

The checkpoint holds what the Trainer's own save of that step would: it is taken once the
step's logging, evaluation, best-metric update and ``ReduceLROnPlateau`` step are done, at the
next ``on_step_begin`` / ``on_epoch_end`` / ``on_train_end``, with the RNG states as they were
before the next batch was drawn.

Resume: the Trainer restores the global step and the data position (the batches to skip) from
a checkpoint directory before any callback runs. :meth:`Callback.latest` therefore writes
pccheck's newest valid checkpoint (every crc32c checked) as such a directory, in the Trainer's own
layout, on a scratch file system (``/dev/shm`` when it has room), and the Trainer's documented
``resume_from_checkpoint`` does the rest exactly as it does for its own checkpoints. The
directory is removed once the first step is done (the RNG states are read then).

Not covered: ``load_best_model_at_end`` and ``save_total_limit`` act on the Trainer's own
checkpoint directories, which this callback does not write (``save_strategy="best"`` keeps the
Trainer's own best-model saves); the state of other stateful callbacks
(``ExportableState``, e.g. early stopping) is kept only when they are passed as ``stateful=``,
since a callback is not told the Trainer's other callbacks.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

from ..checkpointer import Checkpointer
from ..errors import ConfigError, NoCheckpointError
from ..options import Options
from ..orchestrator.stats import StatsReport
from ..persist.files import default_path
from ..restore import load_latest
from ..state.torch_state import rng_state

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pccheck.hf.Callback needs transformers: pip install 'pccheck[hf]'") from exc

__all__ = ["Callback", "write_trainer_checkpoint"]

log = logging.getLogger("pccheck")

KEY = "hf"  # the metadata object of a Trainer checkpoint


class _Held:
    """An extra_state value the callback sets just before each checkpoint (the Trainer's state,
    the RNG states)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


# Directories latest() wrote that are not removed yet; one atexit hook removes what is left.
_RESUME_DIRS: set[Path] = set()


@atexit.register
def _remove_resume_dirs() -> None:
    for d in list(_RESUME_DIRS):
        shutil.rmtree(d, ignore_errors=True)
    _RESUME_DIRS.clear()


class Callback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` run through pccheck every ``interval`` steps.

    Args:
        path: the store directory (default ``$PCCHECK_DIR`` or ``./checkpoints``).
        interval: optimizer steps between checkpoints; the last step is always checkpointed,
            also when a callback (early stopping) ends training before ``max_steps``.
        stateful: other ``ExportableState`` callbacks of the Trainer whose state goes into
            ``trainer_state.json`` as the Trainer's own save records it.
        **settings: :class:`pccheck.Checkpointer` settings (``max_concurrent``, ``writer_threads``,
            ``chunk_size``, ``dram_budget``, ``storage``, ``when_busy``, ``replicated``,
            ``capture_rng``, ...) and ``on_error`` ("raise": the next checkpoint raises a
            background failure; "log").
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, interval: int = 10, *,
                 stateful: Iterable[Any] = (), on_error: str = "raise", **settings: Any) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"interval must be an int >= 1 (optimizer steps), got {interval!r}")
        if on_error not in ("raise", "log"):
            raise ConfigError(f"on_error must be 'raise' or 'log', got {on_error!r}")
        self.path = Path(path) if path is not None else default_path()
        self.interval = interval
        self.options = Options().updated(**settings)  # a wrong name fails here, not at train()
        self.on_error = on_error
        self.stateful = list(stateful)
        self._ck: Checkpointer | None = None
        self._closed: Checkpointer | None = None  # the last train()'s, for stats()
        self._trainer_state = _Held()
        self._rng = _Held()
        self._due: int | None = None        # the step whose checkpoint waits for the Trainer's save point
        self._saved: int | None = None      # the last step handed to the Checkpointer
        self._resume_dir: Path | None = None  # what latest() wrote, removed once training runs
        self._keep_resume_dir = False       # auto_find_batch_size: a retry reads it again

    # -- resume ------------------------------------------------------------------------------------

    def latest(self, scratch_dir: str | os.PathLike[str] | None = None) -> str | None:
        """The newest valid checkpoint as a Trainer checkpoint directory, for
        ``trainer.train(resume_from_checkpoint=cb.latest())``; None when the store holds none.

        The directory goes under ``scratch_dir`` if given, else on ``/dev/shm`` when it has room
        for the checkpoint's tensors, else in the system's temporary directory; it is removed once
        the first step is done (at the end of training with ``auto_find_batch_size``) or at exit.
        In a torch.distributed group every rank calls it (the ranks agree on the step)."""
        self._remove_resume_dir()
        if not self.path.is_dir():
            return None
        try:
            restored = load_latest(self.path)
        except NoCheckpointError:
            log.info("pccheck: no checkpoint in %s yet; the Trainer starts from scratch", self.path)
            return None
        state = restored.state
        if KEY not in restored.metadata:
            raise ConfigError(f"{self.path}: step {restored.step} was not written by pccheck.hf.Callback; "
                              "load it with pccheck.load_latest")
        where = _scratch_dir(scratch_dir, _tensor_bytes(state))
        self._resume_dir = Path(tempfile.mkdtemp(prefix="pccheck-hf-", dir=where))
        _RESUME_DIRS.add(self._resume_dir)
        out = self._resume_dir / f"checkpoint-{state['step']}"
        try:
            write_trainer_checkpoint(state, out, world_size=restored.metadata[KEY].get("world_size", 1))
        except BaseException:
            self._remove_resume_dir()
            raise
        log.info("pccheck: resuming the Trainer from step %d (%s)", state["step"], out)
        return str(out)

    # -- the Trainer's events ----------------------------------------------------------------------
    #
    # Invariant: a checkpoint of step S holds what the Trainer's own save of step S would hold.
    # The Trainer saves at the end of the step's log/evaluate/save pass, which no event marks: the
    # evaluation is followed by the best-metric update and a ReduceLROnPlateau step, and other
    # callbacks may act in on_evaluate after this one. So a due step is checkpointed at the next
    # event after that pass: on_step_begin, on_epoch_end or on_train_end, none of which changes the
    # model, the optimizer or the Trainer's state first. The next step's batch is drawn before
    # on_step_begin, which may draw random numbers: the RNG states are taken earlier, at the last
    # event of the step's pass (on_step_end, on_log, on_evaluate), where nothing after draws any.

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self._ck is not None:
            self._ck.close()
        self._due = self._saved = None
        self._keep_resume_dir = bool(getattr(args, "auto_find_batch_size", False))
        _check_arguments(args)
        extra: dict[str, Any] = {"trainer_state": self._trainer_state}
        if lr_scheduler is not None:
            extra["scheduler"] = lr_scheduler
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer carries it
        if scaler is not None:
            extra["scaler"] = scaler
        if self.options.snapshot.capture_rng:  # taken by the callback at the step's last event
            extra["rng"] = self._rng
        self._take_trainer_state(args, state, control)
        # The Trainer steps accelerate's wrapper, which steps the torch optimizer inside it: the
        # soft copy-on-write hook goes on the one whose step() changes the parameters.
        inner = getattr(optimizer, "optimizer", optimizer)
        self._ck = Checkpointer(model, inner, self.path, extra_state=extra, interval=self.interval,
                                options=self.options.updated(capture_rng=False), on_error=self.on_error,
                                metadata={KEY: {"world_size": int(args.world_size)}})

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_due(args, state, control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_save = False  # pccheck keeps the step checkpoints
        step = state.global_step
        if step % self.interval == 0 or step >= state.max_steps or control.should_training_stop:
            self._due = step
            self._take_rng()
        if not self._keep_resume_dir:
            self._remove_resume_dir()  # one step ran: the Trainer has read all of it

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._due == state.global_step:
            self._take_rng()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._due == state.global_step:
            self._take_rng()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_save = False  # the "epoch" save strategy's save is pccheck's too
        if control.should_training_stop and self._saved != state.global_step and self._due is None \
                and state.global_step > 0:
            self._due = state.global_step  # stopped early (a callback, the data ran out)
            self._take_rng()
        self._save_if_due(args, state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        try:
            self._save_if_due(args, state, control)
        finally:
            self._remove_resume_dir()
            self.close()

    # -- pccheck's side ----------------------------------------------------------------------------

    def close(self) -> None:
        """Waits for the checkpoints in flight and closes the store (``on_train_end`` does)."""
        ck, self._ck = self._ck, None
        if ck is not None:
            self._closed = ck
            ck.close()

    def stats(self) -> StatsReport:
        """The checkpoints of the current (or the last) ``train()``: per checkpoint the stall, the
        copy, the optimizer step's wait for it (``cow_wait_s``), the persist and the outcome."""
        ck = self._ck or self._closed
        return ck.stats() if ck is not None else StatsReport((), 0, None, None)

    def wait(self) -> None:
        """Waits until every checkpoint handed over is committed (or failed)."""
        if self._ck is not None:
            self._ck.wait()

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The :class:`pccheck.Checkpointer` of the current ``train()`` (None outside one)."""
        return self._ck

    def _save_if_due(self, args: Any, state: Any, control: Any) -> None:
        if self._due is None or self._due != state.global_step or self._ck is None:
            return
        self._due = None
        self._take_trainer_state(args, state, control)
        taken = self._ck.checkpoint(state.global_step, {KEY: {"world_size": int(args.world_size),
                                                              "global_step": state.global_step}})
        if taken:
            self._saved = state.global_step
        else:
            log.warning("pccheck: step %d was not checkpointed: %d checkpoints are still in flight "
                        "(when_busy='skip'); the store keeps step %s", state.global_step,
                        self.options.engine.max_concurrent, self._saved)

    def _take_rng(self) -> None:
        if self.options.snapshot.capture_rng:
            self._rng.value = rng_state()

    def _take_trainer_state(self, args: Any, state: Any, control: Any) -> None:
        """``trainer_state.json`` as the Trainer's own save would write it now."""
        doc = dataclasses.asdict(state)
        callbacks = dict(doc.get("stateful_callbacks") or {})
        named: dict[str, Any] = {}
        for cb in [*self.stateful, control]:
            name = type(cb).__name__
            named.setdefault(name, []).append(cb.state())
        callbacks.update({k: v[0] if len(v) == 1 else v for k, v in named.items()})
        doc["stateful_callbacks"] = callbacks
        self._trainer_state.value = doc

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            _RESUME_DIRS.discard(self._resume_dir)
            self._resume_dir = None


def _check_arguments(args: Any) -> None:
    """Says which of the Trainer's own checkpoint settings stay the Trainer's."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)  # an enum, or its string
    if strategy == "best":
        log.warning("pccheck: save_strategy='best': the Trainer keeps writing its own checkpoint at each new "
                    "best metric, beside pccheck's every `interval` steps")
    elif getattr(args, "load_best_model_at_end", False):
        log.warning("pccheck: load_best_model_at_end finds the best model among the Trainer's own checkpoints, "
                    "which pccheck.hf.Callback turns off; use save_strategy='best' to keep those")


def write_trainer_checkpoint(state: dict[str, Any], out: Path, *, world_size: int = 1) -> None:
    """Writes a restored ``pccheck.hf`` checkpoint (``load_latest``'s nested state) as a Trainer
    checkpoint directory: weights, optimizer, scheduler, scaler, RNG states, trainer state. The
    files are the ones ``Trainer.train(resume_from_checkpoint=out)`` reads, each loadable with
    ``torch.load(weights_only=True)``."""
    import torch

    extra = state.get("extra", {})
    trainer_state = extra.get("trainer_state")
    if not isinstance(trainer_state, dict):
        raise ConfigError(f"step {state['step']}: the checkpoint holds no Trainer state; it was not written by "
                          "pccheck.hf.Callback")
    out.mkdir(parents=True)
    # Tied weights (GPT-2's embedding and head) share one tensor: torch.save keeps them shared.
    torch.save(state["model"], out / "pytorch_model.bin")
    if "optimizer" in state:
        torch.save(state["optimizer"], out / "optimizer.pt")
    if "scheduler" in extra:
        torch.save(extra["scheduler"], out / "scheduler.pt")
    if "scaler" in extra:
        torch.save(extra["scaler"], out / "scaler.pt")
    rng = extra.get("rng") or state.get("rng")  # the callback's own record; a plain one before
    if rng:
        rank = _rank()
        name = f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"
        torch.save(_trainer_rng(rng, world_size > 1), out / name)
    (out / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")


def _trainer_rng(rng: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """pccheck's RNG record in the Trainer's ``rng_state.pth`` shape."""
    import torch

    version, internal, gauss = rng["python"]
    out = {"python": (version, tuple(internal), gauss), "numpy": tuple(rng["numpy"]), "cpu": rng["torch"]}
    if "cuda" in rng and torch.cuda.is_available():
        states = list(rng["cuda"])
        out["cuda"] = states if distributed else states[torch.cuda.current_device()]
    return out


def _tensor_bytes(tree: Any) -> int:
    """The bytes of the tensors in a restored state (what the directory will about hold)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _scratch_dir(chosen: str | os.PathLike[str] | None, need: int) -> str | None:
    """Where latest() writes: the caller's choice, else /dev/shm with room to spare (a full tmpfs
    fails the write and takes memory from training), else the system's temporary directory."""
    if chosen is not None:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return str(chosen)
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free >= 2 * need + (64 << 20):
            return shm
        log.info("pccheck: /dev/shm has %d MiB free, the checkpoint needs %d MiB: writing it to %s",
                 free >> 20, need >> 20, tempfile.gettempdir())
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
