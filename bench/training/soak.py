"""Soak: does pccheck leak memory, file descriptors or threads over a long run? ``python -m bench.soak``.

Run::

    python -m bench.soak [--minutes 30] [--cycles 1000] [--quick] [--out bench/results/soak/latest.json]
                         [--size 256MiB] [--cycle-size 4MiB] [--sample-s 10] [--iter-time 0.05] [--dir DIR]

Two parts in one process, both on a torch model + AdamW (:func:`adamw_workload`: the emulated loop of
:mod:`bench.harness.workloads` with AdamW instead of SGD, so a third of the state is parameters and two thirds
the optimizer's ``exp_avg``/``exp_avg_sq``):

1. **loop**: ``--minutes`` of training, **GPU EMULATED** (the host sleeps ``--iter-time``, then
   ``AdamW.step()`` updates all of the state in place), ``--size`` of state, checkpointed by
   bench.systems' ``pccheck_N4`` (N = 4 in flight, interval 1, soft copy-on-write, 2 writers, 64 MiB
   chunks). Every ``--sample-s`` seconds, between two steps on the training thread (no sampler
   thread of its own): RSS (VmRSS), open fds (``/proc/self/fd``), OS threads (``/proc/self/status``
   Threads) and Python threads (``threading.active_count()``). *Warm-up*: the first 10% of the loop,
   and at least a minute (a quarter of a loop shorter than 4 minutes). After it, each series is
   *flat* when its growth (the highest sample minus the first one after warm-up) is within its
   tolerance: 64 MiB for RSS, 0 for fds, and for threads only the commit threads pccheck had not
   started yet (its commit pool starts up to N lazily: a bounded step, not a leak). The least-squares
   slope per minute is reported beside it.
2. **cycles**: ``--cycles`` open-checkpoint-close cycles of one store: ``pccheck.Checkpointer`` on
   the same path (N = 4, ``--cycle-size`` of state), one checkpoint, one training step (the
   copy-on-write pre-hook runs), ``close()``. Resources are read after each close. The first 10% of
   the cycles (at least 5) are warm-up; at their end and at the end of all cycles the cyclic garbage
   collector runs before reading, and fds and threads must be equal, RSS within 16 MiB. What the
   collector freed at the end (``held_until_gc_bytes``) is memory closed Checkpointers kept until a
   collection.

Writes the samples, the verdicts and the command to a JSON file (``--out``; with ``--quick`` the
default is ``bench/results/soak/quick.json``) and a PNG of RSS, fds and threads over time beside it; prints a
summary. ``--quick``: 30 s loop of 64 MiB, 100 cycles (about a minute; a smoke run).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import format_size, host_info, machine_label, parse_size, pyplot, save_figure, scratch_dir, \
    versions, write_json
from bench.harness.probes import proc_status
from bench.harness.systems import make_loop_system
from bench.harness.workloads import LR, Workload, make_emulated

__all__ = ["resources", "adamw_workload", "flatness", "run", "plot", "main"]

_BENCH_DIR = BENCH_DIR
MIB = 1 << 20
SYSTEM = "pccheck_N4"  # interval 1, N = 4: bench.systems' pccheck with max_concurrent=4
N_IN_FLIGHT = 4
RSS_TOL = 64 * MIB         # the target bound on RSS growth after warm-up (loop)
CYCLE_RSS_TOL = 16 * MIB   # RSS growth over the cycles, measured after gc.collect()
COUNT_TOL = 0              # fds and threads: flat means no growth at all
WARMUP_FRAC, WARMUP_MIN_S = 0.10, 60.0
QUICK = {"minutes": 0.5, "cycles": 100, "size": 64 * MIB, "sample_s": 2.0}
FULL = {"minutes": 30.0, "cycles": 1000, "size": 256 * MIB, "sample_s": 10.0}
KEYS = ("rss_bytes", "fds", "threads_os", "threads_py")
# The orchestrator's commit pool (a ThreadPoolExecutor of N workers with this name prefix) starts its
# threads lazily, one more each time more checkpoints than ever before are in flight at once: up to
# N, a bounded step and not a leak, even when it first happens after warm-up.
COMMIT_PREFIX = "pccheck-commit"


# -- what is measured ------------------------------------------------------------------------------------

def _os_threads() -> int:
    """Threads of this process, as the kernel counts them (``Threads:`` of /proc/self/status)."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no Threads line")


