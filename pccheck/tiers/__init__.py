"""Checkpoint tiers beside the local disk store, nearest first: where a checkpoint lives besides the
node's disk, so that it survives the loss of the process or of the machine.

Folder map:

    tiers/
      memory/        the memory tier: RAM that survives the process (a tmpfs store, written by the
                     §4 protocol every ``memory.every`` steps), replicated to peer nodes
                     (Gemini's group placement), and the restore from the nearest tier
                     (``memory/nearest.py``; docs/FORMAT.md §13)
      remote/        the object-storage tier (S3): committed local checkpoints uploaded in the
                     background and committed on the store crash-safely (docs/FORMAT.md §12);
                     ``remote="s3://bucket/prefix"`` on a Checkpointer, ``load_latest("s3://...")``
      keep.py        the one retention rule of every tier (``keep_last``, ``keep_every``)
      base.py        the Tier protocol (one life, its call order numbered) and TierContext, the
                     frozen context every tier is built from
      stack.py       TierStack: the disk store and the configured tiers of one process, built,
                     fed and torn down (one ExitStack) in one place, for every entry point (the
                     Checkpointer, the named stores of Lightning and Accelerate, each rank store
                     of a pccheck.dcp save as a SetMember)

Each tier writes or mirrors the FORMAT.md store layout and checks every byte it reads. The remote
tier reads only committed local slots (never training memory) and holds them from reuse through
the orchestrator's retention policy while it needs them; neither tier makes a training step wait
for its I/O. Layer: front-end services (they may import persist and the orchestrator, never the
reverse).
"""
