"""What the orchestrator measures: each checkpoint's timings (:class:`CheckpointStats`) and the
report ``Checkpointer.stats()`` returns (:class:`StatsReport`), as a dict and as JSON."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CheckpointStats", "StatsReport"]


@dataclass(frozen=True)
class CheckpointStats:
    """Timings of one checkpoint, in seconds. Training was blocked for ``stall_s + prepare_s +
    blocked_copy_s + cow_wait_s`` in all (:attr:`blocked_s`)."""

    step: int
    counter: int
    nbytes: int
    stall_s: float         # waiting because max_concurrent checkpoints were in flight
    blocked_copy_s: float  # copying inside maybe_checkpoint (all of it, or the eager prefix)
    cow_wait_s: float      # in the optimizer pre-hook, finishing the copy before the update
    copy_s: float          # copying into DRAM chunks in all (any thread), incl. back-pressure
    backpressure_s: float  # part of copy_s spent waiting for a free chunk
    persist_s: float       # from the start until durable (or failed)
    outcome: str           # "committed", "superseded" (a newer one won first) or "failed"
    reserve_bytes: int = 0  # bytes staged into the device reserve instead of waited for
    # inside the call, before the copy: opening the store (the first checkpoint) or a new
    # generation, regrowing the chunk pool, waiting for a free slot, describing the arrays
    prepare_s: float = 0.0
    # from the start until every byte was in DRAM chunks (wall time: over a device link, the
    # link's pace; what spread_steps="auto" derives the link bandwidth from)
    copied_s: float = 0.0
    # GoCkpt mode (spread_steps): the optimizer steps the snapshot was spread over, the gradient
    # bytes captured for it, and the seconds its CPU replay took (on a checkpoint thread)
    spread_steps: int = 1
    grad_bytes: int = 0
    replay_s: float = 0.0

    @property
    def blocked_s(self) -> float:
        """Everything the training thread waited for this checkpoint."""
        return self.stall_s + self.prepare_s + self.blocked_copy_s + self.cow_wait_s

    @property
    def gbps(self) -> float:
        """Bytes per second from the start to durable, in GB/s."""
        return self.nbytes / self.persist_s / 1e9 if self.persist_s > 0 else 0.0


@dataclass(frozen=True)
class StatsReport:
    """Finished checkpoints (oldest first), the skip counter and the latest durable checkpoint."""

    checkpoints: tuple[CheckpointStats, ...]
    skipped: int
    last_durable_step: int | None
    last_durable_time: float | None  # time.time() of that commit, in this process

    @property
    def last_durable_age_s(self) -> float | None:
        return None if self.last_durable_time is None else time.time() - self.last_durable_time

    def as_dict(self) -> dict[str, Any]:
        done = [c for c in self.checkpoints if c.outcome != "failed"]

        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "checkpoints": [{**asdict(c), "gbps": c.gbps} for c in self.checkpoints],
            "summary": {
                "count": len(self.checkpoints),
                "failed": sum(c.outcome == "failed" for c in self.checkpoints),
                "skipped": self.skipped,
                "median_stall_s": med([c.blocked_s for c in done]),
                "median_copy_s": med([c.copy_s for c in done]),
                "median_persist_s": med([c.persist_s for c in done]),
                "median_gbps": med([c.gbps for c in done]),
                "bytes": sum(c.nbytes for c in done),
                "reserve_bytes": sum(c.reserve_bytes for c in done),
                "last_durable_step": self.last_durable_step,
                "last_durable_age_s": self.last_durable_age_s,
            },
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.as_dict(), **kw)
