"""Writing a checkpoint as an interchange file: safetensors or a torch state dict.

Both writers go through :func:`pccheck.persist.files.write_durably`: the file is written under a
temporary name in the target directory, fsynced, renamed into place, and the directory fsynced, so
a crash leaves either the old file or the complete new one (never a torn one, unlike a plain
rename without fsync).

safetensors (https://github.com/huggingface/safetensors, README "Format"): an 8-byte
little-endian header length N, N bytes of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets":
[begin, end)}, "__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the
tensors' little-endian bytes, back to back, with no holes, ending exactly at EOF. Tensors are laid
out largest item size first, so every tensor is aligned to its item size.

numpy dtypes without a safetensors or torch equivalent (strings, structured, void, datetime,
complex128 in safetensors, ...) are an :class:`UnsupportedDtypeError` naming the array, unless the
caller asks to skip them. ``import pccheck.ops.export`` never imports torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Mapping

import numpy as np

from ..errors import ConfigError, UnsupportedDtypeError
from ..persist.files import write_durably
from ..persist.recovery import Restored

__all__ = ["FORMATS", "SafetensorsEntry", "safetensors_dtype", "safetensors_header", "export_checkpoint"]

FORMATS = ("safetensors", "torch")

# numpy dtype (little-endian or byte-sized) -> safetensors dtype name.
_NUMPY_TO_ST: dict[np.dtype, str] = {
    np.dtype("|b1"): "BOOL", np.dtype("|u1"): "U8", np.dtype("|i1"): "I8",
    np.dtype("<u2"): "U16", np.dtype("<i2"): "I16", np.dtype("<u4"): "U32", np.dtype("<i4"): "I32",
    np.dtype("<u8"): "U64", np.dtype("<i8"): "I64", np.dtype("<f2"): "F16", np.dtype("<f4"): "F32",
    np.dtype("<f8"): "F64", np.dtype("<c8"): "C64",
}
# torch dtypes numpy lacks (stored with an integer carrier, named in the manifest) -> safetensors.
_TORCH_TO_ST = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


def _little(dtype: np.dtype) -> np.dtype:
    """The little-endian twin of a plain numeric dtype (itself when already so)."""
    return dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype


def _c_order_little(a: np.ndarray) -> np.ndarray:
    """C-contiguous and little-endian, same values and shape (0-d stays 0-d); no copy if already so."""
    return a.astype(_little(a.dtype), order="C", copy=False)


def safetensors_dtype(dtype: np.dtype, torch_dtype: str | None = None) -> str | None:
    """The safetensors name for an array's bytes once made little-endian, or None if it has none."""
    if torch_dtype is not None:
        return _TORCH_TO_ST.get(torch_dtype)
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    return _NUMPY_TO_ST.get(_little(dtype))


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a safetensors file: its name, safetensors dtype, shape and byte count."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def safetensors_header(entries: Iterable[SafetensorsEntry], metadata: Mapping[str, str]) -> tuple[bytes, list[SafetensorsEntry]]:
    """The 8-byte length + padded JSON header, and the entries in the order their bytes must follow.

    Invariant (safetensors spec): offsets are relative to the end of the header, cover
    [0, total) with no holes, and tensors are sorted by item size, largest first (alignment).
    """
    ordered = sorted(entries, key=lambda e: -_ST_ITEMSIZE[e.dtype])  # stable: keeps the given order
    doc: dict[str, Any] = {}
    if metadata:
        doc["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for e in ordered:
        if e.name == "__metadata__":
            raise ConfigError("an array named '__metadata__' cannot be stored in safetensors")
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


def _unsupported(name: str, dtype: np.dtype, fmt: str) -> UnsupportedDtypeError:
    return UnsupportedDtypeError(
        f"array {name!r} has dtype {dtype.str if dtype.fields is None else dtype.descr}, which {fmt} "
        f"cannot hold (only numeric and bool arrays fit). Leave such arrays out with "
        f"--skip-unsupported (skip_unsupported=True), or read them with pccheck.load_latest.")


def _selected(r: Restored, fmt: str, skip_unsupported: bool, ok: Callable[[str, np.ndarray], bool]) -> tuple[list[str], list[str]]:
    keep, skipped = [], []
    for name, arr in r.state.items():
        if ok(name, arr):
            keep.append(name)
        elif skip_unsupported:
            skipped.append(name)
        else:
            raise _unsupported(name, arr.dtype, fmt)
    return keep, skipped


def _checkpoint_metadata(r: Restored, skipped: list[str]) -> dict[str, str]:
    meta = {"pccheck.step": str(r.step), "pccheck.counter": str(r.counter),
            "pccheck.metadata": json.dumps(r.metadata, separators=(",", ":"))}
    if skipped:
        meta["pccheck.skipped"] = json.dumps(skipped)
    return meta


def _export_safetensors(r: Restored, out: Path, skip_unsupported: bool) -> list[str]:
    tdt = getattr(r, "torch_dtypes", {}) or {}
    keep, skipped = _selected(r, "safetensors", skip_unsupported,
                              lambda n, a: safetensors_dtype(a.dtype, tdt.get(n)) is not None)
    arrays = {n: _c_order_little(r.state[n]) for n in keep}
    header, order = safetensors_header(
        (SafetensorsEntry(n, safetensors_dtype(r.state[n].dtype, tdt.get(n)) or "", a.shape, a.nbytes)
         for n, a in arrays.items()), _checkpoint_metadata(r, skipped))

    def write(f: BinaryIO) -> None:
        f.write(header)
        for e in order:
            f.write(memoryview(arrays[e.name].reshape(-1).view(np.uint8)))

    write_durably(out, write)
    return skipped


def _export_torch(r: Restored, out: Path, skip_unsupported: bool) -> list[str]:
    try:
        import torch
    except ImportError:
        raise ConfigError("--format torch needs PyTorch: pip install 'pccheck[torch]' "
                          "(or export --format safetensors)") from None
    from ..arrays import torch_dtype

    tdt = getattr(r, "torch_dtypes", {}) or {}

    def convertible(name: str, arr: np.ndarray) -> bool:
        if name in tdt:
            return True
        if arr.dtype.fields is not None or arr.dtype.subdtype is not None or arr.dtype.kind not in "biufc":
            return False
        try:
            torch.from_numpy(np.empty(0, dtype=_little(arr.dtype)))
        except TypeError:
            return False
        return True

    keep, skipped = _selected(r, "a torch state dict", skip_unsupported, convertible)
    tensors = {}
    for name in keep:
        t = torch.from_numpy(_c_order_little(r.state[name]))
        tensors[name] = t.view(torch_dtype(tdt[name])) if name in tdt else t
    write_durably(out, lambda f: torch.save(tensors, f))
    return skipped


def export_checkpoint(r: Restored, out: str | os.PathLike[str], fmt: str, *, skip_unsupported: bool = False) -> list[str]:
    """Writes the arrays of ``r`` to ``out`` as ``fmt`` ("safetensors" or "torch"), crash-safely.

    safetensors files carry ``pccheck.step``, ``pccheck.counter`` and ``pccheck.metadata`` (JSON) in
    ``__metadata__``; torch files are a plain ``{name: tensor}`` dict that loads with
    ``torch.load(..., weights_only=True)``. Big-endian arrays are converted to little-endian.
    Returns the names of the arrays left out (only with ``skip_unsupported``); otherwise an array
    the format cannot hold raises UnsupportedDtypeError and nothing is written.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"{out} is a directory; give the file to write, e.g. {out / ('model.' + fmt)}")
    if fmt == "safetensors":
        return _export_safetensors(r, out, skip_unsupported)
    return _export_torch(r, out, skip_unsupported)
