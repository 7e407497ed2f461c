"""How one checkpoint is started: :class:`StartArgs`, the one argument object of ``Orchestrator.start``
besides the step, the arrays and the user's metadata (as Orbax's ``args.py`` gathers a save's)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

__all__ = ["StartArgs"]


@dataclass(frozen=True)
class StartArgs:
    """What a caller may say about one checkpoint; every field is optional.

    ``tree`` and ``epoch`` go to the manifest's own fields (FORMAT.md §5).

    ``n_eager``: None, ``start`` returns once every byte is in DRAM chunks; k, once the first k
    arrays are copied, the rest is copied in the background, and ``ensure_copied`` must run before
    anything mutates them (soft copy-on-write). ``validate`` runs after the copy; a message it
    returns fails the checkpoint.

    ``hold`` (with ``n_eager=0``): no array is live memory (a spread checkpoint's shadow and
    clones, pccheck.spread), some are written until ``hold`` is set, and all are copied in the
    background after that (invariant: a chunk holds bytes of several arrays, so none may be
    copied early); ``ensure_copied`` never waits for them. ``copied`` is set once every byte is in
    DRAM chunks (or it failed). ``cow_wait`` (seconds the caller already waited for it) and
    ``extra_stats`` (fields of :class:`~pccheck.orchestrator.stats.CheckpointStats`) go to its stats.

    ``expect_crcs`` (array name -> crc32c): the bytes are known to have those checksums (a
    replica received from a peer); the crc32c the writers compute anyway must match every one,
    else the checkpoint fails before its commit (CorruptCheckpointError): no pass of its own.
    With an incremental plan, an array left in place is checked by the crc32c its slot records.

    ``given`` (an ``in_slot`` store: :class:`~pccheck.orchestrator.slot_records.Given`): the
    arrays' fingerprints and crc32c as their sender computed them, compared with what the slot
    holds instead of fingerprinting the arrays here (a replica). ``on_plan(plan)`` runs once the
    plan (:class:`~pccheck.orchestrator.incremental.CellPlan`) is known, before any byte is
    copied; what it raises fails the checkpoint before anything is written.
    """

    tree: Any = None
    epoch: int | None = None
    n_eager: int | None = None
    validate: Callable[[], str | None] | None = None
    hold: threading.Event | None = None
    copied: threading.Event | None = None
    cow_wait: float = 0.0
    extra_stats: Mapping[str, Any] | None = None
    expect_crcs: Mapping[str, int] | None = None
    given: Any = None
    on_plan: Callable[[Any], None] | None = None
