"""Where ``pccheck.dcp.Writer("s3://bucket/prefix")`` stages its saves, and how
``Reader("s3://...")`` picks a committed one (FORMAT.md §9.1 with §12).

Writing goes through the remote tier every entry point shares: each rank store's tier stack
(``integrations/dcp_store.py``) holds the set mode of ``tiers/remote`` (``sets.py``), which
uploads the rank's committed slot as its part, and the Writer's coordinator commits the step
with its ``SetCommitter``. A save still goes to a local store first, the *staging* directory
(:func:`staging_dir`: ``Writer(url, local=...)``, by default ``$TMPDIR/pccheck-dcp/<hash of the
URL>``), where each rank commits its slot with §4 as for a local save.

Reading: :func:`remote_set` picks the newest committed step (or the one of ``step=``) whose
manifests check out; it is a :class:`pccheck.tiers.remote.sharded.RemoteSet`, whose members the
local Reader's metadata rebuild uses as it uses a local set's, and whose ``read`` fetches one
array by ranged GETs and checks its crc32c.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, NoCheckpointError
from ..tiers.remote.objstore import is_remote
from ..tiers.remote.sharded import RemoteSet, remote_sets

__all__ = ["is_remote", "staging_dir", "remote_set", "older_steps"]


def staging_dir(url: str, local: Any = None) -> Path:
    """Where the ranks' local stores of an s3:// save live: ``local``, or a directory of the
    temporary folder named by the URL (the same on every rank of one host)."""
    if local is not None:
        return Path(local).absolute()
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "pccheck-dcp" / digest


def remote_set(url: str, step: int | None) -> RemoteSet:
    """The newest committed step under ``url`` (or the newest of ``step``) whose manifests check
    out, as a set. NoCheckpointError naming the steps found when there is none."""
    found, problems = [], []
    for cand in remote_sets(url, None):
        found.append(cand.step)
        if step is not None and cand.step != step:
            continue
        try:
            cand.members  # noqa: B018 - fetches and checks the manifests
        except CorruptCheckpointError as exc:
            problems.append(f"step {cand.step}: {exc}")
            continue
        return cand
    what = f"step {step}" if step is not None else "checkpoint"
    raise NoCheckpointError(f"no committed {what} under {url}; steps found: {', '.join(map(str, found)) or 'none'}"
                            + (f" ({'; '.join(problems)})" if problems else ""))


def older_steps(url: str, step: int) -> list[int]:
    """The committed steps under ``url`` older than ``step`` (a hint after a damaged read)."""
    return [c.step for c in remote_sets(url, None) if c.step < step]
