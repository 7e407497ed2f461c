"""Extra checkpointing systems for bench.overhead's training loop, and one way to run its cells.

:mod:`bench.overhead` owns the method (workloads, warm-up, steady-state window, interleaving). This
module only adds systems to it, so that every figure built on it measures them the same way, side by
side in one run:

``gpm``                  the GPM policy (PCcheck §5.1: "We mmap the file for checkpointing ... To
                         persist a checkpoint, we call cudaDeviceSynchronize ... and msync the mmaped
                         file"): training *stalls* while the state is copied straight into a
                         preallocated, mapped file (two slots used in turn, so a crash mid-copy keeps
                         the other) and ``msync``'d, then an 8-byte commit record is written and
                         ``msync``'d. No DRAM staging, one checkpoint at a time, nothing overlaps.
``pccheck_N{n}[_p{p}][_c{MiB}][_b{x}m]``
                         pccheck with N = n, ``writer_threads`` = p (default 2), ``chunk_size`` in MiB
                         (default 64) and ``dram_budget`` = x times the state (default bench.overhead's,
                         2x). A plain ``pccheck_N{n}`` is bench.overhead's own system.
``pccheck_tuned``        pccheck with the (N, p, chunk) the tuner chose; set by :func:`set_tuned`.
``checkfreq``,           bench.overhead's systems, wrapped to also record, per checkpoint, the time
``dcp_async``            from the call until it is durable (``tw_s``, the goodput replay's lag).

:func:`run_cells` runs bench.overhead's ``_run_workload`` with these systems available.
"""

from __future__ import annotations

import contextlib
import inspect
import mmap
import os
import re
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench import overhead as ov

__all__ = ["set_tuned", "tuned_config", "run_cells", "parse_pccheck_name", "tw_of", "n_of"]

_MIB = 1 << 20
_PAGE = mmap.PAGESIZE
_PCCHECK_RE = re.compile(r"^pccheck_N(\d+)(?:_p(\d+))?(?:_c(\d+))?(?:_b(\d+(?:\.\d+)?)m)?$")
_tuned: dict[str, int] | None = None
RETRY_WAIT_S = 20.0  # before re-measuring a disturbed cell, wait up to this long for quiet


def set_tuned(max_concurrent: int, writer_threads: int, chunk_size: int) -> None:
    """The configuration ``pccheck_tuned`` runs with (the tuner's choice)."""
    global _tuned
    _tuned = {"n": int(max_concurrent), "p": int(writer_threads), "chunk": int(chunk_size)}


def tuned_config() -> dict[str, int] | None:
    return None if _tuned is None else dict(_tuned)


def parse_pccheck_name(name: str) -> dict[str, Any] | None:
    """``pccheck_N2_p1_c16_b0.5m`` -> {n: 2, p: 1, chunk: 16 MiB, budget_x: 0.5}; None if not one."""
    m = _PCCHECK_RE.match(name)
    if not m:
        return None
    return {"n": int(m.group(1)), "p": int(m.group(2) or 2), "chunk": int(m.group(3) or 64) * _MIB,
            "budget_x": float(m.group(4)) if m.group(4) else None}


def _state_tensors(wl: Any) -> list[tuple[str, Any]]:
    """Every tensor of the model's and the optimizer's state, in a fixed order."""
    import torch

    out = [(f"model.{k}", v) for k, v in wl.model.state_dict().items()]
    for pid, st in wl.optimizer.state_dict()["state"].items():
        out += [(f"optim.{pid}.{k}", v) for k, v in st.items() if isinstance(v, torch.Tensor)]
    return out


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _window_info(**window: Any) -> dict[str, Any]:
    """An info() result in the shape bench.overhead prints (keys it reads, None where not measured)."""
    keys = ("tw_s", "median_stall_s", "median_blocked_copy_s", "median_cow_wait_s", "median_copy_s",
            "median_persist_s")
    return {"window": {**{k: None for k in keys}, **window}}


class _Lag:
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
        lo, hi = window
        with self._lock:
            lags = [self.done[s] - self.calls[s] for s in self.calls if lo <= s <= hi and s in self.done]
        return _window_info(tw_s=_median(lags), count=len(lags))


