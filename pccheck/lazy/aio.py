"""The lazy half of ``pccheck.aio``: loading a checkpoint from an asyncio host (a serving cold
start, a controller) without ever blocking its event loop.

The small metadata reads (each generation's header and meta records, the candidate slots'
manifests) go through aiofiles; recovery's rule picks the slot from them (:mod:`pccheck.persist.
recovery`, the same pure parsers the synchronous readers use). The bulk reads stay native and in
the loader thread of :mod:`.restore`. The face, ``pccheck/aio.py``, runs the eager ``load_latest``
in a worker thread instead when asked (``lazy=False``): that one lives in the layer above.

    r = await pccheck.aio.load_latest("ckpt", model=model, optimizer=optimizer)
    await r.wait_async()          # or let forward / optimizer.step wait for what they need
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..ops.inventory import Located
from ..persist.files import default_path, store_generation
from ..persist.recovery import (BLOCK, candidate_order, image_from, manifest_from, manifest_region,
                                parse_header_block)
from ..state.torch_state import TorchState
from .restore import LazyRestore, restore_lazily

__all__ = ["load_lazily", "locate"]


async def locate(path: str | os.PathLike[str] | None = None) -> Located:
    """The latest checkpoint whose meta record and manifest validate (recovery's order:
    generations newest first, CHECK_ADDR's slot, then by counter), read with aiofiles."""
    import aiofiles
    import aiofiles.os

    directory = Path(path) if path is not None else default_path()
    if not await aiofiles.os.path.isdir(directory):
        raise NoCheckpointError(f"no checkpoint directory at {directory}: pass the path the Checkpointer "
                                "wrote to (or set PCCHECK_DIR)")
    gens = sorted(((g, directory / n) for n in await aiofiles.os.listdir(directory)
                   if (g := store_generation(n)) is not None), reverse=True)
    problems: list[str] = []
    for _, file in gens:
        try:
            async with aiofiles.open(file, "rb") as f:
                size = (await aiofiles.os.stat(file)).st_size
                header = parse_header_block(file, size, await f.read(BLOCK))
                image = image_from(file, header, await f.read(header["num_slots"] * BLOCK))
                for slot in candidate_order(image):
                    try:
                        off, n = manifest_region(image, slot)
                        await f.seek(off)
                        raw = await f.read(n)  # crc + JSON parse of up to 64 MiB: off the loop
                        return Located(image, slot, await asyncio.to_thread(manifest_from, image, slot, raw))
                    except CorruptCheckpointError as exc:
                        problems.append(f"{file}: {exc}")
        except (CorruptCheckpointError, OSError) as exc:
            problems.append(str(exc) if isinstance(exc, CorruptCheckpointError) else f"{file}: {exc}")
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise NoCheckpointError(f"{directory}: no valid checkpoint{detail}")


async def load_lazily(path: str | os.PathLike[str] | None = None, *, model: Any = None, optimizer: Any = None,
                      extra_state: Mapping[str, Any] | None = None) -> LazyRestore:
    """``pccheck.aio.load_latest(..., lazy=True)``: returns once the metadata is read and the small
    parts are back (needs ``model``)."""
    if model is None:
        raise ConfigError("lazy=True restores a model in place: pass model= (and optimizer=)")
    located = await locate(path)
    return await asyncio.to_thread(restore_lazily, located, TorchState(model, optimizer, extra_state))

