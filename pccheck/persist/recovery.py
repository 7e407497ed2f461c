"""Recovery: find the newest checkpoint that validates, and load it (FORMAT.md §7).

The store file is untrusted input. Every offset and size read from it is checked against the
geometry, and the geometry against the file's real size, before anything is read or allocated.
Picking a slot is a pure function (:func:`candidate_order`); validating one is another
(:func:`load_slot`); :func:`first_valid` combines them into the one rule every reader uses
("the latest valid slot": ``load_latest``, the store's reopen, inventory and fsck), and
:func:`scan` walks a directory's generations newest first. Nothing here unpickles anything.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import numpy as np

from ..errors import CorruptCheckpointError, NoCheckpointError, PCCheckError
from ..native import _native
from .files import STORE_GLOB, default_path, store_generation
from .layout import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .reader import read_region

__all__ = [
    "Restored", "SlotState", "StoreImage", "Scanned", "read_store", "scan", "confirmed_slot", "candidate_order",
    "first_valid", "read_manifest", "load_slot", "load_newest", "store_files", "slot_was_written",
    "was_validated", "mark_validated", "parse_header_block", "image_from", "manifest_region", "manifest_from", "slot_base",
    "slot_manifests", "array_bases", "region_extents",
]

log = logging.getLogger("pccheck")

BLOCK: int = _native.BLOCK
T = TypeVar("T")

# Slots this process has fully validated (every array's crc32c), so that reopening the store
# right after load_latest does not read them again. Keyed by what names their bytes: the file,
# its creation time (a store deleted and made again under the same name is another file), the
# generation, the slot and the counter. Invariant: a slot is never rewritten under the same
# counter (counters only grow within a store file), so a key stays true while the file exists.
_validated: set[tuple[str, int, int, int, int]] = set()
_validated_lock = threading.Lock()


def _validation_key(image: "StoreImage", slot: int, counter: int) -> tuple[str, int, int, int, int]:
    return (os.path.realpath(image.path), int(image.header["created_unix_ns"]), image.generation, slot, counter)


def mark_validated(image: "StoreImage", slot: int, counter: int) -> None:
    """Records that every array of ``slot`` (holding ``counter``) checked out, e.g. after a lazy
    restore read them all (load_slot records its own)."""
    with _validated_lock:
        _validated.add(_validation_key(image, slot, counter))


def was_validated(image: "StoreImage", slot: int) -> bool:
    """Whether this process already validated every byte of ``slot`` as its meta record
    describes it now (:func:`load_slot` with ``verify``)."""
    meta = image.slots[slot].meta if slot < len(image.slots) else None
    if meta is None:
        return False
    with _validated_lock:
        return _validation_key(image, slot, meta["counter"]) in _validated


def store_files(directory: Path) -> list[tuple[int, Path]]:
    """The store generations in a directory, newest first, as (generation, path)."""
    out = []
    for p in directory.glob(STORE_GLOB):
        gen = store_generation(p.name)
        if gen is not None:
            out.append((gen, p))
    return sorted(out, reverse=True)


@dataclass(frozen=True)
class Restored:
    """A loaded checkpoint: ``state`` maps names to arrays with the saved dtype, shape and bytes."""

    step: int
    state: dict[str, np.ndarray]
    metadata: dict[str, Any]
    counter: int
    generation: int
    slot: int
    path: Path = field(repr=False)
    # Arrays whose torch dtype numpy lacks (bfloat16, ...): their arrays hold the raw bits.
    torch_dtypes: dict[str, str] = field(default_factory=dict, repr=False)
    tree: Any = field(default=None, repr=False)  # a PyTorch checkpoint's state tree (manifest "tree")
    epoch: int | None = None  # the job incarnation that wrote it (distributed runs)
    bytes_read: int | None = None  # a resharded load: array bytes this rank read (pccheck.sharded)
    tier: str = "disk"  # where this rank's state came from: "memory", "peer", "disk" or "remote" (pccheck.tiers)


@dataclass(frozen=True)
class SlotState:
    """What a slot's meta record says (``meta``), or why it cannot be used (``problem``)."""

    slot: int
    meta: dict[str, Any] | None
    problem: str | None


@dataclass(frozen=True)
class StoreImage:
    """The header and meta records of one store file."""

    path: Path
    header: dict[str, Any]
    check_word: int
    slots: tuple[SlotState, ...]

    @property
    def generation(self) -> int:
        return int(self.header["generation"])

    @property
    def word_slot(self) -> int:
        """The slot CHECK_ADDR names (meaningful when ``check_word`` is not 0)."""
        return _native.word_slot(self.check_word)

    @property
    def word_counter(self) -> int:
        """The counter CHECK_ADDR names (meaningful when ``check_word`` is not 0)."""
        return _native.word_counter(self.check_word)


