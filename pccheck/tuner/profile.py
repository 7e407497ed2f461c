"""The profilers of §3.4: copy bandwidth T_G, storage bandwidth T_S, and T_w under N in flight.

Each profiler is a small function that can be run and tested on its own; :func:`run_profile`
runs them in order for ``pccheck-tune``. Storage is always measured through pccheck's own writer
(a :class:`pccheck.Checkpointer` on a scratch subdirectory of the path under test), since that is
what will run.

The profiling workload is an :class:`EmulatedState`: ``m`` bytes of float32 parameters, touched
once when created (first touch of memory is slow and must never be timed). One emulated training
iteration lasts ``t`` seconds: the host sleeps (waiting for the accelerator's forward and backward
pass), then the update mutates the whole state in place exactly as ``SGD(momentum=0).step()``
does (``p -= lr * grad``: it reads m bytes of parameters and m of gradients and writes m; on a
CPU-only host this is real work, which the copy and the writers compete with, and it is the part
of t the background copy cannot overlap; on a GPU it is a kernel on the device). When torch is installed the state is a
``torch.nn.Module`` whose parameters share the arrays' memory, with an optimizer that performs the
update, so the Checkpointer runs with soft copy-on-write exactly as in training (the copy overlaps
the next iteration; the optimizer step waits for what is left). Without torch the state is a
mapping of numpy arrays, whose copy blocks ``maybe_checkpoint``. With ``device="cuda"`` (torch
with CUDA) the parameters live on the GPU and the copy is device → pinned DRAM.

Call order (what :func:`run_profile` does)::

    state = EmulatedState(m, device)                     # allocate + touch once
    copy_bandwidth(state, b) for b in chunk sizes        # T_G(b)
    storage_bandwidth(dir, state, p, b, ...) ...         # T_S(p, b): threads at 64 MiB, then chunks at p*
    write_time(dir, state, n, t, p*, b*, M) for n = 1..  # T_w(N), a checkpoint every t seconds
    blocked_time(dir, state, t, f, p*, b*, M)            # after N = 1: B with checkpoints f apart
    state.close()
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, PathNotWritableError
from . import model
from .search import pick_storage

__all__ = [
    "EmulatedState",
    "CopySample",
    "StorageSample",
    "WriteTimeSample",
    "ProfileSpec",
    "Profile",
    "BlockedSample",
    "copy_bandwidth",
    "storage_bandwidth",
    "write_time",
    "blocked_time",
    "scratch_subdir",
    "run_profile",
    "DEFAULT_THREADS",
    "DEFAULT_CHUNKS",
    "ProgressFn",
]

log = logging.getLogger("pccheck")

MiB = 1 << 20
BLOCK = 4096
DEFAULT_THREADS: tuple[int, ...] = (1, 2, 3, 4)
DEFAULT_CHUNKS: tuple[int, ...] = (16 * MiB, 64 * MiB, 256 * MiB)
DEFAULT_CHUNK = 64 * MiB     # pccheck's default chunk_size: the thread sweep runs at it
DEFAULT_N_CAP = 4
_N_ARRAYS = 4

# progress(label, done, total): called before each profiling step and once at the end.
ProgressFn = Callable[[str, int, int], None]


# -- the workload ----------------------------------------------------------------------------------

def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


class EmulatedState:
    """``nbytes`` of float32 parameters to checkpoint, touched once, and one cheap mutation.

    Args:
        nbytes: state size m in bytes (rounded down to a multiple of 4, at least 4 KiB).
        device: "cpu", "cuda" (torch tensors on the GPU), or "auto" (cuda if torch sees one).
        use_torch: on the CPU, wrap the arrays in a torch Module + optimizer (soft copy-on-write,
            as in training). Default: when torch is installed. False: a mapping of numpy arrays.

    ``checkpointer_args()`` gives the positional arguments for :class:`pccheck.Checkpointer`;
    ``mutate()`` is the update of one emulated iteration; ``host_bytes()`` a flat uint8 view of the
    state for the CPU copy profiler; ``device_bytes()`` the same on the GPU.
    """

    def __init__(self, nbytes: int, device: str = "cpu", use_torch: bool | None = None) -> None:
        if nbytes < BLOCK:
            raise ConfigError(f"the state to profile must be at least {BLOCK} bytes, got {nbytes}")
        # torch is imported only when it may be used (it takes seconds to import)
        torch = None if (device == "cpu" and use_torch is False) else _torch()
        if device == "auto":
            device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'auto', got {device!r}")
        if device == "cuda" and (torch is None or not torch.cuda.is_available()):
            raise ConfigError("device='cuda' needs torch with a CUDA device; use device='cpu'")
        self.device = device
        self.nbytes = nbytes // 4 * 4
        elems = self.nbytes // 4
        base, extra = divmod(elems, _N_ARRAYS)
        sizes = [base + (1 if i < extra else 0) for i in range(_N_ARRAYS)]
        sizes = [s for s in sizes if s > 0]
        self.use_torch = device == "cuda" or (torch is not None if use_torch is None else bool(use_torch))
        if self.use_torch and torch is None:
            raise ConfigError("use_torch=True but torch is not installed")
        self.arrays: dict[str, Any] = {}
        self.module: Any = None
        self.optimizer: Any = None
        self._grads: list[Any] = []
        # Parameters, and a gradient of the same size (lr already applied) for an SGD-like update.
        if device == "cuda":
            self._flat_dev = torch.full((elems,), 0.5, dtype=torch.float32, device="cuda")
            parts = list(torch.split(self._flat_dev, sizes))
            grads = list(torch.split(torch.full((elems,), 1e-6, dtype=torch.float32, device="cuda"), sizes))
            self._flat_host: np.ndarray | None = None
        else:
            self._flat_host = np.full(elems, 0.5, dtype=np.float32)  # touches every page once
            cuts = np.cumsum(sizes)[:-1]
            parts = list(np.split(self._flat_host, cuts))
            grads = list(np.split(np.full(elems, 1e-6, dtype=np.float32), cuts))
            self._flat_dev = None
        if self.use_torch:
            self.module = torch.nn.Module()
            for i, part in enumerate(parts):
                tensor = part if device == "cuda" else torch.from_numpy(part)
                self.module.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
            tgrads = [g if device == "cuda" else torch.from_numpy(g) for g in grads]
            self.optimizer = _sgd_optimizer(torch, list(self.module.parameters()), tgrads)
            self.arrays = dict(self.module.named_parameters())
        else:
            self.arrays = {f"p{i}": a for i, a in enumerate(parts)}
            self._grads = grads

    def checkpointer_args(self) -> tuple[Any, Any]:
        """(state, optimizer) for ``Checkpointer(state, optimizer, path=...)``."""
        if self.use_torch:
            return self.module, self.optimizer
        return self.arrays, None

    def checkpointer_kwargs(self) -> dict[str, Any]:
        """Extra keyword arguments for the Checkpointer: none. Its defaults are what training runs
        with (for a torch state that includes capturing the RNG states, a few ms per checkpoint)."""
        return {}

    def mutate(self) -> None:
        """The update of one iteration, as ``SGD(momentum=0).step()``: ``p -= lr * grad`` in place
        for every parameter (reads the parameters and the gradients, writes the parameters),
        through the optimizer when there is one, so its step pre-hook guards the copy."""
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            for a, g in zip(self.arrays.values(), self._grads):
                a -= g

    def host_bytes(self) -> np.ndarray:
        """The CPU state as one flat uint8 array (no copy). Only for device == "cpu"."""
        assert self._flat_host is not None
        return self._flat_host.view(np.uint8)

    def device_bytes(self) -> Any:
        """The GPU state as one flat uint8 tensor (no copy). Only for device == "cuda"."""
        assert self._flat_dev is not None
        return self._flat_dev.view(_torch().uint8)

    def close(self) -> None:
        """Drops the references (the memory goes back when nothing else holds it)."""
        self.arrays, self.module, self.optimizer, self._grads = {}, None, None, []
        self._flat_host = self._flat_dev = None


def _sgd_optimizer(torch: Any, params: list[Any], grads: list[Any]) -> Any:
    class _SGD(torch.optim.Optimizer):
        """``p -= g`` for every parameter and its fixed gradient (lr applied): SGD(momentum=0)'s
        memory traffic, through step(), so the Checkpointer's step pre-hook guards it."""

        def __init__(self) -> None:
            super().__init__(params, {})
            self._grads = grads

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for p, g in zip(self.param_groups[0]["params"], self._grads):
                p.sub_(g)

    return _SGD()


