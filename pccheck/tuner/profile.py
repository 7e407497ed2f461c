"""The profilers of §3.4: copy bandwidth T_G, storage bandwidth T_S, and T_w under N in flight.

Each profiler is a small function that can be run and tested on its own; :func:`run_profile`
runs them in order for ``pccheck-tune``. Storage is always measured through pccheck's own writer
(a Checkpointer on a scratch subdirectory of the path under test), since that is what will run.
The caller hands the profilers the Checkpointer class (``pccheck.Checkpointer``, or any callable
with its signature): the tuner sits beside the front-end, not below it, and does not import it.

The profiling workload is an :class:`~pccheck.tuner.workload.EmulatedState` (its module says what
one emulated iteration does); the results are the plain types of :mod:`pccheck.tuner.samples`,
re-exported here.

Call order (what :func:`run_profile` does)::

    state = EmulatedState(m, device)                     # allocate + touch once
    copy_bandwidth(state, b) for b in chunk sizes        # T_G(b)
    storage_bandwidth(dir, state, ck, p, b, ...) ...     # T_S(p, b): threads at 64 MiB, then chunks at p*
    write_time(dir, state, ck, n, t, p*, b*, M) for n = 1..  # T_w(N), a checkpoint every t seconds
    blocked_time(dir, state, ck, t, f, p*, b*, M)        # after N = 1: B with checkpoints f apart
    state.close()

(``ck`` is the Checkpointer class.)
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, PathNotWritableError
from ..persist.reader import fresh_buffer, prefault
from . import model
from .samples import (
    DEFAULT_CHUNKS,
    DEFAULT_N_CAP,
    DEFAULT_THREADS,
    BlockedSample,
    CopySample,
    Profile,
    ProfileSpec,
    ProgressFn,
    StorageSample,
    WriteTimeSample,
)
from .search import pick_storage
from .workload import BLOCK, EmulatedState

__all__ = [
    "EmulatedState",
    "CopySample",
    "StorageSample",
    "WriteTimeSample",
    "ProfileSpec",
    "Profile",
    "BlockedSample",
    "CheckpointerFactory",
    "copy_bandwidth",
    "storage_bandwidth",
    "write_time",
    "blocked_time",
    "host_chunks",
    "scratch_subdir",
    "run_profile",
    "DEFAULT_THREADS",
    "DEFAULT_CHUNKS",
    "DEFAULT_N_CAP",
    "ProgressFn",
]

log = logging.getLogger("pccheck")

MiB = 1 << 20
DEFAULT_CHUNK = 64 * MiB     # pccheck's default chunk_size: the thread sweep runs at it

# The Checkpointer class the profilers measure through, passed in by the caller (pccheck.Checkpointer
# or a callable with its signature): ``checkpointer(state, optimizer, path=..., **settings)`` gives
# a Checkpointer that is used as a context manager.
CheckpointerFactory = Callable[..., Any]


# -- the profilers ---------------------------------------------------------------------------------

def host_chunks(nbytes: int) -> np.ndarray:
    """``nbytes`` of host memory prepared like the engine's chunk pool: an anonymous mapping with
    transparent huge pages, every page faulted in once (first touch is slow on these machines)."""
    buf = fresh_buffer(max(BLOCK, nbytes))
    prefault(memoryview(buf))
    return buf


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
        import torch  # a CUDA state exists only where torch does
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


def _open(checkpointer: CheckpointerFactory, path: Path, state: EmulatedState, **settings: Any) -> Any:
    """A Checkpointer of ``state`` at ``path`` with ``settings`` (interval, max_concurrent, ...)."""
    st, opt = state.checkpointer_args()
    return checkpointer(st, opt, path=path, **state.checkpointer_kwargs(), **settings)


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


def storage_bandwidth(path: str | os.PathLike[str], state: EmulatedState, checkpointer: CheckpointerFactory, *,
                      writer_threads: int,
                      chunk_size: int, dram_budget: int | None = None, max_concurrent: int = 1,
                      repeats: int = 2, warmup: int = 1) -> StorageSample:
    """T_S: bytes per second of one checkpoint of ``state`` through a ``checkpointer`` at ``path``.

    Runs ``warmup`` untimed checkpoints, then ``repeats`` timed ones, each ``checkpoint(); wait()``
    alone (one in flight), and takes the median ``persist_s`` (start to durable, the copy into
    the chunks pipelined with the writers). ``dram_budget`` None: a small probe pool (threads + 2
    chunks). ``max_concurrent`` only sizes the store (N+1 slots), so that later probes and
    :func:`write_time` at the same path reuse its file instead of allocating a new one. Use a
    scratch directory: the store written there is meant to be deleted.
    """
    budget = _probe_budget(state.nbytes, chunk_size, writer_threads, dram_budget)
    times: list[float] = []
    with _open(checkpointer, Path(path), state, interval=1, max_concurrent=max_concurrent,
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
    """Median seconds of one :meth:`EmulatedState.mutate` with no checkpoint running, after one
    untimed update (the first one may still fault pages in or warm caches)."""
    state.mutate()
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        state.mutate()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_time(path: str | os.PathLike[str], state: EmulatedState, checkpointer: CheckpointerFactory, *,
               n: int, iter_time: float,
               writer_threads: int, chunk_size: int, dram_budget: int | None,
               checkpoints: int | None = None, warmup: int | None = None,
               update_s: float | None = None) -> WriteTimeSample:
    """T_w under N concurrent checkpoints, as §3.4 describes: a ``checkpointer`` with
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
    with _open(checkpointer, Path(path), state, interval=1, max_concurrent=n, writer_threads=writer_threads,
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
    """One emulated iteration: the accelerator's time (sleep), then the update.

    An iteration takes at least ``iter_time``: when the update ran faster than ``update_s`` (the
    estimate was taken on a busier moment), the rest of ``iter_time`` is slept after it. An update
    slowed by a checkpoint still lengthens the iteration, which is what the profiles measure."""
    t0 = time.perf_counter()
    time.sleep(max(0.0, iter_time - update_s))
    state.mutate()
    left = iter_time - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)


