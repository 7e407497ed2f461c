"""``pccheck.Options``: every setting of a Checkpointer, grouped, frozen and validated once.

    opts = pccheck.Options(engine=pccheck.EngineOptions(max_concurrent=2, writer_threads=4),
                           disk=pccheck.DiskOptions(every=10, keep_every=1000))
    ck = pccheck.Checkpointer(model, optimizer, "ckpt", options=opts)
    ck = pccheck.Checkpointer(model, optimizer, "ckpt", max_concurrent=2,
                              disk=pccheck.DiskOptions(every=10, keep_every=1000))  # the same

Six groups: ``engine``, ``snapshot`` and ``group`` (how checkpoints are taken), and one per
storage tier, ``disk``, ``memory`` and ``remote``, whose options objects share the fields
``every``, ``keep_last`` and ``keep_every`` with one meaning (see the tier classes). Each field of
``engine``, ``snapshot`` and ``group`` may also be given to ``Checkpointer`` as a keyword of its
own name, and each tier as ``disk=``/``memory=``/``remote=`` (``remote="s3://..."``: the URL
alone); :meth:`Options.updated` puts them in place, and an unknown name raises ConfigError listing
the valid ones. The tier keywords of pccheck 0.1.0 (``interval=``, ``memory_interval=``,
``remote_every=``, ...) still work: LEGACY_KEYWORDS. ``EngineOptions`` is the type whose tuned
fields ``pccheck-tune.json`` stores (orchestrator/options.py).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable

from .errors import ConfigError
from .orchestrator.copy_engine import CopyEngine
from .orchestrator.incremental import refuse_incremental
from .orchestrator.options import AUTO, TUNABLE_LIMITS, EngineOptions, check_int

__all__ = ["Options", "EngineOptions", "SnapshotOptions", "GroupOptions", "DiskOptions", "MemoryOptions",
           "RemoteOptions", "HistoryOptions", "LEGACY_KEYWORDS"]


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


# ---------------------------------------------------------------------------------------------
# The three storage tiers: one options object each, with the same three fields meaning the same
# thing in every tier (docs/api.md, "Tiers"):
#
#   every       the tier takes (disk, memory) or uploads (remote) the checkpoint of every step
#               with ``step % every == 0``
#   keep_last   besides what the tier needs to work (its slots; the remote tier's newest step),
#               it keeps its newest k checkpoints (None: all of them)
#   keep_every  it also keeps every checkpoint whose ``step % k == 0``, whatever keep_last says
#
# The spellings of pccheck 0.1.0 (``interval``, ``memory_interval``, ``remote_*``, ...) are
# accepted and keep their 0.1.0 behaviour exactly: see LEGACY_KEYWORDS. Most are renames of a
# tier field. Three counted where the tier fields select steps: ``keep_every=k`` (every k-th
# commit copied to history/), ``max_history=m`` (the newest m of those copies kept) and
# ``remote_every=k`` (every k-th durable checkpoint uploaded). Where one of them is exactly a
# tier field (``keep_every=1``, ``max_history`` with it, ``remote_every=1``) it becomes that
# field, silently; otherwise the tier runs in a legacy mode that counts as 0.1.0 did
# (DiskOptions.legacy_history, RemoteOptions.legacy_every) and a DeprecationWarning names the
# per-tier spelling. No step-based translation is exact: 0.1.0 counted explicit ``checkpoint()``
# calls, a checkpoint at step 0 and the commits after a resume, and ``interval="auto"`` moves.
# ---------------------------------------------------------------------------------------------

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _deprecated(message: str) -> None:
    """A DeprecationWarning pointing at the caller's line outside pccheck."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def _check_keep(tier: str, keep_last: Any, keep_every: Any) -> None:
    if keep_last is not None:
        check_int(f"{tier}.keep_last", keep_last, 0)
    if keep_every is not None:
        check_int(f"{tier}.keep_every", keep_every, 1)


