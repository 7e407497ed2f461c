"""``pccheck.Options``: every setting of a Checkpointer, grouped, frozen and validated once.

    opts = pccheck.Options(engine=pccheck.EngineOptions(max_concurrent=2, writer_threads=4),
                           history=pccheck.HistoryOptions(keep_every=100))
    ck = pccheck.Checkpointer(model, optimizer, "ckpt", options=opts)
    ck = pccheck.Checkpointer(model, optimizer, "ckpt", max_concurrent=2, keep_every=100)  # the same

Each field may also be given to ``Checkpointer`` as a keyword of its own name (the spellings of
pccheck 0.1.0); :meth:`Options.updated` puts them into their group, and an unknown name raises
ConfigError listing the valid ones. ``EngineOptions`` is the type whose tuned fields
``pccheck-tune.json`` stores (orchestrator/options.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable

from .errors import ConfigError
from .orchestrator.copy_engine import CopyEngine
from .orchestrator.options import AUTO, EngineOptions, check_int

__all__ = ["Options", "EngineOptions", "SnapshotOptions", "HistoryOptions", "GroupOptions", "RemoteOptions",
           "MemoryOptions"]


def _check_bool(name: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ConfigError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")


@dataclass(frozen=True)
class SnapshotOptions:
    """How the state is captured (PyTorch).

    Attributes:
        soft_cow: copy the tensors in the background while the next forward/backward runs; an
            optimizer step pre-hook finishes the copy before the update mutates them. None
            (default): on when an optimizer is given. Off: copy before maybe_checkpoint returns.
            Anything that mutates parameters outside ``optimizer.step()`` must call
            ``Checkpointer.wait_copied`` first.
        capture_rng: save and restore the Python, numpy, torch and CUDA RNG states.
        eager: state_dict names to copy before maybe_checkpoint returns, besides the module
            buffers (which forward itself changes, e.g. BatchNorm running stats).
        device_reserve: (soft copy-on-write) bytes of spare device memory, allocated once, into
            which the optimizer step pre-hook clones the parts of an in-flight snapshot not yet
            copied to the host, so the step waits only for what does not fit. "auto": up to the
            state size, within a quarter of the free device memory and an eighth of the card
            (none on the CPU). None (default): no reserve.
        copy_engine: the engine that copies the state into DRAM chunks (default: chosen by where
            the tensors live: CUDA, cupy or the CPU).
        spread_steps: GoCkpt mode (pccheck.spread): spread each snapshot over this many optimizer
            steps, one part of the parameters and their optimizer state copied per step, and
            replay the later steps' captured gradients on the CPU so the checkpoint is the exact
            state of the step that finishes it. 1 (default): the whole snapshot at once. "auto":
            the first checkpoint is taken with 1; from its measured copy bandwidth, the iteration
            time and the state and gradient sizes the stall model picks k for the rest. Needs an
            optimizer pccheck can replay exactly (SGD, Adam, AdamW) and ``maybe_checkpoint`` called
            every iteration (the call after k steps finishes the checkpoint).
    """

    soft_cow: bool | None = None
    capture_rng: bool = True
    eager: tuple[str, ...] = ()
    device_reserve: int | str | None = None
    copy_engine: CopyEngine | None = field(default=None, compare=False)
    spread_steps: int | str = 1

    def __post_init__(self) -> None:
        _check_bool("soft_cow", self.soft_cow, optional=True)
        if isinstance(self.spread_steps, str) and self.spread_steps != AUTO:
            raise ConfigError(f'spread_steps must be an integer in [1, {MAX_SPREAD}] or "auto", got {self.spread_steps!r}')
        if self.spread_steps != AUTO:
            check_int("spread_steps", self.spread_steps, 1, MAX_SPREAD)
        _check_bool("capture_rng", self.capture_rng)
        if isinstance(self.eager, str) or not isinstance(self.eager, Iterable):
            raise ConfigError(f"eager must be a list of state_dict names, got {self.eager!r}")
        object.__setattr__(self, "eager", tuple(self.eager))
        if not all(isinstance(n, str) for n in self.eager):
            raise ConfigError(f"eager must be a list of state_dict names (str), got {self.eager!r}")
        if isinstance(self.device_reserve, str):
            if self.device_reserve != AUTO:
                raise ConfigError(f'device_reserve must be a number of bytes, "auto" or None, got {self.device_reserve!r}')
        elif self.device_reserve is not None:
            check_int("device_reserve", self.device_reserve, 0)
        if self.copy_engine is not None and not isinstance(self.copy_engine, CopyEngine):
            raise ConfigError(f"copy_engine must be a pccheck CopyEngine, got {type(self.copy_engine).__name__}")


MAX_SPREAD = 64  # spread_steps: "auto" picks at most 8 (pccheck.spread.plan.MAX_STEPS)


@dataclass(frozen=True)
class HistoryOptions:
    """Debugging history beside the slots.

    Attributes:
        keep_every: if set, every k-th committed checkpoint is also copied, in the background, to
            ``PATH/history/step-XXXXXX.safetensors`` (+ a JSON sidecar).
        max_history: keep at most this many history files (oldest deleted first; never a slot).
    """

    keep_every: int | None = None
    max_history: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_every", "max_history"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)


@dataclass(frozen=True)
class GroupOptions:
    """Running in a torch.distributed group.

    Attributes:
        distributed: in an initialised torch.distributed group of > 1 ranks (detected), each rank
            writes ``path/rank-<r>/`` and the ranks agree on globally committed steps
            (pccheck.group.distributed). Every rank must construct its Checkpointer at the same point.
        replicated: "rank0" for data-parallel replicas: only rank 0 writes (to ``path``).
    """

    distributed: bool = True
    replicated: str | None = None

    def __post_init__(self) -> None:
        _check_bool("distributed", self.distributed)
        if self.replicated not in (None, "rank0"):
            raise ConfigError(f"replicated must be None or 'rank0', got {self.replicated!r}")


@dataclass(frozen=True)
class RemoteOptions:
    """The remote tier (pccheck.tiers.remote): committed checkpoints uploaded to object storage in
    the background, committed there crash-safely (docs/FORMAT.md §12).

    Attributes:
        remote: ``"s3://bucket/prefix"``, or None (default: no remote tier). Endpoint, region and
            credentials come from the standard AWS variables and files (``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE``).
            The store is probed when the Checkpointer is built: wrong credentials, a missing bucket
            or a store without conditional writes raise RemoteConfigError then.
        remote_every: upload every k-th durable checkpoint (default 1). A newer one supersedes an
            upload still queued.
        remote_part_size: bytes per multipart part (>= 8 MiB, a multiple of 4096; default 32 MiB,
            chosen by bench/resilience/remote_clients.py). Memory: (remote_concurrency + 1) parts.
        remote_concurrency: parts in flight at once (default 4).
        remote_close_timeout: seconds ``close()`` waits for the newest checkpoint to be committed
            remotely (default 600; None: no limit).
        remote_keep_last: keep the newest k remotely committed steps of the prefix, delete older
            ones after each remote commit (default None: keep all). Never the newest.
        remote_keep_every: also keep every step divisible by this (like ``keep_every``).
    """

    remote: str | None = None
    remote_every: int = 1
    remote_part_size: int = 32 << 20
    remote_concurrency: int = 4
    remote_close_timeout: float | None = 600.0
    remote_keep_last: int | None = None
    remote_keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.remote is not None:
            if not isinstance(self.remote, str) or not self.remote.startswith("s3://"):
                raise ConfigError(f'remote must be an "s3://bucket/prefix" URL or None, got {self.remote!r}')
        check_int("remote_every", self.remote_every, 1)
        check_int("remote_part_size", self.remote_part_size, 8 << 20)
        if self.remote_part_size % 4096:
            raise ConfigError(f"remote_part_size must be a multiple of 4096, got {self.remote_part_size}")
        check_int("remote_concurrency", self.remote_concurrency, 1, 64)
        for name in ("remote_keep_last", "remote_keep_every"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        t = self.remote_close_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ConfigError(f"remote_close_timeout must be a number of seconds >= 0 or None, got {t!r}")


@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier (pccheck.tiers.memory).

    Attributes:
        memory_interval: also checkpoint into RAM (a tmpfs store that survives the process) every
            k steps (1: every iteration), beside the disk tier's ``interval``. None: off.
        memory_dir: the memory tier's directory (default ``/dev/shm/pccheck/<store>``).
        replicas: copies of each rank's memory checkpoint, its own included: m - 1 go to ranks on
            other nodes (Gemini's group placement; the node is ``PCCHECK_NODE``, else torchrun's
            ``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``). Needs at least m nodes.
    """

    memory_interval: int | None = None
    memory_dir: Any = None
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.memory_interval is not None:
            check_int("memory_interval", self.memory_interval, 1)
        check_int("replicas", self.replicas, 1)
        if self.replicas > 1 and self.memory_interval is None:
            raise ConfigError("replicas copies memory checkpoints: set memory_interval too")


