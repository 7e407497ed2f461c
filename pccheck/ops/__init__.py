"""Store operations: reading a store directory for operators, and copying checkpoints out of it.

- ``inventory.py``: what a store directory holds (``survey``, ``verify``, ``locate``, ``load``), and
  the store below a directory a user knows (a Lightning ``dirpath``, a job root); ``pccheck ls``,
  ``verify`` and ``inspect`` render it, ``load_latest(lazy=True)`` uses ``locate`` (FORMAT.md §7).
- ``export.py``: a checkpoint as a safetensors or torch file, written durably (``pccheck export``).
- ``history.py``: the disk tier's kept checkpoints, copied to ``PATH/history/`` in the background
  (``DiskOptions(keep_last=..., keep_every=...)``; FORMAT.md §1's ``history/``).

Invariants owned here: nothing here writes a store file or frees a slot; everything is read with
the recovery readers, as untrusted input; a history copy never blocks a checkpoint nor pins a slot,
and a history or export file is whole or absent (temporary name, fsync, rename, fsync the directory).
"""

__all__: list[str] = []
