"""The ranks of a torch.distributed job as one checkpointing group (FORMAT.md §8).

- ``distributed.py``: the rank stores under ``PATH/rank-<r>/``; :class:`GroupCoordinator`, the
  global-commit protocol over the process group's key-value store and the store's retention policy;
  ``GLOBAL`` (the newest globally committed step); :func:`agree_and_load` (the ranks agree on the
  newest step all of them hold valid); :func:`detect_group` (pccheck's gloo group, made once).
- ``keys.py``: :func:`wait_key`, the one way a background thread waits for a key of the job's
  key-value store until it is stopped.

Invariants owned here: a step is global only once every rank committed it durably; a rank never
frees the slot of the newest global step it knows nor any newer one; ``GLOBAL`` is written durably
(temporary name, fsync, rename, fsync the directory) by rank 0 only; each incarnation of a job gets
a new epoch, so a step of an earlier incarnation never pairs with a new one; recovery trusts the
ranks' valid sets, not ``GLOBAL`` alone.
"""

__all__: list[str] = []