# -- results ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CopySample:
    """T_G: bytes per second copying the state into pre-touched (CPU) or pinned (GPU) chunks."""

    chunk_size: int
    bytes_per_s: float
    device: str
    seconds: float  # median time to copy the whole state


@dataclass(frozen=True)
class StorageSample:
    """T_S: bytes per second of one checkpoint through pccheck's writer (start to durable)."""

    writer_threads: int
    chunk_size: int
    bytes_per_s: float
    persist_s: float                  # median seconds per checkpoint
    samples: tuple[float, ...] = ()  # every timed persist_s
    mode: str = "?"                   # the write mode pccheck used: "odirect", "mmap" or "pmem"


@dataclass(frozen=True)
class WriteTimeSample:
    """T_w with N in flight, checkpoints issued every ``iter_time`` seconds (interval 1)."""

    n: int
    tw_s: float          # median seconds from the start of the copy to durable
    tw_max_s: float
    blocked_s: float     # median seconds training lost per checkpoint, permit wait excluded (the
                         # maybe_checkpoint call minus stall_s, plus the next update's extra time)
    stall_s: float       # median seconds waiting for one of the N permits
    checkpoints: int     # how many were measured (after the warm-up)
    period_s: float      # measured seconds between checkpoint starts

    @property
    def tw_per_n(self) -> float:
        """T_w / N in seconds: the quantity N* minimises (§3.4)."""
        return self.tw_s / self.n


