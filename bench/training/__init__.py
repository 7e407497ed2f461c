"""Training loops that checkpoint: what checkpointing costs a run, and what a preemption costs.

- ``overhead.py``: throughput while checkpointing every k iterations (Figure 8's measurement);
  ``overhead_report.py``: its targets, tables, CSV and plot.
- ``restart.py`` (+ ``restart_child.py``, the processes it starts): process start to the first
  step after a SIGKILL, per system.
- ``soak.py``: memory, file descriptors and threads over a long run.
- ``integrations.py``: Lightning and Hugging Face Trainer runs that checkpoint through pccheck.
- ``incremental.py``: a LoRA-like model checkpointed at interval 1: pccheck incremental and full,
  DCP ``async_save``, an adapter-only ``torch.save`` and pccheck on the adapters alone (bytes
  written, time lost, time to durable), a full-parameter pair and the cold load of both stores.
- ``ab.py``: the same benches (persist, the emulated loop) against the library before and after a
  change, interleaved round by round: the no-regression check of a refactor.

Invariants: cells of one run are interleaved and wait for a quiet machine (``--quiet-wait``); the
JSON records each window's foreign CPU use, so a disturbed cell is visible.
"""