def _with_aliases(aliases: dict[str, str]) -> Callable[[type], type]:
    """Lets a tier's options class take its 0.1.0 field names as constructor keywords and read
    them as attributes (renames; ``remote_every`` keeps its 0.1.0 meaning through
    :func:`_remote_every_fields`)."""

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            names = [f.name for f in fields(cls)]
            valid = [n for n in names if not n.startswith("legacy_")]  # the legacy_ ones are set by aliases
            unknown = sorted(set(kw) - set(names) - set(aliases))
            if unknown:
                raise ConfigError(f"unknown {cls.__name__} field(s) {', '.join(map(repr, unknown))}; valid: "
                                  f"{', '.join(valid)} (older spellings: {', '.join(aliases)})")
            for old, new in aliases.items():
                if old in kw:
                    if new in kw:
                        raise ConfigError(f"{cls.__name__}: {old!r} is the older spelling of {new!r}; give one")
                    if old == "remote_every":
                        kw.update(_remote_every_fields(kw.pop(old)))
                    else:
                        kw[new] = kw.pop(old)
            init(self, *args, **kw)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.ALIASES = dict(aliases)  # type: ignore[attr-defined]
        for old, new in aliases.items():
            if old not in cls.__dict__:  # a class may read an older name itself (remote_every)
                setattr(cls, old, property(lambda self, _n=new: getattr(self, _n), doc=f"The older name of ``{new}``."))
        return cls

    return wrap


@_with_aliases({"interval": "every"})
@dataclass(frozen=True)
class DiskOptions:
    """The disk tier: the store's N+1 slots under ``path``, and the copies kept beside them in
    ``path/history/`` (safetensors + a JSON sidecar per step; pccheck.ops.history).

    Attributes:
        every: ``maybe_checkpoint(step)`` checkpoints when ``step % every == 0`` (default 10).
            "auto": start from the interval in ``PATH/pccheck-tune.json`` (``pccheck-tune
            --write-config``; 10 without one) and adapt it online (pccheck.tuner.policy.OnlineTuned;
            in a torch.distributed group the tuned interval is used as is).
        keep_last: besides the slots, keep copies of the newest k disk checkpoints in
            ``path/history/`` (every checkpoint is copied, in the background, and the older
            copies deleted). 0 (default): no such copies; None: keep a copy of every one.
        keep_every: also keep a copy of every disk checkpoint whose ``step % k == 0`` (never
            deleted by keep_last). None (default): none.
        incremental: write only the arrays whose bytes differ from the newest committed
            checkpoint's, reference the rest (docs/guide/incremental.md; FORMAT.md §14), and
            upload only those (FORMAT.md §12.8). None (default): on for host (CPU) state taken
            whole at each checkpoint, off where unsupported yet (device state or copy engine,
            spread steps) or for arrays too small for 4 KiB cells (tiers/stack.py). True: on,
            else ConfigError. False: every checkpoint writes every array. Also a Checkpointer
            keyword of its own (``incremental=...``).

    ``keep_last`` != 0 copies every disk checkpoint into ``history/``: a second full write of the
    state per checkpoint (in the background, from the committed slot), of which only the newest
    k stay. ``keep_every`` alone copies only the selected steps.

    ``legacy_history`` is not set by hand: it holds pccheck 0.1.0's ``keep_every``/``max_history``
    (a :class:`HistoryOptions`, counted in commits) where they have no exact per-tier spelling,
    and the tier then copies as 0.1.0 did (see HistoryOptions); keep_last and keep_every are
    then 0 and None.
    """

    every: int | str = 10
    keep_last: int | None = 0
    keep_every: int | None = None
    legacy_history: HistoryOptions | None = None
    incremental: bool | None = None

    def __post_init__(self) -> None:
        _check_bool("disk.incremental", self.incremental, optional=True)
        if isinstance(self.every, str) and self.every != AUTO:
            raise ConfigError(f'disk.every must be an integer >= 1 or "auto", got {self.every!r}')
        if self.every != AUTO:
            check_int("disk.every", self.every, *TUNABLE_LIMITS["interval"])
        _check_keep("disk", self.keep_last, self.keep_every)
        if self.legacy_history is not None:
            if not isinstance(self.legacy_history, HistoryOptions):
                raise ConfigError(f"disk.legacy_history must be a HistoryOptions, got {self.legacy_history!r}")
            if self.keep_last != 0 or self.keep_every is not None:
                raise ConfigError(_MIXED_HISTORY)

    @property
    def keeps_copies(self) -> bool:
        """Whether any checkpoint is copied to ``path/history/``."""
        if self.legacy_history is not None:
            return self.legacy_history.keep_every is not None
        return self.keep_last != 0 or self.keep_every is not None

    def history_view(self) -> HistoryOptions | None:
        """The copies as pccheck 0.1.0's HistoryOptions (keep_every, max_history counted in
        commits), where that spelling says exactly the same; None where it cannot (copies
        selected by step: ``keep_every`` set)."""
        if self.legacy_history is not None:
            return self.legacy_history
        if self.keep_every is not None:
            return None
        if self.keep_last == 0:
            return HistoryOptions()
        return HistoryOptions(keep_every=1, max_history=self.keep_last)  # each commit copied, newest m kept


