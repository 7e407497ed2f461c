"""Incremental replicas (``MemoryOptions(incremental=True)``, FORMAT.md §13): a replica carries
only the arrays the receiver's slot lacks.

The protocol, after replicate.py's header (which then says ``"incremental": true`` and carries
the sender's manifest with every array's fingerprint and crc32c):

1. the receiver's replica store plans its next slot (orchestrator/slot_records.py): an array is
   left in place only when the slot records the sender's fingerprint *and* crc32c under the same
   fingerprint keys; it answers under ``<src>><dst>/<seq>/need`` with ``{"need": [indices]}``
   (``{"skip": true}`` when it failed before its plan: nothing is sent, the pair stays in step);
2. the sender, after waiting at most ``TIMEOUT_S`` for the answer, sends those arrays' bytes from
   its slot (``runs_of``: both ends compute the same ranges from the same manifest and list);
3. the receiver copies them into the slot and commits only if every array's crc32c, the received
   ones' as the writers computed them and the kept ones' as the slot records them, equals the
   manifest's (StartArgs.expect_crcs).

The receiver decides from what its own slot holds, never from what the sender believes it sent:
a receiver that restarted (its other slots unknown) or whose sender restarted (other keys) asks
for every array. Invariant: every array of a committed replica is checked again by whoever loads
it (nearest.py), so a slot whose kept bytes went stale is never loaded.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np

from ...errors import CorruptCheckpointError
from ...orchestrator.args import StartArgs
from ...orchestrator.slot_records import Given
from ...persist.layout import Manifest, plan
from .wire import KeyWaiter, recv_views, send_views

__all__ = ["runs_of", "parse_need", "send_needed", "receive_needed"]

BLOCK = 4096


def runs_of(man: Manifest, need: list[int]) -> list[tuple[int, int]]:
    """(offset, nbytes) of the data-region ranges that carry the arrays ``need`` (indices into
    ``man.arrays``, ascending) of an incremental replica, neighbours merged: both ends compute
    them from the same manifest and list, so every send meets a receive of its size."""
    runs: list[list[int]] = []
    for i in need:
        e = man.arrays[i]
        if not e.nbytes:
            continue
        if runs and runs[-1][0] + runs[-1][1] == e.offset:
            runs[-1][1] += e.nbytes  # no padding between them: one range, array bytes only
        else:
            runs.append([e.offset, e.nbytes])
    return [(a, b) for a, b in runs]


def parse_need(raw: str, n: int) -> list[int] | None:
    """A receiver's answer to an incremental replica's header (untrusted): the ascending indices
    of the arrays its slot lacks, or None when it takes none (it failed before its plan).
    CorruptCheckpointError for anything else."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CorruptCheckpointError("a replica's answer is not JSON") from None
    if isinstance(doc, dict) and doc.get("skip") is True:
        return None
    need = doc.get("need") if isinstance(doc, dict) else None
    if not isinstance(need, list) or not all(type(i) is int and 0 <= i < n for i in need) or \
            any(a >= b for a, b in zip(need, need[1:])):
        raise CorruptCheckpointError("a replica's answer lists no valid ascending array indices")
    return need


def send_needed(pg: Any, rank: int, dst: int, seq: int, man: Manifest, view: np.ndarray, waiter: KeyWaiter,
                stop: threading.Event, timeout_s: float) -> int:
    """The sender's part for one peer, after its header: waits (at most ``timeout_s``, or until
    ``stop``) for ``dst``'s answer, then sends the arrays it names from ``view`` (the slot's data
    region). Returns the array bytes sent."""
    key = f"{rank}>{dst}/{seq}/need"
    raw = waiter.wait(key, _Until(time.monotonic() + timeout_s, stop))
    if raw is None:
        raise TimeoutError(f"rank {dst} did not answer the replica header within {timeout_s:.0f} s")
    try:
        waiter.store.delete_key(key)
    except Exception:  # noqa: BLE001 - only a little memory in the store
        pass
    need = parse_need(raw, len(man.arrays))
    if need is None:
        return 0  # the receiver failed before its plan and takes nothing: the pair stays in step
    runs = runs_of(man, need)
    if any(off + n > view.nbytes for off, n in runs):
        raise CorruptCheckpointError("a replica's answer names bytes beyond the slot's data")
    send_views(pg, dst, [view[off:off + n] for off, n in runs], rank, timeout_s)
    return sum(n for _, n in runs)


def receive_needed(kv: Any, pg: Any, rank: int, src: int, seq: int, man: Manifest, arrays: dict[str, Any],
                   view: np.ndarray, orch: Any, timeout_s: float) -> None:
    """The receiver's part: starts the replica store's checkpoint (``orch``, an ``in_slot``
    Orchestrator) with the sender's fingerprints; once its plan knows which arrays the slot lacks,
    answers the header naming them and receives those alone into ``view`` (``arrays`` are its
    views at the manifest's offsets), from which they are copied into the slot."""
    key = f"{src}>{rank}/{seq}/need"
    answered = False

    def receive(cells: Any) -> None:
        nonlocal answered
        need = list(cells.changed)
        kv.set(key, json.dumps({"need": need}))
        answered = True
        runs = runs_of(man, need)
        recv_views(pg, src, [view[off:off + n] for off, n in runs], src, timeout_s)

    n = len(man.arrays)
    cells = man.cells
    given = Given(cells.keys if cells is not None else None, cells.fps if cells is not None else (None,) * n,
                  man.crcs)
    try:
        orch.copy_engine.expect(None)  # copied from ``view``, not received inside the job
        if tuple(e.offset for e in plan(arrays, BLOCK).entries) != tuple(e.offset for e in man.arrays):
            raise CorruptCheckpointError("replica manifest's offsets are not its arrays' block-aligned layout")
        orch.start(man.step, arrays, man.metadata, StartArgs(
            tree=man.tree, epoch=man.epoch, expect_crcs={e.name: c for e, c in zip(man.arrays, man.crcs)},
            given=given, on_plan=receive))
    except CorruptCheckpointError:
        if not answered:
            kv.set(key, json.dumps({"skip": True}))  # the sender sends nothing: still in step
        raise
    except Exception:
        if not answered:
            kv.set(key, json.dumps({"skip": True}))
            raise CorruptCheckpointError(f"replica of step {man.step} not taken: its plan failed") from None
        raise


class _Until:
    """A stop for KeyWaiter.wait: set once ``deadline`` (monotonic) passed or ``stop`` is set."""

    def __init__(self, deadline: float, stop: threading.Event) -> None:
        self.deadline, self.stop = deadline, stop

    def is_set(self) -> bool:
        return self.stop.is_set() or time.monotonic() > self.deadline
