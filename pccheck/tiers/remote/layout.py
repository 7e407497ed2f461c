"""Keys, the per-step manifest and the ``latest`` pointer of a remote prefix (FORMAT.md §12).

Everything here is pure: encode, and decode with every field checked, since what comes back from
the object store is untrusted input (bounds on sizes, counts and offsets; nothing unpickled).

    PREFIX/latest                                   the pointer (§12.3), JSON
    PREFIX/manifests/g<G>/s<S>.json                 step S of generation G (§12.2), JSON
    PREFIX/data/g<G>/s<S>-<token>/rank-<r>.bin      rank r's data of that step (§12.1)

A step of an incremental writer (manifest version 2, §12.8) names, per array, the data object
holding its bytes: its own (the arrays it uploaded) or one an earlier committed step uploaded.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from ...errors import CorruptCheckpointError

__all__ = ["POINTER", "MANIFESTS", "DATA", "RankPart", "StepManifest", "Pointer", "manifest_key",
           "data_key", "parse_manifest_key", "encode_manifest", "decode_manifest", "encode_pointer",
           "decode_pointer", "MAX_MANIFEST_BYTES", "MIN_PART", "parts_of", "rank_part_from_json",
           "array_sources", "REFS_VERSION"]

POINTER = "latest"
MANIFESTS = "manifests/"
DATA = "data/"
FORMAT = "pccheck-remote"
POINTER_FORMAT = "pccheck-remote-latest"
VERSION = 1
REFS_VERSION = 2  # a step manifest whose parts reference other steps' data objects (§12.8)
MAX_MANIFEST_BYTES = 256 << 20  # the local manifest it embeds is at most 64 MiB (FORMAT.md §5)
MAX_POINTER_BYTES = 64 << 10
MIN_PART = 8 << 20  # S3 takes parts of 5 MiB and more (the last one any size); we upload 8 MiB+
MAX_PARTS = 10_000  # S3's limit per multipart upload
_MAX_GEN = 10**12
_STEP_LIMIT = 2**63
_KEY_RE = re.compile(r"^manifests/g(\d{8,})/s(-?\d+)\.json$")
_HEX8 = re.compile(r"^[0-9a-f]{8}$")


def manifest_key(generation: int, step: int) -> str:
    return f"{MANIFESTS}g{generation:08d}/s{step}.json"


def data_key(generation: int, step: int, token: str, rank: int) -> str:
    return f"{DATA}g{generation:08d}/s{step}-{token}/rank-{rank}.bin"


def parse_manifest_key(rel: str) -> tuple[int, int] | None:
    """(generation, step) of a manifest key, or None for any other key."""
    m = _KEY_RE.match(rel)
    if not m:
        return None
    g, s = int(m.group(1)), int(m.group(2))
    return (g, s) if g < _MAX_GEN and -_STEP_LIMIT <= s < _STEP_LIMIT else None


def parts_of(size: int, part_size: int) -> list[tuple[int, int]]:
    """The (offset, length) of each part of a ``size``-byte object cut at ``part_size``."""
    return [(off, min(part_size, size - off)) for off in range(0, size, part_size)] or [(0, 0)]


@dataclass(frozen=True)
class RankPart:
    """One rank's data object of a step: where it is, how it is cut, and its checksums."""

    rank: int
    data: str             # relative key of the data object
    size: int             # bytes in it: the local slot's data region [0, data_len)
    part_size: int
    part_crcs: tuple[int, ...]  # crc32c of each part, in order
    manifest: bytes       # the local manifest (FORMAT.md §5) of the checkpoint, as committed
    # version 2 (§12.8): the data objects of earlier committed steps this part reads, (key, size),
    # and per array of the local manifest, in order, (object, offset): object 0 is ``data``,
    # k >= 1 is objects[k - 1]. None: version 1, every array in ``data`` at its manifest offset.
    objects: tuple[tuple[str, int], ...] = ()
    where: tuple[tuple[int, int], ...] | None = None

    def as_json(self) -> dict[str, Any]:
        doc = {"rank": self.rank, "data": self.data, "size": self.size, "part_size": self.part_size,
               "parts": [f"{c:08x}" for c in self.part_crcs], "manifest": self.manifest.decode("utf-8")}
        if self.where is not None:
            doc["objects"] = [{"key": k, "size": n} for k, n in self.objects]
            doc["where"] = [list(w) for w in self.where]
        return doc

    def keys(self) -> list[str]:
        """Every data object this part reads: its own, then the ones it references."""
        return [self.data, *(k for k, _ in self.objects)]


