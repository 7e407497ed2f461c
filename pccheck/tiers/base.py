"""One shape for every tier around the disk store: the memory tier, the remote tier, the history.

The disk store (the orchestrator over ``path``'s slots) is where every checkpoint is committed;
a tier takes checkpoints beside it (the memory tier, on its own schedule, from the same
snapshots) or after it (the remote tier and the history, from the disk's durable commits). Each
tier is built by its own ``build_*`` function from a :class:`TierContext` and its options, and is
absent from the list when it is not configured.

A :class:`Tier`'s life, in the order :class:`pccheck.tiers.stack.TierStack` calls it (the
numbers are the order; 4 to 8 repeat)::

    1. build_*(ctx, ...) -> Tier | None   collective in a group; probes what it needs (the object
                                          store: RemoteConfigError; tmpfs room: NoSpaceError)
    2. start(disk, epoch)                 the disk orchestrator exists and the job's epoch is known
    3. prepare(layout, metadata, tree)    the state's size is final: open stores, fault in pools
    4. on_step(step, snapshot, metadata, soft_cow)
                                          every maybe_checkpoint call, before the disk's own
                                          checkpoint; a tier beside the disk takes its own here
    5. on_commit(info)                    a disk checkpoint became the durable latest (commit
                                          thread): a tier after the disk queues its copy, no I/O
    6. ensure_copied()                    before each optimizer step: no copy still reads live
                                          tensors (soft copy-on-write)
    7. wait(timeout) -> bool              everything taken so far is done (False: timed out)
    8. flush(deadline, step) -> int|None  a preemption (pccheck.preemption), between 4-7 and 9,
                                          while no maybe_checkpoint call runs: a tier beside the
                                          disk commits its checkpoint in flight (``step`` None);
                                          a tier after it takes the disk's durable commit of
                                          ``step`` whatever its own schedule (``every``) says
                                          (the remote tier of one process may have started it
                                          from the memory tier's slot: ``flush_from``);
                                          both wait until ``deadline`` (time.monotonic(), inf: no
                                          limit) at most and return the newest step they hold
    9. close(timeout)                     finishes (``timeout``: how long a tier after the disk may
                                          still wait for its newest copy), stops its threads

``newest()`` (any time after 2) gives the newest step per kind the tier holds, for ``stats()``.
Teardown is the stack's, in reverse order of setup; a tier never closes another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from ..errors import PCCheckError

__all__ = ["Tier", "TierContext"]


@dataclass(frozen=True)
class TierContext:
    """What a tier is built from; never the Checkpointer itself.

    Attributes:
        path: the disk store's directory (a group: the job's, each rank under ``rank-<r>/``).
        options: the resolved :class:`pccheck.Options`.
        source: the state source (``snapshot()``, ``may_grow()``).
        metadata: the metadata every checkpoint carries.
        group: the torch.distributed group, or None.
        coord: the disk store's group coordinator (global steps), or None.
        on_error: where a background failure goes (the Checkpointer's ``on_error`` policy).
    """

    path: Path
    options: Any
    source: Any
    metadata: Mapping[str, Any]
    group: Any
    coord: Any
    on_error: Callable[[PCCheckError], None]


class Tier(Protocol):
    """A tier (see the module docstring for the call order)."""

    name: str          # "memory", "remote", "history": the key of its figures in stats()
    after_disk: bool   # fed by the disk's durable commits (on_commit), not by the steps

    def start(self, disk: Any, epoch: int | None) -> None: ...

    def prepare(self, layout: Any, metadata: Mapping[str, Any], tree: Any) -> None: ...

    def on_step(self, step: int, snapshot: Callable[[], Any], metadata: Mapping[str, Any], soft_cow: bool) -> None: ...

    def on_commit(self, info: Any) -> None: ...

    def ensure_copied(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...

    def flush(self, deadline: float, step: int | None) -> int | None: ...

    def newest(self) -> dict[str, Any]: ...

    def close(self, timeout: float | None) -> None: ...