@dataclass(frozen=True)
class Scanned:
    """One generation of a directory: its image, or why it cannot be read (``problem``)."""

    generation: int
    path: Path
    image: StoreImage | None
    problem: str | None


def scan(directory: Path) -> Iterator[Scanned]:
    """The store generations of ``directory``, newest first, each read with :func:`read_store`
    (a file that cannot be read is yielded with its problem, not raised)."""
    for gen, file in store_files(directory):
        try:
            yield Scanned(gen, file, read_store(file), None)
        except (CorruptCheckpointError, OSError) as exc:
            why = str(exc) if isinstance(exc, PCCheckError) else f"{file}: {type(exc).__name__}: {exc}"
            yield Scanned(gen, file, None, why)


def _pread_exact(fd: int, n: int, off: int) -> bytes:
    data = os.pread(fd, n, off)
    if len(data) != n:
        raise CorruptCheckpointError(f"short read at offset {off}: the file is truncated")
    return data


def read_store(path: Path) -> StoreImage:
    """Reads and checks the header and every meta record. Raises CorruptCheckpointError."""
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size
        header = parse_header_block(path, size, _pread_exact(fd, BLOCK, 0) if size >= BLOCK else b"")
        metas = _pread_exact(fd, header["num_slots"] * BLOCK, BLOCK)
    return image_from(path, header, metas)


# The parsing steps of read_store and read_manifest, without I/O: pccheck.aio reads the same
# bytes with aiofiles and passes them here.

def parse_header_block(path: Path, size: int, block0: bytes) -> dict[str, Any]:
    """The header of a store file of ``size`` bytes from its first block, checked against the
    file's real size. Raises CorruptCheckpointError."""
    if size < BLOCK or len(block0) < BLOCK:
        raise CorruptCheckpointError(f"{path}: too short to be a pccheck store")
    try:
        header = _native.parse_header(block0[:BLOCK])
    except ValueError as exc:
        raise CorruptCheckpointError(f"{path}: {exc}") from None
    if header["file_size"] > size:
        raise CorruptCheckpointError(
            f"{path}: header geometry needs {header['file_size']} bytes but the file has {size}")
    return header


def image_from(path: Path, header: dict[str, Any], metas: bytes) -> StoreImage:
    """The StoreImage from a parsed header and the ``num_slots`` meta blocks that follow it."""
    slots = []
    for s in range(header["num_slots"]):
        try:
            meta = _native.parse_meta(metas[s * BLOCK:(s + 1) * BLOCK], s, header["slot_capacity"])
            slots.append(SlotState(s, meta, None if meta else "empty"))
        except ValueError as exc:
            slots.append(SlotState(s, None, str(exc)))
    header = dict(header)
    return StoreImage(path, header, header.pop("check_word"), tuple(slots))


def manifest_region(image: StoreImage, slot: int) -> tuple[int, int]:
    """(file offset, length) of a slot's manifest, as its meta record gives them (bounded)."""
    meta = image.slots[slot].meta
    if meta is None:
        raise CorruptCheckpointError(f"slot {slot}: {image.slots[slot].problem}")
    if meta["manifest_len"] > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"slot {slot}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    return slot_base(image, slot) + meta["manifest_offset"], meta["manifest_len"]


def manifest_from(image: StoreImage, slot: int, raw: bytes) -> Manifest:
    """Validates a slot's manifest bytes against its meta record and parses them."""
    meta = image.slots[slot].meta
    assert meta is not None  # manifest_region checked it
    if len(raw) != meta["manifest_len"]:
        raise CorruptCheckpointError(f"slot {slot}: short read of the manifest: the file is truncated")
    if _native.crc32c(raw) != meta["manifest_crc"]:
        raise CorruptCheckpointError(f"slot {slot}: manifest checksum mismatch")
    man = parse_manifest(raw, step=meta["step"], counter=meta["counter"],
                         data_len_limit=meta["manifest_offset"])
    if man.cells is not None:
        # FORMAT.md §14: a cell names a slot of this store; its bytes sit at the array's offset
        # there, inside [0, data_len), which the slot's capacity bounds (data_len <= manifest_offset).
        bad = [c for c in man.cells.cells if c >= len(image.slots)]
        if bad:
            raise CorruptCheckpointError(f"slot {slot}: an array's cell {bad[0]} is beyond the "
                                         f"{len(image.slots)} slots of generation {image.generation}")
    return man


