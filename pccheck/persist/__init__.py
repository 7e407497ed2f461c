"""The persist layer: the store directory, its files and slots, and recovery (docs/FORMAT.md).

- ``files.py``: every name in a store directory (FORMAT.md §1), the default directory, generations.
- ``store.py``: :class:`SlotStore`, a store opened for writing: its LOCK, its generations, reopening
  a crashed one, and the native slot store under it (§1-§4).
- ``layout.py``: where each array goes in a slot, and the JSON manifest (§5).
- ``recovery.py``: the one "latest valid slot" rule (``first_valid``), validation, loading (§7).
- ``reader.py``: O_DIRECT reads of a slot's data region for recovery and lazy restore.

Invariants owned here: a store directory has one writer (its LOCK); nothing read from disk is
used before its offsets and sizes are bounds-checked and its crc32c matches; nothing is unpickled.
"""
