"""The memory tier: checkpoints in RAM every k iterations, replicated to peer nodes (Gemini,
SOSP'23), restored from the nearest tier. FORMAT.md §13 (the layout is §1-§5's, on tmpfs).

Files and roles:

- ``shm_store.py``: ``MemoryTier`` (a second orchestrator over ``/dev/shm/pccheck/<store>``,
  written in mmap mode, fed the disk tier's snapshots), ``MemoryCoordinator`` (the group's
  common-step protocol for the memory stores, holding the steps the peers' replicas pair with),
  the slot counts and room check (``own_slots``, ``replica_slots``, ``memory_need``,
  ``check_room``) and ``build_memory_tier`` (the Checkpointer's entry).
- ``paths.py``: the memory root (``/dev/shm/pccheck/<store>``), ``rank-<r>/``, ``replica-<src>/``.
- ``placement.py``: the node of a process and Gemini's group / mixed placement (pure).
- ``wire.py``: JSON gathers and chunked byte transfers on pccheck's own gloo group, bounded.
- ``replicate.py``: ``ReplicaLinks`` (who sends to whom), ``Replicator`` (background sender and
  receivers; replicas committed into ``replica-<src>/`` stores of 2 + keep_last slots; the
  throttle).
- ``delta.py``: incremental replicas (``MemoryOptions(incremental=True)``): the receiver names the
  arrays its slot lacks, the sender sends those alone.
- ``nearest.py``: ``load_nearest``: the newest step every rank can obtain, each rank's part from
  its nearest tier (own memory → a peer's replica → own disk → its part on the remote tier),
  every byte checked, voted.

Invariants: nothing received from a peer is unpickled (JSON headers, raw bytes, manifests parsed
by persist.layout); every size and offset from a peer is bounds-checked before use; a gloo
receive is posted only when the sender is known to be sending; a slot is never reused while it
is being sent; a replica is written only after every array matched its crc32c, and committed by
the §4 protocol, so a peer holds only committed replicas (the newest per source, and
``MemoryOptions.keep_last`` (0 or 1) older, beside the slot receiving the next); a rank starts a
memory checkpoint only once its previous one is replicated everywhere, so every store holds the
newest such step and keep_last before it (FORMAT.md §13: 2 + keep_last own slots, as many per
source: 4x the state at replicas=2 by default).
"""

from .nearest import TIERS, load_nearest
from .placement import group_of, node_of_this_process, replica_nodes, replica_ranks
from .paths import default_memory_dir
from .shm_store import MemoryTier, build_memory_tier

__all__ = ["TIERS", "load_nearest", "group_of", "node_of_this_process", "replica_nodes", "replica_ranks",
           "MemoryTier", "build_memory_tier", "default_memory_dir"]
