"""``pccheck.dcp.Writer("s3://bucket/prefix")`` and ``Reader("s3://...")``: DCP saves committed on
an object store with the remote tier's protocol (FORMAT.md §9.1 with §12).

A save still goes to a local store first (the *staging* directory: ``Writer(url, local=...)``,
by default ``$TMPDIR/pccheck-dcp/<hash of the URL>``), where each rank commits its slot with §4
as for a local save. Then, inside ``write_data`` (so ``dcp.async_save``'s future completes only
once it is done), each rank uploads its committed slot as one data object (§12.1: unique key,
parts, per-part and per-array crc32c, the slot checked against its manifest) and PUTs its part
description create-only (§12.7). The coordinator's ``finish``, which DCP calls only after every
rank's ``write_data`` returned, reads the W parts, PUTs the step manifest create-only (the commit)
and moves ``latest`` forward by compare-and-swap. Generations: the coordinator process takes one
per URL at its first save (§12), and every rank uses it (it rides in the save plan).

Reading: :func:`remote_set` picks the newest committed step (or the one of ``step=``) whose
manifests check out; it is a :class:`pccheck.tiers.remote.sharded.RemoteSet`, whose members the
local Reader's metadata rebuild uses as it uses a local set's, and whose ``read`` fetches one
array by ranged GETs and checks its crc32c.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, NoCheckpointError, RemoteError
from ..options import RemoteOptions
from ..tiers.remote.commit import advance_pointer, commit_step, next_generation
from ..tiers.remote.group import part_key
from ..tiers.remote.layout import MAX_MANIFEST_BYTES, StepManifest, rank_part_from_json
from ..tiers.remote.objstore import NotFound, ObjectStore, is_remote
from ..tiers.remote.sharded import RemoteSet, remote_sets
from ..tiers.remote.upload import BufferPool, SlotRef, upload_slot

__all__ = ["is_remote", "staging_dir", "RemoteTarget", "remote_set", "older_steps"]

log = logging.getLogger("pccheck")

_generations: dict[str, int] = {}  # the coordinator process's generation per URL
_lock = threading.Lock()


def staging_dir(url: str, local: Any = None) -> Path:
    """Where the ranks' local stores of an s3:// save live: ``local``, or a directory of the
    temporary folder named by the URL (the same on every rank of one host)."""
    if local is not None:
        return Path(local).absolute()
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "pccheck-dcp" / digest


class RemoteTarget:
    """One Writer's object store: probed at construction (RemoteConfigError: bucket, credentials,
    conditional writes), then each rank's upload and the coordinator's commit."""

    def __init__(self, url: str, options: RemoteOptions | None = None) -> None:
        self.url = url
        self.options = options or RemoteOptions(url=url)
        self.store = ObjectStore(url)
        self.store.probe()

    def generation(self) -> int:
        """The coordinator's generation for this URL in this process (taken at its first save)."""
        with _lock:
            if self.url not in _generations:
                _generations[self.url] = next_generation(self.store)
            return _generations[self.url]

    def upload(self, commit: Any, generation: int, rank: int) -> None:
        """Uploads rank ``rank``'s committed slot (a CommitInfo) and PUTs its part create-only.
        CorruptCheckpointError if the slot no longer holds the step (reused meanwhile: its
        checksums say so); RemoteError if the store fails."""
        o = self.options
        ref = SlotRef(commit.store_file, commit.slot, commit.counter, commit.step)
        with ThreadPoolExecutor(o.concurrency, thread_name_prefix="pccheck-remote-part") as senders:
            part = upload_slot(self.store, ref, generation, rank, o.part_size,
                               BufferPool(o.concurrency + 1, o.part_size), senders, lambda: False)
        self.store.put_new(part_key(generation, commit.step, rank), json.dumps(part.as_json()).encode("utf-8"))

    def commit(self, generation: int, step: int, world_size: int) -> None:
        """The coordinator, once every rank's part is up: the step manifest (the commit), then
        the pointer. RemoteConflictError if another job committed the step or owns the prefix."""
        parts = []
        for r in range(world_size):
            try:
                raw, _ = self.store.get(part_key(generation, step, r), MAX_MANIFEST_BYTES)
            except NotFound:
                raise RemoteError(f"rank {r}'s part of step {step} is missing under {self.url}") from None
            parts.append(rank_part_from_json(raw, f"rank {r}'s part of step {step}"))
        commit_step(self.store, StepManifest(generation, step, world_size, time.time(), tuple(parts)))
        advance_pointer(self.store, generation, step)
        log.info("pccheck: DCP save of step %d committed under %s (generation %d)", step, self.url, generation)


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
