"""How the engine runs: :class:`EngineOptions`, validated once, here.

``pccheck-tune`` chooses three of its fields (``max_concurrent``, ``writer_threads``,
``chunk_size``) and stores them, under these names, in ``pccheck-tune.json``'s ``"chosen"``
object (tuner/config.py reads them back into this type). The value ``"auto"`` stands for that
stored choice until the front-end resolves it; the orchestrator only ever sees resolved options.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

import numpy as np

from ..errors import ConfigError
from ..persist.store import BLOCK, STORAGE_CHOICES

__all__ = ["AUTO", "EngineOptions", "TUNABLE_LIMITS", "check_int", "check_int_or_auto", "chunk_geometry"]

AUTO = "auto"
# The integers "auto" may stand for, with their ranges; the tuner's config obeys the same ones.
TUNABLE_LIMITS: dict[str, tuple[int, int | None]] = {
    "interval": (1, None), "max_concurrent": (1, 254), "writer_threads": (1, 256), "chunk_size": (4096, None)}
WHEN_BUSY = ("block", "skip")


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    """Raises ConfigError unless ``value`` is an integer (not a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")


def check_int_or_auto(name: str, value: Any) -> None:
    """The one check of a tunable value: ``"auto"`` or an integer within TUNABLE_LIMITS."""
    if isinstance(value, str):
        if value != AUTO:
            raise ConfigError(f'{name} must be an integer or "auto", got {value!r}')
        return
    check_int(name, value, *TUNABLE_LIMITS[name])


@dataclass(frozen=True)
class EngineOptions:
    """The checkpoint engine's settings.

    Attributes:
        max_concurrent: N, checkpoints in flight at once; the store holds N+1 slots. "auto": the
            tuned N, else 2.
        writer_threads: threads persisting chunks. "auto": the tuned p, else 2.
        chunk_size: bytes per DRAM chunk, the pipelining unit. "auto": the tuned b, else 64 MiB.
        dram_budget: bytes of DRAM chunks, allocated and touched once (None: 2x the state).
        storage: "auto" (PMEM if libpmem says the file is on PMEM, else "ssd"), "ssd" (O_DIRECT,
            or mmap+msync where O_DIRECT is unsupported), "odirect", "mmap" or "pmem".
        when_busy: when N are in flight: "block" (wait, recorded as stall) or "skip" (counted).
    """

    max_concurrent: int | str = AUTO
    writer_threads: int | str = AUTO
    chunk_size: int | str = AUTO
    dram_budget: int | None = None
    storage: str = "auto"
    when_busy: str = "block"

    TUNED = ("max_concurrent", "writer_threads", "chunk_size")  # what pccheck-tune chooses

    def __post_init__(self) -> None:
        for name in self.TUNED:
            check_int_or_auto(name, getattr(self, name))
        if self.dram_budget is not None:
            check_int("dram_budget", self.dram_budget, 4096)
        if self.storage not in STORAGE_CHOICES:
            raise ConfigError(f"storage must be one of {', '.join(STORAGE_CHOICES)}; got {self.storage!r}")
        if self.when_busy not in WHEN_BUSY:
            raise ConfigError(f"when_busy must be 'block' or 'skip', got {self.when_busy!r}")

    @property
    def resolved(self) -> bool:
        """Whether no field is "auto" any more."""
        return not any(getattr(self, name) == AUTO for name in self.TUNED)

    def with_values(self, values: Mapping[str, Any]) -> "EngineOptions":
        """A copy with the tuned fields found in ``values`` put in place of "auto" (the fields set
        explicitly stay as they are)."""
        return replace(self, **{k: values[k] for k in self.TUNED if getattr(self, k) == AUTO and k in values})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def chunk_geometry(state_bytes: int, chunk_size: int, dram_budget: int | None) -> tuple[int, int]:
    """(chunk bytes, chunk count) for the pool: ``dram_budget`` (default 2x the state) carved
    into chunks of at most ``chunk_size``, each a multiple of 4096."""
    if chunk_size < BLOCK:
        raise ConfigError(f"chunk_size must be at least {BLOCK} bytes, got {chunk_size}")
    state = max(BLOCK, (state_bytes + BLOCK - 1) // BLOCK * BLOCK)
    budget = 2 * state if dram_budget is None else int(dram_budget)
    if budget < BLOCK:
        raise ConfigError(f"dram_budget must be at least {BLOCK} bytes, got {budget}")
    chunk = min(chunk_size // BLOCK * BLOCK, state, budget // BLOCK * BLOCK)
    return chunk, max(1, budget // chunk)
