"""``pccheck-tune.json``: what the tuner measured and chose, stored in the checkpoint directory.

``pccheck-tune --write-config`` writes it; ``Checkpointer(..., interval="auto", ...)`` reads it
through :func:`resolve_auto`. The file is small JSON, written atomically (temporary file, fsync,
rename, fsync of the directory), so a crash leaves either the old file or the new one.

Document (version 1)::

    {"format": "pccheck-tune", "version": 1,
     "created": "2026-11-22T10:00:00+00:00", "host": "hostname", "pccheck": "0.1.0",
     "inputs":   {"state_bytes": ..., "iter_time_s": ..., "max_overhead": q, ...},
     "measured": {"copy": [...], "storage": [...], "write": [...], ...},
     "chosen":   {"interval": f, "max_concurrent": N, "writer_threads": p, "chunk_size": b,
                  "max_overhead": q, ...}}

Only ``chosen`` is read back; it MUST hold the four parameters as positive integers
(``chunk_size`` a multiple of 4096) and MAY hold ``max_overhead`` (a number >= 1).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, PathNotWritableError
from ..orchestrator.options import AUTO, TUNABLE_LIMITS, EngineOptions, check_int, check_int_or_auto
from ..persist.files import TUNE_CONFIG, default_path, write_durably
from ..spread.plan import MAX_STEPS
from ..version import __version__

if TYPE_CHECKING:
    from .samples import Profile
    from .search import Choice, Constraints

__all__ = ["CONFIG_NAME", "FORMAT", "VERSION", "DEFAULTS", "DEFAULT_Q", "AUTO", "config_path", "make_config",
           "write_config", "read_config", "resolve_auto"]

log = logging.getLogger("pccheck")

CONFIG_NAME = TUNE_CONFIG
FORMAT = "pccheck-tune"
VERSION = 1
# pccheck's defaults, used for "auto" when no config exists.
DEFAULTS: dict[str, int] = {"interval": 10, "max_concurrent": 2, "writer_threads": 2, "chunk_size": 64 << 20}
DEFAULT_Q = 1.03
# "chosen" holds the interval and the tuned fields of EngineOptions, under their names.
_PARAMS = ("interval",) + EngineOptions.TUNED


def config_path(path: str | os.PathLike[str] | None) -> Path:
    """``PATH/pccheck-tune.json``; ``path`` None means ``$PCCHECK_DIR`` or ``./checkpoints``."""

    return (Path(path) if path is not None else default_path()) / CONFIG_NAME


def make_config(constraints: Constraints, profile: Profile, choice: Choice, *,
                path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The JSON document for a tuning run: inputs, measurements and the choice."""
    c = constraints
    return {
        "format": FORMAT,
        "version": VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "pccheck": __version__,
        "inputs": {
            "path": str(path) if path is not None else None,
            "state_bytes": c.state_bytes,
            "iter_time_s": c.iter_time,
            "max_overhead": c.max_overhead,
            "dram_budget": c.dram_budget,
            "storage_budget": c.storage_budget,
            "failure_rate_per_hour": c.failure_rate,
            "load_s": c.load_s,
        },
        "measured": {
            "device": profile.device,
            "soft_cow": profile.soft_cow,
            "storage_mode": profile.storage_mode,
            "state_bytes": profile.state_bytes,
            "iter_time_s": profile.iter_time,
            "profile_s": profile.seconds,
            "update_s": profile.update_s,
            "phases_s": dict(profile.phases),
            "copy": [asdict(s) for s in profile.copy],
            "storage": [{**asdict(s), "samples": list(s.samples)} for s in profile.storage],
            "write": [{**asdict(w), "tw_per_n": w.tw_per_n} for w in profile.write],
            "blocked": ({**asdict(profile.blocked), "cycles": list(profile.blocked.cycles)}
                        if profile.blocked is not None else None),
        },
        "chosen": choice.as_dict(),
    }


