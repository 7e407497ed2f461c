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
# The spellings of pccheck 0.1.0 (``interval``, ``memory_interval``, ``remote_every``,
# ``keep_every``/``max_history`` counted in commits, ``remote_*``) are accepted as aliases: see
# LEGACY_KEYWORDS. Only the names whose meaning changed warn (DeprecationWarning).
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
    them as attributes (renames; the one whose meaning changed, ``remote_every``, warns)."""

    def wrap(cls: type) -> type:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kw: Any) -> None:
            valid = [f.name for f in fields(cls)]
            unknown = sorted(set(kw) - set(valid) - set(aliases))
            if unknown:
                raise ConfigError(f"unknown {cls.__name__} field(s) {', '.join(map(repr, unknown))}; valid: "
                                  f"{', '.join(valid)} (older spellings: {', '.join(aliases)})")
            for old, new in aliases.items():
                if old in kw:
                    if new in kw:
                        raise ConfigError(f"{cls.__name__}: {old!r} is the older spelling of {new!r}; give one")
                    _warn_if_changed(old, kw[old])
                    kw[new] = kw.pop(old)
            init(self, *args, **kw)

        cls.__init__ = __init__  # type: ignore[misc]
        cls.ALIASES = dict(aliases)  # type: ignore[attr-defined]
        for old, new in aliases.items():
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
    """

    every: int | str = 10
    keep_last: int | None = 0
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, str) and self.every != AUTO:
            raise ConfigError(f'disk.every must be an integer >= 1 or "auto", got {self.every!r}')
        if self.every != AUTO:
            check_int("disk.every", self.every, *TUNABLE_LIMITS["interval"])
        _check_keep("disk", self.keep_last, self.keep_every)

    @property
    def max_history(self) -> int | None:
        """pccheck 0.1.0's name, read: ``keep_last``."""
        return self.keep_last

    @property
    def keeps_copies(self) -> bool:
        """Whether any checkpoint is copied to ``path/history/``."""
        return self.keep_last != 0 or self.keep_every is not None


@_with_aliases({"memory_interval": "every", "memory_dir": "dir"})
@dataclass(frozen=True)
class MemoryOptions:
    """The memory tier (pccheck.tiers.memory): checkpoints into RAM (a tmpfs store that survives
    the process), replicated to other nodes.

    Attributes:
        every: checkpoint into RAM when ``step % every == 0`` (1: every iteration), from the same
            ``maybe_checkpoint`` call as the disk tier. None (default): no memory tier.
        keep_last: 0 only: RAM holds the tier's slots (the newest memory checkpoints), no copies
            beyond them; keep copies with ``DiskOptions(keep_last=...)``.
        keep_every: None only, for the same reason (``DiskOptions(keep_every=...)``).
        dir: the tier's directory (default ``/dev/shm/pccheck/<store>``).
        replicas: copies of each rank's memory checkpoint, its own included: m - 1 go to ranks on
            other nodes (Gemini's group placement; the node is ``PCCHECK_NODE``, else torchrun's
            ``GROUP_RANK``, else ``RANK // LOCAL_WORLD_SIZE``). Needs at least m nodes.
    """

    every: int | None = None
    keep_last: int | None = 0
    keep_every: int | None = None
    dir: Any = None
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.every is not None:
            check_int("memory.every", self.every, 1)
        _check_keep("memory", self.keep_last, self.keep_every)
        if self.keep_last != 0 or self.keep_every is not None:
            raise ConfigError("the memory tier keeps only its slots (the newest memory checkpoints): memory.keep_last "
                              "must be 0 and memory.keep_every None; keep copies on disk with "
                              "pccheck.DiskOptions(keep_last=..., keep_every=...)")
        check_int("replicas", self.replicas, 1)
        if self.replicas > 1 and self.every is None:
            raise ConfigError("replicas copies memory checkpoints: set memory.every too")


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
    """

    url: str | None = None
    every: int = 1
    keep_last: int | None = None
    keep_every: int | None = None
    part_size: int = 32 << 20
    concurrency: int = 4
    close_timeout: float | None = 600.0

    def __post_init__(self) -> None:
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


def _warn_if_changed(old: str, value: Any) -> None:
    """Warns where an older spelling now means something else (for this value). A value its
    field refuses is left to that field's ConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return
    if old == "remote_every" and value != 1:  # 1 selects every checkpoint in both meanings
        _deprecated(f"remote_every={value!r} counted durable checkpoints; the remote tier's `every` selects steps: "
                    f"a durable checkpoint is uploaded when step % {value!r} == 0. Spell it "
                    f"pccheck.RemoteOptions(url=..., every=...) (remote=pccheck.RemoteOptions(...))")
    elif old == "keep_every" and value not in (None, 1):  # 1: every commit in both meanings
        _deprecated(f"keep_every={value!r} counted commits; the disk tier's keep_every selects steps: a copy of "
                    f"every disk checkpoint with step % {value!r} == 0 is kept in history/, and keep_last never "
                    f"deletes it. Spell it disk=pccheck.DiskOptions(keep_every=...)")
    elif old == "max_history" and value is not None:
        _deprecated(f"max_history={value!r} capped the keep_every copies; it is now the disk tier's keep_last: a "
                    f"copy of each of the newest {value!r} disk checkpoints is kept in history/ (every one is "
                    f"copied), besides the keep_every copies, which it no longer deletes. Spell it "
                    f"disk=pccheck.DiskOptions(keep_last=...)")