class _GPM(ov._System):
    """Stall, copy into the mapped file, msync, commit (see the module docstring)."""

    name = "gpm"

    def __init__(self, wl: Any, workdir: Path, interval: int) -> None:
        super().__init__(wl, workdir, interval)
        self._layout = []
        off = 0
        for name, t in _state_tensors(wl):
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
        tensors = _state_tensors(self.wl)
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
        return _window_info(tw_s=0.0, median_stall_s=_median(xs), count=len(xs))

    def close(self) -> None:
        del self._view
        self._mm.close()
        os.close(self._fd)


class _PCCheckConfig(ov._PCCheck):
    """bench.overhead's pccheck system with writer threads, chunk size and DRAM budget set."""

    def __init__(self, wl: Any, workdir: Path, interval: int, name: str, n: int, p: int, chunk: int,
                 dram_budget: int | None) -> None:
        import pccheck

        ov._System.__init__(self, wl, workdir, interval)
        self.n, self.name, self.p, self.chunk = n, name, p, chunk
        self.ck = pccheck.Checkpointer(wl.model, wl.optimizer, path=workdir, interval=interval,
                                       max_concurrent=n, writer_threads=p, chunk_size=chunk,
                                       dram_budget=dram_budget)
        self._dram_budget_arg = dram_budget

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        d = super().info(window)
        d.update({"writer_threads": self.p, "chunk_bytes_requested": self.chunk})
        return d


class _CheckFreqTimed(ov._CheckFreq):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self._lag = _Lag()

    def checkpoint(self, step: int) -> None:
        self.drain()  # the previous one must be done before the call time of this one is taken
        self._lag.call(step)
        super().checkpoint(step)

    def _run(self, step: int, groups: Any) -> None:
        super()._run(step, groups)
        if self._error is None:
            self._lag.durable(step)

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        return self._lag.window(window)


class _DCPTimed(ov._DCPAsync):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self._lag = _Lag()

    def checkpoint(self, step: int) -> None:
        self._wait_previous()
        self._lag.call(step)
        super().checkpoint(step)
        fut = getattr(self._fut, "upload_completion", self._fut)
        fut.add_done_callback(lambda f, s=step: f.exception() is None and self._lag.durable(s))

    def info(self, window: tuple[int, int]) -> dict[str, Any]:
        return self._lag.window(window)


def _factory(orig: Callable[..., Any], on_cell: Callable[[str, int], None] | None,
             state_bytes: int) -> Callable[..., Any]:
    def make(name: str, wl: Any, workdir: Path, interval: int, dram_budget: int | None) -> Any:
        if on_cell is not None:
            on_cell(name, interval)
        if name == "gpm":
            return _GPM(wl, workdir, interval)
        if name == "checkfreq":
            return _CheckFreqTimed(wl, workdir, interval)
        if name == "dcp_async":
            return _DCPTimed(wl, workdir, interval)
        if name == "pccheck_tuned":
            if _tuned is None:
                raise RuntimeError("pccheck_tuned needs set_tuned() first (the tuner's choice)")
            return _PCCheckConfig(wl, workdir, interval, name, _tuned["n"], _tuned["p"], _tuned["chunk"],
                                  dram_budget)
        cfg = parse_pccheck_name(name)
        if cfg is not None and name != f"pccheck_N{cfg['n']}":
            budget = dram_budget if cfg["budget_x"] is None else int(cfg["budget_x"] * state_bytes)
            return _PCCheckConfig(wl, workdir, interval, name, cfg["n"], cfg["p"], cfg["chunk"], budget)
        return orig(name, wl, workdir, interval, dram_budget)

    return make


