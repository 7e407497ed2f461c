"""What each checkpoint reads: a model with its optimizer (:class:`~.torch_state.TorchState`), or
a mapping of arrays (:class:`ArraysState`), chosen by :func:`make_source` from what the user
passed to the Checkpointer."""

from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError
from .torch_state import Snapshot, TorchState

__all__ = ["ArraysState", "make_source", "is_module", "check_step", "check_metadata"]


class ArraysState:
    """A mapping of arrays, read at every checkpoint and copied before maybe_checkpoint returns."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping):
            raise ConfigError(f"state must be a torch.nn.Module or a mapping of name -> array, "
                              f"got {type(state).__name__}")
        self.state = state

    def snapshot(self) -> Snapshot:
        return Snapshot(dict(self.state), len(self.state), None)

    def may_grow(self) -> bool:
        return False


def is_module(x: Any) -> bool:
    """Whether ``x`` is a torch.nn.Module (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def make_source(state: Any, optimizer: Any, extra_state: Mapping[str, Any] | None,
                snapshot_options: Any) -> tuple[Any, bool]:
    """The source of every snapshot, and whether soft copy-on-write is on (``snapshot_options``:
    a :class:`pccheck.SnapshotOptions`). ConfigError for a combination that cannot work."""
    snap = snapshot_options
    if is_module(state):
        source: Any = TorchState(state, optimizer, extra_state, capture_rng=snap.capture_rng, eager=snap.eager,
                                 record_order=True)
        soft_cow = optimizer is not None if snap.soft_cow is None else snap.soft_cow
        if soft_cow and optimizer is None:
            raise ConfigError("soft_cow needs the optimizer: its step pre-hook guards the copy")
    else:
        if optimizer is not None or extra_state:
            raise ConfigError("optimizer and extra_state go with a torch.nn.Module state")
        source, soft_cow = ArraysState(state), False
    if snap.device_reserve and not soft_cow:
        raise ConfigError("device_reserve works with soft copy-on-write: pass a model with its optimizer "
                          "(soft_cow on); a mapping of arrays is copied before maybe_checkpoint returns")
    return source, soft_cow


def check_step(step: Any) -> None:
    """ConfigError unless ``step`` is an int (a bool is not)."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise ConfigError(f"step must be an int, got {step!r} ({type(step).__name__})")


def check_metadata(metadata: Any) -> dict[str, Any]:
    """A checkpoint's metadata as a dict ({} for None); ConfigError unless it is a mapping."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise ConfigError(f"metadata must be a mapping (a JSON object), got {type(metadata).__name__}")
    return dict(metadata)
