"""Preparing a Checkpointer's store and chunk pool once its state is final (a mixin of
:class:`pccheck.Checkpointer`).

Adam's state appears at the first optimizer step and ``load_latest`` gives a fresh optimizer its
state: sized at construction, the store would get a new generation and the chunk pool would be
remade inside the first checkpoint call. A lazy restore's loader should not share the memory bus
with the pool's prefaulter. So a Checkpointer whose state may still grow (or is being restored)
opens the store and makes the pool (the memory tier's too) from the end of the next optimizer
step, or right after an eager ``load_state_dict``, or when :meth:`Checkpointer.wait_ready` asks,
whichever comes first.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ..errors import PCCheckError
from ..lazy import restoring
from ..persist.layout import plan
from ..state.torch_state import TorchState

__all__ = ["Preparation"]

log = logging.getLogger("pccheck")


class Preparation:
    """The Checkpointer's preparation steps; the attributes are the Checkpointer's."""

    _source: Any
    optimizer: Any
    state: Any
    metadata: dict[str, Any]
    _orch: Any
    _memory: Any
    _prepared: bool
    _prep_hooks: list[Any]
    _prep_lock: threading.Lock
    _epoch: Callable[[], int | None]

    def _defer_prepare(self) -> bool:
        """Whether opening the store and making the chunk pool wait (see :meth:`_prepare_hooks`):
        the optimizer has no state yet (Adam creates it at its first step, a load_latest gives it
        one: sized now, the pool and the store would be remade at the first checkpoint, inside
        the call), or a lazy restore into the model is loading (the pool's prefault and the
        store's background validation would compete with the loader). Needs the optimizer."""
        if not isinstance(self._source, TorchState) or self.optimizer is None:
            return False
        return self._source.may_grow() or restoring(self.state)

    def _prepare_hooks(self) -> list[Any]:
        """Hooks that prepare at the end of the next optimizer step (the state exists then, and a
        lazy restore is complete: its step pre-hook waited for it), or right after an eager
        ``load_state_dict`` gave the optimizer its state (``load_latest`` before the first step)."""
        opt = self.optimizer
        hooks = [opt.register_step_post_hook(lambda *_: self._prepare())]
        if hasattr(opt, "register_load_state_dict_post_hook"):  # torch >= 2.2
            hooks.append(opt.register_load_state_dict_post_hook(lambda _: self._after_load()))
        return hooks

    def _after_load(self) -> None:
        if not self._source.may_grow() and not restoring(self.state):
            self._prepare()

    def _prepare(self, raise_errors: bool = False) -> None:
        """Opens the store and makes the chunk pool for the state as it is now (once). A failure
        is logged (raised with ``raise_errors``): the first checkpoint tries again and reports it
        as its own."""
        # Invariant: _prep_lock serialises preparing with wait_ready() on another thread and with
        # the first checkpoint (which takes it to mark the store as its own to open).
        with self._prep_lock:
            if self._prepared or self._orch is None:
                return
            # Invariant: the hooks stay registered (torch iterates its step hooks live: removing one
            # inside it fails); _prepared makes them no-ops, _drop_prepare_hooks removes them later.
            self._prepared = True
            try:
                snap = self._source.snapshot()
                layout = plan(snap.arrays)
                took = self._orch.prepare(layout, self.metadata, snap.tree, self._epoch())
                self._memory.prepare(layout, self.metadata, snap.tree)  # a no-op without a memory tier
            except PCCheckError as exc:
                if raise_errors:
                    self._prepared = False  # the first checkpoint (or the next call) tries again
                    raise
                failed: PCCheckError | None = exc
            else:
                failed = None
        if failed is None:
            log.info("pccheck: store and chunk pool prepared in %.3f s", took)
        else:
            log.warning("pccheck: preparing the store before the first checkpoint failed (%s); the first "
                        "checkpoint tries again", failed)

    def _drop_prepare_hooks(self) -> None:
        hooks, self._prep_hooks = self._prep_hooks, []
        for h in hooks:
            h.remove()

