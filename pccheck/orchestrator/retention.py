"""Which old checkpoints a store keeps, and when older store generations may be deleted.

The orchestrator asks its :class:`Retention` and nobody else: it opens the store with the
policy's slots and holding mode, and :meth:`Orchestrator.retire_if_allowed` is the one place
where older generations are deleted, when the policy allows it.

Invariant (both policies): an older generation is deleted only while the newest one holds a
checkpoint the policy stands behind, so a crash at any point leaves one loadable.
"""

from __future__ import annotations

__all__ = ["Retention"]


class Retention:
    """One process's policy: the native commit frees the slot it replaces; older generations go
    once the newest has a durable commit (the orchestrator only asks after one).

    A group coordinator (pccheck.distributed) overrides it: one more slot for the global
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
