"""Hooks for ``pccheck-tune -- python train.py``: a training script reports its iterations.

    import pccheck.tune
    for step in ...:
        train_step()
        pccheck.tune.report_iteration(state_bytes=pccheck.tune.state_bytes(model, optimizer))  # or no argument

The public face only: the functions live in :mod:`pccheck.tuner.online`, whose docstring says
what a report writes and when a Checkpointer reports for a script that does not.
"""

from __future__ import annotations

from .tuner.online import ENV_VAR, report_from_checkpointer, report_iteration, state_bytes

__all__ = ["ENV_VAR", "report_iteration", "report_from_checkpointer", "state_bytes"]
