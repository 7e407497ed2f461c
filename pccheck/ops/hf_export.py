"""A checkpoint's model weights as a Hugging Face model directory (``from_pretrained`` reads it).

    pccheck export PATH --format hf --out DIR [--step N] [--dtype keep|bf16|fp32]
                   [--max-shard-size 5GB] [--config config.json]
    pccheck.export_hf(PATH, DIR, step=None, dtype="keep", max_shard_size="5GB", config=None)

Sources: every store a :class:`pccheck.Checkpointer` of a torch model writes, read through the
set readers the loaders use (:func:`pccheck.sharded.index.find_sets` for a store directory, a
distributed job's root with its ``rank-<r>/`` stores, or a memory tier's tmpfs store;
:func:`pccheck.tiers.remote.sharded.remote_sets` for ``s3://``). A set is one step held by every
rank of the job that wrote it. Its model state dict is the ``"model"`` entry of rank 0's tree:

- an unsharded tensor (one process, or DDP where every rank holds the whole model) is rank 0's
  array;
- a sharded one (FSDP2/DTensor, FORMAT.md §9) is consolidated from the chunks of every rank:
  when each chunk is a run of whole rows (``Shard(0)``, FSDP2's placement) its bytes are copied
  straight to their place in the output file by a few workers at once (up to ``WORKERS``, one
  buffer of the largest chunk each, two when chunks are large: see ``_workers``), so the ranks'
  files are read together and the writes overlap the reads; any other layout is assembled tensor
  by tensor. So the whole model is never in memory: peak memory is at most twice the largest
  chunk (or tensor) or ``COPY_BUDGET``, whichever is more.

Only the model is written (not the optimizer, the RNGs or the extra state), under the module's
``state_dict`` names; a prefix every name carries from a wrapper (``module.`` of DDP,
``_orig_mod.`` of ``torch.compile``) is dropped, so the names are the wrapped model's. Every byte
is read through the set's reader, which checks it against the array's crc32c before it is handed
on: nothing unchecked reaches the output.

Layout (what ``save_pretrained`` writes): ``model.safetensors`` when everything fits one shard of
``max_shard_size``, else ``model-00001-of-0000N.safetensors`` ... and
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}``). Tensors go to shards in state-dict order, a new shard starting when the next tensor
would make it exceed the limit (a tensor larger than the limit gets a shard of its own). Each
file's header carries ``"format": "pt"`` (transformers requires it) and the step it came from.

``dtype``: ``keep`` writes every tensor as saved; ``bf16`` / ``fp32`` convert the floating
tensors (float16, bfloat16, float32, float64; not float8) as ``torch.Tensor.to`` does (rounding to
nearest, ties to even; a NaN stays a NaN) and keep the others. No torch is needed: the
conversion is numpy's.

Crash safety: every file is written under a temporary name in DIR, fsynced, then renamed into
place, the index last, and the directory fsynced; shards of an earlier export in DIR that the new
one does not have are removed. A damaged array (crc32c mismatch) stops the export with its
temporary files removed; without ``step`` the next older checkpoint is exported instead (as
``load_latest`` falls back), with ``step`` it is an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import time
import queue
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..arrays import TORCH_DTYPES
from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..persist.files import fsync_dir, write_durably
from ..persist.reader import fresh_buffer
from ..sharded.geometry import Box, full_box, numel, overlap
from .export import SafetensorsEntry, safetensors_header

__all__ = ["HfExport", "export_hf", "parse_size", "DTYPES"]

log = logging.getLogger("pccheck")

DTYPES = ("keep", "bf16", "fp32")
_TARGET = {"bf16": "bfloat16", "fp32": "float32"}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_ST_NAME = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
            "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
            "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
            "complex64": "C64"}
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHARD_FILE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$|^model\.safetensors\.index\.json$")
WORKERS = 4                # chunks copied at once, at most (one per rank's file of a 4-rank job)
COPY_BUDGET = 128 << 20    # their buffers' bytes, beyond the two chunks every export may hold
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


@dataclass(frozen=True)
class HfExport:
    """What :func:`export_hf` wrote."""

    out: Path                 # the model directory
    step: int                 # the checkpoint's step
    files: tuple[str, ...]    # the safetensors files (and the index, when sharded), in DIR
    tensors: int              # tensors written
    bytes: int                # tensor bytes written (after any dtype conversion)
    bytes_read: int           # checkpoint bytes read (each checked against its crc32c)
    dtype: str                # "keep", "bf16" or "fp32"
    seconds: float            # wall time of the export, fsyncs included
    peak_rss: int             # the process's peak resident memory so far, in bytes (getrusage)


@dataclass(frozen=True)
class _Tensor:
    """One model tensor to write: its name, saved torch dtype, global shape and stored pieces."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Any, ...]   # pccheck.sharded.index.Chunk: (rank, array, box)

    def out_dtype(self, dtype: str) -> str:
        return _TARGET[dtype] if dtype in _TARGET and self.dtype in _FLOATS else self.dtype

    def out_bytes(self, dtype: str) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(TORCH_DTYPES[self.out_dtype(dtype)]).itemsize


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` (10**9, as Hugging Face counts), ``500MiB`` (2**20), ``1000`` ...;
    ConfigError for anything else or for a size below 1."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ConfigError(f"max_shard_size {size!r} is not a size; write e.g. 5GB, 500MB, 2GiB or a byte count")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n < 1:
        raise ConfigError(f"max_shard_size must be at least 1 byte, got {size!r}")
    return n


def export_hf(path: str | os.PathLike[str] | None, out: str | os.PathLike[str], *, step: int | None = None,
              dtype: str = "keep", max_shard_size: int | str = "5GB",
              config: str | os.PathLike[str] | None = None) -> HfExport:
    """Writes the model weights of the newest checkpoint under ``path`` (or of ``step``) to the
    directory ``out`` as Hugging Face safetensors shards that ``from_pretrained`` loads.

    Args:
        path: a store directory, a distributed job's root (its ``rank-<r>/`` stores), a memory
            tier's directory, or ``s3://bucket/prefix`` (the remote tier); None: ``$PCCHECK_DIR``
            or ./checkpoints.
        out: the model directory (created if missing).
        step: this step instead of the newest (no fallback to an older one).
        dtype: ``"keep"`` (as saved), ``"bf16"`` or ``"fp32"`` (floating tensors converted).
        max_shard_size: the largest shard file (``"5GB"``, ``"500MiB"``, bytes).
        config: a ``config.json`` copied into ``out`` (its ``dtype`` set to what was written),
            so that ``AutoModelForCausalLM.from_pretrained(out)`` needs nothing else.

    Returns an :class:`HfExport`. Raises NoCheckpointError when there is no (such) checkpoint,
    ConfigError when it holds no torch model or an argument is wrong, CorruptCheckpointError when
    ``step`` is damaged.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    limit = parse_size(max_shard_size)
    cfg = _read_config(config)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; --format hf writes a directory: give a directory to create or fill")
    start = time.perf_counter()
    sets, where = _sets(path, step)
    problems = []
    for cand in sets:
        try:
            tensors = _model_tensors(cand)
            out.mkdir(parents=True, exist_ok=True)
            files, nbytes = _write(cand, tensors, out, dtype, limit)
        except CorruptCheckpointError as exc:
            if step is not None:
                raise CorruptCheckpointError(f"{where}: step {cand.step} cannot be exported: {exc}") from None
            problems.append(f"step {cand.step}: {exc}")
            log.warning("pccheck: step %d cannot be exported (%s); trying an older checkpoint", cand.step, exc)
            continue
        finally:
            cand.close()
        if cfg is not None:
            _write_config(cfg, out, {t.out_dtype(dtype) for t in tensors if t.dtype in _FLOATS})
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
        return HfExport(out, cand.step, tuple(files), len(tensors), nbytes, cand.bytes_read, dtype,
                        time.perf_counter() - start, peak)
    detail = f": {'; '.join(problems)}" if problems else ""
    raise NoCheckpointError(f"no checkpoint under {where} could be exported{detail}")


# -- the source ----------------------------------------------------------------------------------


def _sets(path: str | os.PathLike[str] | None, step: int | None) -> tuple[list[Any], str]:
    """The candidate sets, newest first (only ``step``'s when given), and the source's name."""
    from ..tiers.remote.inventory import remote_url

    url = remote_url(path)
    if url is not None:
        from ..tiers.remote.sharded import remote_sets

        sets, where = list(remote_sets(url, None)), url
    else:
        from ..sharded.index import find_sets
        from .inventory import resolve_directory

        directory = resolve_directory(path)
        sets, where = find_sets(directory), str(directory)
    if step is not None:
        chosen = [s for s in sets if s.step == step]
        if not chosen:
            have = ", ".join(str(s.step) for s in sets) or "none"
            raise NoCheckpointError(f"{where} holds no complete checkpoint of step {step} (steps held: {have})")
        return chosen[:1], where
    if not sets:
        raise NoCheckpointError(f"no complete checkpoint under {where} (every rank of the job that wrote it must "
                                "hold the same step)")
    return sets, where


def _model_tensors(cand: Any) -> list[_Tensor]:
    """The model's tensors of a set, by state_dict name, from rank 0's tree; a wrapper's prefix
    that every name carries is dropped."""
    from ..sharded.index import Chunk

    member = cand.members[0]
    tree = member.manifest.tree
    model = tree.get("model") if isinstance(tree, dict) else None
    if model is None:
        raise ConfigError(f"step {cand.step} holds no model state dict (it was not written by a Checkpointer given a "
                          "torch model); export its arrays with --format safetensors instead")
    if not (isinstance(model, dict) and isinstance(model.get("d"), dict)):
        raise CorruptCheckpointError(f"step {cand.step}: the model entry of rank 0's tree is malformed")
    sharded = cand.tensors() if cand.sharded else {}
    out: list[_Tensor] = []
    for name, leaf in model["d"].items():
        tag, ref = next(iter(leaf.items())) if isinstance(leaf, dict) and len(leaf) == 1 else (None, None)
        if tag == "T" and isinstance(ref, str):
            if ref not in member.entries:
                raise CorruptCheckpointError(f"step {cand.step}: tensor {name!r} names array {ref!r}, which rank 0 "
                                             "does not hold")
            entry = member.entries[ref][0]
            dt = entry.torch_dtype or _torch_name(entry.dtype, name)
            shape = tuple(entry.shape)
            out.append(_Tensor(name, dt, shape, (Chunk(0, ref, full_box(shape)),)))
        elif tag == "S" and isinstance(ref, str):
            info = sharded.get(ref)
            if info is None:
                raise CorruptCheckpointError(f"step {cand.step}: tensor {name!r} is not in any rank's shards section")
            out.append(_Tensor(name, info.dtype, info.shape, info.chunks))
        else:  # a module's non-tensor _extra_state: not a weight
            log.info("pccheck: %r is not a tensor; left out of the Hugging Face export", name)
    for prefix in _WRAPPER_PREFIXES:
        if out and all(t.name.startswith(prefix) for t in out):
            out = [_Tensor(t.name[len(prefix):], t.dtype, t.shape, t.chunks) for t in out]
    for t in out:
        if t.dtype not in _ST_NAME:
            raise ConfigError(f"model tensor {t.name!r} has dtype {t.dtype}, which safetensors cannot hold")
    return out


def _torch_name(dtype: np.dtype, name: str) -> str:
    for torch_name, carrier in TORCH_DTYPES.items():
        if np.dtype(carrier) == dtype and torch_name in _ST_NAME and torch_name != "uint16":
            return torch_name
    if dtype == np.dtype("<u2"):
        return "uint16"
    raise ConfigError(f"model tensor {name!r} has numpy dtype {dtype}, which safetensors cannot hold")


# -- the output ----------------------------------------------------------------------------------


def _shards(tensors: Sequence[_Tensor], dtype: str, limit: int) -> list[list[_Tensor]]:
    """Tensors in state-dict order, split where the next one would overflow ``limit``."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.out_bytes(dtype)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards


def _write(cand: Any, tensors: list[_Tensor], out: Path, dtype: str, limit: int) -> tuple[list[str], int]:
    """Writes every shard (and the index when there are several); returns the file names and the
    tensor bytes written. A failure removes the temporary files and leaves ``out`` as it was."""
    shards = _shards(tensors, dtype, limit)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    temps = [out / f".{name}.{os.getpid()}.tmp" for name in names]
    meta = {"format": "pt", "pccheck.step": str(cand.step)}
    copier = _Copier(cand, dtype, tensors)
    total = 0
    try:
        for shard, tmp in zip(shards, temps):
            total += copier.write_file(tmp, shard, meta)
        for name, tmp in zip(names, temps):
            os.replace(tmp, out / name)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    finally:
        copier.close()
    files = list(names)
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: names[i] for i, shard in enumerate(shards) for t in shard}}
        raw = json.dumps(index, indent=2, sort_keys=False).encode()
        write_durably(out / "model.safetensors.index.json", lambda f: f.write(raw))
        files.append("model.safetensors.index.json")
    for old in out.iterdir():  # an earlier export's shards would mix with these
        if _SHARD_FILE.match(old.name) and old.name not in files:
            old.unlink()
    fsync_dir(out)
    return files, total


class _Copier:
    """Copies tensors from a set into open output files: whole-row chunks straight to their
    offset by a few workers at once, any other layout assembled in memory first.

    A worker takes the next chunk, reads it into a buffer of its own (checking its crc32c), and
    writes it at its place in the output itself, so the reads of several chunks (the ranks' files
    of one tensor) are in flight together and each chunk's write overlaps the others' reads;
    no chunk waits for a slower one before it is written. Invariant: a buffer belongs to one
    job from its read until its write has returned (the free queue hands it on only then)."""

    def __init__(self, cand: Any, dtype: str, tensors: Sequence[_Tensor]) -> None:
        self.cand, self.dtype = cand, dtype
        from ..sharded.index import CheckpointSet

        # A set of local files has its chunks read into page-aligned buffers, past the page cache
        # when it does not hold them (CheckpointSet.read_aligned); any other (remote, or one whose
        # reads a subclass redefines) through its own read.
        self.aligned = isinstance(cand, CheckpointSet) and type(cand).read is CheckpointSet.read
        biggest = max((self._buffer_bytes(c) for t in tensors if _by_rows(t) for c in t.chunks), default=0)
        self.workers = _workers(biggest, converting=any(t.out_dtype(dtype) != t.dtype for t in tensors))
        # Buffers with transparent huge pages: their first touch costs a fraction of 4 KiB pages'.
        self.free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(self.workers):
            self.free.put(fresh_buffer(biggest))
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="pccheck-hf-copy")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _chunk_bytes(self, c: Any) -> int:
        return int(self.cand.members[c.rank].entries[c.array][0].nbytes)

    def _buffer_bytes(self, c: Any) -> int:
        return int(self.cand.aligned_bytes(c.rank, c.array)) if self.aligned else self._chunk_bytes(c)

    def write_file(self, tmp: Path, shard: list[_Tensor], meta: dict[str, str]) -> int:
        header, order = safetensors_header(
            (SafetensorsEntry(t.name, _ST_NAME[t.out_dtype(self.dtype)], t.shape, t.out_bytes(self.dtype))
             for t in shard), meta)
        by_name = {t.name: t for t in shard}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _pwrite(fd, memoryview(header), 0)
            data = sum(e.nbytes for e in order)
            os.ftruncate(fd, len(header) + data)
            off = len(header)
            pending: list[Future] = []
            try:
                for e in order:
                    t = by_name[e.name]
                    if _by_rows(t):
                        pending.extend(self.pool.submit(self._copy_chunk, fd, t, c, at)
                                       for c, at in self._row_chunks(t, off))
                    else:  # a whole tensor in memory: the chunks in flight are written first
                        _wait_all(pending)
                        pending = []
                        _write_array(fd, self._assembled(t), off)
                    off += e.nbytes
                _wait_all(pending)
            except BaseException:
                for f in pending:  # no worker may still write to fd once it is closed
                    f.cancel()
                wait(pending)
                raise
            os.fsync(fd)  # the bytes are durable before the name points at them (a no-op on tmpfs)
        finally:
            os.close(fd)
        return data

    def _row_chunks(self, t: _Tensor, base: int) -> list[tuple[Any, int]]:
        """(chunk, output offset) of each non-empty chunk of a whole-row tensor, in row order;
        CorruptCheckpointError unless they cover its rows exactly once."""
        rows = sorted(_unique(t), key=lambda c: c.box.offsets[0])
        at = 0
        for c in rows:
            if c.box.offsets[0] != at:
                break
            at += c.box.sizes[0]
        if at != t.shape[0]:
            raise CorruptCheckpointError(f"tensor {t.name!r}: its saved chunks do not cover rows 0..{t.shape[0]} "
                                         "exactly once")
        row_out = t.out_bytes(self.dtype) // t.shape[0] if t.shape[0] else 0
        return [(c, base + c.box.offsets[0] * row_out) for c in rows if numel(c.box)]

    def _copy_chunk(self, fd: int, t: _Tensor, c: Any, at: int) -> None:
        """One worker's job: chunk ``c`` read and checked into a free buffer, then written at ``at``."""
        buf = self.free.get()
        try:
            if self.aligned:
                raw = self.cand.read_aligned(c.rank, c.array, buf)
            else:
                raw = self.cand.read(c.rank, c.array, into=buf[:self._chunk_bytes(c)])
            _write_array(fd, _convert(raw.reshape(-1).view(np.uint8).view(TORCH_DTYPES[t.dtype]), t.dtype,
                                      t.out_dtype(self.dtype)), at)
        finally:
            self.free.put(buf)

    def _assembled(self, t: _Tensor) -> np.ndarray:
        chunks = _unique(t)
        total = sum(numel(c.box) for c in chunks)
        crossing = any((ov := overlap(a.box, b.box)) is not None and numel(ov)
                       for i, a in enumerate(chunks) for b in chunks[i + 1:])
        if total != numel(full_box(t.shape)) or crossing:
            raise CorruptCheckpointError(f"tensor {t.name!r}: its saved chunks do not cover it exactly once")
        whole = np.empty(t.shape, dtype=TORCH_DTYPES[t.dtype])
        for c in chunks:
            part = self.cand.read(c.rank, c.array).reshape(-1).view(np.uint8).view(whole.dtype)
            whole[c.box.slices()] = part.reshape(c.box.sizes)
        return _convert(whole, t.dtype, t.out_dtype(self.dtype))


def _workers(biggest: int, converting: bool) -> int:
    """Chunks copied at once: up to WORKERS while their buffers (and, when converting, the
    converted copies: up to three times a chunk) stay within COPY_BUDGET, and never fewer than two
    (one chunk read while another is written), which is what the peak-memory bound assumes."""
    per = biggest * (4 if converting else 1)
    return max(2, min(WORKERS, COPY_BUDGET // per if per else WORKERS))


def _wait_all(futures: list[Future]) -> None:
    """Returns once every future is done; the first failure (in submission order) is raised."""
    for f in futures:
        f.result()


def _write_array(fd: int, arr: np.ndarray, at: int) -> None:
    _pwrite(fd, memoryview(arr.reshape(-1).view(np.uint8)), at)


def _unique(t: _Tensor) -> list[Any]:
    """The chunks, a box stored twice (by two replicas) counted once."""
    seen: dict[Box, Any] = {}
    for c in t.chunks:
        seen.setdefault(c.box, c)
    return list(seen.values())


def _by_rows(t: _Tensor) -> bool:
    """True if every chunk is a run of whole rows: its bytes are one stretch of the tensor's."""
    return len(t.shape) >= 1 and all(tuple(c.box.sizes[1:]) == tuple(t.shape[1:]) and not any(c.box.offsets[1:])
                                     for c in t.chunks)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    _start_writeback(fd, offset, len(data))


def _libc_sync_file_range() -> Callable[..., int] | None:
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback(fd: int, offset: int, n: int) -> None:
    """Starts writing ``n`` bytes at ``offset`` back to the disk without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the disk writes while the next chunks are
    read and the closing fsync waits only for the tail; a no-op where it is missing."""
    if _SYNC_FILE_RANGE is not None and n:
        _SYNC_FILE_RANGE(fd, offset, n, _SYNC_FILE_RANGE_WRITE)


def _convert(a: np.ndarray, src: str, dst: str) -> np.ndarray:
    """``a`` (torch dtype ``src``, in its numpy carrier) as torch dtype ``dst``, as torch's
    ``.to()`` on the CPU rounds: to nearest, ties to even, a NaN stays a NaN."""
    if src == dst:
        return a
    if src == "bfloat16":
        f32 = (a.astype(np.uint32) << 16).view(np.float32)
        return f32 if dst == "float32" else _convert(f32, "float32", dst)
    f32 = a if a.dtype == np.float32 else a.astype(np.float32)
    if dst == "float32":
        return f32
    u = f32.view(np.uint32)
    rounded = ((u + (((u >> 16) & 1) + np.uint32(0x7FFF))) >> 16).astype(np.uint16)
    # A NaN becomes 0xFFFF, the bit pattern torch's CPU conversion gives it (a quiet NaN).
    return np.where(np.isnan(f32), np.uint16(0xFFFF), rounded)


# -- config.json ---------------------------------------------------------------------------------


def _read_config(config: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    if config is None:
        return None
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config {p} does not exist; give the model's config.json "
                          "(model.config.save_pretrained(DIR) writes one)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config {p} is not a readable JSON file: {exc}") from None
    if not isinstance(doc, dict) or "model_type" not in doc:
        raise ConfigError(f"config {p} is not a Hugging Face model config (no \"model_type\")")
    return doc


def _write_config(doc: dict[str, Any], out: Path, floats: set[str]) -> None:
    """config.json with ``dtype`` (``torch_dtype`` before transformers 5) naming the floating
    dtype written, so ``from_pretrained(dtype="auto")`` keeps it; left as given when mixed."""
    doc = dict(doc)
    if len(floats) == 1:
        (name,) = floats
        doc["dtype"] = doc["torch_dtype"] = name
    raw = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    write_durably(out / "config.json", lambda f: f.write(raw))
