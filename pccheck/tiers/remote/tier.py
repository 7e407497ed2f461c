"""The Checkpointer's one entry into the remote tier: the uploader for this process's place.

    up = make_uploader(options.remote, group=group, coord=coordinator, on_error=...)
    ...                                  # Orchestrator(retention=up.retention or the coordinator)
    up.finish(orchestrator, timeout)     # at close: local commits first, then the remote

A single process (or ``replicated="rank0"``'s rank 0) gets a :class:`RemoteUploader`; a rank of a
group with one store per rank gets a :class:`GroupUploader`, wired into its coordinator (one more
slot per rank: the one its part is uploaded from).
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import PCCheckError
from .group import GroupUploader
from .uploader import RemoteUploader

__all__ = ["make_uploader"]


def make_uploader(options: Any, *, group: Any, coord: Any,
                  on_error: Callable[[PCCheckError], None]) -> RemoteUploader:
    """Probes the store (RemoteConfigError) and starts the upload thread."""
    if coord is None:
        return RemoteUploader(options, on_error=on_error)
    up = GroupUploader(options, on_error=on_error, group=group, coord=coord)
    coord.remote, coord.extra_slots = up, 2  # each rank: one more slot, the one its part is read from
    return up