def write_config(path: str | os.PathLike[str] | None, doc: Mapping[str, Any]) -> Path:
    """Writes ``doc`` to ``PATH/pccheck-tune.json`` atomically and durably; returns the file."""
    target = config_path(path)
    _validate(dict(doc), target)  # never write what resolve_auto would refuse
    data = (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_durably(target, lambda f: f.write(data))
    except OSError as exc:
        raise PathNotWritableError(f"cannot write {target} ({exc.strerror or exc}); "
                                   "pass a writable --path") from None
    return target


def read_config(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The stored document, validated; None when there is none. Raises ConfigError when the
    file exists but is malformed (the message says how to fix it)."""
    target = config_path(path)
    try:
        raw = target.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {target} ({exc.strerror or exc}); fix its permissions or delete it") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{target} is not valid JSON ({exc}); delete it or rerun "
                          "`pccheck-tune --write-config`") from None
    _validate(doc, target)
    return doc


def _validate(doc: Any, where: Path) -> None:
    fix = "delete it or rerun `pccheck-tune --write-config`"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ConfigError(f"{where} is not a pccheck-tune config (no \"format\": \"{FORMAT}\"); {fix}")
    if doc.get("version") != VERSION:
        raise ConfigError(f"{where} has version {doc.get('version')!r}; this pccheck reads version {VERSION}: {fix}")
    chosen = doc.get("chosen")
    if not isinstance(chosen, dict):
        raise ConfigError(f"{where} has no \"chosen\" object; {fix}")
    for key in _PARAMS:
        try:  # the limits EngineOptions obeys; "auto" is for callers, never stored
            check_int(f"{where}: chosen.{key}", chosen.get(key), *TUNABLE_LIMITS[key])
        except ConfigError as exc:
            raise ConfigError(f"{exc}; {fix}") from None
    if chosen["chunk_size"] % 4096:
        raise ConfigError(f"{where}: chosen.chunk_size must be a multiple of 4096, got {chosen['chunk_size']}; {fix}")
    k = chosen.get("spread_steps")
    if k is not None:
        try:
            check_int(f"{where}: chosen.spread_steps", k, 1, MAX_STEPS)
        except ConfigError as exc:
            raise ConfigError(f"{exc}; {fix}") from None
    q = chosen.get("max_overhead")
    if q is not None and (isinstance(q, bool) or not isinstance(q, (int, float)) or not math.isfinite(q) or q < 1):
        raise ConfigError(f"{where}: chosen.max_overhead must be a number >= 1, got {q!r}; {fix}")


def resolve_auto(path: str | os.PathLike[str] | None, interval: int | str = AUTO, max_concurrent: int | str = AUTO,
                 writer_threads: int | str = AUTO, chunk_size: int | str = AUTO, *,
                 state_bytes: int | None = None, spread_steps: int | str = 1) -> dict[str, Any]:
    """Replaces every argument equal to ``"auto"`` by the choice stored in ``PATH/pccheck-tune.json``,
    or by pccheck's defaults (interval 10, max_concurrent 2, writer_threads 2, chunk_size 64 MiB)
    when there is no config (logged). Other values pass through unchanged.

    Returns ``{"interval", "max_concurrent", "writer_threads", "chunk_size"}`` (ints) plus
    ``"max_overhead"`` (q for :class:`~pccheck.tuner.online.OnlineTuner`: the stored one, else
    1.03), ``"iter_time_s"`` and ``"tw_s"`` (what the choice was derived from, or None) and
    ``"source"`` (the config file, or "defaults", or "explicit" when nothing was "auto"), and
    ``"spread_steps"``: with ``spread_steps="auto"``, the stored k (None if the config holds none,
    or there is no config: the Checkpointer then learns k as it trains); else the value given.
    ``state_bytes``, when given, is compared with the size the config was tuned for (a warning
    when they differ by more than 2x). Raises ConfigError for a malformed config, or for a string
    other than "auto".
    """
    given = {"interval": interval, "max_concurrent": max_concurrent, "writer_threads": writer_threads,
             "chunk_size": chunk_size}
    for key, v in given.items():
        check_int_or_auto(key, v)
    out: dict[str, Any] = {"max_overhead": DEFAULT_Q, "iter_time_s": None, "tw_s": None,
                           "spread_steps": None if spread_steps == AUTO else spread_steps}
    auto = [k for k, v in given.items() if v == AUTO]
    if not auto and spread_steps != AUTO:
        return {**given, **out, "source": "explicit"}
    doc = read_config(path)
    target = config_path(path)
    if doc is None:
        out.update({k: (DEFAULTS[k] if v == AUTO else v) for k, v in given.items()})
        if auto:
            log.info("pccheck: no %s; \"auto\" uses pccheck's defaults for %s (%s). Run `pccheck-tune --path %s "
                     "--write-config` to tune them", target, ", ".join(auto),
                     ", ".join(f"{k}={DEFAULTS[k]}" for k in auto), target.parent)
        return {**out, "source": "defaults"}
    chosen = doc["chosen"]
    out.update({k: (chosen[k] if v == AUTO else v) for k, v in given.items()})
    if spread_steps == AUTO and chosen.get("spread_steps") is not None:
        out["spread_steps"] = chosen["spread_steps"]
        auto.append("spread_steps")
    if chosen.get("max_overhead") is not None:
        out["max_overhead"] = float(chosen["max_overhead"])
    for key, src in (("iter_time_s", "iter_time"), ("tw_s", "tw_s")):
        v = chosen.get(src)
        out[key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 else None
    log.info("pccheck: %s from %s (tuned %s on %s): %s", ", ".join(auto), target, doc.get("created", "?"),
             doc.get("host", "?"), ", ".join(f"{k}={out[k]}" for k in auto))
    host = doc.get("host")
    if host and host != platform.node():
        log.warning("pccheck: %s was tuned on host %r, this is %r; rerun pccheck-tune here", target, host,
                    platform.node())
    tuned = (doc.get("inputs") or {}).get("state_bytes")
    if state_bytes and isinstance(tuned, int) and tuned > 0 and not 0.5 <= state_bytes / tuned <= 2.0:
        log.warning("pccheck: %s was tuned for a %d-byte state, this one has %d bytes; rerun pccheck-tune",
                    target, tuned, state_bytes)
    return {**out, "source": str(target)}
