"""The checkpointing systems every benchmark compares pccheck with, each defined once, in two layers.

*How each system saves and loads* (module functions, used by :mod:`bench.micro.persist`,
:mod:`bench.micro.recovery`, the training-loop systems below and :mod:`bench.gpu.gpu_train`): ``torch_save``
(:func:`torch_save_durable`, :func:`torch_load`), ``safetensors`` (:func:`safetensors_save_durable`,
:func:`safetensors_load`), DCP (:func:`dcp_writer`, :func:`dcp_async_save`, :func:`dcp_upload`,
:func:`dcp_save`, :func:`dcp_load`), the device limit ``raw_odirect`` (:func:`pieces`,
:func:`odirect_share`) and ``pccheck`` on host arrays (:func:`pccheck_on_arrays`).

*The systems inside a training loop* (:class:`LoopSystem` and :func:`make_loop_system`, used by
:mod:`bench.training.overhead`'s cells and the figures built on them), by the name they carry in every result:

``none``          no checkpointing.
``torch_save``    synchronous :func:`torch_save_durable` of ``{"model": sd, "optim": osd}``; the previous
                  file is deleted once the new one is durable.
``dcp_async``     :func:`dcp_async_save` of the same, at most one in flight as users write it: the
                  previous save is awaited before the next starts (the one before it is then deleted).
``checkfreq``     the CheckFreq (FAST'21) policy: one checkpoint in flight; a background thread snapshots
                  the state into a preallocated, pre-touched DRAM copy (reused), then persists that copy
                  with :func:`torch_save_durable`. The next ``optimizer.step()`` waits until the snapshot is
                  taken (an optimizer pre-hook), the next checkpoint until the previous one is durable.
``gpm``           the GPM policy (PCcheck §5.1): training stalls while the state is copied straight into a
                  preallocated, mapped file (two slots used in turn) and ``msync``'d, then an 8-byte commit
                  record is written and ``msync``'d. No DRAM staging, nothing overlaps.
``pccheck_N{n}[_p{p}][_c{MiB}][_b{x}m]``
                  ``pccheck.Checkpointer(model, optimizer, path=new dir, interval=interval, max_concurrent=n,
                  writer_threads=p (2), chunk_size=MiB (64), dram_budget=x times the state (default: the
                  cell's, else pccheck's 2x))``; soft copy-on-write on, ``when_busy="block"``.
``pccheck_tuned`` the same with the (N, p, chunk) the tuner chose (``tuned=``).

With ``lag=True``, ``checkfreq`` and ``dcp_async`` also record per checkpoint the time from the call
until it is durable (``tw_s``, the goodput replay's lag). torch, safetensors and pccheck are imported
only by the functions that need them.
"""

from __future__ import annotations

import abc
import copy
import mmap
import os
import re
import shutil
import struct
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import median_or_none
from bench.harness.workloads import Workload

__all__ = [
    "CHUNK", "ALIGN", "COLORS", "fsync_path", "torch_tensors", "torch_save_durable", "torch_load",
    "safetensors_save_durable", "safetensors_load", "quiet_dcp_warnings", "dcp_writer", "dcp_async_save", "dcp_upload",
    "dcp_save", "dcp_load", "pccheck_on_arrays", "pieces", "odirect_share", "LoopSystem", "Lag",
    "make_loop_system", "parse_pccheck_name", "n_in_flight",
]

CHUNK = 64 << 20  # pccheck's chunk_size (its default, stated for the DRAM budget arithmetic); raw O_DIRECT piece
ALIGN = 4096      # O_DIRECT alignment of buffer, offset and length (>= the logical block size)
_MIB = 1 << 20
_PAGE = mmap.PAGESIZE
_PCCHECK_RE = re.compile(r"^pccheck_N(\d+)(?:_p(\d+))?(?:_c(\d+))?(?:_b(\d+(?:\.\d+)?)m)?$")