def confirmed_slot(image: StoreImage) -> tuple[int | None, str | None]:
    """The slot CHECK_ADDR names, if its meta record confirms it (carries the counter the word
    says), else None and why not; (None, None) when the word is 0 (nothing committed, or a
    generation whose word was never set)."""
    if not image.check_word:
        return None, None
    s, c = image.word_slot, image.word_counter
    if s >= len(image.slots):
        return None, (f"CHECK_ADDR names slot {s}, beyond the {len(image.slots)} slots of generation "
                      f"{image.generation}")
    st = image.slots[s]
    if st.meta is None or st.meta["counter"] != c:
        held = st.problem if st.meta is None else f"it holds counter {st.meta['counter']}"
        return None, (f"CHECK_ADDR names slot {s} with counter {c}, which its meta record does not confirm "
                      f"({held})")
    return s, None


def candidate_order(image: StoreImage) -> list[int]:
    """Slots to try, best first: the one CHECK_ADDR names, then the rest newest first.

    CHECK_ADDR's slot counts only if its meta record confirms it (:func:`confirmed_slot`); a word
    whose slot is out of range or disagrees is ignored (the fallback scan still runs).
    """
    first, _ = confirmed_slot(image)
    rest = sorted((st for st in image.slots if st.meta and st.slot != first),
                  key=lambda st: st.meta["counter"], reverse=True)
    return ([first] if first is not None else []) + [st.slot for st in rest]


def read_manifest(image: StoreImage, slot: int, fd: int) -> Manifest:
    """Reads and validates one slot's manifest against its meta record (not the array data)."""
    off, n = manifest_region(image, slot)
    return manifest_from(image, slot, _pread_exact(fd, n, off))


def slot_manifests(path: Path, image: StoreImage) -> Iterator[tuple[Any, Manifest]]:
    """(slot state, manifest) of every slot of ``image`` (read from ``path``) whose meta record and
    manifest check out, data not read; a slot that does not is logged and skipped."""
    with open(path, "rb", buffering=0) as f:
        for st in image.slots:
            if st.meta is None:
                continue
            try:
                man = read_manifest(image, st.slot, f.fileno())
            except CorruptCheckpointError as exc:
                log.warning("pccheck: %s slot %d: %s", path, st.slot, exc)
                continue
            yield st, man


def slot_base(image: StoreImage, slot: int) -> int:
    """The file offset of a slot (its data region starts there)."""
    return image.header["slots_offset"] + slot * image.header["slot_capacity"]


def array_bases(image: StoreImage, slot: int, man: Manifest) -> list[int]:
    """The file offset of the slot region holding each array of ``man`` (read from ``slot``): the
    slot's own, or for an incremental checkpoint the cell it references (FORMAT.md §14); an
    array's bytes are at base + its offset."""
    return [slot_base(image, man.cell_of(i, slot)) for i in range(len(man.arrays))]


