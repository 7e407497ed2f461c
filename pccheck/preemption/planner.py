"""What fits in the grace period: the measured bandwidths of each tier and the rule that decides
which tiers a flush attempts.

The disk's rate is the median of its last committed checkpoints' bytes over the time from their
start to durable (``CheckpointStats.persist_s``: a checkpoint that shared the disk with another
one in flight counts slower, so the estimate errs long); the remote's is the bytes uploaded over
the upload time of its parts (``RemoteProgress``). A tier with no measurement yet is attempted
(nothing says it does not fit), bounded by the deadline all the same.

Invariant: a tier is attempted only if its own write is expected to fit in the time left, with
:data:`MARGIN` of headroom on the estimate, counting from when it can start: the remote tier's
upload of a step the memory tier holds starts with the disk write (it reads the memory tier's
slot); of a step only the disk holds, once the disk's commit is durable (it reads the disk's
slot), so it is judged then.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["Rates", "measure", "Verdict", "verdict", "MARGIN"]

MARGIN = 1.25   # an estimate is multiplied by this before it is compared with the time left
RECENT = 5      # committed disk checkpoints the disk's rate is the median of


@dataclass(frozen=True)
class Rates:
    """Bytes per second, None when not measured yet."""

    disk_bps: float | None
    remote_bps: float | None


def measure(finished: Sequence[Any], remote_progress: Any) -> Rates:
    """The rates from the disk's finished checkpoints' stats and the remote tier's progress."""
    done = [c for c in list(finished)[-4 * RECENT:] if c.outcome == "committed" and c.persist_s > 0][-RECENT:]
    disk = statistics.median(c.nbytes / c.persist_s for c in done) if done else None
    remote = None
    if remote_progress is not None and remote_progress.upload_s > 0 and remote_progress.bytes > 0:
        remote = remote_progress.bytes / remote_progress.upload_s
    return Rates(disk, remote)


@dataclass(frozen=True)
class Verdict:
    """Whether a tier is attempted, and the estimate behind it (None: not measured)."""

    attempt: bool
    need_s: float | None
    note: str


def verdict(nbytes: int, bps: float | None, deadline: float, before_s: float = 0.0) -> Verdict:
    """Whether writing ``nbytes`` at ``bps``, after ``before_s`` more seconds of tiers before it,
    is expected to end before ``deadline`` (time.monotonic())."""
    left = deadline - time.monotonic() - before_s
    if bps is None or bps <= 0:
        return Verdict(left > 0, None, "no rate measured yet" if left > 0 else "no time left")
    need = nbytes / bps * MARGIN
    if need > left:
        return Verdict(False, need, f"skipped: needs ~{need:.2f} s at {bps / 1e9:.3f} GB/s, {max(left, 0):.2f} s left")
    return Verdict(True, need, f"~{need:.2f} s expected at {bps / 1e9:.3f} GB/s")
