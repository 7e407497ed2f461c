"""What the profilers measure and what they are asked to: plain data, no behaviour.

The result types of :mod:`pccheck.tuner.profile` (T_G, T_S, T_w and B samples, and the
:class:`Profile` that holds them all), the :class:`ProfileSpec` that says what to profile, and the
progress callback's type. :mod:`.profile` produces them and :mod:`.search` reads them; both import
them from here, so neither imports the other's module for its types. ``pccheck.tuner.profile``
re-exports every name, so ``from pccheck.tuner.profile import Profile`` keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CopySample",
    "StorageSample",
    "WriteTimeSample",
    "BlockedSample",
    "ProfileSpec",
    "Profile",
    "ProgressFn",
    "DEFAULT_THREADS",
    "DEFAULT_CHUNKS",
    "DEFAULT_N_CAP",
]

MiB = 1 << 20
DEFAULT_THREADS: tuple[int, ...] = (1, 2, 3, 4)
DEFAULT_CHUNKS: tuple[int, ...] = (16 * MiB, 64 * MiB, 256 * MiB)
DEFAULT_N_CAP = 4

# progress(label, done, total): called before each profiling step and once at the end.
ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class CopySample:
    """T_G: bytes per second copying the state into pre-touched (CPU) or pinned (GPU) chunks."""

    chunk_size: int
    bytes_per_s: float
    device: str
    seconds: float  # median time to copy the whole state


@dataclass(frozen=True)
class StorageSample:
    """T_S: bytes per second of one checkpoint through pccheck's writer (start to durable)."""

    writer_threads: int
    chunk_size: int
    bytes_per_s: float
    persist_s: float                  # median seconds per checkpoint
    samples: tuple[float, ...] = ()  # every timed persist_s
    mode: str = "?"                   # the write mode pccheck used: "odirect", "mmap" or "pmem"


@dataclass(frozen=True)
class WriteTimeSample:
    """T_w with N in flight, checkpoints issued every ``iter_time`` seconds (interval 1)."""

    n: int
    tw_s: float          # median seconds from the start of the copy to durable
    tw_max_s: float
    blocked_s: float     # median seconds training lost per checkpoint, permit wait excluded (the
                         # maybe_checkpoint call minus stall_s, plus the next update's extra time)
    stall_s: float       # median seconds waiting for one of the N permits
    checkpoints: int     # how many were measured (after the warm-up)
    period_s: float      # measured seconds between checkpoint starts

    @property
    def tw_per_n(self) -> float:
        """T_w / N in seconds: the quantity N* minimises (§3.4)."""
        return self.tw_s / self.n


@dataclass(frozen=True)
class BlockedSample:
    """B measured end to end: checkpoints spaced ``interval`` iterations apart (far enough that
    none waits for another), each cycle's time minus ``interval`` baseline iterations."""

    interval: int
    blocked_s: float             # median extra seconds per checkpoint cycle
    base_iter_s: float           # seconds per emulated iteration without checkpoints
    cycles: tuple[float, ...]    # every measured extra, seconds


@dataclass(frozen=True)
class ProfileSpec:
    """What to profile and under which constraints (bytes and seconds)."""

    path: Path                       # the store directory whose device is profiled
    state_bytes: int                 # m
    iter_time: float                 # t
    dram_budget: int                 # M, bytes of DRAM chunks
    storage_budget: int              # S, bytes of storage for the store
    threads: tuple[int, ...] = DEFAULT_THREADS
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    n_cap: int = DEFAULT_N_CAP
    device: str = "auto"
    use_torch: bool | None = None
    storage_repeats: int = 2
    exhaustive: bool = False         # every (threads, chunk) pair and every N, no early stop
    max_overhead: float = 1.03       # q, only for the early stop of the T_w sweep

    def n_max(self) -> int:
        """The largest N tried: ``min(S/m - 1, n_cap)`` (the store holds N+1 slots of m)."""
        return min(self.storage_budget // max(1, self.state_bytes) - 1, self.n_cap)


@dataclass(frozen=True)
class Profile:
    """Everything measured, and how long measuring took."""

    copy: tuple[CopySample, ...]
    storage: tuple[StorageSample, ...]
    write: tuple[WriteTimeSample, ...]
    state_bytes: int
    iter_time: float
    device: str
    soft_cow: bool
    storage_mode: str                # "odirect", "mmap" or "pmem", as pccheck opened the store
    seconds: float                   # wall time of the whole profile
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per phase
    update_s: float = 0.0            # one emulated update (a pass over the state), no checkpoint running
    blocked: BlockedSample | None = None  # B measured with spaced checkpoints (None: not measured)