def region_extents(image: StoreImage, slot: int, man: Manifest, end: int) -> list[tuple[int, int, int]] | None:
    """For :func:`read_region`: where each block-aligned run of ``[0, end)`` of the data region is
    read from, as (start, end, file offset), when some array lies in another slot's cell; None
    when every byte is in the slot's own region (one contiguous read)."""
    if not man.references(slot):
        return None
    out: list[tuple[int, int, int]] = []
    for i, e in enumerate(man.arrays):  # format 3: offsets block-aligned, so runs never overlap
        if e.nbytes:
            hi = min(end, (e.offset + e.nbytes + BLOCK - 1) // BLOCK * BLOCK)
            at = slot_base(image, man.cell_of(i, slot)) + e.offset
            if out and out[-1][1] == e.offset and out[-1][2] + (out[-1][1] - out[-1][0]) == at:
                out[-1] = (out[-1][0], hi, out[-1][2])  # the next bytes of the same cell: one run
            else:
                out.append((e.offset, hi, at))
    return out


def load_slot(image: StoreImage, slot: int, *, zero_copy: bool = False, verify: bool = True,
              fd: int, mm: mmap.mmap | None = None) -> Restored:
    """Validates one slot (meta, manifest, every array's crc32c) and loads its arrays.

    With ``zero_copy`` the arrays are read-only views of ``mm``; they stay valid while no writer
    reuses the slot (i.e. while training is not running on this store).
    """
    man = read_manifest(image, slot, fd)
    base = slot_base(image, slot)
    state: dict[str, np.ndarray] = {}
    copy = not (zero_copy and mm is not None)
    if copy:  # one parallel O_DIRECT read of the data region, checksummed on the way
        # Up to the end of the last array, not data_len: never read (or allocate) more than the
        # manifest's arrays account for.
        end = max((e.offset + e.nbytes for e in man.arrays), default=0)
        end = min(man.data_len, (end + BLOCK - 1) // BLOCK * BLOCK)
        buf, got = read_region(image.path, base, end, [(e.offset, e.nbytes) for e in man.arrays],
                               extents=region_extents(image, slot, man, end))
    bases = array_bases(image, slot, man)
    for i, (entry, crc) in enumerate(zip(man.arrays, man.crcs)):
        try:
            if not entry.nbytes:
                arr = np.empty(entry.shape, dtype=entry.dtype)
            else:
                src = buf if copy else mm
                arr = np.frombuffer(src, dtype=entry.dtype, count=entry.nbytes // entry.dtype.itemsize,
                                    offset=entry.offset if copy else bases[i] + entry.offset).reshape(entry.shape)
        except (ValueError, TypeError, OverflowError, MemoryError) as exc:  # defence in depth
            raise CorruptCheckpointError(f"slot {slot}: array {entry.name!r} cannot be built: {exc}") from None
        if verify:
            have = got[i] if copy else (
                _native.crc32c(memoryview(mm)[bases[i] + entry.offset:bases[i] + entry.offset + entry.nbytes])
                if entry.nbytes else 0)
            if have != crc:
                raise CorruptCheckpointError(f"slot {slot}: array {entry.name!r} checksum mismatch")
        if zero_copy:
            arr.flags.writeable = False
        state[entry.name] = arr
    if verify:
        mark_validated(image, slot, man.counter)
    return Restored(man.step, state, man.metadata, man.counter, image.generation, slot, image.path,
                    {e.name: e.torch_dtype for e in man.arrays if e.torch_dtype}, man.tree, man.epoch)


def first_valid(image: StoreImage, attempt: Callable[[int], T]) -> tuple[int, T, list[str]] | None:
    """The one "latest valid slot" rule: the first slot of :func:`candidate_order` for which
    ``attempt(slot)`` does not raise CorruptCheckpointError, as (slot, its result, the problems
    met on the way, CHECK_ADDR's first); None if no slot passes."""
    problems = [f"slot {st.slot}: {st.problem}" for st in image.slots if st.problem and st.problem != "empty"]
    _, why = confirmed_slot(image)
    if why:
        problems.insert(0, why)
    for slot in candidate_order(image):
        try:
            return slot, attempt(slot), problems
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
    return None


def latest_in_store(path: Path, *, zero_copy: bool = False, verify: bool = True) -> Restored | None:
    """The newest valid checkpoint of one store file; None if it never had one; NoCheckpointError
    if it has checkpoints but none validates."""
    image = read_store(path)
    with open(path, "rb", buffering=0) as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if zero_copy else None
        found = first_valid(image, lambda slot: load_slot(image, slot, zero_copy=zero_copy, verify=verify,
                                                          fd=f.fileno(), mm=mm))
    if found is not None:
        slot, r, problems = found
        if problems:
            log.warning("pccheck: %s: falling back to slot %d (step %d, counter %d) because: %s",
                        path, slot, r.step, r.counter, "; ".join(problems))
        return r
    if not image.check_word and not any(st.meta or st.problem != "empty" for st in image.slots):
        return None
    _, why = confirmed_slot(image)
    problems = ([why] if why else []) + [f"slot {st.slot}: {st.problem}" for st in image.slots
                                         if st.problem and st.problem != "empty"]
    raise NoCheckpointError(f"{path}: no valid checkpoint" + (f" ({'; '.join(problems)})" if problems else ""))


def load_newest(path: str | os.PathLike[str] | None = None, *, zero_copy: bool = False,
                verify: bool = True) -> Restored:
    """Loads the newest valid checkpoint under ``path`` (default: ``$PCCHECK_DIR`` or ./checkpoints)
    as arrays (``pccheck.load_latest`` builds on it and puts PyTorch state back).

    Reads CHECK_ADDR, validates that slot's meta record, manifest and every array's crc32c; if
    anything is wrong, logs a warning naming it and falls back to the newest slot that validates,
    then to older store generations. Raises NoCheckpointError when nothing validates.
    """
    directory = Path(path) if path is not None else default_path()
    if not directory.is_dir():
        raise NoCheckpointError(
            f"no checkpoint directory at {directory}: pass the path the Checkpointer wrote to "
            "(or set PCCHECK_DIR)")
    files = store_files(directory)
    if not files:
        raise NoCheckpointError(f"{directory} holds no pccheck store ({STORE_GLOB}); nothing to load")
    problems = []
    for _, file in files:
        try:
            r = latest_in_store(file, zero_copy=zero_copy, verify=verify)
            if r is not None:
                return r
            problems.append(f"{file}: no checkpoint yet")
        except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
            problems.append(str(exc) if isinstance(exc, PCCheckError) else f"{file}: {exc}")
            log.warning("pccheck: %s", problems[-1])
    raise NoCheckpointError(f"no valid checkpoint under {directory}: " + "; ".join(problems))


def slot_was_written(image: StoreImage, slot: int, fd: int) -> bool:
    """Whether the slot's first block holds anything (a cleared slot vs a never-written one)."""
    return any(os.pread(fd, BLOCK, slot_base(image, slot)))