def _history_fields(settings: dict[str, Any]) -> dict[str, Any]:
    """The DiskOptions fields for pccheck 0.1.0's ``keep_every``/``max_history`` (popped from
    ``settings``). ``keep_every=1`` with ``max_history=m`` (copy each commit, keep the newest m)
    is ``keep_last=m`` exactly, and silent; otherwise each name maps to its new field (and warns,
    see _warn_if_changed)."""
    out: dict[str, Any] = {}
    has_every, has_max = "keep_every" in settings, "max_history" in settings
    every, most = settings.pop("keep_every", None), settings.pop("max_history", None)
    if has_every and has_max and every == 1 and most is not None:
        return {"keep_last": most, "keep_every": None}
    if has_every:
        _warn_if_changed("keep_every", every)
        out["keep_every"] = every
    if has_max:
        _warn_if_changed("max_history", most)
        out["keep_last"] = 0 if most is None else most  # None: no cap on the keep_every copies
    return out


@dataclass(frozen=True)
class HistoryOptions:
    """pccheck 0.1.0's history group, kept so that ``Options(history=HistoryOptions(...))``
    still works: it becomes ``Options.disk`` (see :func:`_history_fields` for the mapping).
    New code: ``pccheck.DiskOptions(keep_last=..., keep_every=...)``."""

    keep_every: int | None = None
    max_history: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_every", "max_history"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)

    def disk_fields(self) -> dict[str, Any]:
        given = {k: getattr(self, k) for k in ("keep_every", "max_history") if getattr(self, k) is not None}
        return _history_fields(given)


# pccheck 0.1.0's flat Checkpointer keywords of the tiers: name -> (tier, field). All still
# accepted; keep_every, max_history and remote_every warn where their meaning changed.
LEGACY_KEYWORDS: dict[str, tuple[str, str]] = {
    "interval": ("disk", "every"), "keep_every": ("disk", "keep_every"), "max_history": ("disk", "keep_last"),
    "memory_interval": ("memory", "every"), "memory_dir": ("memory", "dir"), "replicas": ("memory", "replicas"),
    "remote_every": ("remote", "every"), "remote_keep_last": ("remote", "keep_last"),
    "remote_keep_every": ("remote", "keep_every"), "remote_part_size": ("remote", "part_size"),
    "remote_concurrency": ("remote", "concurrency"), "remote_close_timeout": ("remote", "close_timeout"),
}

_GROUPS: dict[str, type] = {"engine": EngineOptions, "snapshot": SnapshotOptions, "group": GroupOptions,
                            "disk": DiskOptions, "memory": MemoryOptions, "remote": RemoteOptions}
_FLAT_GROUPS = ("engine", "snapshot", "group")  # their fields are Checkpointer keywords of their own
TIERS = ("disk", "memory", "remote")


@dataclass(frozen=True, init=False)
class Options:
    """All of a Checkpointer's settings, in six groups: ``engine``, ``snapshot``, ``group``, and
    the tiers ``disk``, ``memory``, ``remote`` (see each group's attributes). ``history=`` (a
    :class:`HistoryOptions`, pccheck 0.1.0) is still accepted and becomes ``disk``'s copies."""

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
            object.__setattr__(self, "disk", replace(self.disk, **history.disk_fields()))

    @property
    def history(self) -> DiskOptions:
        """The older name of the disk tier's group (its ``keep_every``; ``max_history`` reads
        ``keep_last``)."""
        return self.disk

    @staticmethod
    def keyword_names() -> dict[str, str]:
        """Each Checkpointer keyword :meth:`updated` takes and the group it sets: the fields of
        engine, snapshot and group, the tiers (``disk``, ``memory``, ``remote``), and the older
        tier keywords (LEGACY_KEYWORDS)."""
        names = {f.name: group for group in _FLAT_GROUPS for f in fields(_GROUPS[group])}
        names.update({t: t for t in TIERS})
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
        if "keep_every" in settings or "max_history" in settings:
            changes["disk"] = _history_fields(settings)
        for name, value in settings.items():
            if name in LEGACY_KEYWORDS:
                tier, new = LEGACY_KEYWORDS[name]
                _warn_if_changed(name, value)
                changes.setdefault(tier, {})[new] = value
            else:
                changes.setdefault(where[name], {})[name] = value
        for g, kw in changes.items():
            try:
                groups[g] = replace(groups.get(g, getattr(self, g)), **kw)
            except ConfigError as exc:
                olds = [n for n in settings_given if n in LEGACY_KEYWORDS and LEGACY_KEYWORDS[n][0] == g]
                if not olds:
                    raise
                raise ConfigError(f"{exc} (given as {', '.join(olds)})") from None
        return replace(self, **groups)
