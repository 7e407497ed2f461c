"""What a remote prefix holds, for ``pccheck ls s3://...`` and ``pccheck verify s3://...``.

:func:`survey` reads the pointer and the step manifests (no data); :func:`verify` also fetches
every data object and checks every part's and every array's crc32c, as a load would
(load.py), and says which step a load would return: exit status 0 (the newest committed step
loads), 1 (an older one does), 2 (none). :func:`rank_steps` is a rank's offer in the per-rank
restore plan (pccheck.tiers.memory.nearest): the newest few committed steps its part of which
checks out, from the manifests alone; :func:`load_rank_step` loads that part.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptCheckpointError, NoCheckpointError, RemoteError
from ...persist.recovery import Restored
from .commit import committed, read_pointer
from .layout import MAX_MANIFEST_BYTES, decode_manifest, manifest_key
from .load import _load_step, local_manifest, load_remote
from .objstore import NotFound, ObjectStore

__all__ = ["RemoteStep", "survey", "verify", "remote_url", "manifest_of", "load_step", "rank_steps",
           "load_rank_step", "PLAN_STEPS"]

log = logging.getLogger("pccheck")

# The newest committed steps a rank reads the manifests of for the restore plan: one listing and
# at most this many manifest GETs per rank. Older steps still load through the remote tier's own
# fallback (load_remote walks every committed step).
PLAN_STEPS = 4
# ...and at most this long on them: the other ranks wait for this rank's offer in a collective
# bounded by the memory tier's TIMEOUT_S (120 s); a slow store offers fewer steps, never a hang.
PLAN_BUDGET_S = 30.0


@dataclass(frozen=True)
class RemoteStep:
    """One committed step: its manifest's facts, and (verify) whether it loads."""

    generation: int
    step: int
    world_size: int
    nbytes: int
    unix_time: float | None
    pointer: bool         # the step the ``latest`` pointer names
    problem: str | None   # why it does not load (verify), or its manifest is unreadable

    def as_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "step": self.step, "world_size": self.world_size,
                "bytes": self.nbytes, "unix_time": self.unix_time, "pointer": self.pointer, "problem": self.problem}


def remote_url(path: Any) -> str | None:
    """``s3://...`` from a CLI argument (typer turns ``s3://b/p`` into the Path ``s3:/b/p``)."""
    text = str(path) if path is not None else ""
    if text.startswith("s3://"):
        return text
    if text.startswith("s3:/"):
        return "s3://" + text[len("s3:/"):]
    return None


def survey(url: str) -> list[RemoteStep]:
    """Every committed step, newest first, from the manifests alone."""
    store = ObjectStore(url)
    ptr, _ = read_pointer(store)
    out = []
    for g, s in committed(store):
        try:
            raw, _ = store.get(manifest_key(g, s), MAX_MANIFEST_BYTES)
            m = decode_manifest(raw, g, s)
            out.append(RemoteStep(g, s, m.world_size, sum(r.size for r in m.ranks), m.unix_time,
                                  ptr is not None and ptr.order == (g, s), None))
        except (NotFound, CorruptCheckpointError, RemoteError) as exc:
            out.append(RemoteStep(g, s, 0, 0, None, ptr is not None and ptr.order == (g, s), str(exc)))
    return out


def verify(url: str) -> tuple[list[RemoteStep], int]:
    """Every committed step fully checked (every rank's part), newest first, and the exit status."""
    store = ObjectStore(url)
    steps = []
    for st in survey(url):
        problem = st.problem
        if problem is None:
            try:
                for rank in range(st.world_size):
                    _load_step(store, st.generation, st.step, rank, st.world_size)
            except (CorruptCheckpointError, RemoteError) as exc:
                problem = str(exc)
        steps.append(RemoteStep(st.generation, st.step, st.world_size, st.nbytes, st.unix_time, st.pointer, problem))
    ok = [i for i, s in enumerate(steps) if s.problem is None]
    return steps, (0 if ok and ok[0] == 0 else 1 if ok else 2)


def _find(store: ObjectStore, url: str, step: int | None) -> tuple[int, int]:
    steps = committed(store)
    found = [gs for gs in steps if step is None or gs[1] == step]
    if not found:
        raise NoCheckpointError(f"{url} holds no committed step" + (f" {step}" if step is not None else ""))
    return found[0]


def manifest_of(url: str, step: int | None = None) -> tuple[int, int, Any]:
    """(generation, world size, rank 0's local manifest) of the newest committed step (or of
    ``step``): for ``pccheck inspect s3://...``; the manifest is checked, the data is not read."""
    store = ObjectStore(url)
    g, s = _find(store, url, step)
    raw, _ = store.get(manifest_key(g, s), MAX_MANIFEST_BYTES)
    m = decode_manifest(raw, g, s)
    return g, m.world_size, local_manifest(m.ranks[0], s)


def load_step(url: str, step: int | None = None) -> Any:
    """Rank 0's arrays of the newest committed step that loads (or of ``step``, no fallback),
    every checksum checked: for ``pccheck export s3://...``."""
    if step is None:
        return load_remote(url)
    store = ObjectStore(url)
    g, s = _find(store, url, step)
    raw, _ = store.get(manifest_key(g, s), MAX_MANIFEST_BYTES)
    return _load_step(store, g, s, 0, decode_manifest(raw, g, s).world_size)


def rank_steps(url: str, rank: int, world: int, limit: int = PLAN_STEPS) -> dict[tuple[int, int], tuple[int, int]]:
    """(epoch, step) -> (generation, step) of the newest ``limit`` committed steps under ``url``
    that hold a part for ``rank`` of a job of ``world`` ranks (a step of that world size, or of
    one writer, which every rank reads whole), its step manifest and embedded local manifest
    checked (§12.2, §5); no data is read. The epoch is the embedded manifest's (0 without one),
    so a remote step pairs with the memory and disk tiers' by (epoch, step); the newest
    generation wins a duplicate key. A prefix that cannot be listed offers nothing, and a slow one
    only the steps read within ``PLAN_BUDGET_S`` (logged)."""
    store = ObjectStore(url)
    found: dict[tuple[int, int], tuple[int, int]] = {}
    deadline = time.monotonic() + PLAN_BUDGET_S
    try:
        candidates = committed(store)[:max(0, limit)]
    except RemoteError as exc:
        log.warning("pccheck: cannot list %s for the restore plan: %s", url, exc)
        return found
    for g, s in candidates:
        if time.monotonic() > deadline:
            log.warning("pccheck: %s: reading step manifests took over %.0f s; offering %d steps to the restore "
                        "plan", url, PLAN_BUDGET_S, len(found))
            break
        try:
            raw, _ = store.get(manifest_key(g, s), MAX_MANIFEST_BYTES)
            m = decode_manifest(raw, g, s)
            if m.world_size not in (1, world):
                continue  # another world size: only a sharded load (the remote tier's own) reads it
            man = local_manifest(m.ranks[rank if m.world_size > 1 else 0], s)
        except (NotFound, CorruptCheckpointError, RemoteError) as exc:
            log.warning("pccheck: %s: step %d (generation %d) is not offered: %s", url, s, g, exc)
            continue
        found.setdefault((man.epoch or 0, s), (g, s))
    return found


def load_rank_step(url: str, generation: int, step: int, rank: int, world: int) -> Restored:
    """``rank``'s part of committed step (generation, step) of a job of ``world`` ranks, every
    part's and array's crc32c checked (load.py's checks). CorruptCheckpointError or RemoteError
    when it does not load (no fallback: the caller plans again)."""
    return _load_step(ObjectStore(url), generation, step, rank, world)
