"""``Checkpointer.stats()``: per-checkpoint timings and a summary, as a dict and as JSON."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from .orchestrator.orchestrator import CheckpointStats

__all__ = ["StatsReport"]


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
                "median_stall_s": med([c.stall_s + c.blocked_copy_s + c.cow_wait_s for c in done]),
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
