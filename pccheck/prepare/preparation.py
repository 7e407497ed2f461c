"""Preparing a Checkpointer's stores and chunk pools once its state is final.

Adam's state appears at the first optimizer step and ``load_latest`` gives a fresh optimizer its
state: sized at construction, the store would get a new generation and the chunk pool would be
remade inside the first checkpoint call. A lazy restore's loader should not share the memory bus
with the pool's prefaulter. So a Checkpointer whose state may still grow (or is being restored)
opens the stores and makes the pools (every tier's, through its
:class:`~pccheck.tiers.stack.TierStack`) from the end of the next optimizer step, or right after an
eager ``load_state_dict``, or when :meth:`Checkpointer.wait_ready` asks, whichever comes first.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

from ..errors import PCCheckError
from ..lazy import restoring
from ..persist.layout import plan
from ..state.torch_state import TorchState

__all__ = ["Preparation", "defer_prepare"]

log = logging.getLogger("pccheck")


def defer_prepare(source: Any, optimizer: Any, model: Any) -> bool:
    """Whether opening the stores and making the pools wait: the optimizer has no state yet (Adam
    creates it at its first step, a load_latest gives it one: sized now, the pool and the store
    would be remade at the first checkpoint, inside the call), or a lazy restore into the model is
    loading (the pool's prefault and the store's background validation would compete with the
    loader). Needs the optimizer."""
    if not isinstance(source, TorchState) or optimizer is None:
        return False
    return source.may_grow() or restoring(model)


class Preparation:
    """The preparation of one Checkpointer's tier stack (``prepared``: done at construction)."""

    def __init__(self, stack: Any, source: Any, optimizer: Any, model: Any, metadata: Mapping[str, Any],
                 prepared: bool) -> None:
        self.stack, self.source, self.optimizer, self.model, self.metadata = stack, source, optimizer, model, metadata
        # Invariant: lock serialises preparing with wait_ready() on another thread and with the
        # first checkpoint (which takes it to mark the stores as its own to open).
        self.lock = threading.Lock()
        self.prepared = prepared
        self._hooks: list[Any] = [] if prepared else self._install()

    def _install(self) -> list[Any]:
        """Hooks that prepare at the end of the next optimizer step (the state exists then, and a
        lazy restore is complete: its step pre-hook waited for it), or right after an eager
        ``load_state_dict`` gave the optimizer its state (``load_latest`` before the first step)."""
        opt = self.optimizer
        hooks = [opt.register_step_post_hook(lambda *_: self.run())]
        if hasattr(opt, "register_load_state_dict_post_hook"):  # torch >= 2.2
            hooks.append(opt.register_load_state_dict_post_hook(lambda _: self._after_load()))
        return hooks

    def _after_load(self) -> None:
        if not self.source.may_grow() and not restoring(self.model):
            self.run()

    def run(self, raise_errors: bool = False) -> None:
        """Opens the stores and makes the pools for the state as it is now (once). A failure is
        logged (raised with ``raise_errors``): the first checkpoint tries again and reports it as
        its own."""
        with self.lock:
            if self.prepared or self.stack.disk is None:
                return
            # Invariant: the hooks stay registered (torch iterates its step hooks live: removing one
            # inside it fails); `prepared` makes them no-ops, claim() removes them later.
            self.prepared = True
            try:
                snap = self.source.snapshot()
                took = self.stack.prepare(plan(snap.arrays), self.metadata, snap.tree)
            except PCCheckError as exc:
                if raise_errors:
                    self.prepared = False  # the first checkpoint (or the next call) tries again
                    raise
                failed: PCCheckError | None = exc
            else:
                failed = None
        if failed is None:
            log.info("pccheck: store and chunk pool prepared in %.3f s", took)
        else:
            log.warning("pccheck: preparing the store before the first checkpoint failed (%s); the first "
                        "checkpoint tries again", failed)

    def ready(self) -> bool:
        """wait_ready's part: prepares now if the state is final; False if it is not yet."""
        if not self.prepared:
            if defer_prepare(self.source, self.optimizer, self.model):
                return False
            self.run(raise_errors=True)
        return True

    def claim(self) -> None:
        """The first checkpoint (or close) takes over: nothing is prepared by the hooks any more
        (the checkpoint's start opens what is not open yet), and they are removed."""
        with self.lock:  # a wait_ready() on another thread finishes its prepare first
            self.prepared = True
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()
