"""A sampler's epoch and offset in every checkpoint: resume a ``DistributedSampler`` mid-epoch.

``torch.utils.data.DistributedSampler`` has no ``state_dict``: its order is a function of its seed
and of the epoch given to ``set_epoch``, and nothing records how far into that order training
got. :class:`ResumableSampler` wraps it (or any sampler with ``set_epoch``) and keeps both, as an
``extra_state`` object of a :class:`pccheck.Checkpointer`:

    sampler = pccheck.ResumableSampler(DistributedSampler(dataset, shuffle=True, seed=0))
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=4)
    ck = pccheck.Checkpointer(model, optimizer, "ckpt", extra_state={"sampler": sampler})
    try:
        step = pccheck.load_latest("ckpt", model=model, optimizer=optimizer, extra_state={"sampler": sampler}).step
    except pccheck.NoCheckpointError:
        step = 0                          # a fresh start
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)          # the resumed epoch keeps its offset
        for batch in loader:
            sampler.advance(len(batch))   # the samples training has consumed
            ...
            step += 1
            ck.maybe_checkpoint(step)

The offset counts what the *training loop* consumed (``advance``), not what the sampler handed
out: a ``DataLoader`` with workers draws indices several batches ahead of the loop, so counting
at the sampler would skip the prefetched batches on a resume. A resumed epoch yields the same
order from the saved offset on, so the batches after a resume are the ones the uninterrupted run
would have drawn (with ``drop_last=False`` the last, short batch included).

A ``torchdata.stateful_dataloader.StatefulDataLoader`` keeps its own position (pass the loader
itself in ``extra_state``); it needs this wrapper only to remember a ``DistributedSampler``'s
epoch. ``import pccheck`` does not import torch for this class.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import ConfigError

__all__ = ["ResumableSampler"]


class ResumableSampler:
    """Wraps a sampler with ``set_epoch`` (``DistributedSampler``) and records its epoch and the
    samples consumed in it, for ``extra_state``; see the module docstring for the loop."""

    def __init__(self, sampler: Any) -> None:
        if not hasattr(sampler, "set_epoch") or not hasattr(sampler, "__iter__"):
            raise ConfigError(f"ResumableSampler wraps a sampler with set_epoch (a DistributedSampler), got "
                              f"{type(sampler).__name__}; a sampler without epochs needs no wrapper: "
                              "StatefulDataLoader keeps its position")
        self.sampler = sampler
        self.epoch = int(getattr(sampler, "epoch", 0))
        self.consumed = 0   # samples of this epoch the training loop has consumed (advance)
        self._start = 0     # where the current iteration began in the epoch's order

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` from its beginning, unless it is the epoch the state was loaded at
        (or the current one): then it goes on from the consumed offset."""
        if epoch != self.epoch:
            self.consumed = 0
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def advance(self, n: int) -> None:
        """Counts ``n`` samples as consumed by training (call it once per batch, with its size)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ConfigError(f"advance takes the number of samples consumed (an int >= 0), got {n!r}")
        self.consumed += n

    def __iter__(self) -> Iterator[int]:
        self._start = self.consumed
        for i, index in enumerate(self.sampler):
            if i >= self._start:
                yield index

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.consumed)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": e, "consumed": n}``."""
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Puts the sampler at the saved epoch and offset; the next iteration starts there."""
        try:
            epoch, consumed = int(state["epoch"]), int(state["consumed"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"not a ResumableSampler state: {state!r}") from None
        if epoch < 0 or consumed < 0:
            raise ConfigError(f"a ResumableSampler state has a negative epoch or offset: {state!r}")
        self.epoch, self.consumed = epoch, consumed
        self.sampler.set_epoch(epoch)