@dataclass(frozen=True)
class StepManifest:
    """A committed remote step: every rank's part (FORMAT.md §12.2)."""

    generation: int
    step: int
    world_size: int
    unix_time: float
    ranks: tuple[RankPart, ...]


def encode_manifest(m: StepManifest) -> bytes:
    refs = any(r.where is not None for r in m.ranks)
    doc = {"format": FORMAT, "version": REFS_VERSION if refs else VERSION, "generation": m.generation, "step": m.step,
           "world_size": m.world_size, "unix_time": m.unix_time, "ranks": [r.as_json() for r in m.ranks]}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _int(doc: dict[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = doc.get(key)
    if type(v) is not int or not lo <= v < hi:
        raise CorruptCheckpointError(f"{where}: '{key}' is missing or out of range")
    return v


def _load(raw: bytes, fmt: str, where: str, versions: tuple[int, ...] = (VERSION,)) -> dict[str, Any]:
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(f"{where} is not UTF-8 JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt or doc.get("version") not in versions:
        raise CorruptCheckpointError(f"{where} has an unknown format")
    return doc


def _data_key_ok(key: Any) -> bool:
    return isinstance(key, str) and key.startswith(DATA) and ".." not in key.split("/")


def _references(r: dict[str, Any], data: str, where: str) -> tuple[tuple[tuple[str, int], ...], tuple[tuple[int, int], ...]]:
    """A version-2 part's ``objects`` and ``where`` (§12.8), every field checked; the offsets
    against the arrays' sizes later (:func:`array_sources`, which has the local manifest)."""
    objs, at = r.get("objects"), r.get("where")
    if not isinstance(objs, list) or not isinstance(at, list) or len(objs) > 1 << 20 or len(at) > 1 << 24:
        raise CorruptCheckpointError(f"{where}: 'objects' or 'where' is missing or malformed")
    objects = []
    for o in objs:
        if not isinstance(o, dict) or not _data_key_ok(o.get("key")):
            raise CorruptCheckpointError(f"{where}: bad referenced data key")
        objects.append((o["key"], _int(o, "size", 0, _STEP_LIMIT, where)))
    if len({k for k, _ in objects} | {data}) != len(objects) + 1:
        raise CorruptCheckpointError(f"{where}: a data object is named twice")
    places = []
    for w in at:
        if (not isinstance(w, list) or len(w) != 2 or type(w[0]) is not int or type(w[1]) is not int
                or not 0 <= w[0] <= len(objects) or not 0 <= w[1] < _STEP_LIMIT):
            raise CorruptCheckpointError(f"{where}: bad array location")
        places.append((w[0], w[1]))
    return tuple(objects), tuple(places)


def _rank_part(r: Any, where: str, refs: bool = False) -> RankPart:
    if not isinstance(r, dict):
        raise CorruptCheckpointError(f"{where} is not an object")
    rank = _int(r, "rank", 0, 1 << 20, where)
    size = _int(r, "size", 0, _STEP_LIMIT, where)
    part = _int(r, "part_size", 1, 5 << 30, where)
    data, parts, man = r.get("data"), r.get("parts"), r.get("manifest")
    if not _data_key_ok(data):
        raise CorruptCheckpointError(f"{where}: bad data key")
    if not isinstance(parts, list) or len(parts) != max(1, math.ceil(size / part)) or len(parts) > MAX_PARTS:
        raise CorruptCheckpointError(f"{where}: the part count does not match size / part_size")
    if not all(isinstance(c, str) and _HEX8.match(c) for c in parts):
        raise CorruptCheckpointError(f"{where}: bad part crc32c")
    if not isinstance(man, str):
        raise CorruptCheckpointError(f"{where}: no local manifest")
    objects, places = _references(r, data, where) if refs else ((), None)
    return RankPart(rank, data, size, part, tuple(int(c, 16) for c in parts), man.encode("utf-8"), objects, places)


def rank_part_from_json(raw: bytes, where: str) -> RankPart:
    """One rank's part description (a group's ``parts/...`` object), every field checked."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError(f"{where} is not UTF-8 JSON") from None
    # an incremental rank's part (§12.8) carries 'objects' and 'where'; then both are checked
    return _rank_part(doc, where, refs=isinstance(doc, dict) and ("where" in doc or "objects" in doc))


def decode_manifest(raw: bytes, generation: int, step: int) -> StepManifest:
    """Parses a step manifest fetched from ``manifest_key(generation, step)``; every field
    checked, and its generation and step MUST match its key."""
    where = f"remote manifest g{generation} s{step}"
    doc = _load(raw, FORMAT, where, (VERSION, REFS_VERSION))
    refs = doc["version"] == REFS_VERSION
    if _int(doc, "generation", 0, _MAX_GEN, where) != generation or \
            _int(doc, "step", -_STEP_LIMIT, _STEP_LIMIT, where) != step:
        raise CorruptCheckpointError(f"{where}: its generation or step differs from its key")
    world = _int(doc, "world_size", 1, 1 << 20, where)
    t = doc.get("unix_time")
    ranks = doc.get("ranks")
    if not isinstance(t, (int, float)) or not isinstance(ranks, list) or len(ranks) != world:
        raise CorruptCheckpointError(f"{where}: 'unix_time' or 'ranks' is malformed")
    parts = tuple(_rank_part(r, f"{where} rank #{i}", refs) for i, r in enumerate(ranks))
    if sorted(p.rank for p in parts) != list(range(world)):
        raise CorruptCheckpointError(f"{where}: ranks are not 0..{world - 1}")
    return StepManifest(generation, step, world, float(t), tuple(sorted(parts, key=lambda p: p.rank)))


def array_sources(part: RankPart, arrays: Any) -> list[tuple[str, int]]:
    """Per array of the part's local manifest (``arrays``: its entries, offset and nbytes each),
    the data object key and offset its bytes are read from, bounded by that object's size.
    Version 1: the part's own object at the manifest offset (bounded when the manifest was
    parsed against ``size``)."""
    if part.where is None:
        return [(part.data, e.offset) for e in arrays]
    if len(part.where) != len(arrays):
        raise CorruptCheckpointError(f"{part.data}: {len(part.where)} array locations for {len(arrays)} arrays")
    objects = [(part.data, part.size), *part.objects]
    out = []
    for e, (o, off) in zip(arrays, part.where):
        key, size = objects[o]
        if off + e.nbytes > size:
            raise CorruptCheckpointError(f"array {e.name!r} lies beyond the end of {key} ({size} bytes)")
        out.append((key, off))
    # arrays never share bytes, so together they fit in the objects they name (this bounds what a
    # reader allocates for them by sizes the manifest declares, each checked on read)
    if sum(e.nbytes for e in arrays) > sum(size for _, size in {objects[o] for o, _ in part.where}):
        raise CorruptCheckpointError(f"{part.data}: the arrays hold more bytes than the objects they lie in")
    return out


@dataclass(frozen=True)
class Pointer:
    """The ``latest`` pointer: the newest (generation, step) a writer committed (§12.3)."""

    generation: int
    step: int

    @property
    def order(self) -> tuple[int, int]:
        return (self.generation, self.step)


def encode_pointer(p: Pointer) -> bytes:
    doc = {"format": POINTER_FORMAT, "version": VERSION, "generation": p.generation, "step": p.step,
           "manifest": manifest_key(p.generation, p.step), "unix_time": time.time()}
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def decode_pointer(raw: bytes) -> Pointer:
    doc = _load(raw, POINTER_FORMAT, "the remote 'latest' pointer")
    g = _int(doc, "generation", 0, _MAX_GEN, "latest")
    s = _int(doc, "step", -_STEP_LIMIT, _STEP_LIMIT, "latest")
    if doc.get("manifest") != manifest_key(g, s):
        raise CorruptCheckpointError("the remote 'latest' pointer names another manifest than its step")
    return Pointer(g, s)
