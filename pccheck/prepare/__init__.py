"""Preparing a Checkpointer's store and chunk pool once its state is final (:mod:`.mixin`)."""

from .mixin import Preparation

__all__ = ["Preparation"]