COLORS = {  # one color per system in every figure
    "none": "black", "ideal": "grey", "torch_save": "#1f77b4", "dcp_async": "#ff7f0e", "checkfreq": "#9467bd",
    "gpm": "#8c564b", "pccheck_N1": "#bcbd22", "pccheck_N2": "#2ca02c", "pccheck_N3": "#17becf",
    "pccheck_N4": "#e377c2", "pccheck_tuned": "#d62728",
    "pccheck": "#d62728", "raw_odirect": "black", "safetensors": "#17becf",  # Figure 11's
}


# -- how each system saves and loads ---------------------------------------------------------------------

def fsync_path(path: Path) -> None:
    """``fsync`` a file (or directory) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_tensors(state: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """torch tensors sharing the numpy arrays' memory (no copy)."""
    import torch

    return {k: torch.from_numpy(v) for k, v in state.items()}


def torch_save_durable(obj: Any, path: Path) -> None:
    """``torch.save`` to a new file, then flush + ``fsync``."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path: Path) -> Any:
    """``torch.load`` of a tensor file into fresh memory (no mapping)."""
    import torch

    return torch.load(path, mmap=False, weights_only=True)


def safetensors_save_durable(tensors: Mapping[str, Any], path: Path) -> None:
    """``safetensors.torch.save_file`` to a new file, then ``fsync`` it."""
    from safetensors.torch import save_file

    save_file(tensors, path)
    fsync_path(path)


def safetensors_load(path: Path) -> dict[str, Any]:
    """``safetensors.torch.load_file``, then one byte of every page read: load_file maps the file
    lazily, and without this nothing would be read from disk."""
    import torch
    from safetensors.torch import load_file

    out = load_file(path)
    for t in out.values():
        flat = t.reshape(-1).view(torch.uint8)
        if flat.numel():
            flat[::4096].sum()
    return out


def quiet_dcp_warnings() -> None:
    """Silence the warning DCP raises (from its save thread too) even with ``no_dist=True``: one
    process is what the benchmarks mean."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


def dcp_writer(out: Path) -> Any:
    """DCP's writer into the new directory ``out``, every file fsync'd."""
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(out, sync_files=True)


def dcp_async_save(state: Any, writer: Any, stager: Any = None, process: bool = False) -> Any:
    """Start ``async_save`` of ``state`` through ``writer`` (:func:`dcp_writer`), with ``stager`` as its
    ``async_stager`` where given (else DCP's default staging); returns DCP's response. ``process``:
    the save runs in DCP's checkpoint process (``AsyncCheckpointerType.PROCESS``), which needs the
    default process group (one rank of gloo will do)."""
    from torch.distributed.checkpoint import async_save

    extra: dict[str, Any] = {"async_stager": stager} if stager is not None else {}
    if process:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        return async_save(state, storage_writer=writer, async_checkpointer_type=AsyncCheckpointerType.PROCESS, **extra)
    # no_dist: one process, no process group (DCP would assume the same, with a warning).
    return async_save(state, storage_writer=writer, no_dist=True, **extra)


def dcp_upload(response: Any) -> Any:
    """The future that completes when an ``async_save`` is durable (an AsyncSaveResponse's
    ``upload_completion`` with async stagers, else the future itself)."""
    return getattr(response, "upload_completion", response)