def resources() -> dict[str, int]:
    """RSS in bytes, open file descriptors, OS threads, Python threads and pccheck's commit threads of
    this process, now."""
    return {"rss_bytes": proc_status()["VmRSS"], "fds": len(os.listdir("/proc/self/fd")),
            "threads_os": _os_threads(), "threads_py": threading.active_count(),
            "commit_threads": sum(t.name.startswith(COMMIT_PREFIX) for t in threading.enumerate())}


def warmup_s(duration_s: float) -> float:
    """The loop's warm-up: the first 10% of it, at least a minute (a quarter of a loop under 4 min)."""
    return max(WARMUP_FRAC * duration_s, min(WARMUP_MIN_S, duration_s / 4))


def flatness(samples: Sequence[Mapping[str, Any]], key: str, start_s: float, tolerance: float) -> dict[str, Any]:
    """Whether ``key`` is flat in the samples taken at ``t_s >= start_s``: its growth (highest minus
    first) within ``tolerance``; also its range and least-squares slope per minute."""
    post = [s for s in samples if s["t_s"] >= start_s]
    if len(post) < 2:
        return {"flat": None, "samples": len(post), "why": "fewer than 2 samples after warm-up"}
    ts, ys = [s["t_s"] / 60 for s in post], [float(s[key]) for s in post]
    growth = max(ys) - ys[0]
    return {"flat": growth <= tolerance, "growth": growth, "tolerance": tolerance, "first": ys[0],
            "last": ys[-1], "min": min(ys), "max": max(ys),
            "slope_per_min": statistics.linear_regression(ts, ys).slope, "samples": len(post)}


# -- the workload -----------------------------------------------------------------------------------------

