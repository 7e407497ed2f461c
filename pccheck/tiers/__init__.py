"""Storage tiers beyond the local store: where a committed checkpoint goes after the local commit.

Folder map:

    tiers/
      remote/        the object-storage tier (S3): committed local checkpoints uploaded in the
                     background and committed on the store crash-safely (docs/FORMAT.md §12);
                     ``remote="s3://bucket/prefix"`` on a Checkpointer, ``load_latest("s3://...")``

A tier reads only committed local slots (never training memory), holds them from reuse through the
orchestrator's retention policy while it needs them, and never makes a training step wait.
Layer: front-end (it may import persist and the orchestrator's retention, never the store).
"""
