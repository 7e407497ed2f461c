"""Where each array goes inside a slot, and the JSON manifest that describes it (FORMAT.md §5).

A slot holds the arrays' raw bytes, in the order given, each at a 64-byte aligned offset, padded
with zeros to a 4096-byte boundary (``data_len``); the manifest follows at ``data_len``.
Parsing treats the manifest as untrusted input: it raises only :class:`CorruptCheckpointError`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..arrays import TORCH_DTYPES, ArrayInfo, describe
from ..errors import ConfigError, CorruptCheckpointError
from ..native import _native

__all__ = ["ArrayEntry", "Layout", "plan", "build_manifest", "parse_manifest", "Manifest", "ARRAY_ALIGN", "Cells",
           "FINGERPRINT_METHOD"]

ARRAY_ALIGN = 64
BLOCK: int = _native.BLOCK
# Format 2 keeps pccheck's own fields ("tree", "epoch") apart from the user's "metadata".
# Format 1 (pccheck 0.1.0) kept them in "metadata" under reserved keys; it is still read.
# Format 3 (FORMAT.md §14) adds, per array, the cell (slot) holding its bytes and a fingerprint:
# written by incremental checkpoints only, so a reader that predates it refuses them cleanly.
MANIFEST_FORMAT = 2
CELLS_FORMAT = 3
READABLE_FORMATS = (1, 2, 3)
FINGERPRINT_METHOD = "poly61x2"  # native fingerprint.h: two polynomial hashes mod 2**61 - 1
_FP_PRIME = 2**61 - 1
_MAX_SLOT = 254
LEGACY_TREE_KEY = "pccheck.state"  # format 1: metadata key of the tree
LEGACY_EPOCH_KEY = "pccheck.epoch"  # format 1: metadata key of the epoch
_MAX_EPOCH = 2**63 - 1
MAX_MANIFEST_BYTES = 64 << 20
_MAX_NDIM = 64
_MAX_NUMPY_BYTES = 2**63 - 1
_CRC_PLACEHOLDER = "00000000"


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class ArrayEntry:
    """One array's place in a slot."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    torch_dtype: str | None = None  # a torch dtype numpy lacks; ``dtype`` is then its byte carrier


@dataclass(frozen=True)
class Layout:
    """The arrays of one checkpoint and the size of their data region."""

    entries: tuple[ArrayEntry, ...]
    data_len: int  # multiple of BLOCK; the manifest starts here
    # The planned arrays' byte layouts (pointers included), in entry order, so a copy engine does
    # not describe every array a second time per checkpoint. Valid for this snapshot only; not
    # part of the layout's identity.
    infos: tuple[ArrayInfo, ...] = field(default=(), compare=False, repr=False)

    def same_shape_as(self, other: "Layout | None") -> bool:
        return other is not None and self.entries == other.entries

    def realigned(self, align: int) -> "Layout":
        """The same arrays in the same order, each at an ``align``-aligned offset."""
        entries, off = [], 0
        for e in self.entries:
            off = _align(off, align)
            entries.append(ArrayEntry(e.name, e.dtype, e.shape, off, e.nbytes, e.torch_dtype))
            off += e.nbytes
        return Layout(tuple(entries), _align(off, BLOCK), self.infos)


def plan(arrays: Mapping[str, Any], align: int = ARRAY_ALIGN) -> Layout:
    """Validates the arrays (numpy, torch or cupy) and assigns each an aligned offset, in order
    (``align``: 64 bytes, or a block for an incremental checkpoint's cells, FORMAT.md §14)."""
    entries, infos = [], []
    off = 0
    for name, arr in arrays.items():
        if not isinstance(name, str):
            raise ConfigError(f"state keys must be str, got {name!r} ({type(name).__name__})")
        info = describe(name, arr)
        off = _align(off, align)
        entries.append(ArrayEntry(name, info.dtype, info.shape, off, info.nbytes, info.torch_dtype))
        infos.append(info)
        off += info.nbytes
    return Layout(tuple(entries), _align(off, BLOCK), tuple(infos))


@dataclass(frozen=True)
class Cells:
    """An incremental checkpoint's own fields (FORMAT.md §14): per array the slot whose region
    holds its bytes (``cells``) and its fingerprint (``fps``: (H_k1, H_k2), or None), and the
    fingerprint keys."""

    cells: tuple[int, ...]
    fps: tuple[tuple[int, int] | None, ...]
    keys: tuple[int, int] | None = None


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest."""

    step: int
    counter: int
    data_len: int
    arrays: tuple[ArrayEntry, ...]
    crcs: tuple[int, ...]
    metadata: dict[str, Any]  # the user's JSON object, and only theirs
    tree: Any = None  # a PyTorch checkpoint's state tree (torch_state.py); None for arrays
    epoch: int | None = None  # the job incarnation that wrote it (distributed runs)
    cells: Cells | None = None  # format 3: where each array's bytes are (None: all in its own slot)

    def cell_of(self, i: int, own_slot: int) -> int:
        """The slot whose region holds array ``i``'s bytes."""
        return own_slot if self.cells is None else self.cells.cells[i]

    def references(self, own_slot: int) -> bool:
        """Whether any array's bytes lie in another slot than the manifest's own."""
        return self.cells is not None and any(c != own_slot for c in self.cells.cells)


