"""Training throughput while checkpointing every k iterations: the Figure 8 analog of PCcheck.

Run::

    python -m bench.overhead [--size 1GiB] [--iter-time 0.05] [--intervals 1,10,25,50,100]
                             [--iters N] [--systems none,torch_save,...] [--workloads emulated,real]
                             [--json bench/results/overhead.json] [--dir bench/_scratch] [--quick]

**The GPU is emulated** (this machine has none). One emulated training iteration is: the host waits
``t = --iter-time`` seconds with ``time.sleep`` (as it waits for a GPU's forward/backward), then
``optimizer.step()`` of a ``torch.optim.SGD`` (lr 1e-3, *no momentum*, so the optimizer holds no
tensors) updates *all* of the state in place: ``p -= lr * grad`` over ``--size`` bytes of float32
parameters (4 ``nn.Parameter`` of a small ``nn.Module``; grads are set once, untimed). The update is
a real memory-bandwidth pass (~0.17 s for 1 GiB on 2 vCPUs), part of every iteration and not timed
separately; it runs through ``optimizer.step()`` so pccheck's soft copy-on-write pre-hook guards it.

The second workload (``real``) is a real model trained on the CPU: an MLP (1024-2048-2048-2048-1024-10,
~12.6 M parameters) on a fixed synthetic data set, forward + cross-entropy + backward + Adam; state
(parameters + Adam's two moments) ~150 MB. Nothing is emulated there, and the checkpoint threads
compete with training for the same 2 cores.

Systems, all measured in one run, each for every interval (a checkpoint after step s if
``s % interval == 0``); every checkpoint holds the model's and the optimizer's state:

``none``        no checkpointing.
``torch_save``  ``torch.save({"model": sd, "optim": osd}, f)`` + flush + ``fsync``, synchronous, a new
                file per checkpoint; the previous one is deleted after the new one is durable.
``dcp_async``   ``torch.distributed.checkpoint.async_save(state_dict,
                storage_writer=FileSystemWriter(new dir, sync_files=True), no_dist=True)``, at most one
                in flight as users write it: the previous future's ``.result()`` is awaited before the
                next save starts (the one before it is then deleted).
``checkfreq``   the CheckFreq policy: one checkpoint in flight. A background thread snapshots the state
                into a preallocated, pre-touched DRAM copy (reused), then persists that copy with
                ``torch.save`` + ``fsync``. The next ``optimizer.step()`` waits until the snapshot is
                taken (an optimizer pre-hook), the next checkpoint until the previous one is durable.
``pccheck_N``   ``pccheck.Checkpointer(model, optimizer, path=new dir, interval=interval,
                max_concurrent=N, writer_threads=2, chunk_size=64 MiB)``, defaults otherwise
                (soft copy-on-write on, ``when_busy="block"``, DRAM budget 2x the state, O_DIRECT).

Method, per (interval, system) "cell", interleaved so drift hits every system alike (for each interval,
every system in turn): ``gc.collect()`` + ``os.sync()`` (untimed), reset the peak-RSS counter
(``/proc/self/clear_refs``), set the system up in a fresh directory on the disk under test (untimed),
2 plain iterations, then the warm-up: pccheck checkpoints N+1 times back to back (every one of its N+1
slots written once, so no timed write converts unwritten extents) and the peers once, then everything
is waited for. Then the update of step s0 (a multiple of the interval) and its checkpoint c0 start the
steady state, untimed; the timer runs from there over ``iters = k * interval`` iterations, which end
with the k-th checkpoint call. So the window holds k checkpoint calls (c1..ck, each waiting for its
predecessor where the policy says so) and the background work of k checkpoints (c0..c(k-1)), as in
a long run. Throughput = iters / window seconds; slowdown = it/s of ``none`` / it/s of the system;
extra time per iteration = 1/it/s - 1/it/s(none). Memory: VmRSS when the window starts and ends
(a flat RSS means no allocation per checkpoint), VmHWM - VmRSS before set-up (peak growth, set-up
included), and minor page faults per checkpoint in the window (each is a newly touched 4 KiB page).

Default iterations: k = max(1, min(10, 60 // interval)) checkpoints per window, iters = k * interval
(1: 10, 10: 60, 25: 50, 50: 50, 100: 100); ``--iters N`` sets every interval's window to N iterations
rounded up to a multiple of the interval. The real workload uses intervals 1,10,50 and systems
none, torch_save, dcp_async, pccheck_N2 with k = max(1, min(10, 40 // interval)).
"""

from __future__ import annotations

import abc
import argparse
import copy
import gc
import math
import os
import resource
import shutil
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._common import (
    pyplot,
    format_size,
    host_info,
    machine_label,
    parse_size,
    print_table,
    save_figure,
    scratch_dir,
    write_csv,
    write_json,
)

__all__ = ["SYSTEMS", "REAL_SYSTEMS", "run_benchmark", "main"]

_BENCH_DIR = Path(__file__).resolve().parent
_MIB = 1 << 20
_CHUNK = 64 << 20  # pccheck chunk_size (its default), stated explicitly for the DRAM budget arithmetic
_N_PARAMS = 4
_LR = 1e-3

SYSTEMS: tuple[str, ...] = ("none", "torch_save", "dcp_async", "checkfreq",
                            "pccheck_N1", "pccheck_N2", "pccheck_N3", "pccheck_N4")
REAL_SYSTEMS: tuple[str, ...] = ("none", "torch_save", "dcp_async", "pccheck_N2")
DEFAULT_INTERVALS: tuple[int, ...] = (1, 10, 25, 50, 100)
REAL_INTERVALS: tuple[int, ...] = (1, 10, 50)

