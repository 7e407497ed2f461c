"""One checkpoint in flight (:class:`Flight`, owned by the orchestrator) and what a commit that
won reports (:class:`CommitInfo`)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..persist.layout import Layout
from .copy_engine import Sources
from .incremental import CellPlan

__all__ = ["Flight", "CommitInfo"]


@dataclass
class Flight:
    """A checkpoint in flight (mutable, owned by the orchestrator)."""

    job: Any
    src: Sources
    native: Any
    layout: Layout
    step: int
    counter: int
    metadata: Mapping[str, Any] | None
    tree: Any
    epoch: int | None
    validate: Callable[[], str | None] | None
    t0: float
    stall: float
    blocked_copy: float = 0.0
    prepare: float = 0.0
    slot_wait: float = 0.0  # part of prepare: waiting for a free slot
    cow_wait: float = 0.0
    reserve_bytes: int = 0
    copied: threading.Event = field(default_factory=threading.Event)  # every chunk is in host memory
    # Soft copy-on-write: set once the copy thread has claimed its last chunk (all chunks are
    # claimed by then, and the ones it claimed are copied), so no thread still reads live memory
    # except the caller of ensure_copied itself.
    live_done: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    staged: list = field(default_factory=list)  # (chunk, reserve offset, token), guarded by lock
    checked: bool = False  # the version check ran (guarded by lock), with this result:
    problem: str | None = None
    hold: threading.Event | None = None  # pccheck's own tail buffers are final once set (start())
    # The arrays themselves: the native job copies through raw pointers, so whatever it has not
    # copied yet must stay alive (e.g. a spread checkpoint's clones, which nobody else holds).
    arrays: Any = None
    copied_s: float = 0.0  # from the start until every byte was in DRAM chunks
    extra_stats: Mapping[str, Any] = field(default_factory=dict)
    expect: Mapping[str, int] | None = None  # StartArgs.expect_crcs, checked before the commit
    cells: CellPlan | None = None  # an incremental checkpoint: what it writes, where, what it references
    slot: int = -1  # the slot its meta record and manifest go to
    given: Any = None  # StartArgs.given: a replica's fingerprints (slot_records.Given)
    on_plan: Callable[[CellPlan], None] | None = None  # StartArgs.on_plan
    # set once job, src and cells exist (at once, unless an incremental plan runs on the commit
    # thread: ensure_copied waits for it, since its fingerprint pass reads live memory)
    planned: threading.Event = field(default_factory=lambda: _set(threading.Event()))

    def check(self) -> str | None:
        """The snapshot's version check, once, after the last read of live memory and before
        ensure_copied lets a mutation run (either thread may get here first)."""
        with self.lock:
            if not self.checked:
                self.problem = self.validate() if self.validate is not None else None
                self.checked = True
            return self.problem


@dataclass(frozen=True)
class CommitInfo:
    """A checkpoint that just became the durable latest: where it lives. The slot stays as it is
    until a newer checkpoint commits, so readers must validate what they read (crc32c)."""

    step: int
    counter: int
    slot: int
    store_file: Path


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event
