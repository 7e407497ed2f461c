"""What a flush reached: :class:`FlushResult` (returned by ``Checkpointer.flush``, kept in
``stats().flush``) and, per tier, :class:`TierReach`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["FlushResult", "TierReach"]


@dataclass(frozen=True)
class TierReach:
    """One tier after a flush.

    Attributes:
        tier: "memory", "disk", "remote" (or "history").
        step: the newest step the tier holds once the flush ended (None: none).
        reached: whether it holds the flushed step (or a newer one).
        at_s: seconds from the notice until it did (None: it did not).
        note: how it got there, or why not ("skipped: needs ~12.0 s, 3.1 s left", "timed out").
        started_s: seconds from the notice until the remote tier's upload of the step began,
            where the flush started it beside the disk write (from the memory tier's slot);
            else None.
    """

    tier: str
    step: int | None
    reached: bool
    at_s: float | None = None
    note: str = ""
    started_s: float | None = None


@dataclass(frozen=True)
class FlushResult:
    """One flush (a preemption notice, or ``Checkpointer.flush()``).

    Attributes:
        step: the step the flush made durable on the tiers that reached it (None: nothing to flush).
        floor: the step of the last ``maybe_checkpoint`` that had returned when the flush began
            (the flushed step is at least this one when ``step_ok``).
        source: where the flushed state came from: "memory" (the memory tier's newest
            checkpoint, persisted to disk), "in flight" (a disk checkpoint already running or
            committed), "boundary" (a checkpoint taken at the next ``maybe_checkpoint``) or "none".
        cause: what started it: "signal SIGTERM", "notice <url>" or "flush()".
        tiers: each tier's :class:`TierReach`, nearest first.
        started: wall-clock time (``time.time()``) of the notice.
        took_s: seconds from the notice to the flush's end.
    """

    step: int | None
    floor: int | None
    source: str
    cause: str
    tiers: tuple[TierReach, ...]
    started: float
    took_s: float

    def tier(self, name: str) -> TierReach | None:
        """The :class:`TierReach` of ``name``, or None if that tier is not configured."""
        return next((t for t in self.tiers if t.tier == name), None)

    @property
    def step_ok(self) -> bool:
        """Whether the flushed step is at least :attr:`floor`."""
        return self.step is not None and (self.floor is None or self.step >= self.floor)

    @property
    def complete(self) -> bool:
        """Whether every configured tier reached the flushed step."""
        return self.step is not None and all(t.reached for t in self.tiers)

    @property
    def missed(self) -> tuple[str, ...]:
        """The tiers that did not reach it."""
        return tuple(t.tier for t in self.tiers if not t.reached)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "complete": self.complete, "step_ok": self.step_ok}
