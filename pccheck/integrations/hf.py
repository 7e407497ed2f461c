"""pccheck as a Hugging Face ``Trainer`` callback (public as ``pccheck.hf.Callback``).

    cb = pccheck.hf.Callback("ckpt", interval=10)
    trainer = transformers.Trainer(model, args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.latest())   # None on the first run: starts fresh

Write path: every ``interval`` optimizer steps (and at the last one) the callback checkpoints
the model, the optimizer, the LR scheduler, the grad scaler (if any), the RNG states and the
Trainer's state through a :class:`pccheck.Checkpointer`: buffers and RNGs are copied before the
callback returns, parameters and optimizer state while training goes on, and the next optimizer
step waits only for what is not copied yet (soft copy-on-write). The Trainer's own step saves are
turned off (``control.should_save = False`` at every step end).

The checkpoint is taken where the Trainer takes its own: after the step's logging and evaluation
(which add to ``log_history`` and the best metric), before the next batch is drawn. So at a step
that logs or evaluates, the callback waits for ``on_log``/``on_evaluate``, and takes it at once
otherwise.

Resume: the Trainer restores the global step and the data position (the batches to skip) from
a checkpoint directory before any callback runs. :meth:`Callback.latest` therefore writes
pccheck's newest valid checkpoint (every crc32c checked) as such a directory, in the Trainer's own
layout, on a scratch file system (``/dev/shm`` where there is one), and the Trainer's documented
``resume_from_checkpoint`` does the rest exactly as it does for its own checkpoints. The
directory is removed once training has begun its first step (the RNG states are read then).

Not covered: ``load_best_model_at_end`` and ``save_total_limit`` act on the Trainer's own
checkpoint directories, which this callback does not write; the state of other stateful callbacks
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

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("pccheck.hf.Callback needs transformers: pip install 'pccheck[hf]'") from exc

__all__ = ["Callback", "write_trainer_checkpoint"]

log = logging.getLogger("pccheck")

KEY = "hf"  # the metadata object of a Trainer checkpoint


class _Held:
    """An extra_state value the callback sets just before each checkpoint (the Trainer's state)."""

    def __init__(self) -> None:
        self.value: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


class Callback(TrainerCallback):
    """Checkpoints a ``transformers.Trainer`` run through pccheck every ``interval`` steps.

    Args:
        path: the store directory (default ``$PCCHECK_DIR`` or ``./checkpoints``).
        interval: optimizer steps between checkpoints; the last step is always checkpointed.
        stateful: other ``ExportableState`` callbacks of the Trainer whose state goes into
            ``trainer_state.json`` as the Trainer's own save records it.
        **settings: :class:`pccheck.Checkpointer` settings (``max_concurrent``, ``writer_threads``,
            ``chunk_size``, ``dram_budget``, ``storage``, ``when_busy``, ``replicated``, ...) and
            ``on_error`` ("raise": the next checkpoint raises a background failure; "log").
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
        self._due: int | None = None        # the step whose checkpoint waits for its log/eval
        self._resume_dir: Path | None = None  # what latest() wrote, removed once training runs

    # -- resume ------------------------------------------------------------------------------------

    def latest(self) -> str | None:
        """The newest valid checkpoint as a Trainer checkpoint directory, for
        ``trainer.train(resume_from_checkpoint=cb.latest())``; None when the store holds none.
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
        scratch = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None
        self._resume_dir = Path(tempfile.mkdtemp(prefix="pccheck-hf-", dir=scratch))
        atexit.register(shutil.rmtree, self._resume_dir, True)
        out = self._resume_dir / f"checkpoint-{state['step']}"
        write_trainer_checkpoint(state, out, world_size=restored.metadata[KEY].get("world_size", 1))
        log.info("pccheck: resuming the Trainer from step %d (%s)", state["step"], out)
        return str(out)

    # -- the Trainer's events ----------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self._ck is not None:
            self._ck.close()
        extra: dict[str, Any] = {"trainer_state": self._trainer_state}
        if lr_scheduler is not None:
            extra["scheduler"] = lr_scheduler
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer carries it
        if scaler is not None:
            extra["scaler"] = scaler
        self._take_trainer_state(args, state, control)
        # The Trainer steps accelerate's wrapper, which steps the torch optimizer inside it: the
        # soft copy-on-write hook goes on the one whose step() changes the parameters.
        inner = getattr(optimizer, "optimizer", optimizer)
        self._ck = Checkpointer(model, inner, self.path, extra_state=extra, interval=self.interval,
                                options=self.options, on_error=self.on_error,
                                metadata={KEY: {"world_size": int(args.world_size)}})

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_due(args, state, control)
        self._remove_resume_dir()  # the Trainer has read it all (the RNG states last, before this)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        control.should_save = False  # pccheck keeps the step checkpoints
        step = state.global_step
        if step % self.interval == 0 or step >= state.max_steps:
            self._due = step
            if not (control.should_log or control.should_evaluate):
                self._save_if_due(args, state, control)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not control.should_evaluate:  # an evaluation's own log comes before its results
            self._save_if_due(args, state, control)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_due(args, state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_if_due(args, state, control)
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
        self._ck.checkpoint(state.global_step, {KEY: {"world_size": int(args.world_size),
                                                      "global_step": state.global_step}})

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
            self._resume_dir = None


def write_trainer_checkpoint(state: dict[str, Any], out: Path, *, world_size: int = 1) -> None:
    """Writes a restored ``pccheck.hf`` checkpoint (``load_latest``'s nested state) as a Trainer
    checkpoint directory: weights, optimizer, scheduler, scaler, RNG states, trainer state. The
    files are the ones ``Trainer.train(resume_from_checkpoint=out)`` reads, each loadable with
    ``torch.load(weights_only=True)``."""
    import torch

    out.mkdir(parents=True)
    extra = state.get("extra", {})
    # Tied weights (GPT-2's embedding and head) share one tensor: torch.save keeps them shared.
    torch.save(state["model"], out / "pytorch_model.bin")
    if "optimizer" in state:
        torch.save(state["optimizer"], out / "optimizer.pt")
    if "scheduler" in extra:
        torch.save(extra["scheduler"], out / "scheduler.pt")
    if "scaler" in extra:
        torch.save(extra["scaler"], out / "scaler.pt")
    if "rng" in state:
        rank = _rank()
        name = f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"
        torch.save(_trainer_rng(state["rng"], world_size > 1), out / name)
    trainer_state = extra.get("trainer_state")
    if not isinstance(trainer_state, dict):
        raise ConfigError(f"step {state['step']}: the checkpoint holds no Trainer state; it was not written by "
                          "pccheck.hf.Callback")
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


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
