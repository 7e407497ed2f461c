"""The paper's figures, reproduced on this machine (``python -m bench all`` runs them in order).

- ``fig8.py``: training throughput vs checkpoint interval, every policy (over training/overhead).
- ``fig11.py``: time to persist one checkpoint vs its size (over micro/persist).
- ``fig12.py``: sensitivity to N, writer threads, chunk size and DRAM budget.
- ``goodput.py``: goodput under preemption, the replay simulator (Figure 9), fed by the above.
- ``tuner.py``: ``pccheck-tune``'s choice against a grid search.

Invariants: each figure's PNG and CSV come from the JSON written in the same run; ``--quick`` runs
write ``quick.*`` beside each ``latest.*``, whose numbers mean nothing.
"""
