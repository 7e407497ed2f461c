"""``pccheck.aio``: ``r = await pccheck.aio.load_latest(...)``; ``await r.wait_async()``.

A face over :mod:`pccheck.lazy.aio` (the metadata reads through aiofiles and the lazy restore;
needs the ``aio`` extra: aiofiles) and :func:`pccheck.load_latest` (the eager load, run in a worker
thread): the one place that sees both layers picks between them.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Mapping

from .lazy import LazyRestore
from .lazy.aio import load_lazily, locate
from .persist.recovery import Restored
from .restore import load_latest as load_eagerly

__all__ = ["load_latest", "locate"]


async def load_latest(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                      extra_state: Mapping[str, Any] | None = None, lazy: bool = True) -> LazyRestore | Restored:
    """``pccheck.load_latest`` for asyncio. With ``lazy=True`` (default; needs ``model``) it
    returns once the metadata is read and the small parts are back: await ``r.wait_async()`` (or
    train: forward and the optimizer step wait for what they need). With ``lazy=False`` the
    eager, fully validated load runs in a worker thread."""
    if not lazy:
        return await asyncio.to_thread(load_eagerly, path, model=model, optimizer=optimizer,
                                       extra_state=extra_state, distributed=False)
    return await load_lazily(path, model=model, optimizer=optimizer, extra_state=extra_state)
