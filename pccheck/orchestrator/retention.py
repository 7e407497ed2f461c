"""Which old checkpoints a store keeps, and when older store generations may be deleted.

The orchestrator asks its :class:`Retention` and nobody else: it opens the store with the
policy's slots and holding mode, and :meth:`Orchestrator.retire_if_allowed` is the one place
where older generations are deleted, when the policy allows it.

Invariant (both policies): an older generation is deleted only while the newest one holds a
checkpoint the policy stands behind, so a crash at any point leaves one loadable.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Retention", "KeepOlder", "HeldSlots"]


class Retention:
    """One process's policy: the native commit frees the slot it replaces; older generations go
    once the newest has a durable commit (the orchestrator only asks after one).

    A group coordinator (pccheck.group.distributed) overrides it: one more slot for the global
    checkpoint, replaced slots held for it to release, some slots of the reopened generation
    protected, and retirement only once a globally committed step lives in the newest generation.
    """

    extra_slots: int = 0       # slots beyond N in flight + the latest
    hold_replaced: bool = False  # replaced slots are held (take_held/release_slot), not freed

    def protected_slots(self) -> tuple[int, ...]:
        """Slots of the newest generation that must not be reused when it is reopened."""
        return ()

    def may_free_slots(self) -> bool:
        """Whether slots this policy holds may come back (a writer waits for them instead of
        failing with "no free slot")."""
        return False

    def may_retire(self, generation: int) -> bool:
        """Whether generations older than ``generation`` (which has a durable commit) may go."""
        return True


class KeepOlder(Retention):
    """One process's policy keeping ``keep_last`` committed checkpoints beyond the newest (the
    memory tier's single-process and replica stores). Invariant: the native commit frees the
    slot it replaces and the free queue hands out the slot freed longest ago, so with N = 1 in
    flight and 2 + keep_last slots the newest 1 + keep_last committed checkpoints stay valid
    while the next one is written."""

    def __init__(self, keep_last: int) -> None:
        self.extra_slots = keep_last


class HeldSlots:
    """The bookkeeping of a policy with ``hold_replaced``: what each slot of the open generation
    holds, and the replaced slots it keeps. Invariant: a held slot is given back only once its
    step is older than the step the policy must keep (or it holds nothing known). Not locked:
    the policy's own lock guards every call."""

    def __init__(self) -> None:
        self.generation = 0                # the store generation the two below refer to
        self.step_of: dict[int, int] = {}  # slot -> the step it holds
        self.held: set[int] = set()        # replaced slots kept from reuse

    def record(self, orch: Any, slot: int, step: int) -> None:
        """``slot`` of the orchestrator's open generation now holds ``step`` (a local commit)."""
        self._sync(orch)
        self.step_of[slot] = step

    def holds(self, generation: int, step: int | None) -> bool:
        """True if ``step`` lives in a slot of ``generation`` (it may then be retired behind)."""
        return generation == self.generation and step is not None and step in self.step_of.values()

    def settle(self, orch: Any, keep: int | None, pinned: Any = None) -> None:
        """Takes the slots the store replaced and gives back those older than ``keep``, except
        the steps ``pinned(step)`` says another user still reads (the remote tier's upload)."""
        self._sync(orch)
        gen = self.generation
        self.held.update(orch.take_held(gen))
        for s in sorted(self.held):
            step = self.step_of.get(s)
            if step is not None and pinned is not None and pinned(step):
                continue
            if step is None or (keep is not None and step < keep):
                self.held.discard(s)
                self.step_of.pop(s, None)
                orch.release_slot(s, gen)

    def _sync(self, orch: Any) -> None:
        if orch.generation != self.generation:  # a new generation: slot numbers start over
            self.generation, self.held, self.step_of = orch.generation, set(), {}