def blocked_time(path: str | os.PathLike[str], state: EmulatedState, checkpointer: CheckpointerFactory, *,
                 iter_time: float, interval: int,
                 writer_threads: int, chunk_size: int, dram_budget: int | None, cycles: int = 6,
                 update_s: float | None = None) -> BlockedSample:
    """B end to end: what one checkpoint costs training when it does not wait for another.

    A ``checkpointer`` with N = 1; each cycle is one checkpoint call followed by ``2 * interval``
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
    with _open(checkpointer, Path(path), state, interval=1, max_concurrent=1, writer_threads=writer_threads,
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


def run_profile(spec: ProfileSpec, checkpointer: CheckpointerFactory, progress: ProgressFn | None = None,
                tol: float = 0.05) -> Profile:
    """Runs every profiler for ``spec`` on a scratch subdirectory of ``spec.path``, through
    ``checkpointer`` (the Checkpointer class, ``pccheck.Checkpointer``); returns all measurements
    (the choice is :func:`pccheck.tuner.search.choose`'s job). ``progress`` is told of each step.

    T_S: the thread counts at 64 MiB chunks (or the one chunk size given) in increasing order until
    one does not beat the best so far by more than ``tol`` (more writers cannot help a saturated
    device), then the chunk sizes at the best thread count (a coordinate search; ``exhaustive``
    for the full grid). T_w: N = 1,
    2, ... up to :meth:`ProfileSpec.n_max`, stopping early (unless ``exhaustive``) once T_w/N stops
    improving by more than ``tol``, or after N = 1 when N > 1 cannot give a smaller interval: the
    iteration time alone covers T_w, or the time a checkpoint blocks training already needs an
    interval at least as long as eq. (3) does.
    """
    run = _Run(spec, checkpointer, _n_max_that_fits(spec), progress, tol)
    t_start = time.perf_counter()
    run.step(f"allocating {spec.state_bytes / MiB:.0f} MiB of state")
    with run.phase("setup_s"):
        state = EmulatedState(spec.state_bytes, spec.device, spec.use_torch)
    try:
        with run.phase("copy_s"):
            copies = run.copy_sweep(state)
        with scratch_subdir(spec.path) as sub:
            with run.phase("storage_s"):
                storage = run.storage_sweep(sub, state)
            p_star, b_star = pick_storage(storage, tol)
            with run.phase("write_s"):
                update_s = run.update_time(state)
                writes, blocked = run.write_sweep(sub, state, p_star, b_star, update_s)
        run.finish()
    finally:
        state.close()
    return Profile(tuple(copies), tuple(storage), tuple(writes), state_bytes=spec.state_bytes // 4 * 4,
                   iter_time=spec.iter_time, device=state.device, soft_cow=state.use_torch,
                   storage_mode=storage[0].mode, seconds=time.perf_counter() - t_start, phases=run.phases,
                   update_s=update_s, blocked=blocked)


def _n_max_that_fits(spec: ProfileSpec) -> int:
    """:meth:`ProfileSpec.n_max`, lowered (with a warning) to what the free space at ``spec.path``
    holds; ConfigError when not even N = 1 fits the budget or the disk."""
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
    return n_max


class _Run:
    """One :func:`run_profile`: the sweeps it makes, in order, and the progress count and phase
    times they leave. Each sweep method is one phase of the profile."""

    def __init__(self, spec: ProfileSpec, checkpointer: CheckpointerFactory, n_max: int,
                 progress: ProgressFn | None, tol: float) -> None:
        self.spec, self.checkpointer, self.n_max, self.tol = spec, checkpointer, n_max, tol
        self._progress = progress or (lambda label, done, total: None)
        self.chunks = tuple(sorted({min(c, _round_block(spec.state_bytes)) for c in spec.chunks}))
        self.threads = tuple(sorted(set(spec.threads)))
        self.base_chunk = (DEFAULT_CHUNK if DEFAULT_CHUNK in self.chunks
                           else min(self.chunks, key=lambda c: abs(c - DEFAULT_CHUNK)))
        self.total = len(self.chunks) + len(self.threads) + len(self.chunks) - 1 + n_max + 2
        self.done = 0
        self.phases: dict[str, float] = {}

    def step(self, label: str) -> None:
        """Reports the step about to run."""
        self._progress(label, self.done, self.total)

    def finish(self) -> None:
        """Reports the end (every step done, skipped ones included)."""
        self._progress("done", self.total, self.total)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Records the wall seconds of the block as ``phases[name]`` (when it does not raise)."""
        t0 = time.perf_counter()
        yield
        self.phases[name] = time.perf_counter() - t0

    def copy_sweep(self, state: EmulatedState) -> list[CopySample]:
        """T_G for every chunk size."""
        copies = []
        # One pool-like buffer for every chunk size: it is touched once, not once per size.
        scratch = host_chunks(2 * max(self.chunks)) if state.device != "cuda" else None
        for c in self.chunks:
            self.step(f"T_G: copy bandwidth, {c / MiB:g} MiB chunks")
            copies.append(copy_bandwidth(state, c, repeats=2, scratch=scratch))
            self.done += 1
        return copies

    def storage_sweep(self, sub: Path, state: EmulatedState) -> list[StorageSample]:
        """T_S: every (threads, chunk) pair when exhaustive; else the thread counts at the base
        chunk (until more stop helping), then the other chunk sizes at the best thread count."""
        if self.spec.exhaustive:
            return self._thread_sweep(sub, state, [(p, c) for p in self.threads for c in self.chunks])
        storage = self._thread_sweep(sub, state, [(p, self.base_chunk) for p in self.threads])
        p_star = pick_storage(storage, self.tol)[0]
        for c in self.chunks:
            if c == self.base_chunk:
                continue
            self.step(f"T_S: {p_star} writer thread(s), {c / MiB:g} MiB chunks")
            storage.append(self._storage(sub, state, p_star, c))
            self.done += 1
        return storage

    def _thread_sweep(self, sub: Path, state: EmulatedState, plan: Sequence[tuple[int, int]]) -> list[StorageSample]:
        """T_S for each (threads, chunk) of ``plan`` in order; unless exhaustive, stops after the
        first that does not beat the best so far by more than ``tol``."""
        storage: list[StorageSample] = []
        for p, c in plan:
            self.step(f"T_S: {p} writer thread(s), {c / MiB:g} MiB chunks")
            # The first probe writes every slot once (untimed), so no timed write pays for
            # converting the unwritten extents of a freshly allocated file.
            best = max((x.bytes_per_s for x in storage), default=None)
            storage.append(self._storage(sub, state, p, c, warmup=self.n_max + 1 if not storage else 1))
            self.done += 1
            if not self.spec.exhaustive and best is not None and storage[-1].bytes_per_s <= best * (1.0 + self.tol):
                skipped = [q for q, _ in plan if q > p]
                if skipped:
                    log.info("pccheck-tune: %d writer threads are no faster than fewer (%.2f vs %.2f GB/s): "
                             "not trying %s", p, storage[-1].bytes_per_s / 1e9, best / 1e9, skipped)
                    self.done += len(skipped)
                break
        return storage

    def _storage(self, sub: Path, state: EmulatedState, threads: int, chunk: int, **kw: Any) -> StorageSample:
        return storage_bandwidth(sub, state, self.checkpointer, writer_threads=threads, chunk_size=chunk,
                                 dram_budget=self.spec.dram_budget, max_concurrent=self.n_max,
                                 repeats=self.spec.storage_repeats, **kw)

    def update_time(self, state: EmulatedState) -> float:
        """One update with no checkpoint running (:func:`_update_time`); warns when it exceeds t."""
        update_s = _update_time(state)
        if update_s > self.spec.iter_time:
            log.warning("pccheck-tune: one update pass over the %d-byte state takes %.3f s on this host, more "
                        "than the iteration time t = %.3f s; the emulated iterations last %.3f s",
                        self.spec.state_bytes, update_s, self.spec.iter_time, update_s)
        return update_s

    def write_sweep(self, sub: Path, state: EmulatedState, p_star: int, b_star: int,
                    update_s: float) -> tuple[list[WriteTimeSample], BlockedSample | None]:
        """T_w for N = 1, 2, ... (until a larger N cannot help, unless exhaustive), and B after N = 1."""
        spec = self.spec
        writes: list[WriteTimeSample] = []
        blocked: BlockedSample | None = None
        for n in range(1, self.n_max + 1):
            self.step(f"T_w: N={n} in flight, a checkpoint every {spec.iter_time * 1e3:g} ms")
            with _open(self.checkpointer, sub, state, interval=1, max_concurrent=n, writer_threads=p_star,
                       chunk_size=b_star, dram_budget=spec.dram_budget) as ck:
                w = _write_time_on(ck, state, n, spec.iter_time, update_s)
                writes.append(w)
                self.done += 1
                log.info("pccheck-tune: N=%d: T_w %.3f s (T_w/N %.3f s), blocked %.3f s, stall %.3f s",
                         n, w.tw_s, w.tw_per_n, w.blocked_s, w.stall_s)
                if n == 1:  # the same Checkpointer: its pool is allocated and touched once
                    blocked = self._blocked(ck, state, w, update_s)
            if not spec.exhaustive and self._enough(writes, blocked):
                break
        return writes, blocked

    def _blocked(self, ck: Any, state: EmulatedState, w: WriteTimeSample, update_s: float) -> BlockedSample:
        """B end to end on ``ck``, with checkpoints far enough apart (after T_w ``w``) that none stalls."""
        f_probe = max(2, math.ceil(1.25 * w.tw_s / self.spec.iter_time))
        self.step(f"B: a checkpoint every {f_probe} iterations")
        blocked = _blocked_time_on(ck, state, self.spec.iter_time, f_probe, 5, update_s, warm=False)
        log.info("pccheck-tune: B %.3f s per checkpoint at interval %d (cycles %s)",
                 blocked.blocked_s, f_probe, ", ".join(f"{x:.3f}" for x in blocked.cycles))
        return blocked

    def _enough(self, writes: Sequence[WriteTimeSample], blocked: BlockedSample | None) -> bool:
        """Whether, after the T_w just measured (the last of ``writes``), a larger N cannot help."""
        spec, w = self.spec, writes[-1]
        if w.n == 1 and w.tw_s <= spec.iter_time:
            log.info("pccheck-tune: T_w %.3f s <= t %.3f s: more than one in flight cannot help", w.tw_s,
                     spec.iter_time)
            return True
        if w.n == 1 and spec.max_overhead > 1 and blocked is not None and blocked.blocked_s > 0 and (
                model.min_interval(0.0, 1, spec.max_overhead, spec.iter_time, blocked.blocked_s)
                >= model.interval_eq3(w.tw_s, 1, spec.max_overhead, spec.iter_time)):
            # The time each checkpoint costs training, not T_w, sets the interval; it does
            # not shrink with more in flight, so a larger N cannot give a smaller interval.
            log.info("pccheck-tune: B %.3f s per checkpoint limits the interval, not T_w: N=1 suffices",
                     blocked.blocked_s)
            return True
        best = min(x.tw_per_n for x in writes[:-1]) if w.n > 1 else None
        # T_w/N stopped improving: larger N only adds contention (§3.4)
        return best is not None and w.tw_per_n > best * (1.0 - self.tol)


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
