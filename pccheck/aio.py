"""``pccheck.aio``: ``r = await pccheck.aio.load_latest(...)``; ``await r.wait_async()``.

A thin face over :mod:`pccheck.lazy.aio` (needs the ``aio`` extra: aiofiles).
"""

from .lazy.aio import load_latest, locate

__all__ = ["load_latest", "locate"]
