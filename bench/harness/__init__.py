"""What every benchmark shares (no benchmark here).

- ``common.py``: ``BENCH_DIR`` (results/ and _scratch/ live under it), sizes, tables, JSON/CSV/PNG
  writers, host and device information, ``figure_parser``, ``pccheck_path_first`` (children load
  the parent's pccheck).
- ``probes.py``: what a timed window reads about this process and the machine (memory, faults, CPU).
- ``workloads.py``: the training workloads the throughput benches checkpoint.
- ``systems.py``: the checkpointing systems compared with pccheck, each defined once.

Invariants: a figure or number comes from a result document a bench wrote (never typed in); every
system is defined once here, so benches compare the same thing.
"""
