"""Benchmarks and figure reproductions for pccheck; run them on purpose, e.g. ``python -m bench.persist``.

Grouped by job, one folder each (each folder's ``__init__.py`` lists its files):

- ``harness/``: what every bench shares: ``common.py`` (sizes, tables, JSON/CSV, figures, host info,
  ``BENCH_DIR``), ``probes.py``, ``workloads.py``, ``systems.py`` (the systems compared, each defined once).
- ``micro/``: one operation timed: persist, recovery, call_cost, copy_threads.
- ``training/``: training loops that checkpoint: overhead (+ overhead_report), restart, soak, integrations, ab,
  incremental.
- ``paper/``: the paper's figures: fig8, fig11, fig12, goodput (Figure 9), tuner.
- ``modes/``: pccheck's modes: gockpt (spread), lazy, sharded, distributed, transparent.
- ``resilience/``: surviving a lost machine: scale (the goodput model of a large job per tier set), preempt
  (the flush on a preemption notice).
- ``gpu/``: the GPU benches (``python -m bench.gpu``, gpu_claims; gpu_train, gpu_profile).
- ``analysis/``: scripts behind design choices (not benches; run as files).

Where each runnable name lives (``python -m bench.X``; results in ``bench/results/X/latest.*``):

============  =====================================================================
folder        X
============  =====================================================================
micro/        persist, recovery, call_cost, copy_threads, memory_tier
training/     overhead, restart, soak, integrations, ab, incremental
paper/        fig8, fig11, fig12, goodput, tuner
modes/        gockpt, lazy, sharded, distributed, transparent, export
resilience/   remote, remote_clients, tiers, tiers_loss, tiers_plot, scale, preempt
gpu/          gpu, gpu_claims
============  =====================================================================

``python -m bench.X`` (the commands in the docs and in every result's ``command``) runs X from its
folder: the folders are on this package's search path, after bench/ itself, so ``bench.persist`` is
``bench/micro/persist.py`` (a module name is unique across the folders). In code, import a bench by
its folder (``bench.micro.persist``). ``python -m bench NAME`` is ``python -m bench.NAME``;
``python -m bench all`` runs the paper's evaluation (``__main__.py``). Results go to
``bench/results/<X>/latest.*`` (``harness.common.result_path``), scratch to ``bench/_scratch/``.

Contract: a bench module's roles go by one name each: ``run`` (measure; returns the result
document), ``targets`` (judge it against its targets), ``report`` (print it, write its
tables), ``plot`` (draw it), and ``main(argv)`` (the command line). A module defines the roles it
has, under these names and no others (tests/test_structure.py checks the names).
"""

from pathlib import Path as _Path

# `python -m bench.X` finds bench/<folder>/X.py (see above; tests/test_structure.py keeps the names unique).
RUNNABLE_FOLDERS = ("micro", "training", "paper", "modes", "resilience", "gpu")
__path__ += [str(_Path(__file__).parent / _g) for _g in RUNNABLE_FOLDERS]
