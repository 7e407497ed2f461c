"""The orchestrator layer: up to N checkpoints in flight through one DRAM chunk pool.

- ``orchestrator.py``: :class:`Orchestrator` owns the store (opens it, grows it into a new
  generation, retires old ones), hands out in-flight permits, counters and slots, and runs each
  checkpoint's copy, write and commit on its commit threads (FORMAT.md §4 steps 1-5); ``args.py``
  (:class:`StartArgs`: how one checkpoint is started).
- ``copy_engine.py`` (CPU engines, the chunk protocol, ``filling()``), ``cuda_engine.py`` (torch CUDA
  and cupy: own stream, pinned pool, ``depth`` chunks queued), ``engine_choice.py`` (which engine a
  state needs), ``reserve.py`` (``device_reserve``), ``threads.py`` (pools started before the pool).
- ``options.py`` (:class:`EngineOptions`), ``retention.py`` (which slots and generations stay),
  ``stats.py`` (:class:`CheckpointStats`, :class:`StatsReport`).

Invariants owned here: at most N checkpoints in flight (the permits); a chunk is handed to the
writers only once its bytes are in host memory; no thread reads live memory after ``ensure_copied``
returns (soft copy-on-write); an older generation is deleted only after the newer one committed.
"""