def dcp_save(state: Any, out: Path) -> None:
    """The synchronous ``dcp.save`` of ``state`` into the new directory ``out``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp_writer(out), no_dist=True)


def dcp_load(shapes: Mapping[str, tuple[tuple[int, ...], Any]], src: Path) -> dict[str, Any]:
    """``dcp.load`` into freshly allocated tensors of the given (shape, numpy dtype)."""
    import torch
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.from_numpy(np.empty(shape, dtype=dt)) for k, (shape, dt) in shapes.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(src), no_dist=True)
    return sd


def pccheck_on_arrays(state: Mapping[str, Any], path: Path, storage: str = "auto") -> Any:
    """The persist and recovery benches' Checkpointer: N = 2, p = 2, 64 MiB chunks, full checkpoints
    (their state never changes: an incremental one would write nothing; bench.incremental times that)."""
    import pccheck

    if not hasattr(pccheck, "Checkpointer"):  # e.g. the bare source tree, not the built package
        raise RuntimeError(
            f"pccheck imported from {getattr(pccheck, '__path__', '?')} has no Checkpointer; build and "
            "install it (make setup), or leave pccheck out of --systems")
    path.mkdir(parents=True, exist_ok=True)
    return pccheck.Checkpointer(dict(state), path=path, interval=1, max_concurrent=2, writer_threads=2,
                                chunk_size=CHUNK, storage=storage, incremental=False)


def pieces(length: int, piece: int = CHUNK) -> list[tuple[int, int]]:
    """(offset, length) of the ``piece``-byte parts of ``length`` bytes (the last one shorter)."""
    return [(o, min(piece, length - o)) for o in range(0, length, piece)]


def odirect_share(fd: int, buf: mmap.mmap, parts: list[tuple[int, int]], first: int, stride: int, *,
                  write: bool, base: int = 0) -> None:
    """One thread's share of an O_DIRECT transfer: parts ``first``, ``first + stride``, ... between
    ``buf`` (at their offset) and the file (at ``base`` + their offset), ``pwrite`` or ``preadv``.
    A short transfer leaves an aligned remainder on block devices; it is continued."""
    with memoryview(buf) as mv:
        for off, length in parts[first::stride]:
            done = 0
            while done < length:
                view, at = mv[off + done:off + length], base + off + done
                n = os.pwrite(fd, view, at) if write else os.preadv(fd, [view], at)
                if n <= 0:
                    raise OSError(f"O_DIRECT {'write' if write else 'read'} returned {n} at offset {at}")
                done += n


# -- the systems inside a training loop ---------------------------------------------------------------

def _window_info(**window: Any) -> dict[str, Any]:
    """An info() result in the shape bench.overhead prints (keys it reads, None where not measured)."""
    keys = ("tw_s", "median_stall_s", "median_blocked_copy_s", "median_cow_wait_s", "median_copy_s",
            "median_persist_s")
    return {"window": {**{k: None for k in keys}, **window}}


class Lag:
    """Per-checkpoint (step, call time, durable time), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[int, float] = {}
        self.done: dict[int, float] = {}

    def call(self, step: int) -> None:
        with self._lock:
            self.calls[step] = time.perf_counter()

    def durable(self, step: int) -> None:
        with self._lock:
            self.done[step] = time.perf_counter()

    def window(self, window: tuple[int, int]) -> dict[str, Any]:
        """The median call-to-durable time of the checkpoints called in ``window`` (both ends in)."""
        lo, hi = window
        with self._lock:
            lags = [self.done[s] - self.calls[s] for s in self.calls if lo <= s <= hi and s in self.done]
        return _window_info(tw_s=median_or_none(lags), count=len(lags))


class LoopSystem(abc.ABC):
    """One checkpointing policy inside the training loop.

    Call order: ``__init__(workload, workdir, interval)`` (untimed; may preallocate) →
    ``warmup(step) -> next step`` (untimed: checkpoints and waits for them) → ``after_step(s)`` after
    the update of every step s (the untimed c0, then the timed window) → ``drain()`` (untimed: waits for
    what is in flight) → ``info()`` → ``close()``.
    """

    name: str = "?"

    def __init__(self, wl: Workload, workdir: Path, interval: int) -> None:
        self.wl, self.dir, self.interval = wl, workdir, interval
        workdir.mkdir(parents=True, exist_ok=True)

    def warmup(self, step: int) -> int:
        """One checkpoint of the current state, waited for; returns the next step number."""
        self.wl.step()
        self.checkpoint(step)
        self.drain()
        return step + 1

    def after_step(self, step: int) -> bool:
        """Checkpoint after ``step`` if the interval says so; True if it did."""
        if step % self.interval:
            return False
        self.checkpoint(step)
        return True

    @abc.abstractmethod
    def checkpoint(self, step: int) -> None:
        """Checkpoint the state after step ``step``; return when training may go on."""

    def drain(self) -> None:
        """Wait for every checkpoint in flight."""

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        """What the system measured about the checkpoints of the timed window (empty: nothing)."""
        return {}

    def close(self) -> None:
        """Release files, threads and buffers."""

    def _state(self) -> dict[str, Any]:
        return {"model": self.wl.model.state_dict(), "optim": self.wl.optimizer.state_dict()}