def _descr(dtype: np.dtype) -> Any:
    return np.lib.format.dtype_to_descr(dtype)


def build_manifest(layout: Layout, step: int, counter: int, crcs: list[int] | None,
                   metadata: Mapping[str, Any] | None, *, tree: Any = None, epoch: int | None = None,
                   cells: Cells | None = None) -> bytes:
    """The manifest JSON (UTF-8). With ``crcs=None`` it has placeholders of the final length
    (and, with ``cells``, the longest cell and fingerprint fields)."""
    arrays = []
    for i, e in enumerate(layout.entries):
        crc = _CRC_PLACEHOLDER if crcs is None else f"{crcs[i]:08x}"
        item = {"name": e.name, "dtype": _descr(e.dtype), "shape": list(e.shape),
                "offset": e.offset, "nbytes": e.nbytes, "crc32c": crc}
        if e.torch_dtype:
            item["torch_dtype"] = e.torch_dtype
        if cells is not None:
            item["cell"] = _MAX_SLOT if crcs is None else int(cells.cells[i])
            fp = (_FP_PRIME - 1, _FP_PRIME - 1) if crcs is None else cells.fps[i]
            if fp is not None:
                item["fp"] = f"{fp[0]:016x}{fp[1]:016x}"
        arrays.append(item)
    doc = {"format": MANIFEST_FORMAT if cells is None else CELLS_FORMAT, "step": int(step),
           "counter": int(counter), "data_len": layout.data_len, "arrays": arrays,
           "metadata": dict(metadata or {})}
    if cells is not None:
        keys = (_FP_PRIME - 1, _FP_PRIME - 1) if crcs is None or cells.keys is None else cells.keys
        doc["fingerprint"] = {"method": FINGERPRINT_METHOD, "keys": [int(keys[0]), int(keys[1])]}
    if tree is not None:
        doc["tree"] = tree
    if epoch is not None:
        doc["epoch"] = int(epoch)
    try:
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"checkpoint metadata must be JSON-serialisable (no NaN/inf): {exc}") from None


def manifest_upper_bound(layout: Layout, metadata: Mapping[str, Any] | None, *, tree: Any = None,
                         epoch: int | None = None, incremental: bool = False) -> int:
    """The most bytes the manifest of this layout can take, whatever the step, counter and epoch
    (and, ``incremental``, whatever its cells and fingerprints)."""
    cells = Cells((), ()) if incremental else None
    return len(build_manifest(layout, -(2**63), 2**63 - 1, None, metadata, tree=tree,
                              epoch=None if epoch is None else _MAX_EPOCH, cells=cells))


