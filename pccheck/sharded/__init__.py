"""Sharded checkpoints (FSDP2, DTensor) and resharded loads (docs/FORMAT.md §9).

- ``dtensor.py``: a DTensor as pccheck sees it: the local box a rank holds and whether it stores it
  (replicas store once).
- ``geometry.py``: where a local shard lies in its global tensor; where two shards overlap.
- ``index.py``: a job's checkpoints as sets across its rank directories, and the shards each holds.
- ``load.py``: a checkpoint of W ranks loaded into a job of W' ranks: each rank reads only the
  overlaps of the boxes it needs, validated by the per-array crc32c.

Invariants owned here: a set is loadable only if every shard of every array is present in one
committed checkpoint of one global step; a rank writes each byte of a global tensor it stores
once, and a load covers every byte of each destination exactly once.
"""
