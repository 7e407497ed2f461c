"""The remote tier: checkpoints in object storage (S3), committed crash-safely in the background.

Files, each one job (docs/FORMAT.md §12 is the normative spec they implement):

    objstore.py   ObjectStore: boto3 under one small face; create-only / compare-and-swap PUTs
                  with 404, 409 and 412 mapped to LostRace; multipart; ranged GETs into buffers;
                  the probe at construction (bucket, credentials, conditional writes)
    layout.py     keys, the step manifest and the ``latest`` pointer: encode, and decode with
                  every field checked (§12.1-§12.3)
    commit.py     the commit: the step manifest create-only, then the pointer forward by CAS;
                  the committed list and the next generation (§12.2-§12.4)
    upload.py     one rank's data object of one step, read from its committed local slot in
                  parts, per-part and per-array crc32c, parts sent in parallel (§12.1)
    increment.py  incremental=True: only the arrays changed since the last step this writer
                  committed, read from their local cells; the rest referenced in earlier steps'
                  data objects (§12.8)
    uploader.py   RemoteUploader: the background thread, one queued upload (newest supersedes),
                  the held slots (UploadRetention), retries, progress for stats()
    retention.py  prune: keep-last / keep-every, manifest deleted before its data; orphans and
                  stale multipart uploads of older generations (§12.6)
    parts.py      §12.7's multi-rank step: a rank's part (its data object, then the part
                  create-only) and the commit once all W parts are up
    group.py      GroupUploader: a torch.distributed group's side (each rank its part, rank 0
                  announces the steps and commits them; §12.7)
    sets.py       the sets a caller pairs (pccheck.dcp): SetUploader, one rank's tier (its part
                  at each expected local commit; incremental: only what changed since its
                  part of the plan's base), SetCommitter (the caller's coordinator:
                  generation, incremental bases leased from retention, commit, retention)
    inventory.py  survey / verify / manifest_of / load_step of a prefix (``pccheck ls|verify|inspect|export
                  s3://...``); rank_steps / load_rank_step: a rank's remote source in the
                  per-rank restore plan (tiers/memory/nearest.py)
    load.py       load_remote: newest committed step whose every checksum holds, falling back;
                  locate_remote (lazy, one process or a group); read_array (ranged GETs of one array)
    sharded.py    RemoteSet: a committed step as a §9 set for the resharding planner (sharded
                  and resharded loads on any world size, only the byte ranges each rank needs)
    devserver.py  a local SeaweedFS (``weed mini``) for tests, benchmarks and trying it out

Invariants: data keys are unique and never overwritten; a step is committed only by its manifest,
written last and create-only; the pointer only moves forward; readers trust only what a committed
manifest names and check every checksum; training never waits for the object store.

This package imports no client library at import time (boto3 loads when a store is opened).
"""