TARGET_INTERVAL = 10
TARGET_SLOWDOWN = 1.03          # pccheck slowdown at interval 10 when Tw/N <= 10 t
TARGET_EXTRA_VS_DCP = 0.3       # pccheck extra time per iteration / DCP async_save's
RSS_SLACK = 64 * _MIB           # peak RSS growth <= dram_budget + this
FLAT_RSS_TOL = 8 * _MIB         # |VmRSS(end) - VmRSS(start of window)| for "no allocation per checkpoint"
FLAT_FAULTS_PER_CKPT = 1024     # minor faults (4 KiB pages = 4 MiB) per checkpoint, same criterion
NOISY_OTHER_CPUS = 0.25         # a window where the rest of the machine used more CPUs than this is flagged


# -- memory and CPU probes ---------------------------------------------------------------------------

def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _usage() -> tuple[int, float]:
    """(minor page faults, CPU seconds user + system) of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_utime + ru.ru_stime


def _cpu_busy_s() -> float:
    """CPU-seconds the whole machine spent busy (all CPUs, every process, steal included), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _wait_quiet(max_wait_s: float, threshold: float = NOISY_OTHER_CPUS) -> tuple[float, float]:
    """Wait (up to ``max_wait_s``) until the rest of the machine uses < ``threshold`` CPUs, sampled over
    1 s while this process idles. Returns (seconds waited, the last sample). Other sessions share these
    2 vCPUs; a cell timed while they run measures them, not the checkpointer."""
    t0 = time.perf_counter()
    while True:
        busy0, cpu0 = _cpu_busy_s(), _usage()[1]
        time.sleep(1.0)
        other = max(0.0, (_cpu_busy_s() - busy0) - (_usage()[1] - cpu0))
        waited = time.perf_counter() - t0
        if other < threshold or waited >= max_wait_s:
            return waited, other
        time.sleep(2.0)


def _settle() -> None:
    """Untimed, before each cell: collect garbage and flush what earlier cells left dirty."""
    gc.collect()
    os.sync()


# -- workloads -----------------------------------------------------------------------------------------

class _Workload:
    """A model, its optimizer and one training iteration (``step()``)."""

    def __init__(self, name: str, model: Any, optimizer: Any, step: Callable[[], None], describe: str) -> None:
        self.name, self.model, self.optimizer, self.step, self.describe = name, model, optimizer, step, describe

    def state_bytes(self) -> int:
        """Bytes of tensors in the model's and the optimizer's state_dict."""
        import torch

        n = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for st in self.optimizer.state_dict()["state"].values():
            n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        return n


def make_emulated(nbytes: int, iter_time: float) -> _Workload:
    """Emulated GPU iteration: sleep ``iter_time``, then SGD (no momentum) updates every parameter."""
    import torch

    elems = nbytes // 4
    base, extra = divmod(elems, _N_PARAMS)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.full((base + (i < extra),), 0.5)) for i in range(_N_PARAMS)])
    for p in model.parameters():  # set once, outside timing; full_like touches every page
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=_LR, momentum=0.0)

    def step() -> None:
        time.sleep(iter_time)  # the host waiting for the (emulated) GPU's forward/backward
        opt.step()             # the update: every byte of the state mutated in place

    return _Workload("emulated", model, opt, step,
                     f"GPU EMULATED: sleep {iter_time * 1e3:g} ms, then torch.optim.SGD(momentum=0).step() "
                     f"over {format_size(nbytes)} of float32 in {_N_PARAMS} Parameters")


def make_real(batch: int = 128, seed: int = 0) -> _Workload:
    """A real MLP trained on the CPU with Adam on a fixed synthetic data set."""
    import torch

    torch.manual_seed(seed)
    dims = (1024, 2048, 2048, 2048, 1024)
    layers: list[Any] = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(dims[-1], 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    xs = torch.randn(8, batch, dims[0])
    ys = torch.randint(0, 10, (8, batch))
    it = [0]

    def step() -> None:
        i = it[0] % len(xs)
        it[0] += 1
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(xs[i]), ys[i])
        loss.backward()
        opt.step()

    for _ in range(2):  # Adam creates its state lazily: make it exist before any checkpointer sees it
        step()
    nparams = sum(p.numel() for p in model.parameters())
    return _Workload("real", model, opt, step,
                     f"REAL CPU training: MLP {'-'.join(map(str, dims))}-10 ({nparams / 1e6:.1f} M params), "
                     f"batch {batch}, Adam, synthetic data")


# -- systems -------------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save_durable(obj: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


class _System(abc.ABC):
    """One checkpointing policy inside the training loop.

    Call order: ``__init__(workload, workdir, interval)`` (untimed; may preallocate) →
    ``warmup(step) -> next step`` (untimed: checkpoints and waits for them) → ``after_step(s)`` after
    the update of every step s (the untimed c0, then the timed window) → ``drain()`` (untimed: waits for
    what is in flight) → ``info()`` → ``close()``.
    """

    name: str = "?"

    def __init__(self, wl: _Workload, workdir: Path, interval: int) -> None:
        self.wl, self.dir, self.interval = wl, workdir, interval
        workdir.mkdir(parents=True, exist_ok=True)

    def warmup(self, step: int) -> int:
        """One checkpoint of the current state, waited for; returns the next step number."""
        self.wl.step()
        self.checkpoint(step)
        self.drain()
        return step + 1

    def after_step(self, step: int) -> bool:
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
        return {}

    def close(self) -> None:
        pass


class _None(_System):
    name = "none"

    def warmup(self, step: int) -> int:
        return step

    def after_step(self, step: int) -> bool:
        return False

    def checkpoint(self, step: int) -> None:  # never called
        pass


class _TorchSave(_System):
    name = "torch_save"

    def __init__(self, wl: _Workload, workdir: Path, interval: int) -> None:
        super().__init__(wl, workdir, interval)
        self._prev: Path | None = None

    def checkpoint(self, step: int) -> None:
        path = self.dir / f"ckpt-{step}.pt"
        _torch_save_durable({"model": self.wl.model.state_dict(), "optim": self.wl.optimizer.state_dict()}, path)
        if self._prev is not None:  # keep the newest durable checkpoint only
            self._prev.unlink()
        self._prev = path


