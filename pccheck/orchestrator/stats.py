"""What the orchestrator measures: each checkpoint's timings (:class:`CheckpointStats`) and the
report ``Checkpointer.stats()`` returns (:class:`StatsReport`), as a dict and as JSON."""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CheckpointStats", "SpreadDecision", "StatsReport"]


@dataclass(frozen=True)
class SpreadDecision:
    """Why a checkpoint was spread over the steps it was (``spread_steps="auto"``): the k chosen,
    what the stall model was fed, and what it predicted. The inputs are the ones measured up to
    the checkpoint's begin; ``reason`` says which rule decided:

    - "warm-up": nothing measured yet (no finished checkpoint, or fewer than two iterations);
    - "tuned": the k pccheck-tune stored, before anything was measured;
    - "model": the stall model's best k (the first choice, or a move for a clear gain);
    - "hysteresis": the model's best k was not clearly better than the k in use, which was kept;
    - "no budget": the DRAM budget leaves no room for captured gradients (k = 1);
    - "interval cap": the model's k was cut to half the checkpoint interval.
    """

    k: int                     # the steps this checkpoint is spread over
    reason: str
    best_k: int = 0            # the model's best k for these inputs (0: not modelled)
    state_bytes: int = 0       # S: bytes of the newest finished checkpoint
    grad_bytes: int = 0        # G: one step's gradient bytes
    link_bps: float = 0.0      # B: the copy link's estimate, bytes/s
    link_source: str = ""      # "parts" (spread part copies) or "whole" (a one-step checkpoint's copy)
    link_samples: int = 0      # copies the estimate is the median of (first-touch copies left out)
    window_s: float = 0.0      # t: an optimizer step's end to the next one's begin (median)
    step_s: float = 0.0        # u: an optimizer step's duration (median)
    iter_s: float = 0.0        # one maybe_checkpoint call to the next (median), for reference
    # R: the CPU replay of one step over the whole state (its back-pressure term), and where it
    # came from: "spread" (the last spreads' replay_s), "live step" (CPU parameters: step_s), "none"
    replay_step_s: float = 0.0
    replay_source: str = ""
    model_stall_s: float = 0.0     # modelled stall per checkpoint at k
    model_stall_k1_s: float = 0.0  # and at k = 1

    @property
    def gain(self) -> float | None:
        """Modelled stall at k over that at k = 1 (< 1: spreading pays), None if not modelled."""
        return self.model_stall_s / self.model_stall_k1_s if self.model_stall_k1_s > 0 else None


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
    # part of prepare_s spent waiting for a free slot (N+1 slots: when persisting one checkpoint
    # takes longer than the interval, the disk is the bound and it shows here)
    slot_wait_s: float = 0.0
    # from the start until every byte was in DRAM chunks (wall time: over a device link, the
    # link's pace; what spread_steps="auto" derives the link bandwidth from)
    copied_s: float = 0.0
    # GoCkpt mode (spread_steps): the optimizer steps the snapshot was spread over, the gradient
    # bytes captured for it, and the seconds its CPU replay took (on a checkpoint thread)
    spread_steps: int = 1
    grad_bytes: int = 0
    replay_s: float = 0.0
    replay_cpu_s: float = 0.0  # the replay thread's own CPU time (replay_s is wall time)
    # where a spread's cow_wait_s went, by cause: "previous" (begin waited for the previous
    # spread's replay), "parts" (part copies), "replay" (the replay's back-pressure: RECORDS
    # steps of gradients were waiting), "grads" (the step's gradient copies); None if not spread
    spread_waits: dict[str, float] | None = None
    # spread_steps="auto": the decision behind spread_steps (None for a fixed spread_steps)
    spread_decision: SpreadDecision | None = None
    # array bytes this checkpoint wrote, and (incremental=True) the unchanged ones it referenced
    # in an earlier checkpoint's cells instead, and the seconds its fingerprint pass took
    bytes_written: int = 0
    bytes_referenced: int = 0
    fingerprint_s: float = 0.0

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
    # The remote tier (remote="s3://..."): remote_step (newest step committed remotely by this
    # job), remote_lag_s (age of the oldest local commit not remote yet; 0 when caught up), and
    # the upload counters (pccheck/tiers/remote/uploader.py, RemoteProgress; incremental=True:
    # remote_last_bytes and remote_last_referenced, the last remote step's uploaded and
    # referenced bytes, and remote_bytes_referenced in all). None without one.
    remote: dict[str, Any] | None = None

    @property
    def remote_step(self) -> int | None:
        return self.remote["remote_step"] if self.remote else None

    @property
    def remote_lag_s(self) -> float | None:
        return self.remote["remote_lag_s"] if self.remote else None
    tiers: dict[str, Any] = field(default_factory=dict)  # newest step per tier (pccheck.tiers)
    # The last flush (a preemption notice or Checkpointer.flush()): pccheck.FlushResult.as_dict(),
    # what each tier reached and how many seconds after the notice. None before any.
    flush: dict[str, Any] | None = None

    @property
    def last_durable_age_s(self) -> float | None:
        return None if self.last_durable_time is None else time.time() - self.last_durable_time

    def as_dict(self) -> dict[str, Any]:
        done = [c for c in self.checkpoints if c.outcome != "failed"]

        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "checkpoints": [_as_dict(c) for c in self.checkpoints],
            "summary": {
                "count": len(self.checkpoints),
                "failed": sum(c.outcome == "failed" for c in self.checkpoints),
                "skipped": self.skipped,
                "median_stall_s": med([c.blocked_s for c in done]),
                "median_copy_s": med([c.copy_s for c in done]),
                "median_persist_s": med([c.persist_s for c in done]),
                "median_gbps": med([c.gbps for c in done]),
                "bytes": sum(c.nbytes for c in done),
                "bytes_written": sum(c.bytes_written for c in done),
                "bytes_referenced": sum(c.bytes_referenced for c in done),
                "reserve_bytes": sum(c.reserve_bytes for c in done),
                "last_durable_step": self.last_durable_step,
                "last_durable_age_s": self.last_durable_age_s,
                **(self.remote or {}),
            },
            "tiers": self.tiers,
            "flush": self.flush,
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.as_dict(), **kw)


def _as_dict(c: CheckpointStats) -> dict[str, Any]:
    out = {**asdict(c), "gbps": c.gbps}
    if c.spread_decision is not None:
        out["spread_decision"]["gain"] = c.spread_decision.gain
    return out