class _None(LoopSystem):
    name = "none"

    def warmup(self, step: int) -> int:
        return step

    def after_step(self, step: int) -> bool:
        return False

    def checkpoint(self, step: int) -> None:  # never called
        pass


class _TorchSave(LoopSystem):
    name = "torch_save"

    def __init__(self, wl: Workload, workdir: Path, interval: int) -> None:
        super().__init__(wl, workdir, interval)
        self._prev: Path | None = None

    def checkpoint(self, step: int) -> None:
        path = self.dir / f"ckpt-{step}.pt"
        torch_save_durable(self._state(), path)
        if self._prev is not None:  # keep the newest durable checkpoint only
            self._prev.unlink()
        self._prev = path


class _DCPAsync(LoopSystem):
    name = "dcp_async"

    def __init__(self, wl: Workload, workdir: Path, interval: int, lag: Lag | None = None) -> None:
        super().__init__(wl, workdir, interval)
        quiet_dcp_warnings()
        self._fut: Any = None
        self._dirs: list[Path] = []
        self._lag = lag

    def _wait_previous(self) -> None:
        if self._fut is not None:
            dcp_upload(self._fut).result()
            self._fut = None
        while len(self._dirs) > 1:  # the newest completed checkpoint stays
            shutil.rmtree(self._dirs.pop(0))

    def checkpoint(self, step: int) -> None:
        self._wait_previous()  # at most one in flight, as users write it
        if self._lag is not None:
            self._lag.call(step)
        out = self.dir / f"step-{step}"
        self._dirs.append(out)
        self._fut = dcp_async_save(self._state(), dcp_writer(out))
        if self._lag is not None:
            lag = self._lag
            dcp_upload(self._fut).add_done_callback(lambda f, s=step: f.exception() is None and lag.durable(s))

    def drain(self) -> None:
        self._wait_previous()

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        return {} if self._lag is None else self._lag.window(window)


class _CheckFreq(LoopSystem):
    """CheckFreq (FAST'21) policy: pipelined snapshot into a reused DRAM copy, then persist; one in flight."""

    name = "checkfreq"

    def __init__(self, wl: Workload, workdir: Path, interval: int, lag: Lag | None = None) -> None:
        import torch

        super().__init__(wl, workdir, interval)
        self._live = dict(wl.tensors())
        with torch.no_grad():  # preallocate and pre-touch the DRAM copy once; reused by every checkpoint
            self._snap = {k: v.detach().clone() for k, v in self._live.items()}
        self._snapped = threading.Event()
        self._snapped.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._prev: Path | None = None
        self._lag = lag
        self._hook = wl.optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._snapped.wait()  # the update must not run before the snapshot is taken

    def _run(self, step: int, groups: Any) -> None:
        import torch

        try:
            try:
                with torch.no_grad():
                    for k, v in self._live.items():
                        self._snap[k].copy_(v)
            finally:
                self._snapped.set()
            path = self.dir / f"ckpt-{step}.pt"
            torch_save_durable({"tensors": self._snap, "param_groups": groups}, path)
            if self._prev is not None:
                self._prev.unlink()
            self._prev = path
            if self._lag is not None:
                self._lag.durable(step)
        except BaseException as exc:  # surfaced on the training thread at the next checkpoint
            self._error = exc

    def checkpoint(self, step: int) -> None:
        self.drain()  # one in flight: the previous persist must be done
        if self._lag is not None:
            self._lag.call(step)
        self._snapped.clear()
        groups = copy.deepcopy(self.wl.optimizer.state_dict()["param_groups"])
        self._thread = threading.Thread(target=self._run, args=(step, groups), name="checkfreq", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"checkfreq background checkpoint failed: {err!r}") from err

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        return {} if self._lag is None else self._lag.window(window)

    def close(self) -> None:
        self._hook.remove()
        self.drain()


