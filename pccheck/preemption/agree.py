"""The ranks of a group agree on what to flush, through the job's key-value store (never the
training collectives: the training thread may be inside one).

Each rank writes its value under ``preempt/e<epoch>/f<n>/<name>/<rank>`` (n: the how-many-th
flush of this Checkpointer, the same on every rank since every rank gets the notice) and reads
every rank's, polling with non-blocking checks (group.keys.wait_key: the connection is shared
with pccheck's other threads) until the deadline.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..group.keys import wait_key

__all__ = ["Exchange"]


class Exchange:
    """All-gathers small JSON values among the ranks of ``group`` (a pccheck Group)."""

    def __init__(self, group: Any, epoch: int | None, index: int) -> None:
        self.group = group
        self.prefix = f"preempt/e{epoch or 0}/f{index}/"

    def all(self, name: str, value: Any, deadline: float) -> list[Any] | None:
        """Every rank's ``value`` (by rank), or None if one has not given it by ``deadline``."""
        store, g = self.group.store, self.group
        store.set(f"{self.prefix}{name}/{g.rank}", json.dumps(value))
        out = []
        for r in range(g.world_size):
            got = wait_key(store, f"{self.prefix}{name}/{r}", lambda: time.monotonic() > deadline, blocking=False)
            if got is None:
                return None
            out.append(json.loads(got))
        return out
