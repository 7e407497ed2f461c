"""Benchmarks and figure reproductions for pccheck; run them on purpose, e.g. ``python -m bench.persist``."""
