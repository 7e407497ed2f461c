"""The one retention rule of every tier (``DiskOptions``, ``RemoteOptions``; docs/api.md "Tiers").

Of the checkpoints a tier holds beyond what it needs to work (the disk tier's copies in
``history/``, the remote tier's committed steps), it keeps the newest ``keep_last`` (None: all)
and, whatever ``keep_last`` says, every one whose ``step % keep_every == 0``.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

__all__ = ["retained"]

T = TypeVar("T")


def retained(newest_first: Sequence[T], step: Callable[[T], int], keep_last: int | None,
             keep_every: int | None) -> set[T]:
    """The items (newest first) the rule keeps; ``step`` gives an item's step."""
    keep = set(newest_first if keep_last is None else newest_first[:keep_last])
    if keep_every is not None:
        keep.update(x for x in newest_first if step(x) % keep_every == 0)
    return keep