class _PCCheck(LoopSystem):
    """pccheck with N = ``n``, ``writer_threads``, ``chunk`` and ``dram_budget`` (None: pccheck's 2x).
    A configured name (not plain ``pccheck_N{n}``) also reports the threads and chunk it asked for."""

    def __init__(self, wl: Workload, workdir: Path, interval: int, n: int, dram_budget: int | None, *,
                 writer_threads: int = 2, chunk: int = CHUNK, name: str | None = None) -> None:
        import pccheck

        super().__init__(wl, workdir, interval)
        self.n, self.name, self.p, self.chunk = n, name or f"pccheck_N{n}", writer_threads, chunk
        self.ck = pccheck.Checkpointer(wl.model, wl.optimizer, path=workdir, interval=interval,
                                       max_concurrent=n, writer_threads=writer_threads, chunk_size=chunk,
                                       dram_budget=dram_budget)
        self._dram_budget_arg = dram_budget

    def warmup(self, step: int) -> int:
        # N+1 checkpoints back to back: the slots are used round-robin, so each of the N+1 is written
        # once and no timed write converts the unwritten extents posix_fallocate left.
        for _ in range(self.n + 1):
            self.wl.step()
            if not self.ck.checkpoint(step):
                raise RuntimeError(f"{self.name}: warm-up checkpoint of step {step} was skipped")
            step += 1
        self.ck.wait()
        return step

    def after_step(self, step: int) -> bool:
        return self.ck.maybe_checkpoint(step)

    def checkpoint(self, step: int) -> None:  # not used: maybe_checkpoint decides
        self.ck.checkpoint(step)

    def drain(self) -> None:
        self.ck.wait()

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        from pccheck.orchestrator.orchestrator import chunk_geometry

        d = self.ck.stats().as_dict()
        lo, hi = window
        # The checkpoints whose background work (copy-on-write wait, persist) falls inside the timed
        # window: c0 (step lo, started just before it) .. c(k-1). The last call's (step hi) falls after it.
        win = [c for c in d["checkpoints"] if lo <= c["step"] < hi and c["outcome"] != "failed"]
        nbytes = d["checkpoints"][-1]["nbytes"] if d["checkpoints"] else 0
        # The geometry of the default chunk size, as every result so far reports it; a configured
        # system adds the chunk size it asked for (chunk_bytes_requested).
        chunk, count = chunk_geometry(nbytes, CHUNK, self._dram_budget_arg)
        tws = [c["persist_s"] - c["stall_s"] for c in win]
        out = {
            "storage": self.ck.storage, "checkpoint_bytes": nbytes, "dram_budget_bytes": chunk * count,
            "chunk_bytes": chunk, "chunks": count,
            "summary": d["summary"],  # pccheck's own summary: every checkpoint of the cell, warm-up included
            "window": {
                "steps": [lo, hi], "checkpoints": win, "count": len(win),
                "outcomes": sorted({c["outcome"] for c in win}),
                **{f"median_{k}": median_or_none([c[k] for c in win])
                   for k in ("stall_s", "blocked_copy_s", "cow_wait_s", "copy_s", "backpressure_s", "persist_s")},
                "max_cow_wait_s": max((c["cow_wait_s"] for c in win), default=None),
                "tw_s": median_or_none(tws),  # start (permit held) until durable
            },
        }
        if self.name != f"pccheck_N{self.n}":
            out.update({"writer_threads": self.p, "chunk_bytes_requested": self.chunk})
        return out

    def close(self) -> None:
        self.ck.close()


