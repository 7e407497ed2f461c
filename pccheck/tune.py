"""Hooks for ``pccheck-tune -- python train.py``: a training script reports its iterations.

    import pccheck.tune
    for step in ...:
        train_step()
        pccheck.tune.report_iteration(state_bytes=pccheck.tune.state_bytes(model, optimizer))  # or no argument

``pccheck-tune`` runs the script with ``$PCCHECK_TUNE_REPORT`` naming a file; each call appends
one line ``<time.monotonic()> <state_bytes or -1>`` to it, from which the tuner measures the
iteration time t (and the checkpoint size m, when given). Without the variable, the call returns
at once (one dictionary lookup): it is safe to leave in a training script.

A script that does not call it is timed by its Checkpointer instead: each ``maybe_checkpoint`` call
reports one iteration with the checkpoint size (:func:`report_from_checkpointer`), unless the
script reports for itself. Its checkpoints go on as usual; the tuner takes the median iteration
time, which the few iterations that checkpoint do not move.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

__all__ = ["ENV_VAR", "report_iteration", "report_from_checkpointer", "state_bytes"]

ENV_VAR = "PCCHECK_TUNE_REPORT"

_lock = threading.Lock()
_fd: int = -1
_fd_path: str | None = None
_script_reports = False  # the script called report_iteration: the Checkpointer leaves it to it


def report_iteration(state_bytes: int | None = None) -> None:
    """Reports the end of one training iteration to ``pccheck-tune`` (no-op without
    ``$PCCHECK_TUNE_REPORT``). ``state_bytes``: the checkpoint size m, if the script knows it."""
    global _script_reports
    target = os.environ.get(ENV_VAR)
    if not target:
        return
    _script_reports = True
    _append(target, state_bytes)


def report_from_checkpointer(state_bytes: Callable[[], int | None]) -> None:
    """What ``Checkpointer.maybe_checkpoint`` calls once per iteration: reports it like
    :func:`report_iteration` while ``pccheck-tune`` times the script, unless the script reports
    its iterations itself (then this does nothing, so no iteration counts twice). ``state_bytes``
    is only called when the iteration is reported."""
    target = os.environ.get(ENV_VAR)
    if target and not _script_reports:
        _append(target, state_bytes())


def _append(target: str, state_bytes: int | None) -> None:
    global _fd, _fd_path
    line = f"{time.monotonic():.6f} {int(state_bytes) if state_bytes is not None else -1}\n".encode()
    with _lock:
        if target != _fd_path:
            if _fd >= 0:
                os.close(_fd)
            # O_APPEND: each short write lands whole at the end, whoever else appends.
            _fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            _fd_path = target
        os.write(_fd, line)


def state_bytes(module: Any, optimizer: Any = None) -> int:
    """Bytes of the tensors in ``module.state_dict()`` and ``optimizer.state_dict()`` (what a
    pccheck checkpoint of them holds, give or take the small JSON tree). Tied tensors count once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(x: Any) -> None:
        nonlocal total
        if hasattr(x, "untyped_storage") and hasattr(x, "element_size"):
            key = (x.untyped_storage().data_ptr(), x.storage_offset())
            if key not in seen:
                seen.add(key)
                total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                add(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                add(v)

    add(module.state_dict())
    if optimizer is not None:
        add(optimizer.state_dict().get("state", {}))
    return total