def _int(doc: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = doc.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptCheckpointError(f"{where}: '{key}' is missing or out of range")
    return v


def _dtype_from_descr(descr: Any, where: str) -> np.dtype:
    def tuplify(x: Any) -> Any:
        # JSON turns the tuples of a structured descr into lists; numpy wants tuples for fields.
        if isinstance(x, list):
            return [tuple(tuplify(i) for i in f) if isinstance(f, list) else f for f in x]
        return x

    if not isinstance(descr, (str, list)) or len(json.dumps(descr)) > 1 << 16:
        raise CorruptCheckpointError(f"{where}: bad dtype description")
    try:
        dt = np.lib.format.descr_to_dtype(tuplify(descr))
    except Exception as exc:  # numpy raises many types on hostile descrs
        raise CorruptCheckpointError(f"{where}: bad dtype description ({type(exc).__name__})") from None
    if dt.hasobject:
        raise CorruptCheckpointError(f"{where}: object dtype in a checkpoint")
    return dt


def parse_manifest(raw: bytes, *, step: int, counter: int, data_len_limit: int) -> Manifest:
    """Parses and validates a manifest against its meta record. Raises CorruptCheckpointError."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptCheckpointError("manifest is not valid UTF-8 JSON") from None
    fmt = doc.get("format") if isinstance(doc, dict) else None
    if type(fmt) is not int or fmt not in READABLE_FORMATS:
        raise CorruptCheckpointError("manifest has an unknown format")
    if _int(doc, "step", -(2**63), 2**63 - 1, "manifest") != step:
        raise CorruptCheckpointError("manifest step differs from its meta record")
    if _int(doc, "counter", 1, 2**56 - 1, "manifest") != counter:
        raise CorruptCheckpointError("manifest counter differs from its meta record")
    data_len = _int(doc, "data_len", 0, data_len_limit, "manifest")
    if data_len % BLOCK:
        raise CorruptCheckpointError("manifest data_len is not a multiple of 4096")
    items = doc.get("arrays")
    metadata = doc.get("metadata")
    if not isinstance(items, list) or not isinstance(metadata, dict):
        raise CorruptCheckpointError("manifest lacks 'arrays' or 'metadata'")
    entries, crcs, names = [], [], set()
    cells: list[int] = []
    fps: list[tuple[int, int] | None] = []
    end = 0
    for i, a in enumerate(items):
        where = f"manifest array #{i}"
        if not isinstance(a, dict):
            raise CorruptCheckpointError(f"{where} is not an object")
        name = a.get("name")
        if not isinstance(name, str) or name in names:
            raise CorruptCheckpointError(f"{where}: missing or duplicate name")
        names.add(name)
        dt = _dtype_from_descr(a.get("dtype"), where)
        shape = a.get("shape")
        if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
                or any(type(s) is not int or s < 0 for s in shape)):
            raise CorruptCheckpointError(f"{where}: bad shape")
        offset = _int(a, "offset", 0, data_len, where)
        nbytes = _int(a, "nbytes", 0, data_len, where)
        # Python ints do not overflow: a hostile shape gives a huge product and fails here.
        if math.prod(shape) * dt.itemsize != nbytes:
            raise CorruptCheckpointError(f"{where}: nbytes does not match dtype and shape")
        # A zero-size array passes the check above with any shape: numpy must still be able to
        # represent it (each extent, and the product of the non-zero ones, below 2**63).
        if math.prod(s for s in shape if s) * max(dt.itemsize, 1) > _MAX_NUMPY_BYTES:
            raise CorruptCheckpointError(f"{where}: shape too large to represent")
        if offset < end or offset + nbytes > data_len:
            raise CorruptCheckpointError(f"{where}: region overlaps another or leaves the data region")
        end = offset + nbytes
        crc = a.get("crc32c")
        if not isinstance(crc, str) or len(crc) != 8 or any(c not in "0123456789abcdef" for c in crc):
            raise CorruptCheckpointError(f"{where}: bad crc32c")
        tdt = a.get("torch_dtype")
        if tdt is not None and (not isinstance(tdt, str) or tdt not in TORCH_DTYPES
                                or np.dtype(TORCH_DTYPES[tdt]) != dt):
            raise CorruptCheckpointError(f"{where}: bad torch_dtype")
        entries.append(ArrayEntry(name, dt, tuple(shape), offset, nbytes, tdt))
        crcs.append(int(crc, 16))
        if fmt == CELLS_FORMAT:
            cells.append(_cell_fields(a, offset, where, fps))
    tree, epoch = _own_fields(doc, fmt, metadata)
    found = Cells(tuple(cells), tuple(fps), _fp_keys(doc)) if fmt == CELLS_FORMAT else None
    return Manifest(step, counter, data_len, tuple(entries), tuple(crcs), metadata, tree, epoch, found)


def _cell_fields(a: Mapping[str, Any], offset: int, where: str, fps: list[tuple[int, int] | None]) -> int:
    """Format 3: an array's ``cell`` (a slot index; the reader checks it against the store's
    slots) and ``fp``; its offset must be block-aligned so that cells never share a block."""
    cell = _int(a, "cell", 0, _MAX_SLOT, where)
    if offset % BLOCK:
        raise CorruptCheckpointError(f"{where}: an array of an incremental checkpoint must start on a block")
    fp = a.get("fp")
    if fp is None:
        fps.append(None)
    elif (isinstance(fp, str) and len(fp) == 32 and all(c in "0123456789abcdef" for c in fp)
          and int(fp[:16], 16) < _FP_PRIME and int(fp[16:], 16) < _FP_PRIME):
        fps.append((int(fp[:16], 16), int(fp[16:], 16)))
    else:
        raise CorruptCheckpointError(f"{where}: bad fingerprint")
    return cell


def _fp_keys(doc: Mapping[str, Any]) -> tuple[int, int] | None:
    """Format 3: the fingerprint keys, or None when absent or of another method (the arrays'
    fingerprints are then not comparable, only their cells are used)."""
    f = doc.get("fingerprint")
    if f is None:
        return None
    if not isinstance(f, dict) or not isinstance(f.get("keys"), list) or len(f["keys"]) != 2:
        raise CorruptCheckpointError("manifest: bad 'fingerprint'")
    keys = f["keys"]
    if any(type(k) is not int or not 1 <= k < _FP_PRIME for k in keys):
        raise CorruptCheckpointError("manifest: bad fingerprint keys")
    return (keys[0], keys[1]) if f.get("method") == FINGERPRINT_METHOD else None


def _own_fields(doc: dict[str, Any], fmt: int, metadata: dict[str, Any]) -> tuple[Any, int | None]:
    """pccheck's own fields: top-level in format 2; popped out of ``metadata`` in format 1, so
    the metadata a reader sees is the user's in both."""
    if fmt == 1:
        doc = {"tree": metadata.pop(LEGACY_TREE_KEY, None), "epoch": metadata.pop(LEGACY_EPOCH_KEY, None)}
    if doc.get("tree") is not None and not isinstance(doc.get("tree"), dict):
        raise CorruptCheckpointError("manifest: 'tree' is not a JSON object")
    epoch = doc.get("epoch")
    if epoch is not None and (type(epoch) is not int or not 0 <= epoch <= _MAX_EPOCH):
        raise CorruptCheckpointError("manifest: 'epoch' is not a non-negative integer")
    return doc.get("tree"), epoch