class _GPM(LoopSystem):
    """Stall, copy into the mapped file, msync, commit (see the module docstring)."""

    name = "gpm"

    def __init__(self, wl: Workload, workdir: Path, interval: int) -> None:
        super().__init__(wl, workdir, interval)
        self._layout = []
        off = 0
        for name, t in wl.tensors():
            nb = t.numel() * t.element_size()
            self._layout.append((name, off, nb))
            off += -(-nb // 64) * 64
        self._slot = max(_PAGE, -(-off // _PAGE) * _PAGE)
        size = _PAGE + 2 * self._slot
        self._fd = os.open(workdir / "gpm.bin", os.O_RDWR | os.O_CREAT, 0o644)
        os.posix_fallocate(self._fd, 0, size)
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._view = np.frombuffer(self._mm, dtype=np.uint8)
        self._next = 0
        self._times: dict[int, float] = {}

    def warmup(self, step: int) -> int:
        for _ in range(2):  # both slots written once: no timed write allocates file pages
            self.wl.step()
            self.checkpoint(step)
            step += 1
        return step

    def checkpoint(self, step: int) -> None:
        t0 = time.perf_counter()
        slot = self._next
        base = _PAGE + slot * self._slot
        tensors = self.wl.tensors()
        if [(n, t.numel() * t.element_size()) for n, t in tensors] != [(n, nb) for n, _, nb in self._layout]:
            raise RuntimeError("gpm: the state changed shape; the benchmark expects a fixed state")
        import torch

        with torch.no_grad():
            for (_, t), (_, off, nb) in zip(tensors, self._layout):
                if nb:
                    src = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
                    self._view[base + off:base + off + nb] = src
        self._mm.flush(base, self._slot)        # the data durable before the record that names it
        struct.pack_into("<QQ", self._mm, 0, step, slot)
        self._mm.flush(0, _PAGE)                # the commit record durable: now step is recoverable
        self._next = 1 - slot
        self._times[step] = time.perf_counter() - t0

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        lo, hi = window
        xs = [v for s, v in self._times.items() if lo <= s <= hi]
        return _window_info(tw_s=0.0, median_stall_s=median_or_none(xs), count=len(xs))

    def close(self) -> None:
        del self._view
        self._mm.close()
        os.close(self._fd)


def parse_pccheck_name(name: str) -> dict[str, Any] | None:
    """``pccheck_N2_p1_c16_b0.5m`` -> {n: 2, p: 1, chunk: 16 MiB, budget_x: 0.5}; None if not one."""
    m = _PCCHECK_RE.match(name)
    if not m:
        return None
    return {"n": int(m.group(1)), "p": int(m.group(2) or 2), "chunk": int(m.group(3) or 64) * _MIB,
            "budget_x": float(m.group(4)) if m.group(4) else None}


def n_in_flight(system: str, tuned: Mapping[str, int] | None = None) -> int:
    """Checkpoints a system may have in flight (``tuned``: the tuner's pick, for ``pccheck_tuned``)."""
    if system == "pccheck_tuned":
        return (tuned or {"n": 1})["n"]
    cfg = parse_pccheck_name(system)
    return cfg["n"] if cfg else 1


def make_loop_system(name: str, wl: Workload, workdir: Path, interval: int, dram_budget: int | None, *,
                     lag: bool = False, tuned: Mapping[str, int] | None = None) -> LoopSystem:
    """The system called ``name`` (see the module docstring) for one cell of the training loop.
    ``lag``: checkfreq and dcp_async record call-to-durable times; ``tuned``: {n, p, chunk} of
    ``pccheck_tuned``."""
    if name == "pccheck_tuned":
        if tuned is None:
            raise RuntimeError("pccheck_tuned needs the tuner's choice (tuned=)")
        return _PCCheck(wl, workdir, interval, tuned["n"], dram_budget, writer_threads=tuned["p"],
                        chunk=tuned["chunk"], name=name)
    cfg = parse_pccheck_name(name)
    if cfg is not None:
        budget = dram_budget if cfg["budget_x"] is None else int(cfg["budget_x"] * wl.state_bytes())
        return _PCCheck(wl, workdir, interval, cfg["n"], budget, writer_threads=cfg["p"], chunk=cfg["chunk"],
                        name=name)
    if name in ("dcp_async", "checkfreq"):
        cls = _DCPAsync if name == "dcp_async" else _CheckFreq
        return cls(wl, workdir, interval, Lag() if lag else None)
    systems: dict[str, type[LoopSystem]] = {c.name: c for c in (_None, _TorchSave, _GPM)}
    if name not in systems:
        raise ValueError(f"unknown system {name!r}")
    return systems[name](wl, workdir, interval)
