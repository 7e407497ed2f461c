"""Surviving a lost machine: the tiers beyond the local disk, measured here and planned at scale.

- ``scale.py``: goodput of a 16,384-GPU job under Llama 3's interruption rate, per tier set (a
  model; its inputs, each with its source, are ``bench/results/scale-inputs.json``).

Invariants: the model is a pure function of its inputs file; ``--refresh`` takes the measured
efficiencies only from result files of this repository, named in the inputs.
"""
