"""The profiling tuner of PCcheck §3.4: measure, then choose N, writer threads, chunk size, interval.

    pccheck-tune --path CKPT --size 1.3GiB --iter-time 0.12 --write-config   # commands/tune_cli.py
    Checkpointer(..., path=CKPT, interval="auto", max_concurrent="auto")     # reads the choice

Modules, one job each: :mod:`.model` (the formulas), :mod:`.workload` (the emulated state the
profilers checkpoint), :mod:`.samples` (what the profilers measure: plain data), :mod:`.profile`
(the profilers), :mod:`.search` (the choice), :mod:`.config` (``pccheck-tune.json`` and
``resolve_auto``), :mod:`.online` (what runs during training: iteration reports, whose public face
is :mod:`pccheck.tune`, and ``interval="auto"``), :mod:`.policy` (when ``maybe_checkpoint`` takes a
checkpoint: a fixed interval or the online tuner's). The command is :mod:`pccheck.commands.tune_cli`.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import CONFIG_NAME, DEFAULT_Q, DEFAULTS, config_path, read_config, resolve_auto, write_config
from .online import IntervalChange, OnlineTuner

# The profilers and the search load only when used: the front-end imports tuner.config and
# tuner.online, and `import pccheck` must not pull in the profiler (PEP 562 lazy attributes).
_LAZY = {name: ".samples" for name in ("BlockedSample", "CopySample", "Profile", "ProfileSpec", "StorageSample",
                                      "WriteTimeSample")}
_LAZY.update({"EmulatedState": ".workload"})
_LAZY.update({name: ".profile" for name in ("copy_bandwidth", "run_profile", "storage_bandwidth", "write_time",
                                           "blocked_time")})
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
