"""What a store directory holds, for operators: a listing, an fsck and checkpoint lookup.

Read-only. Everything is read with the recovery readers (:mod:`pccheck.persist.recovery`), so the
file is treated as untrusted input exactly as ``load_latest`` treats it (FORMAT.md §7). This module
returns plain frozen dataclasses; rendering them is the CLI's job (:mod:`pccheck.commands.cli`).

Slot statuses (:func:`survey`), from the meta records, without reading array data:

* ``latest``: the checkpoint recovery tries first in the newest generation that has one
  (CHECK_ADDR's slot when its meta record confirms it, else the newest meta record);
* ``committed``: another slot with a valid meta record: a complete older checkpoint (or, after a
  crash, a newer one whose commit word never reached the disk), loadable by step until reused;
* ``free``: an all-zero meta record over a slot that was written before: cleared for reuse;
* ``empty``: an all-zero meta record over a never-written slot;
* ``invalid``: the meta record fails validation (``problem`` says why).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError, PCCheckError
from ..persist.layout import Manifest
from ..persist.files import HISTORY_DIR, STORE_GLOB, default_path
from ..persist.recovery import (Restored, Scanned, StoreImage, candidate_order, confirmed_slot, first_valid,
                               load_slot, read_manifest, scan, slot_was_written)

__all__ = [
    "SlotInfo", "GenerationInfo", "SlotCheck", "VerifyReport", "Located",
    "survey", "verify", "locate", "load", "resolve_directory", "find_stores", "resolve_store",
]

T = TypeVar("T")


@dataclass(frozen=True)
class SlotInfo:
    """One slot as its meta record describes it."""

    slot: int
    status: str               # latest, committed, free, empty, invalid
    step: int | None
    counter: int | None
    data_bytes: int | None     # the array data region (FORMAT.md §3 data_len)
    manifest_bytes: int | None
    commit_unix_ns: int | None
    age_s: float | None        # seconds since the commit, by this machine's clock
    problem: str | None


@dataclass(frozen=True)
class GenerationInfo:
    """One store file: its header and slots, or why it cannot be read."""

    path: Path
    generation: int
    file_bytes: int
    num_slots: int | None
    slot_capacity: int | None
    created_unix_ns: int | None
    check_word: int | None
    slots: tuple[SlotInfo, ...]
    problem: str | None        # the header or file is unusable


@dataclass(frozen=True)
class SlotCheck:
    """The fsck verdict on one slot: ``ok``, ``bad`` (``problem`` says why) or ``empty``."""

    generation: int
    slot: int
    step: int | None
    counter: int | None
    verdict: str
    problem: str | None
    arrays: int | None         # arrays whose crc32c was checked


@dataclass(frozen=True)
class VerifyReport:
    """Every slot's verdict, the latest checkpoint's and the newest valid one.

    ``latest`` is what CHECK_ADDR names in the newest generation holding a checkpoint (or, with no
    word, its newest meta record); ``latest_problem`` is set when it does not verify.
    ``exit_code``: 0 the latest is valid; 1 it is not, but ``newest_valid`` is; 2 nothing is valid.
    """

    directory: Path
    checks: tuple[SlotCheck, ...]
    latest: SlotCheck | None
    latest_problem: str | None
    newest_valid: SlotCheck | None
    generation_problems: tuple[tuple[int, str], ...]

    @property
    def exit_code(self) -> int:
        if self.latest is not None and self.latest_problem is None:
            return 0
        return 1 if self.newest_valid is not None else 2


@dataclass(frozen=True)
class Located:
    """A checkpoint found by :func:`locate`: its store image, slot and validated manifest."""

    image: StoreImage
    slot: int
    manifest: Manifest

    @property
    def generation(self) -> int:
        return self.image.generation


def resolve_directory(path: str | os.PathLike[str] | None) -> Path:
    """The store directory (default ``$PCCHECK_DIR`` or ./checkpoints); NoCheckpointError if absent."""
    d = Path(path) if path is not None else default_path()
    if not d.is_dir():
        raise NoCheckpointError(f"no checkpoint directory at {d}: pass the path the Checkpointer wrote to "
                                "(or set PCCHECK_DIR)")
    return d


_STORE_DEPTH = 2  # how far below the given directory find_stores looks


def _has_store(directory: Path) -> bool:
    return any(directory.glob(STORE_GLOB))


def find_stores(path: str | os.PathLike[str] | None = None) -> list[Path]:
    """The store directories at or below ``path``: the directory itself if it holds a store, else the
    nearest ones below it, up to two levels down, sorted. The directory a user knows is found this
    way: a Lightning ``dirpath`` keeps its store in ``.pccheck/`` (``.pccheck-dcp/rank-r/`` for a
    model-parallel strategy), a distributed job one per ``rank-r/``. ``history/`` holds no store."""
    directory = resolve_directory(path)
    if _has_store(directory):
        return [directory]
    level = [directory]
    for _ in range(_STORE_DEPTH):
        found, below = [], []
        for d in level:
            for child in sorted(d.iterdir()):
                if child.is_dir() and not child.is_symlink() and child.name != HISTORY_DIR:
                    (found if _has_store(child) else below).append(child)
        if found:
            return found
        level = below
    return []


def resolve_store(path: str | os.PathLike[str] | None = None) -> Path:
    """The one store directory at or below ``path`` (:func:`find_stores`). NoCheckpointError if there
    is none; ConfigError naming them if there are several (a distributed job: pass one rank's)."""
    stores = find_stores(path)
    directory = resolve_directory(path)
    if not stores:
        raise NoCheckpointError(f"{directory} holds no pccheck store ({STORE_GLOB}), nor does any directory "
                                "below it; nothing to read")
    if len(stores) > 1:
        names = ", ".join(str(s) for s in stores[:8]) + (", ..." if len(stores) > 8 else "")
        raise ConfigError(f"{directory} holds {len(stores)} pccheck stores (a distributed run keeps one per "
                          f"rank): pass one of them: {names}")
    return stores[0]


def _generations(directory: Path) -> list[Scanned]:
    """Recovery's scan of a store directory (newest first)."""
    found = list(scan(directory))
    if not found:  # the store vanished since resolve_store found it
        raise NoCheckpointError(f"{directory} holds no pccheck store ({STORE_GLOB}); nothing to read")
    return found


def survey(path: str | os.PathLike[str] | None = None) -> list[GenerationInfo]:
    """Every generation (newest first) and slot of the store at or below ``path`` (:func:`resolve_store`),
    from headers and meta records."""
    directory = resolve_store(path)
    now = time.time_ns()
    out = []
    latest_marked = False
    for scanned in _generations(directory):
        gen, file, image = scanned.generation, scanned.path, scanned.image
        if image is None:
            out.append(GenerationInfo(file, gen, _size(file), None, None, None, None, (), scanned.problem))
            continue
        order = candidate_order(image)
        latest = order[0] if order and not latest_marked else None
        latest_marked = latest_marked or latest is not None
        slots = []
        with open(file, "rb", buffering=0) as f:
            for st in image.slots:
                m = st.meta
                if m is not None:
                    status = "latest" if st.slot == latest else "committed"
                    slots.append(SlotInfo(st.slot, status, m["step"], m["counter"], m["data_len"], m["manifest_len"],
                                          m["unix_ns"], max(0.0, (now - m["unix_ns"]) / 1e9), None))
                elif st.problem == "empty":
                    status = "free" if slot_was_written(image, st.slot, f.fileno()) else "empty"
                    slots.append(SlotInfo(st.slot, status, None, None, None, None, None, None, None))
                else:
                    slots.append(SlotInfo(st.slot, "invalid", None, None, None, None, None, None, st.problem))
        h = image.header
        out.append(GenerationInfo(file, gen, _size(file), h["num_slots"], h["slot_capacity"], h["created_unix_ns"],
                                  image.check_word, tuple(slots), None))
    return out


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except OSError:
        return 0


def verify(path: str | os.PathLike[str] | None = None) -> VerifyReport:
    """fsck of the store at or below ``path``: every slot of every generation (meta record, manifest,
    every array's crc32c)."""
    directory = resolve_store(path)
    checks: list[SlotCheck] = []
    gen_problems: list[tuple[int, str]] = []
    latest: SlotCheck | None = None
    latest_problem: str | None = None
    newest_valid: SlotCheck | None = None
    for scanned in _generations(directory):
        gen, file, image = scanned.generation, scanned.path, scanned.image
        if image is None:
            gen_problems.append((gen, scanned.problem))
            if latest is None and not checks:  # the newest generation is unreadable
                latest = SlotCheck(gen, -1, None, None, "bad", scanned.problem, None)
                latest_problem = f"generation {gen} ({file.name}) cannot be read: {scanned.problem}"
            continue
        by_slot: dict[int, SlotCheck] = {}
        with open(file, "rb", buffering=0) as f:
            for st in image.slots:
                if st.meta is None:
                    verdict, problem = ("empty", None) if st.problem == "empty" else ("bad", st.problem)
                    by_slot[st.slot] = SlotCheck(gen, st.slot, None, None, verdict, problem, None)
                    continue
                try:
                    r = load_slot(image, st.slot, fd=f.fileno())
                    by_slot[st.slot] = SlotCheck(gen, st.slot, r.step, r.counter, "ok", None, len(r.state))
                except CorruptCheckpointError as exc:
                    by_slot[st.slot] = SlotCheck(gen, st.slot, st.meta["step"], st.meta["counter"], "bad",
                                                 str(exc), None)
        checks.extend(by_slot[s] for s in sorted(by_slot))
        if latest is None:
            latest, latest_problem = _latest_of(image, by_slot)
        if newest_valid is None:  # the one recovery would load, by its own rule
            found = first_valid(image, lambda s: _ok(by_slot[s]))
            newest_valid = found[1] if found is not None else None
    if latest is not None and latest_problem is None:
        newest_valid = latest
    return VerifyReport(directory, tuple(checks), latest, latest_problem, newest_valid, tuple(gen_problems))


def _ok(check: SlotCheck) -> SlotCheck:
    if check.verdict != "ok":
        raise CorruptCheckpointError(check.problem or "invalid")
    return check


def _latest_of(image: StoreImage, by_slot: dict[int, SlotCheck]) -> tuple[SlotCheck | None, str | None]:
    """The latest checkpoint of one generation (what recovery tries first) and what is wrong with
    it; (None, None) if it has none."""
    slot, why = confirmed_slot(image)
    if why is not None:  # CHECK_ADDR names a slot its meta record does not confirm
        problem = "slot out of range" if image.word_slot >= len(image.slots) else "meta record does not match"
        return SlotCheck(image.generation, image.word_slot, None, image.word_counter, "bad", problem, None), why
    order = candidate_order(image)
    if slot is None and not order:
        return None, None  # never committed: look at the next older generation
    c = by_slot[order[0]]
    return c, (None if c.verdict == "ok" else c.problem)


def _search(path: str | os.PathLike[str] | None, step: int | None,
            attempt: Callable[[StoreImage, int, int], T]) -> T:
    """Recovery's order (generations newest first, CHECK_ADDR's slot, then newest counter),
    restricted to ``step`` if given: the first slot for which ``attempt(image, slot, fd)`` does not
    raise CorruptCheckpointError. Raises NoCheckpointError saying what exists."""
    directory = resolve_store(path)
    problems: list[str] = []
    steps: set[int] = set()
    for scanned in _generations(directory):
        image = scanned.image
        if image is None:
            problems.append(scanned.problem)
            continue
        with open(scanned.path, "rb", buffering=0) as f:
            for slot in candidate_order(image):
                meta = image.slots[slot].meta
                assert meta is not None  # candidate_order only yields slots with a meta record
                if step is not None and meta["step"] != step:
                    steps.add(meta["step"])
                    continue
                try:
                    return attempt(image, slot, f.fileno())
                except CorruptCheckpointError as exc:
                    problems.append(str(exc))
    what = "no valid checkpoint" if step is None else f"no valid checkpoint of step {step}"
    hint = f"; steps on disk: {', '.join(map(str, sorted(steps)))}" if steps else ""
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise NoCheckpointError(f"{directory}: {what}{hint}{detail}")


def locate(path: str | os.PathLike[str] | None = None, step: int | None = None, *, verify: bool = False) -> Located:
    """Finds the latest checkpoint, or the newest one of ``step``, whose manifest validates (with
    ``verify``, whose array checksums too), in the order recovery uses."""
    def attempt(image: StoreImage, slot: int, fd: int) -> Located:
        man = read_manifest(image, slot, fd)
        if verify:
            load_slot(image, slot, fd=fd)
        return Located(image, slot, man)

    return _search(path, step, attempt)


def load(path: str | os.PathLike[str] | None = None, step: int | None = None) -> Restored:
    """Loads the latest checkpoint, or the newest valid one of ``step``, fully validated (the arrays
    as stored; no PyTorch reassembly)."""
    return _search(path, step, lambda image, slot, fd: load_slot(image, slot, fd=fd))