class _DCPAsync(_System):
    name = "dcp_async"

    def __init__(self, wl: _Workload, workdir: Path, interval: int) -> None:
        super().__init__(wl, workdir, interval)
        # Raised from DCP's save thread even with no_dist=True; one process is what we mean.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        self._fut: Any = None
        self._dirs: list[Path] = []

    def _wait_previous(self) -> None:
        if self._fut is not None:
            getattr(self._fut, "upload_completion", self._fut).result()  # AsyncSaveResponse with async stagers
            self._fut = None
        while len(self._dirs) > 1:  # the newest completed checkpoint stays
            shutil.rmtree(self._dirs.pop(0))

    def checkpoint(self, step: int) -> None:
        from torch.distributed.checkpoint import FileSystemWriter, async_save

        self._wait_previous()  # at most one in flight, as users write it
        out = self.dir / f"step-{step}"
        self._dirs.append(out)
        state = {"model": self.wl.model.state_dict(), "optim": self.wl.optimizer.state_dict()}
        self._fut = async_save(state, storage_writer=FileSystemWriter(out, sync_files=True), no_dist=True)

    def drain(self) -> None:
        self._wait_previous()


class _CheckFreq(_System):
    """CheckFreq (FAST'21) policy: pipelined snapshot into a reused DRAM copy, then persist; one in flight."""

    name = "checkfreq"

    def __init__(self, wl: _Workload, workdir: Path, interval: int) -> None:
        import torch

        super().__init__(wl, workdir, interval)
        self._live = dict(wl.model.state_dict())
        for pid, st in wl.optimizer.state_dict()["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    self._live[f"optim.{pid}.{k}"] = v
        with torch.no_grad():  # preallocate and pre-touch the DRAM copy once; reused by every checkpoint
            self._snap = {k: v.detach().clone() for k, v in self._live.items()}
        self._snapped = threading.Event()
        self._snapped.set()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._prev: Path | None = None
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
            _torch_save_durable({"tensors": self._snap, "param_groups": groups}, path)
            if self._prev is not None:
                self._prev.unlink()
            self._prev = path
        except BaseException as exc:  # surfaced on the training thread at the next checkpoint
            self._error = exc

    def checkpoint(self, step: int) -> None:
        self.drain()  # one in flight: the previous persist must be done
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

    def close(self) -> None:
        self._hook.remove()
        self.drain()


class _PCCheck(_System):
    def __init__(self, wl: _Workload, workdir: Path, interval: int, n: int, dram_budget: int | None) -> None:
        import pccheck

        super().__init__(wl, workdir, interval)
        self.n, self.name = n, f"pccheck_N{n}"
        self.ck = pccheck.Checkpointer(wl.model, wl.optimizer, path=workdir, interval=interval,
                                       max_concurrent=n, writer_threads=2, chunk_size=_CHUNK,
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
        chunk, count = chunk_geometry(nbytes, _CHUNK, self._dram_budget_arg)

        def med(key: str) -> float | None:
            return statistics.median(c[key] for c in win) if win else None

        tws = [c["persist_s"] - c["stall_s"] for c in win]
        return {
            "storage": self.ck.storage,
            "checkpoint_bytes": nbytes,
            "dram_budget_bytes": chunk * count,
            "chunk_bytes": chunk,
            "chunks": count,
            "summary": d["summary"],  # pccheck's own summary: every checkpoint of the cell, warm-up included
            "window": {
                "steps": [lo, hi],
                "checkpoints": win,
                "count": len(win),
                "outcomes": sorted({c["outcome"] for c in win}),
                **{f"median_{k}": med(k) for k in ("stall_s", "blocked_copy_s", "cow_wait_s", "copy_s",
                                                   "backpressure_s", "persist_s")},
                "max_cow_wait_s": max((c["cow_wait_s"] for c in win), default=None),
                "tw_s": statistics.median(tws) if tws else None,  # start (permit held) until durable
            },
        }

    def close(self) -> None:
        self.ck.close()


def _make_system(name: str, wl: _Workload, workdir: Path, interval: int, dram_budget: int | None) -> _System:
    if name.startswith("pccheck_N"):
        return _PCCheck(wl, workdir, interval, int(name.removeprefix("pccheck_N")), dram_budget)
    cls = {c.name: c for c in (_None, _TorchSave, _DCPAsync, _CheckFreq)}[name]
    return cls(wl, workdir, interval)


# -- one cell ------------------------------------------------------------------------------------------

def _window_iters(interval: int, iters: int | None, budget: int) -> int:
    if iters is not None:
        return max(1, math.ceil(iters / interval)) * interval
    return max(1, min(10, budget // interval)) * interval


def _run_cell(wl: _Workload, name: str, interval: int, iters: int, workdir: Path, step: int,
              dram_budget: int | None, quiet_wait: float) -> tuple[dict[str, Any], int]:
    """Set up, warm up and time one (system, interval); return its record and the next step number."""
    _settle()
    waited, other_before = _wait_quiet(quiet_wait) if quiet_wait > 0 else (0.0, None)
    peak_reset = _reset_peak_rss()
    rss_setup = _proc_status()["VmRSS"]
    cell_dir = workdir / f"{wl.name}-{name}-i{interval}"
    t_cell = time.perf_counter()
    sysm = _make_system(name, wl, cell_dir, interval, dram_budget)
    try:
        for _ in range(2):
            wl.step()
        step = sysm.warmup(step)
        s0 = -(-step // interval) * interval
        wl.step()
        sysm.after_step(s0)  # c0: the checkpoint in flight when the window opens, as in a long run
        rss_start = _proc_status()["VmRSS"]
        flt0, cpu0 = _usage()
        busy0, load0 = _cpu_busy_s(), os.getloadavg()[0]
        calls: list[float] = []
        t0 = time.perf_counter()
        for s in range(s0 + 1, s0 + iters + 1):
            wl.step()
            c0 = time.perf_counter()
            if sysm.after_step(s):
                calls.append(time.perf_counter() - c0)
        elapsed = time.perf_counter() - t0
        flt1, cpu1 = _usage()
        busy1, load1 = _cpu_busy_s(), os.getloadavg()[0]
        rss_end = _proc_status()["VmRSS"]
        sysm.drain()
        hwm = _proc_status()["VmHWM"]
        info = sysm.info((s0, s0 + iters))
    finally:
        sysm.close()
        shutil.rmtree(cell_dir, ignore_errors=True)
    nck = len(calls)
    rec = {
        "workload": wl.name,
        "interval": interval,
        "system": name,
        "iters": iters,
        "checkpoints": nck,
        "elapsed_s": elapsed,
        "it_per_s": iters / elapsed,
        "s_per_iter": elapsed / iters,
        "ckpt_call_median_s": statistics.median(calls) if calls else None,
        "ckpt_call_max_s": max(calls) if calls else None,
        "cpu_util": (cpu1 - cpu0) / elapsed,  # CPU-seconds per second, all threads (2 = both cores busy)
        # CPU-seconds per second used by everything else on the machine (other processes, steal): noise
        "foreign_cpu_util": max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / elapsed,
        "loadavg_1min": [load0, load1],
        "quiet_wait_s": waited,
        "other_cpus_before": other_before,
        "rss_setup_bytes": rss_setup,
        "rss_window_start_bytes": rss_start,
        "rss_window_end_bytes": rss_end,
        "rss_drift_bytes": rss_end - rss_start,
        "peak_rss_growth_bytes": hwm - rss_setup if peak_reset else None,
        "minflt_window": flt1 - flt0,  # per checkpoint, net of training's own faults: see _derive
        "cell_s": time.perf_counter() - t_cell,
    }
    if info:
        rec["pccheck"] = info
    return rec, s0 + iters + 1


def _run_workload(wl: _Workload, systems: Sequence[str], intervals: Sequence[int], iters: int | None,
                  budget: int, workdir: Path, dram_budget: int | None, repeats: int,
                  quiet_wait: float) -> list[dict[str, Any]]:
    """Every (interval, system) cell ``repeats`` times, interleaved: rounds over intervals over systems.
    Returns one aggregated record per cell (see :func:`_aggregate`), slowdowns filled in."""
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    step = 1
    for rep in range(repeats):
        for interval in intervals:
            n_it = _window_iters(interval, iters, budget)
            for name in systems:
                rec, step = _run_cell(wl, name, interval, n_it, workdir, step, dram_budget, quiet_wait)
                rec["repeat"] = rep
                runs.setdefault((interval, name), []).append(rec)
                extra = ""
                if "pccheck" in rec:
                    w = rec["pccheck"]["window"]
                    extra = (f"  Tw {_f(w['tw_s'], '.3f')} s, cow_wait {_f(w['median_cow_wait_s'], '.3f')} s, "
                             f"stall {_f(w['median_stall_s'], '.3f')} s")
                print(f"  [{wl.name}{f' run {rep + 1}/{repeats}' if repeats > 1 else ''}] interval {interval:>3} "
                      f"{name:<11} {rec['it_per_s']:7.3f} it/s ({rec['iters']} it, {rec['checkpoints']} ckpt, "
                      f"{rec['cell_s']:.0f} s, other load {rec['foreign_cpu_util']:.2f} CPUs){extra}", flush=True)
    records = [_aggregate(runs[(i, s)]) for i in intervals for s in systems]
    _derive(records)
    return records


def _aggregate(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One record for a cell measured len(runs) times: it/s is the median of the runs; every other
    field comes from the run whose it/s is the (lower) median, so they describe one real run."""
    rep = sorted(runs, key=lambda r: r["it_per_s"])[(len(runs) - 1) // 2]
    out = dict(rep)
    out["it_per_s"] = statistics.median(r["it_per_s"] for r in runs)
    out["s_per_iter"] = 1 / out["it_per_s"]
    out["it_per_s_runs"] = [r["it_per_s"] for r in runs]
    out["foreign_cpu_util_runs"] = [r["foreign_cpu_util"] for r in runs]
    return out


def _derive(records: Sequence[dict[str, Any]]) -> None:
    """Fill in what needs the ``none`` cell of the same interval: slowdown, extra time per iteration,
    minor faults per checkpoint net of training's own, and peak RSS growth net of training's own."""
    none = {r["interval"]: r for r in records if r["system"] == "none"}
    for r in records:
        r["minflt_per_iter"] = r["minflt_window"] / r["iters"]
    for r in records:
        base = none.get(r["interval"])
        r["slowdown"] = base["it_per_s"] / r["it_per_s"] if base else None
        r["extra_s_per_iter"] = r["s_per_iter"] - base["s_per_iter"] if base else None
        nck = r["checkpoints"]
        r["minflt_per_ckpt"] = ((r["minflt_window"] - base["minflt_per_iter"] * r["iters"]) / nck
                                if nck and base else None)
        g, g0 = r["peak_rss_growth_bytes"], base["peak_rss_growth_bytes"] if base else None
        r["peak_rss_growth_net_bytes"] = g - g0 if g is not None and g0 is not None else None


# -- targets, report, plot -----------------------------------------------------------------------------

def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _cell(records: Sequence[Mapping[str, Any]], interval: int, system: str) -> Mapping[str, Any] | None:
    return next((r for r in records if r["interval"] == interval and r["system"] == system), None)


def _targets(records: Sequence[Mapping[str, Any]], iter_time: float,
             rss_key: str = "peak_rss_growth_bytes") -> list[dict[str, Any]]:
    """Targets of the issue; peak RSS growth is judged on ``rss_key`` (raw, or net of the none cell's)."""
    out: list[dict[str, Any]] = []
    dcp = _cell(records, TARGET_INTERVAL, "dcp_async")
    none = _cell(records, TARGET_INTERVAL, "none")

    def other(*cells: Mapping[str, Any] | None) -> float:
        """The largest load by the rest of the machine during any run of these cells, in CPUs."""
        return max((o for c in cells if c is not None for o in c["foreign_cpu_util_runs"]), default=0.0)

    for r in records:
        if not r["system"].startswith("pccheck_N"):
            continue
        n = int(r["system"].removeprefix("pccheck_N"))
        pc = r["pccheck"]
        if r["interval"] == TARGET_INTERVAL:
            w = pc["window"]
            tw = w["tw_s"]
            applies = tw is not None and tw / n <= 10 * iter_time
            cond = f"Tw/N = {_f(tw, '.3f')}/{n} = {_f(tw / n if tw else None, '.3f')} s vs 10 t = {10 * iter_time:.3f} s"
            # Training blocked inside pccheck per iteration (stall + blocked copy + copy-on-write wait of
            # the window's checkpoints): a direct cost that does not depend on the none cell's noise.
            blocked = sum(c["stall_s"] + c["blocked_copy_s"] + c["cow_wait_s"] for c in w.get("checkpoints", []))
            blocked_per_iter = blocked / r["iters"] if w.get("checkpoints") else None
            est = (1 + blocked_per_iter / none["s_per_iter"]) if none and blocked_per_iter is not None else None
            o = other(r, none)
            out.append({"target": "slowdown", "system": r["system"], "interval": r["interval"],
                        "other_cpus_max": o, "applies": applies, "condition": cond, "value": r["slowdown"],
                        "limit": TARGET_SLOWDOWN, "blocked_ms_per_iter": _ms(blocked_per_iter),
                        "blocked_slowdown_estimate": est,
                        "met": (r["slowdown"] is not None and r["slowdown"] <= TARGET_SLOWDOWN) if applies else None,
                        "verdict": _verdict(applies, r["slowdown"], TARGET_SLOWDOWN, o)})
            ratio = None
            if dcp is not None and dcp.get("extra_s_per_iter") and r.get("extra_s_per_iter") is not None:
                ratio = r["extra_s_per_iter"] / dcp["extra_s_per_iter"]
            o = other(r, none, dcp)
            out.append({"target": "extra_vs_dcp", "system": r["system"], "interval": r["interval"],
                        "other_cpus_max": o, "applies": applies and ratio is not None, "condition": cond,
                        "value": ratio, "pccheck_extra_ms": _ms(r.get("extra_s_per_iter")),
                        "dcp_extra_ms": _ms(dcp.get("extra_s_per_iter")) if dcp else None,
                        "pccheck_blocked_ms_per_iter": _ms(blocked_per_iter),
                        "limit": TARGET_EXTRA_VS_DCP,
                        "met": (ratio <= TARGET_EXTRA_VS_DCP) if applies and ratio is not None else None,
                        "verdict": _verdict(applies and ratio is not None, ratio, TARGET_EXTRA_VS_DCP, o)})
        growth = r[rss_key]
        limit = pc["dram_budget_bytes"] + RSS_SLACK
        out.append({"target": "peak_rss", "system": r["system"], "interval": r["interval"], "applies": growth is not None,
                    "measure": rss_key, "raw": r["peak_rss_growth_bytes"], "net": r["peak_rss_growth_net_bytes"],
                    "value": growth, "limit": limit, "met": None if growth is None else growth <= limit})
        drift, faults = r["rss_drift_bytes"], r["minflt_per_ckpt"]
        flat = abs(drift) <= FLAT_RSS_TOL and (faults is None or faults <= FLAT_FAULTS_PER_CKPT)
        out.append({"target": "no_alloc_per_ckpt", "system": r["system"], "interval": r["interval"], "applies": True,
                    "value": drift, "minflt_per_ckpt": faults, "limit": FLAT_RSS_TOL, "met": flat})
    return out


def _verdict(applies: bool, value: float | None, limit: float, other_cpus: float) -> str:
    """MET / MISSED, or why neither: a timing target measured while other processes used more than
    NOISY_OTHER_CPUS of the 2 CPUs measures them as much as the checkpointer."""
    if not applies or value is None:
        return "n/a"
    if other_cpus > NOISY_OTHER_CPUS:
        return "INCONCLUSIVE"
    return "MET" if value <= limit else "MISSED"


def _judged(t: Mapping[str, Any], unit: str) -> str:
    """"MET (under by 0.006x)": a target's verdict and its distance from the limit."""
    v, lim = t["value"], t["limit"]
    return f"{t['verdict']} ({'under' if v <= lim else 'over'} by {abs(v - lim):.3f}{unit})"


def _noisy(t: Mapping[str, Any]) -> str:
    o = t.get("other_cpus_max", 0.0)
    return f"  (NOISY: other processes used up to {o:.2f} CPUs during these runs)" if o > NOISY_OTHER_CPUS else ""


def _print_targets(targets: Sequence[Mapping[str, Any]], title: str) -> None:
    print(f"\nTargets ({title}):")
    for t in targets:
        if t["target"] == "slowdown":
            head = f"  {t['system']:<11} interval {t['interval']}: slowdown <= {t['limit']:.2f}x"
            if not t["applies"]:
                print(f"{head}: not applicable ({t['condition']} does not hold); measured {_f(t['value'], '.3f')}x")
                continue
            v = t["value"]
            print(f"{head}: {v:.3f}x  {_judged(t, 'x')}  [{t['condition']}]{_noisy(t)}")
            print(f"{'':13} training blocked in pccheck {_f(t['blocked_ms_per_iter'], '.1f')} ms/iteration "
                  f"(stall + blocked_copy + cow_wait) alone gives {_f(t['blocked_slowdown_estimate'], '.3f')}x")
        elif t["target"] == "extra_vs_dcp":
            head = f"  {t['system']:<11} interval {t['interval']}: extra time/iter <= {t['limit']:.2f} x DCP's"
            if t["value"] is None:
                print(f"{head}: not evaluated (needs none and dcp_async at interval {t['interval']})")
                continue
            detail = f"({_f(t['pccheck_extra_ms'], '.1f')} ms vs {_f(t['dcp_extra_ms'], '.1f')} ms)"
            if not t["applies"]:
                print(f"{head}: not applicable (Tw/N > 10 t); measured {t['value']:.3f} {detail}")
                continue
            print(f"{head}: {t['value']:.3f} {detail}  {_judged(t, '')}{_noisy(t)}")
        elif t["target"] == "peak_rss":
            head = f"  {t['system']:<11} interval {t['interval']:>3}: peak RSS growth <= dram_budget + 64 MiB"
            if t["value"] is None:
                print(f"{head}: not measured (/proc/self/clear_refs not writable)")
                continue
            net = "" if t["net"] is None else f", net of none's {t['net'] / _MIB:.0f} MiB"
            print(f"{head} = {t['limit'] / _MIB:.0f} MiB: raw {t['raw'] / _MIB:.0f} MiB{net}; judged on "
                  f"{'net' if t['measure'].endswith('net_bytes') else 'raw'}: "
                  f"{'MET' if t['met'] else 'MISSED'} by {abs(t['limit'] - t['value']) / _MIB:.0f} MiB")
        else:
            print(f"  {t['system']:<11} interval {t['interval']:>3}: no allocation per checkpoint (|RSS drift| <= "
                  f"{FLAT_RSS_TOL // _MIB} MiB, <= {FLAT_FAULTS_PER_CKPT} minor faults/ckpt): drift "
                  f"{t['value'] / _MIB:+.1f} MiB, {_f(t['minflt_per_ckpt'], '.0f')} faults/ckpt  "
                  f"{'MET' if t['met'] else 'MISSED'}")


_CSV_HEADERS = ["workload", "interval", "system", "iters", "checkpoints", "elapsed_s", "it_per_s", "it_per_s_runs",
                "slowdown", "extra_ms_per_iter", "ckpt_call_median_ms", "cpu_util", "foreign_cpu_util",
                "peak_rss_growth_mib", "peak_rss_growth_net_mib", "rss_drift_mib", "minflt_per_iter", "minflt_per_ckpt",
                "pccheck_tw_s", "pccheck_median_stall_s", "pccheck_median_blocked_copy_s", "pccheck_median_cow_wait_s",
                "pccheck_max_cow_wait_s", "pccheck_median_copy_s", "pccheck_median_backpressure_s",
                "pccheck_median_persist_s", "pccheck_dram_budget_mib"]


def _mib(x: float | None) -> float | None:
    return None if x is None else x / _MIB


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def _report(records: Sequence[Mapping[str, Any]], systems: Sequence[str], intervals: Sequence[int],
            title: str) -> list[list[Any]]:
    """Print the pivot, detail and pccheck tables; return CSV rows."""
    pivot = []
    for i in intervals:
        row: list[Any] = [i]
        for s in systems:
            r = _cell(records, i, s)
            row.append("-" if r is None else f"{r['it_per_s']:.2f} ({_f(r['slowdown'], '.2f')}x)")
        pivot.append(row)
    print()
    print_table(f"{title}: iterations/s (slowdown vs none)", ["interval"] + list(systems), pivot)
    rows, pc_rows, csv_rows = [], [], []
    for r in records:
        pcw = r.get("pccheck", {}).get("window", {})
        runs = "/".join(f"{x:.2f}" + ("*" if o > NOISY_OTHER_CPUS else "")
                        for x, o in zip(r["it_per_s_runs"], r["foreign_cpu_util_runs"]))
        rows.append([r["interval"], r["system"], r["iters"], r["checkpoints"], runs, _f(r["slowdown"], ".3f"),
                     _f(_ms(r["extra_s_per_iter"]), ".1f"), _f(_ms(r["ckpt_call_median_s"]), ".1f"),
                     f"{r['cpu_util']:.2f}", f"{r['foreign_cpu_util']:.2f}",
                     _f(_mib(r["peak_rss_growth_bytes"]), ".0f") + " / " + _f(_mib(r["peak_rss_growth_net_bytes"]), ".0f"),
                     f"{r['rss_drift_bytes'] / _MIB:+.1f}", _f(r["minflt_per_ckpt"], ".0f")])
        if "pccheck" in r:
            n = int(r["system"].removeprefix("pccheck_N"))
            pc_rows.append([r["interval"], r["system"], pcw["count"], _f(pcw["tw_s"], ".3f"),
                            _f(None if pcw["tw_s"] is None else pcw["tw_s"] / n, ".3f"),
                            _f(_ms(pcw["median_stall_s"]), ".1f"), _f(_ms(pcw["median_blocked_copy_s"]), ".1f"),
                            _f(_ms(pcw["median_cow_wait_s"]), ".1f") + " / " + _f(_ms(pcw["max_cow_wait_s"]), ".1f"),
                            _f(_ms(pcw["median_copy_s"]), ".0f"), _f(_ms(pcw["median_backpressure_s"]), ".0f"),
                            _f(_ms(pcw["median_persist_s"]), ".0f"), f"{r['pccheck']['dram_budget_bytes'] / _MIB:.0f}"])
        csv_rows.append([r["workload"], r["interval"], r["system"], r["iters"], r["checkpoints"], r["elapsed_s"],
                         r["it_per_s"], runs, r["slowdown"], _ms(r["extra_s_per_iter"]), _ms(r["ckpt_call_median_s"]),
                         r["cpu_util"], r["foreign_cpu_util"], _mib(r["peak_rss_growth_bytes"]),
                         _mib(r["peak_rss_growth_net_bytes"]), r["rss_drift_bytes"] / _MIB, r["minflt_per_iter"],
                         r["minflt_per_ckpt"], pcw.get("tw_s"), pcw.get("median_stall_s"),
                         pcw.get("median_blocked_copy_s"), pcw.get("median_cow_wait_s"), pcw.get("max_cow_wait_s"),
                         pcw.get("median_copy_s"), pcw.get("median_backpressure_s"), pcw.get("median_persist_s"),
                         _mib(r.get("pccheck", {}).get("dram_budget_bytes"))])
    print_table(f"{title}: details (it/s of each run; extra = s/it - s/it of none; CPU util = this process, "
                f"other = rest of the machine, in CPUs, * = run with other > {NOISY_OTHER_CPUS}; RSS +MiB = peak growth raw / net of none's; "
                "faults/ckpt = minor faults net of none's)",
                ["interval", "system", "iters", "ckpts", "it/s", "slowdown", "extra ms/it", "ckpt call ms",
                 "CPU", "other", "peak RSS +MiB", "RSS drift MiB", "faults/ckpt"], rows)
    if pc_rows:
        print_table(f"{title}: pccheck per checkpoint, medians over the window (ms; Tw = start to durable, s; "
                    "cow_wait median / max)",
                    ["interval", "system", "ckpts", "Tw s", "Tw/N s", "stall", "blocked_copy", "cow_wait",
                     "copy", "backpressure", "persist", "DRAM MiB"], pc_rows)
    return csv_rows


def _plot(path: Path, panels: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[str], Sequence[int]]],
          label: str) -> bool:
    """Throughput vs checkpoint interval (log x), one line per system, one panel per workload."""
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, records, systems, intervals) in zip(axes[0], panels):
        for s in systems:  # one colour per system in every panel; hollow markers: a run had other load
            color = colors[SYSTEMS.index(s) % len(colors)] if s in SYSTEMS else None
            cells = [r for i in intervals if (r := _cell(records, i, s)) is not None]
            if not cells:
                continue
            xs, ys = [r["interval"] for r in cells], [r["it_per_s"] for r in cells]
            line = ax.plot(xs, ys, linestyle="--" if s == "none" else "-", color=color, label=s)[0]
            noisy = [max(r["foreign_cpu_util_runs"]) > NOISY_OTHER_CPUS for r in cells]
            ax.scatter([x for x, n in zip(xs, noisy) if not n], [y for y, n in zip(ys, noisy) if not n],
                       color=line.get_color(), zorder=3)
            ax.scatter([x for x, n in zip(xs, noisy) if n], [y for y, n in zip(ys, noisy) if n],
                       facecolors="white", edgecolors=line.get_color(), zorder=3)
        ax.set_xscale("log")
        ax.set_xticks(list(intervals), [str(i) for i in intervals])
        ax.set_xlabel("checkpoint interval (iterations)")
        ax.set_ylabel("training iterations/s (higher is better)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Training throughput while checkpointing (Figure 8 analog)\n{label}; hollow marker: other "
                 f"processes used > {NOISY_OTHER_CPUS} CPUs during a run of that cell", fontsize=9)
    save_figure(fig, path)
    return True


def _versions() -> dict[str, str]:
    return {name: str(getattr(sys.modules[name], "__version__", "?"))
            for name in ("numpy", "torch", "matplotlib", "pccheck") if name in sys.modules}


def _by_interval(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for r in records:
        out.setdefault(str(r["interval"]), {})[r["system"]] = r[key]
    return out


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the selected workloads in a scratch directory under ``args.dir``; return the result dict."""
    import torch

    result: dict[str, Any] = {"benchmark": "bench.overhead"}
    with scratch_dir(args.dir) as workdir:
        host = host_info(workdir)
        result["machine"] = machine_label(host)
        result["host"] = host
        if host["fs_type"] in ("tmpfs", "ramfs"):
            print(f"warning: {args.dir} is on {host['fs_type']}; these are not disk numbers")
        print(f"bench.overhead on {result['machine']}; torch {torch.__version__}, {torch.get_num_threads()} threads")
        if "emulated" in args.workloads:
            wl = make_emulated(args.size, args.iter_time)
            print(f"\n{wl.describe}; state {format_size(wl.state_bytes())}; intervals {args.intervals}")
            t0 = time.perf_counter()
            recs = _run_workload(wl, args.systems, args.intervals, args.iters, 60, workdir, args.dram_budget,
                                 args.repeats, args.quiet_wait)
            result["emulated"] = {"describe": wl.describe, "state_bytes": wl.state_bytes(),
                                  "runtime_s": time.perf_counter() - t0, "cells": recs}
            del wl
            gc.collect()
        if "real" in args.workloads:
            wl = make_real()
            systems = [s for s in REAL_SYSTEMS if s in args.systems or s == "none"]
            print(f"\n{wl.describe}; state {format_size(wl.state_bytes())}; intervals {list(args.real_intervals)}")
            t0 = time.perf_counter()
            recs = _run_workload(wl, systems, args.real_intervals, args.real_iters, 40, workdir, None, args.repeats,
                                 args.quiet_wait)
            result["real"] = {"describe": wl.describe, "state_bytes": wl.state_bytes(),
                              "runtime_s": time.perf_counter() - t0, "cells": recs, "systems": systems}
    if "emulated" in result:
        cells = result["emulated"]["cells"]
        # The issue's shape: {interval: {system: it_per_s}} (emulated GPU workload), and the slowdowns.
        result["it_per_s"] = _by_interval(cells, "it_per_s")
        result["slowdown"] = _by_interval(cells, "slowdown")
        result["targets"] = _targets(cells, args.iter_time)
    if "real" in result:
        result["real"]["it_per_s"] = _by_interval(result["real"]["cells"], "it_per_s")
        result["real"]["slowdown"] = _by_interval(result["real"]["cells"], "slowdown")
        # Real training allocates and frees activations every iteration, so its own peak RSS growth (the
        # none cell's) is subtracted there; the emulated workload allocates nothing and is judged raw.
        result["real"]["targets"] = _targets(result["real"]["cells"], float("nan"), "peak_rss_growth_net_bytes")
    result["note"] = (
        "GPU EMULATED in 'emulated' (host sleeps iter_time, then SGD updates all state in place); "
        "'real' is a real MLP trained with Adam on this CPU. it/s over a steady-state window of iters "
        "iterations holding k checkpoint calls and the background work of k checkpoints; slowdown = "
        "it/s(none)/it/s(system), measured side by side in one run; Tw = pccheck start-to-durable time "
        "per checkpoint (persist_s - stall_s, median over the window)")
    result["config"] = {
        "size_bytes": args.size, "iter_time_s": args.iter_time, "intervals": list(args.intervals),
        "iters": args.iters, "repeats": args.repeats, "quiet_wait_s": args.quiet_wait, "systems": list(args.systems), "workloads": list(args.workloads),
        "real_intervals": list(args.real_intervals),
        "optimizer": f"emulated: SGD(lr={_LR}, momentum=0); real: Adam(lr=1e-4)",
        "pccheck": {"writer_threads": 2, "chunk_size": _CHUNK, "dram_budget": args.dram_budget or "default (2x state)",
                    "soft_cow": "default (on)", "when_busy": "block"},
        "targets": {"interval": TARGET_INTERVAL, "slowdown": TARGET_SLOWDOWN, "extra_vs_dcp": TARGET_EXTRA_VS_DCP,
                    "rss_slack_bytes": RSS_SLACK, "flat_rss_tol_bytes": FLAT_RSS_TOL,
                    "flat_faults_per_ckpt": FLAT_FAULTS_PER_CKPT},
        "dir": str(args.dir), "versions": _versions(),
    }
    return result


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=None, help="emulated state size (default: 1GiB; 64MiB with --quick)")
    p.add_argument("--iter-time", type=float, default=0.05, help="emulated GPU time per iteration, s (default: %(default)s)")
    p.add_argument("--intervals", default=None, help="comma-separated checkpoint intervals (default: 1,10,25,50,100)")
    p.add_argument("--iters", type=int, default=None,
                   help="iterations per timed window for every interval (rounded up to a multiple of it); "
                        "default: k = max(1, min(10, 60 // interval)) checkpoints per window")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ",".join(SYSTEMS))
    p.add_argument("--repeats", type=int, default=1,
                   help="measure every cell this many times, interleaved, and report the median it/s (default: %(default)s)")
    p.add_argument("--quiet-wait", type=float, default=30.0,
                   help="before each cell wait up to this many seconds for the rest of the machine to use < "
                        f"{NOISY_OTHER_CPUS} CPUs (0: do not wait; default: %(default)s)")
    p.add_argument("--workloads", default="emulated,real", help="emulated, real or both (default: %(default)s)")
    p.add_argument("--dram-budget", default=None, help="pccheck dram_budget for the emulated workload (default: 2x state)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64MiB, intervals 1,10, short windows; writes overhead-quick.* unless --json")
    p.add_argument("--json", type=Path, default=None,
                   help="JSON output; CSV and PNG go beside it (default: bench/results/overhead.json)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    args = p.parse_args(argv)
    args.size = parse_size(args.size or ("64MiB" if args.quick else "1GiB"))
    intervals = args.intervals or ("1,10" if args.quick else ",".join(map(str, DEFAULT_INTERVALS)))
    args.intervals = [int(x) for x in intervals.split(",") if x.strip()]
    args.real_intervals = list(REAL_INTERVALS[:2] if args.quick else REAL_INTERVALS)
    args.real_iters = 10 if args.quick else None
    if args.quick and args.iters is None:
        args.iters = 10
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        p.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    if "none" not in args.systems:
        args.systems.insert(0, "none")  # every slowdown is relative to it
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.workloads or set(args.workloads) - {"emulated", "real"}:
        p.error("--workloads takes emulated, real or emulated,real")
    args.dram_budget = parse_size(args.dram_budget) if args.dram_budget else None
    if args.json is None:
        args.json = _BENCH_DIR / "results" / ("overhead-quick.json" if args.quick else "overhead.json")
    if not args.intervals or min(args.intervals) < 1 or args.iter_time < 0 or args.size < 4 * _N_PARAMS:
        p.error("need intervals >= 1, --iter-time >= 0 and --size of at least 16 bytes")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    args = _parse_args(argv)
    t0 = time.perf_counter()
    result = run_benchmark(args)
    result["runtime_s"] = time.perf_counter() - t0
    csv_rows: list[list[Any]] = []
    panels = []
    if "emulated" in result:
        title = f"emulated GPU (t = {args.iter_time * 1e3:g} ms, {format_size(args.size)})"
        csv_rows += _report(result["emulated"]["cells"], args.systems, args.intervals, title)
        panels.append((f"GPU EMULATED: sleep {args.iter_time * 1e3:g} ms + SGD update of "
                       f"{format_size(args.size)}", result["emulated"]["cells"], args.systems, args.intervals))
    if "real" in result:
        title = "real MLP trained on the CPU (Adam)"
        csv_rows += _report(result["real"]["cells"], result["real"]["systems"], args.real_intervals, title)
        panels.append((f"real CPU training: MLP + Adam, state {format_size(result['real']['state_bytes'])}",
                       result["real"]["cells"], result["real"]["systems"], args.real_intervals))
    if "targets" in result:
        _print_targets(result["targets"], f"emulated GPU, interval {TARGET_INTERVAL} for the first two")
    if "real" in result:
        _print_targets([t for t in result["real"]["targets"] if t["target"] in ("peak_rss", "no_alloc_per_ckpt")],
                       "real CPU workload, memory; informational: training itself allocates and frees "
                       "activations every iteration, so its RSS swings by tens of MiB")
    json_path: Path = args.json
    write_json(json_path, result)
    write_csv(json_path.with_suffix(".csv"), _CSV_HEADERS, csv_rows)
    wrote = [json_path, json_path.with_suffix(".csv")]
    if panels and _plot(json_path.with_suffix(".png"), panels, result["machine"]):
        wrote.append(json_path.with_suffix(".png"))
    print(f"\nwrote {', '.join(str(p) for p in wrote)}  ({result['runtime_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