def _retrying(orig: Callable[..., Any], retries: int, threshold: float) -> Callable[..., Any]:
    """bench.overhead's ``_run_cell``, run again (up to ``retries`` times) while other processes used
    more than ``threshold`` CPUs during its window; the least disturbed attempt is kept, with every
    attempt's foreign load."""
    def run_cell(wl: Any, name: str, interval: int, iters: int, workdir: Path, step: int, *a: Any,
                 **k: Any) -> tuple[dict[str, Any], int]:
        attempts: list[dict[str, Any]] = []
        for attempt in range(retries + 1):
            rec, step = orig(wl, name, interval, iters, workdir, step, *a, **k)
            attempts.append(rec)
            load = rec.get("foreign_cpu_util")
            if load is None or load <= threshold or attempt == retries:
                break
            print(f"  [{wl.name}] interval {interval:>3} {name}: other processes used {load:.2f} CPUs "
                  f"(> {threshold}) during the window; measuring again once they are quiet", flush=True)
            wait_quiet = getattr(ov, "_wait_quiet", None)
            if wait_quiet is not None:  # up to RETRY_WAIT_S for the other processes to go quiet first
                wait_quiet(RETRY_WAIT_S, threshold)
        best = min(attempts, key=lambda r: r.get("foreign_cpu_util") or 0.0)
        best["attempts"] = len(attempts)
        best["foreign_cpu_util_attempts"] = [r.get("foreign_cpu_util") for r in attempts]
        return best, step

    return run_cell


@contextlib.contextmanager
def _systems_added(on_cell: Callable[[str, int], None] | None, state_bytes: int, retries: int,
                   threshold: float) -> Iterator[None]:
    orig, orig_cell = ov._make_system, ov._run_cell
    ov._make_system = _factory(orig, on_cell, state_bytes)
    if retries > 0:
        ov._run_cell = _retrying(orig_cell, retries, threshold)
    try:
        yield
    finally:
        ov._make_system, ov._run_cell = orig, orig_cell


def tw_of(cell: dict[str, Any]) -> float | None:
    """Median time from checkpoint call to durable in the cell's window, where measured."""
    return (cell.get("pccheck") or {}).get("window", {}).get("tw_s")


def n_of(system: str) -> int:
    """Checkpoints a system may have in flight."""
    if system == "pccheck_tuned":
        return (_tuned or {"n": 1})["n"]
    cfg = parse_pccheck_name(system)
    return cfg["n"] if cfg else 1


_FIXED = ("wl", "systems", "intervals", "iters", "budget", "workdir", "dram_budget")


def _optional_args(fn: Callable[..., Any], known: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``fn``'s parameters after the fixed ones: the values in ``known`` where
    ``fn`` has such a parameter; a parameter neither known nor defaulted is an error that says so."""
    out = {}
    for name, prm in inspect.signature(fn).parameters.items():
        if name in _FIXED:
            continue
        if name in known:
            out[name] = known[name]
        elif prm.default is inspect.Parameter.empty:
            raise TypeError(f"bench.overhead.{fn.__name__} has a new required parameter {name!r}; "
                            "teach bench.policies.run_cells about it")
    return out


def run_cells(wl: Any, systems: Sequence[str], intervals: Sequence[int], iters: int | None, budget: int,
              workdir: Path, dram_budget: int | None = None,
              on_cell: Callable[[str, int], None] | None = None, repeats: int = 1,
              quiet_wait: float = 0.0, retries: int = 0, noisy_cpus: float = 0.3) -> list[dict[str, Any]]:
    """bench.overhead's cells (for each interval, every system in turn) with this module's systems
    available; ``on_cell(system, interval)`` is called as each cell starts. Each record gains
    ``tw_s`` (call to durable, median over the window; 0 for gpm) and ``n`` (checkpoints in flight).
    ``repeats`` (where bench.overhead supports it) measures every cell that many times, interleaved,
    and keeps the median run; ``quiet_wait`` (likewise) waits up to that many seconds before each cell
    for the rest of the machine to go quiet. ``retries``: a cell during whose window other processes
    used more than ``noisy_cpus`` CPUs is measured again, up to that many times (the least disturbed
    attempt is kept, with every attempt's foreign load in ``foreign_cpu_util_attempts``)."""
    kw = _optional_args(ov._run_workload, {"repeats": repeats, "quiet_wait": quiet_wait})
    with _systems_added(on_cell, wl.state_bytes(), retries, noisy_cpus):
        recs = ov._run_workload(wl, list(systems), list(intervals), iters, budget, workdir, dram_budget, **kw)
    for r in recs:
        r["tw_s"] = tw_of(r)
        r["n"] = n_of(r["system"])
    return recs