_MIXED_HISTORY = ("pccheck 0.1.0's keep_every/max_history (counted in commits) and the disk tier's keep_last/"
                  "keep_every (steps) cannot be combined; give one: disk=pccheck.DiskOptions(keep_last=..., "
                  "keep_every=...)")


@_with_aliases({"memory_interval": "every", "memory_dir": "dir"})
@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier (pccheck.tiers.memory): checkpoints into RAM (a tmpfs store that survives
    the process), replicated to other nodes.

    Attributes:
        every: checkpoint into RAM when ``step % every == 0`` (1: every iteration), from the same
            ``maybe_checkpoint`` call as the disk tier. None (default): no memory tier.
        keep_last: committed memory checkpoints kept beyond the tier's slots, as
            ``DiskOptions.keep_last`` counts copies beyond the disk's: 0 (default) or 1. 0 holds
            the newest memory checkpoint and the one in flight (with ``replicas=2``: 4x the state
            in RAM per rank, own and replicas); 1 holds one older memory checkpoint too, in the own
            store and per replica source (6x at ``replicas=2``), so a node loss whose newest
            replica is damaged restores the older one instead of falling back to the next tier.
            More copies go on disk: ``DiskOptions(keep_last=...)``.
        keep_every: None only: RAM holds no selected steps (``DiskOptions(keep_every=...)``).
        dir: the tier's directory (default ``/dev/shm/pccheck/<store>``).
        replicas: copies of each rank's memory checkpoint, its own included: m - 1 go to ranks on
            other nodes (Gemini's group placement; the node is ``PCCHECK_NODE``, else torchrun's
            ``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``). Needs at least m nodes.
        incremental: copy into a slot, and send to a replica, only the arrays it lacks (host state;
            docs/guide/incremental.md). True/False: this tier alone; None (default): as an explicit
            ``incremental=``, else full (on a RAM slot a fingerprint costs what the copy it saves).
    """

    every: int | None = None
    keep_last: int | None = 0
    keep_every: int | None = None
    dir: Any = None
    replicas: int = 1
    incremental: bool | None = None

    def __post_init__(self) -> None:
        if self.every is not None:
            check_int("memory.every", self.every, 1)
        _check_keep("memory", self.keep_last, self.keep_every)
        if self.keep_last is None or self.keep_last > 1:
            raise ConfigError(f"memory.keep_last={self.keep_last}: the memory tier keeps at most one older checkpoint "
                              "(keep_last=1: one more slot of the state in RAM per store, own and per replica source); "
                              "keep more copies on disk with pccheck.DiskOptions(keep_last=...)")
        if self.keep_every is not None:
            raise ConfigError("the memory tier keeps no selected steps in RAM: memory.keep_every must be None; keep "
                              "them on disk with pccheck.DiskOptions(keep_every=...)")
        check_int("replicas", self.replicas, 1)
        if self.replicas > 1 and self.every is None:
            raise ConfigError("replicas copies memory checkpoints: set memory.every too")
        _check_bool("memory.incremental", self.incremental, optional=True)


@_with_aliases({"remote": "url", "remote_part_size": "part_size", "remote_concurrency": "concurrency",
                "remote_close_timeout": "close_timeout", "remote_keep_last": "keep_last",
                "remote_keep_every": "keep_every", "remote_every": "every"})
@dataclass(frozen=True)
class RemoteOptions:
    """The remote tier (pccheck.tiers.remote): durable disk checkpoints uploaded to object
    storage in the background, committed there crash-safely (docs/FORMAT.md §12).

    Attributes:
        url: ``"s3://bucket/prefix"``, or None (default: no remote tier). Endpoint, region and
            credentials come from the standard AWS variables and files (``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE``).
            The store is probed when the Checkpointer is built: wrong credentials, a missing bucket
            or a store without conditional writes raise RemoteConfigError then.
        every: upload the disk checkpoint of every step with ``step % every == 0`` once it is
            durable (default 1: each one). One upload runs at a time; a newer selected checkpoint
            supersedes one still queued, so under load some selected steps are passed over.
        keep_last: keep the newest k remotely committed steps of the prefix, delete older ones
            after each remote commit (default None: keep all). Never the newest.
        keep_every: also keep every remote step whose ``step % k == 0``.
        part_size: bytes per multipart part (>= 8 MiB, a multiple of 4096; default 32 MiB,
            chosen by bench/resilience/remote_clients.py). Memory: (concurrency + 1) parts.
        concurrency: parts in flight at once (default 4).
        close_timeout: seconds ``close()`` waits for the newest checkpoint to be committed
            remotely (default 600; None: no limit).

    ``legacy_every`` is not set by hand: it holds pccheck 0.1.0's ``remote_every=k`` (k > 1),
    under which every k-th durable checkpoint is uploaded, counted as they commit (each rank's
    local commits; in a group, the globally committed steps), as 0.1.0 did; ``every`` is then 1.
    """

    url: str | None = None
    every: int = 1
    keep_last: int | None = None
    keep_every: int | None = None
    part_size: int = 32 << 20
    concurrency: int = 4
    close_timeout: float | None = 600.0
    legacy_every: int | None = None

    @property
    def remote_every(self) -> int:
        """Read as pccheck 0.1.0 named it: k of "every k-th durable checkpoint" when given that
        way (``legacy_every``), else ``every`` (the same thing at 1; at > 1 ``every`` selects
        steps, which 0.1.0 could not say)."""
        return self.legacy_every if self.legacy_every is not None else self.every

    def __post_init__(self) -> None:
        if self.legacy_every is not None:
            check_int("remote_every", self.legacy_every, 1)
            if self.legacy_every == 1:  # every durable checkpoint: the same as every=1
                object.__setattr__(self, "legacy_every", None)
            elif self.every != 1:
                raise ConfigError("remote_every (pccheck 0.1.0: every k-th durable checkpoint) and remote.every "
                                  "(steps) cannot be combined; give one")
        if self.url is not None:
            if not isinstance(self.url, str) or not self.url.startswith("s3://"):
                raise ConfigError(f'remote.url must be an "s3://bucket/prefix" URL or None, got {self.url!r}')
        check_int("remote.every", self.every, 1)
        _check_keep("remote", self.keep_last, self.keep_every)
        check_int("remote.part_size", self.part_size, 8 << 20)
        if self.part_size % 4096:
            raise ConfigError(f"remote.part_size must be a multiple of 4096, got {self.part_size}")
        check_int("remote.concurrency", self.concurrency, 1, 64)
        t = self.close_timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise ConfigError(f"remote.close_timeout must be a number of seconds >= 0 or None, got {t!r}")


def _remote_every_fields(value: Any) -> dict[str, Any]:
    """The RemoteOptions fields for pccheck 0.1.0's ``remote_every=k``: every k-th durable
    checkpoint, counted as they commit. k = 1 is ``every=1`` exactly (silent); k > 1 counts as
    0.1.0 did (``legacy_every``) and warns with the per-tier spelling, which selects steps."""
    check_int("remote_every", value, 1)
    if value == 1:
        return {"every": 1, "legacy_every": None}
    _deprecated(f"remote_every={value!r} keeps its pccheck 0.1.0 meaning (one durable checkpoint in {value} is "
                f"uploaded, counted as they commit); the per-tier spelling selects steps instead: "
                f"remote=pccheck.RemoteOptions(url=..., every=N) uploads the durable checkpoints whose step % N == 0")
    return {"every": 1, "legacy_every": value}


def _disk_history_fields(disk: DiskOptions, given: dict[str, Any]) -> dict[str, Any]:
    """The DiskOptions fields for pccheck 0.1.0's ``keep_every``/``max_history`` (``given``, over
    what ``disk`` already says in that spelling). ``keep_every=1`` (each commit copied) with
    ``max_history=m`` (the newest m copies kept; None: all) is ``keep_last=m`` exactly, and
    silent; nothing at all is no copies. Otherwise the tier keeps 0.1.0's commit counting
    (``legacy_history``) and a DeprecationWarning names the per-tier spelling."""
    view = disk.history_view()
    if view is None:
        raise ConfigError(_MIXED_HISTORY)
    merged = replace(view, **given)
    if merged.keep_every == 1:
        return {"keep_last": merged.max_history, "keep_every": None, "legacy_history": None}
    if merged == HistoryOptions():
        return {"keep_last": 0, "keep_every": None, "legacy_history": None}
    if merged.keep_every is None:  # max_history alone: 0.1.0 copied nothing
        _deprecated(f"max_history={merged.max_history!r} without keep_every keeps no copies (as in pccheck 0.1.0); "
                    f"to keep the newest m disk checkpoints spell it disk=pccheck.DiskOptions(keep_last=m)")
    else:
        _deprecated(f"keep_every={merged.keep_every!r}, max_history={merged.max_history!r} keep their pccheck 0.1.0 "
                    f"meaning (one commit in {merged.keep_every} copied to history/, "
                    f"{'all copies' if merged.max_history is None else f'the newest {merged.max_history} copies'} "
                    f"kept); the per-tier spelling selects steps instead: "
                    f"disk=pccheck.DiskOptions(keep_every=N) keeps the copies of the steps divisible by N, "
                    f"keep_last=m the newest m checkpoints")
    return {"keep_last": 0, "keep_every": None, "legacy_history": merged}


@dataclass(frozen=True)
class HistoryOptions:
    """pccheck 0.1.0's history group, kept so that ``Options(history=HistoryOptions(...))``
    still works, with its 0.1.0 behaviour: it becomes ``Options.disk`` (see
    :func:`_disk_history_fields`). New code: ``pccheck.DiskOptions(keep_last=..., keep_every=...)``.

    Attributes:
        keep_every: every k-th committed checkpoint (counted by the keeper, whatever its step) is
            also copied, in the background, to ``PATH/history/step-XXXXXX.safetensors``.
        max_history: keep at most this many of those copies (the oldest deleted first); None:
            all. Without keep_every nothing is copied.
    """

    keep_every: int | None = None
    max_history: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_every", "max_history"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)



# pccheck 0.1.0's flat Checkpointer keywords of the tiers: name -> (tier, field). All still
# accepted with their 0.1.0 behaviour. keep_every, max_history and remote_every counted commits:
# they become the tier field where that is exact, else a legacy mode of the tier, with a
# DeprecationWarning (_disk_history_fields, _remote_every_fields).
LEGACY_KEYWORDS: dict[str, tuple[str, str]] = {
    "interval": ("disk", "every"), "keep_every": ("disk", "legacy_history"),
    "max_history": ("disk", "legacy_history"),
    "memory_interval": ("memory", "every"), "memory_dir": ("memory", "dir"), "replicas": ("memory", "replicas"),
    "remote_every": ("remote", "legacy_every"), "remote_keep_last": ("remote", "keep_last"),
    "remote_keep_every": ("remote", "keep_every"), "remote_part_size": ("remote", "part_size"),
    "remote_concurrency": ("remote", "concurrency"), "remote_close_timeout": ("remote", "close_timeout"),
}

_GROUPS: dict[str, type] = {"engine": EngineOptions, "snapshot": SnapshotOptions, "group": GroupOptions,
                            "disk": DiskOptions, "memory": MemoryOptions, "remote": RemoteOptions}
_FLAT_GROUPS = ("engine", "snapshot", "group")  # their fields are Checkpointer keywords of their own
TIERS = ("disk", "memory", "remote")
TIER_KEYWORDS = {"incremental": "disk"}  # tier fields that are Checkpointer keywords of their own


@dataclass(frozen=True, init=False)
class Options:
    """All of a Checkpointer's settings, in six groups: ``engine``, ``snapshot``, ``group``, and
    the tiers ``disk``, ``memory``, ``remote`` (see each group's attributes). ``history=`` (a
    :class:`HistoryOptions`, pccheck 0.1.0) is still accepted, with its 0.1.0 behaviour, and
    becomes ``disk``'s copies."""

    engine: EngineOptions
    snapshot: SnapshotOptions
    group: GroupOptions
    disk: DiskOptions
    memory: MemoryOptions
    remote: RemoteOptions

    def __init__(self, engine: EngineOptions | None = None, snapshot: SnapshotOptions | None = None,
                 group: GroupOptions | None = None, disk: DiskOptions | None = None,
                 memory: MemoryOptions | None = None, remote: RemoteOptions | str | None = None, *,
                 history: HistoryOptions | None = None) -> None:
        given = dict(engine=engine, snapshot=snapshot, group=group, disk=disk, memory=memory,
                     remote=RemoteOptions(url=remote) if isinstance(remote, str) else remote)
        for name, cls in _GROUPS.items():
            value = cls() if given[name] is None else given[name]
            if not isinstance(value, cls):
                raise ConfigError(f"Options.{name} must be a {cls.__name__}, got {type(value).__name__}")
            object.__setattr__(self, name, value)
        if history is not None:
            if not isinstance(history, HistoryOptions):
                raise ConfigError(f"Options.history must be a HistoryOptions, got {type(history).__name__}")
            if history != HistoryOptions() and self.disk.history_view() != HistoryOptions():
                raise ConfigError(_MIXED_HISTORY)
            given = {"keep_every": history.keep_every, "max_history": history.max_history}
            object.__setattr__(self, "disk", replace(self.disk, **_disk_history_fields(self.disk, given)))
        if self.disk.incremental:
            if self.snapshot.spread_steps != 1:
                raise refuse_incremental("spread_steps != 1")

    @property
    def history(self) -> HistoryOptions | None:
        """The disk tier's copies in pccheck 0.1.0's spelling (``keep_every``, ``max_history``,
        counted in commits): what was given that way, or its exact equivalent; None where the
        copies are selected by step (``DiskOptions(keep_every=...)``), which 0.1.0 could not say."""
        return self.disk.history_view()

    @staticmethod
    def keyword_names() -> dict[str, str]:
        """Each Checkpointer keyword :meth:`updated` takes and the group it sets: the fields of
        engine, snapshot and group, the tiers (``disk``, ``memory``, ``remote``), and the older
        tier keywords (LEGACY_KEYWORDS)."""
        names = {f.name: group for group in _FLAT_GROUPS for f in fields(_GROUPS[group])}
        names.update({t: t for t in TIERS})
        names.update(TIER_KEYWORDS)
        names.update({old: tier for old, (tier, _) in LEGACY_KEYWORDS.items()})
        return names

    def updated(self, **settings: Any) -> "Options":
        """A copy with the given settings in place, validated: fields of engine, snapshot and
        group by their own names, a whole tier as ``disk=``, ``memory=``, ``remote=`` (or
        ``remote="s3://..."``), then the older tier keywords (LEGACY_KEYWORDS) over them.
        Raises ConfigError for a name that is none of these, listing the valid ones."""
        where = self.keyword_names()
        unknown = sorted(set(settings) - set(where))
        if unknown:
            current = sorted(n for n in where if n not in LEGACY_KEYWORDS)
            raise ConfigError(f"unknown Checkpointer setting(s) {', '.join(map(repr, unknown))}; valid: "
                              f"{', '.join(current)} (older spellings: {', '.join(sorted(LEGACY_KEYWORDS))}; "
                              f"or options=pccheck.Options(...))")
        if not settings:
            return self
        settings_given, settings = list(settings), dict(settings)
        groups: dict[str, Any] = {}
        for tier in TIERS:
            if tier in settings:
                value = settings.pop(tier)
                if tier == "remote" and (value is None or isinstance(value, str)):
                    value = replace(self.remote, url=value)  # remote="s3://...": the URL alone
                elif not isinstance(value, _GROUPS[tier]):
                    raise ConfigError(f"{tier}= must be a pccheck.{_GROUPS[tier].__name__}"
                                      f"{' or an s3:// URL' if tier == 'remote' else ''}, got {type(value).__name__}")
                groups[tier] = value
        changes: dict[str, dict[str, Any]] = {}
        history = {k: settings.pop(k) for k in ("keep_every", "max_history") if k in settings}
        for name, value in settings.items():
            if name == "remote_every":
                changes.setdefault("remote", {}).update(_remote_every_fields(value))
            elif name in LEGACY_KEYWORDS:
                tier, new = LEGACY_KEYWORDS[name]
                changes.setdefault(tier, {})[new] = value
            else:
                changes.setdefault(where[name], {})[name] = value
        if history:  # over the disk tier as given (a disk= object, then interval=)
            disk = groups.get("disk", self.disk)
            if "disk" in changes:
                disk = replace(disk, **changes.pop("disk"))
            try:
                groups["disk"] = replace(disk, **_disk_history_fields(disk, history))
            except ConfigError as exc:
                raise ConfigError(f"{exc} (given as {', '.join(history)})") from None
        for g, kw in changes.items():
            try:
                groups[g] = replace(groups.get(g, getattr(self, g)), **kw)
            except ConfigError as exc:
                olds = [n for n in settings_given if n in LEGACY_KEYWORDS and LEGACY_KEYWORDS[n][0] == g]
                if not olds:
                    raise
                raise ConfigError(f"{exc} (given as {', '.join(olds)})") from None
        return replace(self, **groups)


def checkpointer_arguments(optimizer: Any, path: Any, options: Any,
                           settings: dict[str, Any]) -> tuple[Any, Any, Options]:
    """The Checkpointer's optimizer, path and resolved options from its arguments: a path given
    as the second positional argument (``Checkpointer(arrays, "ckpt")``), and ``options``
    updated by the keyword ``settings``. ConfigError for a path given twice or a wrong ``options``."""
    if isinstance(optimizer, (str, os.PathLike)):  # Checkpointer(arrays, "ckpt")
        if path is not None:
            raise ConfigError("path given twice (positionally and as path=)")
        optimizer, path = None, optimizer
    if options is not None and not isinstance(options, Options):
        raise ConfigError(f"options must be a pccheck.Options, got {type(options).__name__}")
    return optimizer, path, (options or Options()).updated(**settings)