_GROUPS: dict[str, type] = {"engine": EngineOptions, "snapshot": SnapshotOptions, "history": HistoryOptions,
                            "group": GroupOptions, "remote": RemoteOptions, "memory": MemoryOptions}


@dataclass(frozen=True)
class Options:
    """All of a Checkpointer's settings, in six groups (see each group's attributes)."""

    engine: EngineOptions = field(default_factory=EngineOptions)
    snapshot: SnapshotOptions = field(default_factory=SnapshotOptions)
    history: HistoryOptions = field(default_factory=HistoryOptions)
    group: GroupOptions = field(default_factory=GroupOptions)
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)

    def __post_init__(self) -> None:
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Options.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")

    @staticmethod
    def keyword_names() -> dict[str, str]:
        """Each field's name, as a Checkpointer keyword, and the group it belongs to."""
        return {f.name: group for group, cls in _GROUPS.items() for f in fields(cls)}

    def updated(self, **settings: Any) -> "Options":
        """A copy with the given fields (by their own names) replaced in their groups; validated.
        Raises ConfigError for a name that is no field, listing the valid ones."""
        where = self.keyword_names()
        unknown = sorted(set(settings) - set(where))
        if unknown:
            raise ConfigError(f"unknown Checkpointer setting(s) {', '.join(map(repr, unknown))}; valid: "
                              f"{', '.join(sorted(where))} (or options=pccheck.Options(...))")
        if not settings:
            return self
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            changes.setdefault(where[name], {})[name] = value
        return replace(self, **{g: replace(getattr(self, g), **kw) for g, kw in changes.items()})
