"""One operation timed, pccheck against the device limit and its peers.

- ``persist.py``: time to make one checkpoint durable (``python -m bench.persist``; Figure 11 runs it).
- ``recovery.py``: a cold load of one checkpoint (``python -m bench.recovery``).
- ``call_cost.py``: what one ``checkpoint()`` call costs the training thread for many small tensors.
- ``copy_threads.py``: the CPU copy engine with 1, 2 or more copy threads.
- ``memory_tier.py``: one committed memory-tier checkpoint: the tmpfs store (pccheck's design) against
  the floor of the DRAM chunk pool as the tier (``docs/ARCHITECTURE.md`` says why).

Invariants: every timed run starts from the same state (gc, sync, cold cache where it says so);
systems are interleaved within a run; results go to ``bench/results/`` with their command.
"""
