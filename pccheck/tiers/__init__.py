"""Checkpoint tiers beside the disk store, nearest first: memory (this package's ``memory/``:
RAM that survives the process, replicated to peer nodes), then disk (pccheck.persist), then a
remote object store (``remote/``, issue 28). Each tier writes the FORMAT.md store layout; a
restore takes every rank's part of the newest common step from the nearest tier holding it
(``memory/nearest.py``)."""