def adamw_workload(nbytes: int, iter_time: float) -> Workload:
    """bench.workloads' emulated model (4 float32 Parameters, grads set once) of ``nbytes / 3`` with
    ``torch.optim.AdamW`` stepped once, so its state exists: ``nbytes`` of state in all."""
    import torch

    base = make_emulated(max(16, nbytes // 3), iter_time)
    opt = torch.optim.AdamW(base.model.parameters(), lr=LR)

    def step() -> None:
        time.sleep(iter_time)  # the host waiting for the (emulated) GPU's forward/backward
        opt.step()             # every byte of parameters and optimizer state updated in place

    wl = Workload("adamw", base.model, opt, step,
                  f"GPU EMULATED: sleep {iter_time * 1e3:g} ms, then torch.optim.AdamW.step() over "
                  f"{format_size(nbytes)} of float32 state (parameters, exp_avg, exp_avg_sq)")
    opt.step()
    return wl


# -- part 1: the long loop --------------------------------------------------------------------------------

def _sample(t0: float, **extra: Any) -> dict[str, Any]:
    return {"t_s": round(time.perf_counter() - t0, 3), **extra, **resources()}


def _print_sample(s: Mapping[str, Any], what: str) -> None:
    print(f"  [{what} {s['t_s']:7.1f} s] RSS {s['rss_bytes'] / MIB:7.1f} MiB  fds {s['fds']:3d}  threads "
          f"{s['threads_os']:3d} (py {s['threads_py']})" + (f"  checkpoints {s['checkpoints']}"
                                                             if "checkpoints" in s else ""), flush=True)


def _tolerance(key: str, samples: Sequence[Mapping[str, Any]], start_s: float) -> float:
    """RSS: 64 MiB. fds: 0. Threads: the commit threads not started by the end of warm-up."""
    if key == "rss_bytes":
        return RSS_TOL
    first = next((s for s in samples if s["t_s"] >= start_s), None)
    if key.startswith("threads") and first is not None:
        return max(COUNT_TOL, N_IN_FLIGHT - first["commit_threads"])
    return COUNT_TOL


def _loop(wl: Workload, workdir: Path, minutes: float, sample_s: float) -> dict[str, Any]:
    """Train ``minutes`` with a checkpoint every step (``SYSTEM``), sampling every ``sample_s`` seconds."""
    duration = 60.0 * minutes
    t0 = time.perf_counter()
    samples = [_sample(t0, step=0, checkpoints=0, phase="before open")]
    sysm = make_loop_system(SYSTEM, wl, workdir, 1, None)
    taken = 0
    try:
        step = sysm.warmup(1)  # N + 1 checkpoints, waited for: every slot written once
        next_at = sample_s
        while (now := time.perf_counter() - t0) < duration:
            wl.step()
            taken += sysm.after_step(step)
            step += 1
            if now >= next_at:
                samples.append(_sample(t0, step=step, checkpoints=taken))
                _print_sample(samples[-1], "loop")
                next_at += sample_s * (1 + int((now - next_at) // sample_s))
        sysm.drain()
        summary = sysm.ck.stats().as_dict()["summary"]
    finally:
        sysm.close()
    closed = _sample(t0, step=step, checkpoints=taken, phase="after close")
    w = warmup_s(duration)
    verdicts = {k: flatness(samples, k, w, _tolerance(k, samples, w)) for k in KEYS}
    return {"system": SYSTEM, "interval": 1, "max_concurrent": N_IN_FLIGHT, "workload": wl.describe,
            "state_bytes": wl.state_bytes(), "minutes": minutes, "sample_s": sample_s, "warmup_s": w,
            "steps": step - 1, "loop_checkpoints": taken, "pccheck_summary": summary, "samples": samples,
            "after_close": closed, "verdicts": verdicts, "ok": all(v["flat"] for v in verdicts.values())}


# -- part 2: open-checkpoint-close cycles ----------------------------------------------------------------

def _one_cycle(wl: Workload, path: Path, step: int) -> None:
    """Open the store, checkpoint, train one step (the copy-on-write pre-hook runs), close."""
    import pccheck

    ck = pccheck.Checkpointer(wl.model, wl.optimizer, path=path, interval=1, max_concurrent=N_IN_FLIGHT)
    try:
        if not ck.checkpoint(step):
            raise RuntimeError(f"cycle {step}: the checkpoint was skipped")
        wl.step()
    finally:
        ck.close()


def _collected() -> dict[str, int]:
    """resources() after the cyclic garbage collector ran, with the RSS it freed."""
    before = proc_status()["VmRSS"]
    gc.collect()
    r = resources()
    return {**r, "held_until_gc_bytes": max(0, before - r["rss_bytes"])}


def _compare(at_warmup: Mapping[str, int], at_end: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    out = {}
    for k in KEYS:
        tol = CYCLE_RSS_TOL if k == "rss_bytes" else COUNT_TOL
        growth = at_end[k] - at_warmup[k]
        out[k] = {"after_warmup": at_warmup[k], "end": at_end[k], "growth": growth, "tolerance": tol,
                  "flat": growth <= tol}
    return out


def _cycles(wl: Workload, path: Path, cycles: int) -> dict[str, Any]:
    """``cycles`` open-checkpoint-close cycles of the store at ``path``; resources after each close."""
    warm = max(5, cycles // 10)
    every = max(1, cycles // 200)
    t0 = time.perf_counter()
    samples, at_warmup = [], None
    for i in range(1, cycles + 1):
        _one_cycle(wl, path, i)
        if i == warm:
            at_warmup = _collected()
        if i % every == 0 or i == cycles:
            samples.append(_sample(t0, cycle=i))
        if i % max(1, cycles // 10) == 0:
            _print_sample(samples[-1], f"cycle {i:>5}")
    at_end = _collected()
    if at_warmup is None:  # fewer cycles than the warm-up
        at_warmup = at_end
    verdicts = _compare(at_warmup, at_end)
    return {"cycles": cycles, "warmup_cycles": warm, "state_bytes": wl.state_bytes(), "max_concurrent": N_IN_FLIGHT,
            "seconds": time.perf_counter() - t0, "samples": samples, "at_warmup": at_warmup, "at_end": at_end,
            "held_until_gc_bytes": at_end["held_until_gc_bytes"],
            "rss_raw_max_bytes": max(s["rss_bytes"] for s in samples),
            "verdicts": verdicts, "ok": all(v["flat"] for v in verdicts.values())}


# -- the run, the figure, the summary ----------------------------------------------------------------------

def run(cfg: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
    """Both parts with the settings in ``cfg`` (minutes, cycles, size, cycle_size, sample_s, iter_time)."""
    host = host_info(workdir)
    print(f"soak: {cfg['minutes']:g} min loop of {format_size(cfg['size'])}, then {cfg['cycles']} cycles of "
          f"{format_size(cfg['cycle_size'])} in {workdir}", flush=True)
    wl = adamw_workload(cfg["size"], cfg["iter_time"])
    loop = _loop(wl, workdir / "loop", cfg["minutes"], cfg["sample_s"])
    del wl
    gc.collect()
    small = adamw_workload(cfg["cycle_size"], 0.0)
    cycles = _cycles(small, workdir / "cycles", cfg["cycles"])
    return {"benchmark": "soak", "machine": machine_label(host), "host": host,
            "versions": versions(("numpy", "torch", "pccheck")), "config": dict(cfg),
            "tolerances": {"loop_rss_bytes": RSS_TOL, "cycles_rss_bytes": CYCLE_RSS_TOL, "fds": COUNT_TOL,
                           "threads": "cycles: 0; loop: the commit threads not started by the end of warm-up"},
            "loop": loop, "cycles": cycles, "ok": loop["ok"] and cycles["ok"]}


def _panel(ax: Any, xs: Sequence[float], series: Mapping[str, Sequence[float]], ylabel: str,
           warm: float | None) -> None:
    for label, ys in series.items():
        ax.plot(xs, ys, marker=".", markersize=3, linewidth=1, label=label)
    if warm is not None:
        ax.axvspan(0, warm, color="grey", alpha=0.15, label="warm-up")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _column(axes: Sequence[Any], samples: Sequence[Mapping[str, Any]], x: Callable[[Mapping[str, Any]], float],
            warm: float) -> None:
    xs = [x(s) for s in samples]
    _panel(axes[0], xs, {"RSS": [s["rss_bytes"] / MIB for s in samples]}, "RSS (MiB)", warm)
    _panel(axes[1], xs, {"open fds": [s["fds"] for s in samples]}, "file descriptors", warm)
    _panel(axes[2], xs, {"OS threads": [s["threads_os"] for s in samples],
                         "Python threads": [s["threads_py"] for s in samples]}, "threads", warm)


def _word(ok: bool | None) -> str:
    return {True: "flat", False: "GROWS", None: "n/a"}[ok]


def plot(path: Path, res: Mapping[str, Any]) -> bool:
    """RSS, fds and threads over the loop (left, minutes) and over the cycles (right); False without
    matplotlib."""
    plt = pyplot(path)
    if plt is None:
        return False
    loop, cyc = res["loop"], res["cycles"]
    fig, axes = plt.subplots(3, 2, figsize=(12, 8), sharex="col")
    _column(axes[:, 0], loop["samples"], lambda s: s["t_s"] / 60, loop["warmup_s"] / 60)
    _column(axes[:, 1], cyc["samples"], lambda s: s["cycle"], cyc["warmup_cycles"])
    axes[0, 1].scatter([cyc["warmup_cycles"], cyc["cycles"]], [cyc[k]["rss_bytes"] / MIB for k in ("at_warmup", "at_end")],
                       color="red", zorder=3, label="after gc.collect() (compared)")
    axes[0, 1].legend(fontsize=7)
    axes[2, 0].set_xlabel("minutes")
    axes[2, 1].set_xlabel("open-checkpoint-close cycle")
    lv, cv = loop["verdicts"], cyc["verdicts"]
    axes[0, 0].set_title(f"loop: {format_size(loop['state_bytes'])}, interval 1, N = 4, {loop['steps']} steps; "
                         f"RSS {_word(lv['rss_bytes']['flat'])}, fds {_word(lv['fds']['flat'])}, threads "
                         f"{_word(lv['threads_os']['flat'])}", fontsize=8)
    axes[0, 1].set_title(f"{cyc['cycles']} cycles of one store, {format_size(cyc['state_bytes'])}; RSS (after gc) "
                         f"{_word(cv['rss_bytes']['flat'])}, fds {_word(cv['fds']['flat'])}, threads "
                         f"{_word(cv['threads_os']['flat'])}", fontsize=8)
    fig.suptitle(f"pccheck soak (GPU EMULATED: sleep + AdamW.step), {res['machine']}", fontsize=9)
    save_figure(fig, path)
    return True


def _line(name: str, v: Mapping[str, Any], scale: float = 1.0, unit: str = "") -> str:
    if v.get("flat") is None:
        return f"  {name:<11} n/a ({v.get('why', '')})"
    slope = f", slope {v['slope_per_min'] / scale:+.2f}{unit}/min" if "slope_per_min" in v else ""
    first, last = v.get("first", v.get("after_warmup")), v.get("last", v.get("end"))
    return (f"  {name:<11} {_word(v['flat']):<5} {first / scale:.1f} -> {last / scale:.1f}{unit}, growth "
            f"{v['growth'] / scale:+.1f}{unit} (limit {v['tolerance'] / scale:g}{unit}){slope}")


_ROWS = (("RSS", "rss_bytes", MIB, " MiB"), ("fds", "fds", 1, ""), ("threads", "threads_os", 1, ""),
         ("py threads", "threads_py", 1, ""))


def summarize(res: Mapping[str, Any]) -> None:
    """Print the verdicts."""
    loop, cyc = res["loop"], res["cycles"]
    print(f"\nloop: {loop['minutes']:g} min, {format_size(loop['state_bytes'])}, {loop['steps']} steps, "
          f"{loop['loop_checkpoints']} checkpoints in the loop ({loop['pccheck_summary']['failed']} failed); "
          f"after the first {loop['warmup_s']:.0f} s:")
    for name, key, scale, unit in _ROWS:
        print(_line(name, loop["verdicts"][key], scale, unit))
    print(f"  (thread limit: the commit threads not started by the end of warm-up; pccheck starts up to "
          f"N = {N_IN_FLIGHT} lazily)")
    print(f"cycles: {cyc['cycles']} of {format_size(cyc['state_bytes'])} in {cyc['seconds']:.0f} s; after cycle "
          f"{cyc['warmup_cycles']} vs the end (both after gc.collect()); the collector freed "
          f"{cyc['held_until_gc_bytes'] / MIB:.1f} MiB at the end:")
    for name, key, scale, unit in _ROWS:
        print(_line(name, cyc["verdicts"][key], scale, unit))
    print(f"verdict: {'no leak found' if res['ok'] else 'GROWTH FOUND'}")


# -- command line ----------------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="30 s loop of 64 MiB, 100 cycles (a smoke run)")
    p.add_argument("--minutes", type=float, help=f"loop length (default {FULL['minutes']:g}; quick {QUICK['minutes']:g})")
    p.add_argument("--cycles", type=int, help=f"open-checkpoint-close cycles (default {FULL['cycles']}; quick "
                                              f"{QUICK['cycles']})")
    p.add_argument("--size", type=parse_size, help="loop state (default 256MiB; quick 64MiB)")
    p.add_argument("--cycle-size", type=parse_size, default=4 * MIB, help="state of each cycle (default 4MiB)")
    p.add_argument("--sample-s", type=float, help="seconds between loop samples (default 10; quick 2)")
    p.add_argument("--iter-time", type=float, default=0.05, help="emulated GPU time per step (default 0.05 s)")
    p.add_argument("--out", "--json", dest="out", type=Path,
                   help="result JSON (default bench/results/soak/latest.json; quick: quick.json); the PNG goes beside it")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    a = p.parse_args(argv)
    base = QUICK if a.quick else FULL
    for k, v in base.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.out is None:
        a.out = result_path("soak", quick=a.quick)
    if a.minutes <= 0 or a.cycles < 1 or a.sample_s <= 0:
        p.error("--minutes and --sample-s must be > 0, --cycles >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: exit status 0 when nothing grew, 1 otherwise."""
    args = list(sys.argv[1:] if argv is None else argv)
    a = _parse_args(args)
    cfg = {k: getattr(a, k) for k in ("minutes", "cycles", "size", "cycle_size", "sample_s", "iter_time")}
    with scratch_dir(a.dir) as workdir:
        res = {"command": shlex.join(["python", "-m", "bench.soak", *args]), **run(cfg, workdir)}
    write_json(a.out, res)
    png = a.out.with_suffix(".png")
    plot(png, res)
    summarize(res)
    print(f"wrote {a.out} and {png}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
