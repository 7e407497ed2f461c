"""Preparing a Checkpointer's stores and chunk pools once its state is final (:mod:`.preparation`)."""

from .preparation import Preparation, defer_prepare

__all__ = ["Preparation", "defer_prepare"]
