"""The profiling tuner of PCcheck §3.4: measure, then choose N, writer threads, chunk size, interval.

    pccheck-tune --path CKPT --size 1.3GiB --iter-time 0.12 --write-config   # the command (cli.py)
    Checkpointer(..., path=CKPT, interval="auto", max_concurrent="auto")     # reads the choice

Modules, one job each: :mod:`.model` (the formulas), :mod:`.profile` (the profilers),
:mod:`.search` (the choice), :mod:`.config` (``pccheck-tune.json`` and ``resolve_auto``),
:mod:`.online` (``interval="auto"`` during training), :mod:`.cli` (the command; imported only by it).
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import CONFIG_NAME, DEFAULT_Q, DEFAULTS, config_path, read_config, resolve_auto, write_config
from .online import IntervalChange, OnlineTuner

# The profilers and the search load only when used: the front-end imports tuner.config and
# tuner.online, and `import pccheck` must not pull in the profiler (PEP 562 lazy attributes).
_LAZY = {name: ".profile" for name in ("CopySample", "EmulatedState", "Profile", "ProfileSpec", "StorageSample",
                                      "WriteTimeSample", "copy_bandwidth", "run_profile", "storage_bandwidth",
                                      "write_time")}
_LAZY.update({name: ".search" for name in ("Choice", "Constraints", "choose")})

__all__ = [
    "CONFIG_NAME", "DEFAULT_Q", "DEFAULTS", "config_path", "read_config", "resolve_auto", "write_config",
    "OnlineTuner", "IntervalChange", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
