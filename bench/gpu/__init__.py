"""The benches that need one CUDA GPU (exit 2, nothing written, without one).

- ``gpu.py``: copy-engine and disk bandwidth, and the slowdown of training a GPT
  (``python -m bench.gpu``, through ``__main__.py``; ``make gpu-check`` runs it).
- ``gpu_train.py``: the GPT it trains and the systems in its loop; ``gpu_profile.py``: where a
  window's time goes (``--profile``); ``gpu_report.py``: the figures derived from its records,
  the targets, the table, CSV and chart.
- ``gpu_claims.py``: lazy restore onto the device, the CPU replay against a CUDA optimizer, the
  integrations' extra device memory (``python -m bench.gpu_claims``).

Invariants: every section, set-up and window is its own ``try`` (errors recorded, the rest runs);
``latest.json`` (``quick.json``) is rewritten after each phase.
"""
