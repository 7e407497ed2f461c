"""The ranks of a group agree on what to flush, through the job's key-value store (never the
training collectives: the training thread may be inside one).

Each rank writes its value under ``preempt/e<epoch>/f<n>/<name>/<rank>`` (n: the how-many-th
flush of this Checkpointer, the same on every rank since every rank gets the notice) and reads
every rank's, polling with non-blocking checks ``POLL_S`` apart (as group.keys.wait_key does
when the connection is shared with pccheck's other threads) until the deadline.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ..group.keys import POLL_S

__all__ = ["Exchange"]

log = logging.getLogger("pccheck")


class Exchange:
    """All-gathers small JSON values among the ranks of ``group`` (a pccheck Group).

    Invariant: a rank that stops waiting (its deadline passed) says so under ``gone/<rank>``
    before it goes on alone, so the others never wait out their own deadlines for a value it
    will not give; a gone rank never commits the group's step, so the group's global step stays
    at an older complete one (the group commit rule), never a mixed one."""

    def __init__(self, group: Any, epoch: int | None, index: int) -> None:
        self.group = group
        self.prefix = f"preempt/e{epoch or 0}/f{index}/"

    def all(self, name: str, value: Any, deadline: float) -> dict[int, Any] | None:
        """Every rank's ``value`` by rank, without the ranks gone; None once ``deadline`` passed
        here (this rank is gone from then on)."""
        try:
            return self._all(name, value, deadline)
        except (RuntimeError, OSError) as exc:  # torch's DistNetworkError is a RuntimeError
            # the store lives in the node-0 agent (torchrun), which ends once rank 0 has: go on alone
            log.warning("pccheck: flush: the job's key-value store stopped answering (%s); flushing alone", exc)
            return None

    def _all(self, name: str, value: Any, deadline: float) -> dict[int, Any] | None:
        store, g = self.group.store, self.group
        store.set(f"{self.prefix}{name}/{g.rank}", json.dumps(value))
        out: dict[int, Any] = {}
        for r in range(g.world_size):
            key, gone = f"{self.prefix}{name}/{r}", f"{self.prefix}gone/{r}"
            while True:
                if store.check([key]):
                    out[r] = json.loads(store.get(key).decode())
                    break
                if store.check([gone]):
                    break
                if time.monotonic() > deadline:
                    store.set(f"{self.prefix}gone/{g.rank}", "1")
                    return None
                time.sleep(POLL_S)
        return out
