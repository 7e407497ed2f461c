"""One view of the array types pccheck accepts: numpy arrays, torch tensors (CPU or CUDA) and
cupy arrays. Gives each one's byte layout (dtype, shape, byte strides, pointer) and device,
without importing torch or cupy unless such an object is actually passed in.

torch dtypes numpy lacks (bfloat16, float8 variants, ...) are stored as an unsigned integer
"carrier" of the same size, and the manifest records the torch dtype so a torch reader gets the
original type back bit for bit.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ConfigError, UnsupportedDtypeError

__all__ = ["ArrayInfo", "describe", "is_torch_tensor", "is_cupy_array", "TORCH_DTYPES", "TORCH_ONLY", "torch_dtype"]

# torch dtype name -> numpy dtype holding the same bytes. Names are torch's (str(dtype)[6:]).
TORCH_DTYPES: dict[str, str] = {
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "bfloat16": "<u2",
    "complex128": "<c16", "complex64": "<c8", "complex32": "<u4",
    "int64": "<i8", "int32": "<i4", "int16": "<i2", "int8": "|i1",
    "uint64": "<u8", "uint32": "<u4", "uint16": "<u2", "uint8": "|u1", "bool": "|b1",
    "float8_e4m3fn": "|u1", "float8_e5m2": "|u1", "float8_e4m3fnuz": "|u1", "float8_e5m2fnuz": "|u1",
}
# The ones whose numpy carrier is not the same type: the manifest must name them.
TORCH_ONLY = {"bfloat16", "complex32", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"}


@dataclass(frozen=True)
class ArrayInfo:
    """Byte layout of one array. ``strides`` are in bytes; ``device`` is "cpu", "cuda:N" or "cupy:N"."""

    dtype: np.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    ptr: int
    itemsize: int
    device: str
    torch_dtype: str | None  # set only for torch dtypes numpy cannot represent

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n


def is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_cupy_array(x: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def torch_dtype(name: str) -> Any:
    """The torch dtype for a manifest's ``torch_dtype`` name (imports torch)."""
    import torch

    dt = getattr(torch, name, None)
    if name not in TORCH_DTYPES or not isinstance(dt, torch.dtype):
        raise ConfigError(f"unknown torch dtype {name!r} in checkpoint")
    return dt


def describe(name: str, x: Any) -> ArrayInfo:
    """The byte layout of ``x``; raises a PCCheckError naming ``name`` if it cannot be stored."""
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise UnsupportedDtypeError(
                f"state[{name!r}] has dtype {x.dtype} which holds Python objects; pccheck stores raw "
                "bytes only. Convert it to a numeric, string or fixed-size dtype.")
        return ArrayInfo(x.dtype, tuple(x.shape), tuple(x.strides), x.ctypes.data, x.itemsize, "cpu", None)
    if is_torch_tensor(x):
        return _describe_torch(name, x)
    if is_cupy_array(x):
        return ArrayInfo(np.dtype(x.dtype), tuple(x.shape), tuple(x.strides), int(x.data.ptr), x.itemsize,
                         f"cupy:{x.device.id}", None)
    raise ConfigError(f"state[{name!r}] is a {type(x).__name__}; pccheck stores numpy arrays, torch "
                      "tensors and cupy arrays")


# torch dtype -> (numpy carrier, itemsize, the name to record or None); filled on first use, so
# describing a tensor (once per array per checkpoint) costs no string work.
_TORCH_CARRIERS: dict[Any, tuple[np.dtype, int, str | None]] = {}


def _torch_carrier(name: str, dtype: Any) -> tuple[np.dtype, int, str | None]:
    got = _TORCH_CARRIERS.get(dtype)
    if got is None:
        tname = str(dtype).removeprefix("torch.")
        carrier = TORCH_DTYPES.get(tname)
        if carrier is None:
            raise UnsupportedDtypeError(f"tensor {name!r} has dtype {dtype}, which pccheck cannot store")
        got = _TORCH_CARRIERS[dtype] = (np.dtype(carrier), np.dtype(carrier).itemsize,
                                        tname if tname in TORCH_ONLY else None)
    return got


def _describe_torch(name: str, t: Any) -> ArrayInfo:
    if t.layout != sys.modules["torch"].strided:
        raise ConfigError(f"tensor {name!r} has layout {t.layout}; convert it with .to_dense() first")
    if t.is_quantized or t.is_conj() or t.is_neg():
        raise ConfigError(f"tensor {name!r} is quantized or a lazy conj/neg view; store a resolved "
                          "tensor (.resolve_conj().resolve_neg(), or dequantize)")
    carrier, es, recorded = _torch_carrier(name, t.dtype)
    dev = t.device
    where = "cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}"
    return ArrayInfo(carrier, tuple(t.shape), tuple(s * es for s in t.stride()), t.data_ptr(), es, where, recorded)
