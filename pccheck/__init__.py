"""pccheck: persistent, concurrent, crash-safe checkpoints for ML training.

    import pccheck
    ck = pccheck.Checkpointer(model, optimizer, path="ckpt")      # or a mapping name -> array
    ...
    r = pccheck.load_latest("ckpt", model=model, optimizer=optimizer)   # restored in place

``import pccheck`` never imports torch or cupy.
"""

from __future__ import annotations

import logging as _logging

from .errors import (ConfigError, CorruptCheckpointError, CriuError, DeviceIOError, NativeExtensionError,
                     NoCheckpointError, NoSpaceError, PathNotWritableError, PCCheckError, RemoteConfigError,
                     RemoteConflictError, RemoteError, ReplicationError, SnapshotError, StoppedError,
                     StorageError, StoreLockedError, UnsupportedDtypeError)
from .checkpointer import Checkpointer  # loads the native core: fails early, with build instructions
from .options import (DiskOptions, EngineOptions, GroupOptions, HistoryOptions, MemoryOptions, Options, RemoteOptions,
                      SnapshotOptions)
from .orchestrator.stats import CheckpointStats, StatsReport
from .persist.recovery import Restored
from .preemption import FlushResult, TierReach
from .lazy import LazyRestore
from .restore import load_latest
from .ops.hf_export import HfExport, export_hf
from .state.resumable_sampler import ResumableSampler
from .tuner.policy import FixedInterval, OnlineTuned
from .version import __version__

__all__ = [
    "Checkpointer", "Options", "EngineOptions", "SnapshotOptions", "GroupOptions", "DiskOptions",
    "MemoryOptions", "RemoteOptions", "HistoryOptions", "FixedInterval", "OnlineTuned",
    "CheckpointStats", "StatsReport", "FlushResult", "TierReach", "Restored", "LazyRestore", "load_latest",
    "export_hf", "HfExport", "ResumableSampler", "SnapshotError",
    "PCCheckError", "NativeExtensionError", "ConfigError", "UnsupportedDtypeError",
    "PathNotWritableError", "StoreLockedError", "NoCheckpointError", "CorruptCheckpointError",
    "StorageError", "NoSpaceError", "DeviceIOError", "CriuError", "RemoteError",
    "RemoteConfigError", "RemoteConflictError", "ReplicationError", "StoppedError", "__version__",
]

_logging.getLogger("pccheck").addHandler(_logging.NullHandler())
