"""pccheck's modes, each against its baseline.

- ``gockpt.py``: ``spread_steps`` (GoCkpt mode) against one-step soft copy-on-write and DCP.
- ``lazy.py``: how soon training runs after ``load_latest(..., lazy=True)``.
- ``sharded.py`` (+ ``sharded_child.py``, one rank): sharded saves and a resharded load on CPU ranks.
- ``export.py`` (+ ``export_child.py``, one rank): Hugging Face export of an FSDP2 checkpoint against the raw read and DCP.
- ``distributed.py``: the global-commit protocol's coordination overhead.
- ``transparent.py``: transparent mode (CRIU) against a plain ``criu dump``.

Invariants: children load the parent's pccheck (``harness.common.pccheck_path_first``); each
result records its command (``python -m bench.X ...``).
"""
