"""Flushing on a preemption notice (``Checkpointer.on_preemption``, ``Checkpointer.flush``).

Folder map, one job per module:

    notice.py      where a notice comes from: signal handlers (chaining the previous ones) and
                   the metadata-endpoint poller (AWS, GCE, or any URL: 200 = notice, 404 = none)
    gate.py        StepGate: holds maybe_checkpoint calls during a flush; records the floor (the
                   last call that returned); asks the next call for a checkpoint when needed
    planner.py     the measured rates of each tier and what fits in the time left
    agree.py       a group's ranks agree on the step to flush (the job's key-value store)
    source.py      the memory tier's committed checkpoint of a step, as views of its store
    flush.py       one flush, through the tier stack: disk first, then the tiers after it
    controller.py  Preemption: the notice sources, the flush thread, the Checkpointer's faces
    result.py      FlushResult and TierReach: what each tier reached, and when

Layer: front-end parts (it imports the tier stack's services, never the Checkpointer).
"""

from .controller import Preemption
from .result import FlushResult, TierReach

__all__ = ["Preemption", "FlushResult", "TierReach"]