@dataclass(frozen=True)
class BlockedSample:
    """B measured end to end: checkpoints spaced ``interval`` iterations apart (far enough that
    none waits for another), each cycle's time minus ``interval`` baseline iterations."""

    interval: int
    blocked_s: float             # median extra seconds per checkpoint cycle
    base_iter_s: float           # seconds per emulated iteration without checkpoints
    cycles: tuple[float, ...]    # every measured extra, seconds


@dataclass(frozen=True)
class ProfileSpec:
    """What to profile and under which constraints (bytes and seconds)."""

    path: Path                       # the store directory whose device is profiled
    state_bytes: int                 # m
    iter_time: float                 # t
    dram_budget: int                 # M, bytes of DRAM chunks
    storage_budget: int              # S, bytes of storage for the store
    threads: tuple[int, ...] = DEFAULT_THREADS
    chunks: tuple[int, ...] = DEFAULT_CHUNKS
    n_cap: int = DEFAULT_N_CAP
    device: str = "auto"
    use_torch: bool | None = None
    storage_repeats: int = 2
    exhaustive: bool = False         # every (threads, chunk) pair and every N, no early stop
    max_overhead: float = 1.03       # q, only for the early stop of the T_w sweep

    def n_max(self) -> int:
        """The largest N tried: ``min(S/m - 1, n_cap)`` (the store holds N+1 slots of m)."""
        return min(self.storage_budget // max(1, self.state_bytes) - 1, self.n_cap)


@dataclass(frozen=True)
class Profile:
    """Everything measured, and how long measuring took."""

    copy: tuple[CopySample, ...]
    storage: tuple[StorageSample, ...]
    write: tuple[WriteTimeSample, ...]
    state_bytes: int
    iter_time: float
    device: str
    soft_cow: bool
    storage_mode: str                # "odirect", "mmap" or "pmem", as pccheck opened the store
    seconds: float                   # wall time of the whole profile
    phases: dict[str, float] = field(default_factory=dict)  # wall seconds per phase
    update_s: float = 0.0            # one emulated update (a pass over the state), no checkpoint running
    blocked: BlockedSample | None = None  # B measured with spaced checkpoints (None: not measured)


# -- the profilers ---------------------------------------------------------------------------------

def host_chunks(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory prepared like the engine's chunk pool: an anonymous mapping with
    transparent huge pages, every page faulted in once (first touch is slow on these machines)."""
    from ..native import _native

    mm = mmap.mmap(-1, max(BLOCK, nbytes))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    _native.prefault(memoryview(mm))
    return np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive


def copy_bandwidth(state: EmulatedState, chunk_size: int, repeats: int = 3,
                   scratch: np.ndarray | None = None) -> CopySample:
    """T_G: copies the whole state into chunks of ``chunk_size`` bytes and returns bytes/second.

    CPU: memcpy (numpy) into two chunk buffers used alternately, prepared as pccheck's chunk pool
    is (:func:`host_chunks`); ``scratch`` (at least 2 chunks of such memory) lets several calls
    share one allocation. GPU: device → pinned host chunks on a separate CUDA stream. The median
    of ``repeats`` timed passes after one untimed pass."""
    if chunk_size < BLOCK:
        raise ConfigError(f"chunk_size must be at least {BLOCK} bytes, got {chunk_size}")
    chunk = min(chunk_size, state.nbytes)
    times = []
    if state.device == "cuda":
        torch = _torch()
        src = state.device_bytes()
        dst = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        stream = torch.cuda.Stream()
        for r in range(repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for i, off in enumerate(range(0, state.nbytes, chunk)):
                    n = min(chunk, state.nbytes - off)
                    dst[i % 2][:n].copy_(src[off:off + n], non_blocking=True)
            stream.synchronize()
            if r:
                times.append(time.perf_counter() - t0)
        del dst
    else:
        src_h = state.host_bytes()
        buf = scratch if scratch is not None and scratch.nbytes >= 2 * chunk else host_chunks(2 * chunk)
        dst_h = [buf[:chunk], buf[chunk:2 * chunk]]
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            for i, off in enumerate(range(0, state.nbytes, chunk)):
                n = min(chunk, state.nbytes - off)
                np.copyto(dst_h[i % 2][:n], src_h[off:off + n])
            if r:
                times.append(time.perf_counter() - t0)
        del dst_h, buf
    med = statistics.median(times)
    return CopySample(chunk_size, state.nbytes / med, state.device, med)


def _checkpointer(path: Path, state: EmulatedState, **kw: Any) -> Any:
    from ..checkpointer import Checkpointer

    st, opt = state.checkpointer_args()
    return Checkpointer(st, opt, path=path, **state.checkpointer_kwargs(), **kw)


def _probe_budget(state_bytes: int, chunk_size: int, writer_threads: int, dram_budget: int | None) -> int:
    """DRAM for a bandwidth probe: enough chunks to keep every writer busy while the copy runs
    ahead (threads + 2), never more than one checkpoint's chunks (a probe has one in flight) nor
    the user's budget. Smaller than the real pool, because each probe allocates and touches its
    pool afresh and first touch is slow."""
    chunk = max(BLOCK, min(chunk_size, state_bytes) // BLOCK * BLOCK)
    want = min(writer_threads + 2, -(-state_bytes // chunk)) * chunk
    if dram_budget is not None:
        want = min(want, dram_budget)
    return max(want, chunk)


def storage_bandwidth(path: str | os.PathLike[str], state: EmulatedState, *, writer_threads: int,
                      chunk_size: int, dram_budget: int | None = None, max_concurrent: int = 1,
                      repeats: int = 2, warmup: int = 1) -> StorageSample:
    """T_S: bytes per second of one checkpoint of ``state`` through a Checkpointer at ``path``.

    Runs ``warmup`` untimed checkpoints, then ``repeats`` timed ones, each ``checkpoint(); wait()``
    alone (one in flight), and takes the median ``persist_s`` (start to durable, the copy into
    the chunks pipelined with the writers). ``dram_budget`` None: a small probe pool (threads + 2
    chunks). ``max_concurrent`` only sizes the store (N+1 slots), so that later probes and
    :func:`write_time` at the same path reuse its file instead of allocating a new one. Use a
    scratch directory: the store written there is meant to be deleted.
    """
    budget = _probe_budget(state.nbytes, chunk_size, writer_threads, dram_budget)
    times: list[float] = []
    with _checkpointer(Path(path), state, interval=1, max_concurrent=max_concurrent,
                       writer_threads=writer_threads, chunk_size=chunk_size, dram_budget=budget) as ck:
        step = (ck.last_durable_step or 0) + 1
        for i in range(warmup + repeats):
            ck.checkpoint(step)
            ck.wait()
            if i >= warmup:
                times.append(ck.stats().checkpoints[-1].persist_s)
            step += 1
        mode = ck.storage  # the store opens lazily (at the first checkpoint) for a torch state
    med = statistics.median(times)
    return StorageSample(writer_threads, chunk_size, state.nbytes / med, med, tuple(times), mode)


def _update_time(state: EmulatedState, iterations: int = 7) -> float:
    """Median seconds of one :meth:`EmulatedState.mutate` with no checkpoint running."""
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        state.mutate()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_time(path: str | os.PathLike[str], state: EmulatedState, *, n: int, iter_time: float,
               writer_threads: int, chunk_size: int, dram_budget: int | None,
               checkpoints: int | None = None, warmup: int | None = None,
               update_s: float | None = None) -> WriteTimeSample:
    """T_w under N concurrent checkpoints, as §3.4 describes: a Checkpointer with
    ``max_concurrent=n`` and ``interval=1`` gets a checkpoint after every emulated iteration of
    ``iter_time`` seconds (sleep ``iter_time - update_s``, then :meth:`EmulatedState.mutate`), so
    one is issued every ``t`` seconds and, when ``T_w > N*t``, N are in flight with maximum
    contention.

    ``warmup`` (default N) checkpoints fill the pipeline untimed; the next ``checkpoints``
    (default max(6, N+2)) are measured. T_w = ``persist_s - stall_s`` (from the start of the
    copy, the permit held, until durable), the median over them. B, the time training loses per
    checkpoint apart from the permit wait: the ``maybe_checkpoint`` call minus ``stall_s``
    (snapshot, planning, any copy it does itself) plus how much longer the next update took than
    ``update_s`` (measured first, without checkpoints, when not given): the optimizer's wait for
    the background copy (``cow_wait_s``) and the copy's and writers' interference with the update.
    Also the median permit wait and the measured period between checkpoint starts.
    """
    if n < 1:
        raise ConfigError(f"n must be >= 1, got {n}")
    if iter_time <= 0:
        raise ConfigError(f"iter_time must be > 0 seconds, got {iter_time}")
    base = _update_time(state) if update_s is None else update_s
    with _checkpointer(Path(path), state, interval=1, max_concurrent=n, writer_threads=writer_threads,
                       chunk_size=chunk_size, dram_budget=dram_budget) as ck:
        return _write_time_on(ck, state, n, iter_time, base, checkpoints, warmup)


def _write_time_on(ck: Any, state: EmulatedState, n: int, iter_time: float, base: float,
                   checkpoints: int | None = None, warmup: int | None = None) -> WriteTimeSample:
    """:func:`write_time` on an open Checkpointer with ``max_concurrent=n``."""
    warm = n if warmup is None else warmup
    k = max(6, n + 2) if checkpoints is None else checkpoints
    ck.interval = 1
    first = (ck.last_durable_step or 0) + 1
    starts: list[float] = []
    calls: dict[int, float] = {}
    updates: dict[int, float] = {}  # step -> seconds of the update right after its checkpoint
    for step in range(first, first + warm + k + 1):
        time.sleep(max(0.0, iter_time - base))  # the host waiting for the accelerator
        u0 = time.perf_counter()
        state.mutate()                          # the update (waits for the previous copy)
        c0 = time.perf_counter()
        updates[step - 1] = c0 - u0
        if step == first + warm + k:
            break                               # the last iteration only times the update
        starts.append(c0)
        ck.maybe_checkpoint(step)               # snapshot, permit (stall_s), eager/blocking copy
        calls[step] = time.perf_counter() - c0
    ck.wait()
    done = [c for c in ck.stats().checkpoints if first + warm <= c.step < first + warm + k and c.outcome != "failed"]
    if not done:
        raise ConfigError("every profiling checkpoint failed; see the log for the storage error")
    tws = [c.persist_s - c.stall_s for c in done]
    blocked = [max(0.0, calls[c.step] - c.stall_s) + max(0.0, updates[c.step] - base) for c in done]
    period = (starts[-1] - starts[warm]) / max(1, len(starts) - 1 - warm) if len(starts) > warm + 1 else iter_time
    return WriteTimeSample(
        n=n,
        tw_s=statistics.median(tws),
        tw_max_s=max(tws),
        blocked_s=statistics.median(blocked),
        stall_s=statistics.median(c.stall_s for c in done),
        checkpoints=len(done),
        period_s=period,
    )


def _iterate(state: EmulatedState, iter_time: float, update_s: float) -> None:
    """One emulated iteration: the accelerator's time (sleep), then the update."""
    time.sleep(max(0.0, iter_time - update_s))
    state.mutate()


def blocked_time(path: str | os.PathLike[str], state: EmulatedState, *, iter_time: float, interval: int,
                 writer_threads: int, chunk_size: int, dram_budget: int | None, cycles: int = 6,
                 update_s: float | None = None) -> BlockedSample:
    """B end to end: what one checkpoint costs training when it does not wait for another.

    A Checkpointer with N = 1; each cycle is one checkpoint call followed by ``2 * interval``
    emulated iterations. Choose ``interval`` so that ``interval * t`` exceeds T_w: then all of a
    checkpoint's effects (the call itself, the optimizer step waiting for the background copy,
    the copy's and the writers' interference with the updates) fall into the first half of its
    cycle, and the second half runs as if nothing were checkpointed. B for a cycle is the first
    half's time (call included) minus ``interval`` times the median clean iteration (of all
    second halves): a baseline measured beside it, so the machine's drift cancels. Returns the
    median over ``cycles`` cycles, after one untimed cycle.
    """
    if interval < 1 or cycles < 1:
        raise ConfigError(f"need interval >= 1 and cycles >= 1, got {interval} and {cycles}")
    u = _update_time(state) if update_s is None else update_s
    with _checkpointer(Path(path), state, interval=1, max_concurrent=1, writer_threads=writer_threads,
                       chunk_size=chunk_size, dram_budget=dram_budget) as ck:
        return _blocked_time_on(ck, state, iter_time, interval, cycles, u, warm=True)


def _blocked_time_on(ck: Any, state: EmulatedState, iter_time: float, interval: int, cycles: int, u: float,
                     warm: bool) -> BlockedSample:
    """:func:`blocked_time` on an open Checkpointer with ``max_concurrent=1``; ``warm``: run one
    untimed cycle first (not needed when the Checkpointer has already checkpointed)."""
    affected: list[float] = []
    clean: list[float] = []
    step = (ck.last_durable_step or 0) + 1
    for cycle in range(cycles + 1 if warm else cycles):
        c0 = time.perf_counter()
        ck.checkpoint(step)
        step += 1
        marks = [c0]
        for _ in range(2 * interval):
            _iterate(state, iter_time, u)
            marks.append(time.perf_counter())
        if warm and cycle == 0:
            continue  # untimed: the first checkpoint opens the store and touches the pool
        d = [b - a for a, b in zip(marks[:-1], marks[1:])]
        affected.append(sum(d[:interval]))
        clean += d[interval:]
    ck.wait()
    t_base = statistics.median(clean)
    extra = [a - interval * t_base for a in affected]
    return BlockedSample(interval, max(0.0, statistics.median(extra)), t_base, tuple(extra))


@contextlib.contextmanager
def scratch_subdir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A fresh ``.pccheck-tune-*`` directory inside ``path`` (created if missing), removed after.
    Raises PathNotWritableError when ``path`` cannot be written."""
    base = Path(path)
    try:
        base.mkdir(parents=True, exist_ok=True)
        sub = Path(tempfile.mkdtemp(prefix=".pccheck-tune-", dir=base))
    except OSError as exc:
        raise PathNotWritableError(f"cannot write to {base} ({exc.strerror or exc}); "
                                   "pass a writable --path (the directory the checkpoints will go to)") from None
    try:
        yield sub
    finally:
        shutil.rmtree(sub, ignore_errors=True)


def run_profile(spec: ProfileSpec, progress: ProgressFn | None = None, tol: float = 0.05) -> Profile:
    """Runs every profiler for ``spec`` on a scratch subdirectory of ``spec.path``; returns all
    measurements (the choice is :func:`pccheck.tuner.search.choose`'s job).

    T_S: the thread counts at 64 MiB chunks (or the one chunk size given) in increasing order until
    one does not beat the best so far by more than ``tol`` (more writers cannot help a saturated
    device), then the chunk sizes at the best thread count (a coordinate search; ``exhaustive``
    for the full grid). T_w: N = 1,
    2, ... up to :meth:`ProfileSpec.n_max`, stopping early (unless ``exhaustive``) once T_w/N stops
    improving by more than ``tol``, or after N = 1 when N > 1 cannot give a smaller interval: the
    iteration time alone covers T_w, or the time a checkpoint blocks training already needs an
    interval at least as long as eq. (3) does.
    """
    n_max = spec.n_max()
    if n_max < 1:
        raise ConfigError(f"the storage budget ({spec.storage_budget} bytes) holds fewer than 2 checkpoints of "
                          f"{spec.state_bytes} bytes; pccheck needs N+1 >= 2 slots: raise --storage-budget")
    free = _free_bytes(spec.path)
    slot = _round_block(spec.state_bytes) + (1 << 20)  # data + manifest room, roughly
    if free is not None and free < (n_max + 1) * slot:
        fits = free // slot - 1
        if fits < 1:
            raise ConfigError(f"{spec.path} has {free} bytes free, too little for a profiling store of 2 x "
                              f"{spec.state_bytes} bytes; free space there or profile a smaller --size")
        log.warning("pccheck-tune: only %d bytes free at %s: trying N up to %d instead of %d",
                    free, spec.path, fits, n_max)
        n_max = fits
    progress = progress or (lambda label, done, total: None)
    chunks = tuple(sorted({min(c, _round_block(spec.state_bytes)) for c in spec.chunks}))
    threads = tuple(sorted(set(spec.threads)))
    base_chunk = DEFAULT_CHUNK if DEFAULT_CHUNK in chunks else (min(chunks, key=lambda c: abs(c - DEFAULT_CHUNK)))
    if spec.exhaustive:
        storage_plan = [(p, c) for p in threads for c in chunks]
    else:
        storage_plan = [(p, base_chunk) for p in threads]  # then (p*, c) for the other chunks
    total = len(chunks) + len(threads) + len(chunks) - 1 + n_max + 2
    done = 0
    phases: dict[str, float] = {}
    t_start = time.perf_counter()

    progress(f"allocating {spec.state_bytes / MiB:.0f} MiB of state", done, total)
    t0 = time.perf_counter()
    state = EmulatedState(spec.state_bytes, spec.device, spec.use_torch)
    phases["setup_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        copies = []
        # One pool-like buffer for every chunk size: it is touched once, not once per size.
        scratch = host_chunks(2 * max(chunks)) if state.device != "cuda" else None
        for c in chunks:
            progress(f"T_G: copy bandwidth, {c / MiB:g} MiB chunks", done, total)
            copies.append(copy_bandwidth(state, c, repeats=2, scratch=scratch))
            done += 1
        del scratch
        phases["copy_s"] = time.perf_counter() - t0

        with scratch_subdir(spec.path) as sub:
            t0 = time.perf_counter()
            storage: list[StorageSample] = []
            first = True
            for p, c in storage_plan:
                progress(f"T_S: {p} writer thread(s), {c / MiB:g} MiB chunks", done, total)
                # The first probe writes every slot once (untimed), so no timed write pays for
                # converting the unwritten extents of a freshly allocated file.
                best = max((x.bytes_per_s for x in storage), default=None)
                storage.append(storage_bandwidth(sub, state, writer_threads=p, chunk_size=c,
                                                 dram_budget=spec.dram_budget, max_concurrent=n_max,
                                                 repeats=spec.storage_repeats, warmup=n_max + 1 if first else 1))
                first = False
                done += 1
                if not spec.exhaustive and best is not None and storage[-1].bytes_per_s <= best * (1.0 + tol):
                    skipped = [q for q, _ in storage_plan if q > p]
                    if skipped:
                        log.info("pccheck-tune: %d writer threads are no faster than fewer (%.2f vs %.2f GB/s): "
                                 "not trying %s", p, storage[-1].bytes_per_s / 1e9, best / 1e9, skipped)
                        done += len(skipped)
                    break
            if not spec.exhaustive:
                p_star = _pick_threads(storage, tol)
                for c in chunks:
                    if c == base_chunk:
                        continue
                    progress(f"T_S: {p_star} writer thread(s), {c / MiB:g} MiB chunks", done, total)
                    storage.append(storage_bandwidth(sub, state, writer_threads=p_star, chunk_size=c,
                                                     dram_budget=spec.dram_budget, max_concurrent=n_max,
                                                     repeats=spec.storage_repeats))
                    done += 1
            phases["storage_s"] = time.perf_counter() - t0
            p_star, b_star = pick_storage(storage, tol)

            t0 = time.perf_counter()
            update_s = _update_time(state)
            if update_s > spec.iter_time:
                log.warning("pccheck-tune: one update pass over the %d-byte state takes %.3f s on this host, more "
                            "than the iteration time t = %.3f s; the emulated iterations last %.3f s",
                            spec.state_bytes, update_s, spec.iter_time, update_s)
            writes: list[WriteTimeSample] = []
            blocked: BlockedSample | None = None
            for n in range(1, n_max + 1):
                progress(f"T_w: N={n} in flight, a checkpoint every {spec.iter_time * 1e3:g} ms", done, total)
                with _checkpointer(sub, state, interval=1, max_concurrent=n, writer_threads=p_star,
                                   chunk_size=b_star, dram_budget=spec.dram_budget) as ck:
                    w = _write_time_on(ck, state, n, spec.iter_time, update_s)
                    writes.append(w)
                    done += 1
                    log.info("pccheck-tune: N=%d: T_w %.3f s (T_w/N %.3f s), blocked %.3f s, stall %.3f s",
                             n, w.tw_s, w.tw_per_n, w.blocked_s, w.stall_s)
                    if n == 1:
                        # B end to end, with checkpoints far enough apart that none stalls (the
                        # same Checkpointer: its pool is allocated and touched once)
                        f_probe = max(2, math.ceil(1.25 * w.tw_s / spec.iter_time))
                        progress(f"B: a checkpoint every {f_probe} iterations", done, total)
                        blocked = _blocked_time_on(ck, state, spec.iter_time, f_probe, 5, update_s, warm=False)
                        log.info("pccheck-tune: B %.3f s per checkpoint at interval %d (cycles %s)",
                                 blocked.blocked_s, f_probe, ", ".join(f"{x:.3f}" for x in blocked.cycles))
                if spec.exhaustive:
                    continue
                if n == 1 and w.tw_s <= spec.iter_time:
                    log.info("pccheck-tune: T_w %.3f s <= t %.3f s: more than one in flight cannot help", w.tw_s,
                             spec.iter_time)
                    break
                if n == 1 and spec.max_overhead > 1 and blocked is not None and blocked.blocked_s > 0 and (
                        model.min_interval(0.0, 1, spec.max_overhead, spec.iter_time, blocked.blocked_s)
                        >= model.interval_eq3(w.tw_s, 1, spec.max_overhead, spec.iter_time)):
                    # The time each checkpoint costs training, not T_w, sets the interval; it does
                    # not shrink with more in flight, so a larger N cannot give a smaller interval.
                    log.info("pccheck-tune: B %.3f s per checkpoint limits the interval, not T_w: N=1 suffices",
                             blocked.blocked_s)
                    break
                best = min(x.tw_per_n for x in writes[:-1]) if n > 1 else None
                if best is not None and w.tw_per_n > best * (1.0 - tol):
                    break  # T_w/N stopped improving: larger N only adds contention (§3.4)
            phases["write_s"] = time.perf_counter() - t0
            mode = storage[0].mode
        progress("done", total, total)
    finally:
        state.close()
    return Profile(tuple(copies), tuple(storage), tuple(writes), state_bytes=spec.state_bytes // 4 * 4,
                   iter_time=spec.iter_time, device=state.device, soft_cow=state.use_torch,
                   storage_mode=mode, seconds=time.perf_counter() - t_start, phases=phases, update_s=update_s,
                   blocked=blocked)


def _pick_threads(storage: Sequence[StorageSample], tol: float) -> int:
    return pick_storage(storage, tol)[0]


def _round_block(n: int) -> int:
    return max(BLOCK, (n + BLOCK - 1) // BLOCK * BLOCK)


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None
