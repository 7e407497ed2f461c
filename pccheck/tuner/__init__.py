"""The profiling tuner of PCcheck §3.4: measure, then choose N, writer threads, chunk size, interval.

    pccheck-tune --path CKPT --size 1.3GiB --iter-time 0.12 --write-config   # the command (cli.py)
    Checkpointer(..., path=CKPT, interval="auto", max_concurrent="auto")     # reads the choice

Modules, one job each: :mod:`.model` (the formulas), :mod:`.profile` (the profilers),
:mod:`.search` (the choice), :mod:`.config` (``pccheck-tune.json`` and ``resolve_auto``),
:mod:`.online` (``interval="auto"`` during training), :mod:`.cli` (the command; imported only by it).
"""

from __future__ import annotations

from .config import CONFIG_NAME, DEFAULT_Q, DEFAULTS, config_path, read_config, resolve_auto, write_config
from .online import IntervalChange, OnlineTuner
from .profile import (
                      CopySample,
                      EmulatedState,
                      Profile,
                      ProfileSpec,
                      StorageSample,
                      WriteTimeSample,
                      copy_bandwidth,
                      run_profile,
                      storage_bandwidth,
                      write_time,
)
from .search import Choice, Constraints, choose

__all__ = [
    "CONFIG_NAME", "DEFAULT_Q", "DEFAULTS", "config_path", "read_config", "resolve_auto", "write_config",
    "OnlineTuner", "IntervalChange",
    "CopySample", "EmulatedState", "Profile", "ProfileSpec", "StorageSample", "WriteTimeSample",
    "copy_bandwidth", "run_profile", "storage_bandwidth", "write_time",
    "Choice", "Constraints", "choose",
]
