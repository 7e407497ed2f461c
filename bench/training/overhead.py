"""Training throughput while checkpointing every k iterations: the Figure 8 analog of PCcheck.

Run::

    python -m bench.overhead [--size 1GiB] [--iter-time 0.05] [--intervals 1,10,25,50,100]
                             [--iters N] [--systems none,torch_save,...] [--workloads emulated,real]
                             [--json bench/results/overhead/latest.json] [--dir bench/_scratch] [--quick]

This module is the harness: it sets each system up on a workload, warms it up and times a
steady-state window per (interval, system) cell. The workloads are :mod:`bench.harness.workloads`'s
(``emulated``: **the GPU is emulated**, the host sleeps ``--iter-time`` then SGD updates all of
``--size`` bytes of state in place, ~0.17 s for 1 GiB on 2 vCPUs; ``real``: an MLP trained with Adam on
the CPU, state ~150 MB, whose checkpoint threads compete with training for the same 2 cores). The
systems are :mod:`bench.harness.systems`'s training-loop systems, all measured in one run, each for every
interval (a checkpoint after step s if ``s % interval == 0``; every checkpoint holds the model's and
the optimizer's state): ``none``, ``torch_save``, ``dcp_async``, ``checkfreq`` and ``pccheck_N{1..4}``
(``writer_threads=2, chunk_size=64 MiB``, pccheck's defaults otherwise: soft copy-on-write on,
``when_busy="block"``, DRAM budget 2x the state, O_DIRECT). :mod:`bench.training.overhead_report` judges the
targets and writes the tables, the CSV and the plot.

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

:func:`run_cells` is the same harness as the figures use it (:mod:`bench.paper.fig8`, :mod:`bench.paper.fig12`):
any system :func:`bench.systems.make_loop_system` knows, call-to-durable times recorded, and cells
measured again while other processes disturb them.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.training import overhead_report as rpt
from bench.harness.common import fmt, format_size, host_info, machine_label, parse_size, scratch_dir, versions, \
    write_csv, write_json
from bench.harness.probes import NOISY_OTHER_CPUS, cpu_busy_s, proc_status, reset_peak_rss, settle, usage, wait_quiet
from bench.harness.systems import CHUNK, LoopSystem, make_loop_system, n_in_flight
from bench.harness.workloads import LR, N_PARAMS, Workload, make_emulated, make_real

__all__ = ["SYSTEMS", "REAL_SYSTEMS", "RETRY_WAIT_S", "make_emulated", "make_real", "run_workload", "run_cells",
           "run", "main"]

_BENCH_DIR = BENCH_DIR

SYSTEMS: tuple[str, ...] = ("none", "torch_save", "dcp_async", "checkfreq",
                            "pccheck_N1", "pccheck_N2", "pccheck_N3", "pccheck_N4")
REAL_SYSTEMS: tuple[str, ...] = ("none", "torch_save", "dcp_async", "pccheck_N2")
DEFAULT_INTERVALS: tuple[int, ...] = (1, 10, 25, 50, 100)
REAL_INTERVALS: tuple[int, ...] = (1, 10, 50)
RETRY_WAIT_S = 20.0  # before re-measuring a disturbed cell, wait up to this long for quiet

MakeSystem = Callable[[str, Workload, Path, int, int | None], LoopSystem]  # make_loop_system's shape


# -- one cell ------------------------------------------------------------------------------------------

def _window_iters(interval: int, iters: int | None, budget: int) -> int:
    if iters is not None:
        return max(1, math.ceil(iters / interval)) * interval
    return max(1, min(10, budget // interval)) * interval


def _run_cell(wl: Workload, name: str, interval: int, iters: int, workdir: Path, step: int,
              dram_budget: int | None, quiet_wait: float, make_system: MakeSystem) -> tuple[dict[str, Any], int]:
    """Set up, warm up and time one (system, interval); return its record and the next step number."""
    settle()
    waited, other_before = wait_quiet(quiet_wait) if quiet_wait > 0 else (0.0, None)
    peak_reset = reset_peak_rss()
    rss_setup = proc_status()["VmRSS"]
    cell_dir = workdir / f"{wl.name}-{name}-i{interval}"
    t_cell = time.perf_counter()
    sysm = make_system(name, wl, cell_dir, interval, dram_budget)
    try:
        for _ in range(2):
            wl.step()
        step = sysm.warmup(step)
        s0 = -(-step // interval) * interval
        wl.step()
        sysm.after_step(s0)  # c0: the checkpoint in flight when the window opens, as in a long run
        rss_start = proc_status()["VmRSS"]
        flt0, cpu0 = usage()
        busy0, load0 = cpu_busy_s(), os.getloadavg()[0]
        calls: list[float] = []
        t0 = time.perf_counter()
        for s in range(s0 + 1, s0 + iters + 1):
            wl.step()
            c0 = time.perf_counter()
            if sysm.after_step(s):
                calls.append(time.perf_counter() - c0)
        elapsed = time.perf_counter() - t0
        flt1, cpu1 = usage()
        busy1, load1 = cpu_busy_s(), os.getloadavg()[0]
        rss_end = proc_status()["VmRSS"]
        sysm.drain()
        hwm = proc_status()["VmHWM"]
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


def _measure_cell(wl: Workload, name: str, interval: int, iters: int, workdir: Path, step: int,
                  dram_budget: int | None, quiet_wait: float, make_system: MakeSystem, retries: int,
                  noisy_cpus: float) -> tuple[dict[str, Any], int]:
    """:func:`_run_cell`, run again (up to ``retries`` times) while other processes used more than
    ``noisy_cpus`` CPUs during its window; the least disturbed attempt is kept, with every attempt's
    foreign load. ``retries=0``: the one attempt, as it is."""
    if retries <= 0:
        return _run_cell(wl, name, interval, iters, workdir, step, dram_budget, quiet_wait, make_system)
    attempts: list[dict[str, Any]] = []
    for attempt in range(retries + 1):
        rec, step = _run_cell(wl, name, interval, iters, workdir, step, dram_budget, quiet_wait, make_system)
        attempts.append(rec)
        load = rec.get("foreign_cpu_util")
        if load is None or load <= noisy_cpus or attempt == retries:
            break
        print(f"  [{wl.name}] interval {interval:>3} {name}: other processes used {load:.2f} CPUs "
              f"(> {noisy_cpus}) during the window; measuring again once they are quiet", flush=True)
        wait_quiet(RETRY_WAIT_S, noisy_cpus)  # up to RETRY_WAIT_S for the other processes to go quiet first
    best = min(attempts, key=lambda r: r.get("foreign_cpu_util") or 0.0)
    best["attempts"] = len(attempts)
    best["foreign_cpu_util_attempts"] = [r.get("foreign_cpu_util") for r in attempts]
    return best, step


# -- cells of one workload -------------------------------------------------------------------------------

def run_workload(wl: Workload, systems: Sequence[str], intervals: Sequence[int], iters: int | None,
                 budget: int, workdir: Path, dram_budget: int | None, repeats: int = 1, quiet_wait: float = 0.0,
                 *, make_system: MakeSystem = make_loop_system, retries: int = 0,
                 noisy_cpus: float = 0.3) -> list[dict[str, Any]]:
    """Every (interval, system) cell ``repeats`` times, interleaved: rounds over intervals over systems.
    Returns one aggregated record per cell (see :func:`_aggregate`), slowdowns filled in. Before each
    cell: wait up to ``quiet_wait`` s for the rest of the machine to go quiet; ``retries``: see
    :func:`_measure_cell`."""
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    step = 1
    for rep in range(repeats):
        for interval in intervals:
            n_it = _window_iters(interval, iters, budget)
            for name in systems:
                rec, step = _measure_cell(wl, name, interval, n_it, workdir, step, dram_budget, quiet_wait,
                                          make_system, retries, noisy_cpus)
                rec["repeat"] = rep
                runs.setdefault((interval, name), []).append(rec)
                extra = ""
                if "pccheck" in rec:
                    w = rec["pccheck"]["window"]
                    extra = (f"  Tw {fmt(w['tw_s'], '.3f')} s, cow_wait {fmt(w['median_cow_wait_s'], '.3f')} s, "
                             f"stall {fmt(w['median_stall_s'], '.3f')} s")
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


def run_cells(wl: Workload, systems: Sequence[str], intervals: Sequence[int], iters: int | None, budget: int,
              workdir: Path, dram_budget: int | None = None, on_cell: Callable[[str, int], None] | None = None,
              repeats: int = 1, quiet_wait: float = 0.0, retries: int = 0, noisy_cpus: float = 0.3,
              tuned: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """The cells as the figures measure them: :func:`run_workload` with every system of
    :func:`bench.systems.make_loop_system` available (``tuned``: the tuner's {n, p, chunk} for
    ``pccheck_tuned``) and call-to-durable times recorded; ``on_cell(system, interval)`` is called as
    each cell's system is set up. Each record gains ``tw_s`` (call to durable, median over the window;
    0 for gpm) and ``n`` (checkpoints in flight)."""
    def make(name: str, wl: Workload, workdir: Path, interval: int, dram_budget: int | None) -> LoopSystem:
        if on_cell is not None:
            on_cell(name, interval)
        return make_loop_system(name, wl, workdir, interval, dram_budget, lag=True, tuned=tuned)

    recs = run_workload(wl, list(systems), list(intervals), iters, budget, workdir, dram_budget, repeats,
                        quiet_wait, make_system=make, retries=retries, noisy_cpus=noisy_cpus)
    for r in recs:
        r["tw_s"] = (r.get("pccheck") or {}).get("window", {}).get("tw_s")
        r["n"] = n_in_flight(r["system"], tuned)
    return recs


# -- the benchmark and its command line ----------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
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
            recs = run_workload(wl, args.systems, args.intervals, args.iters, 60, workdir, args.dram_budget,
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
            recs = run_workload(wl, systems, args.real_intervals, args.real_iters, 40, workdir, None, args.repeats,
                                args.quiet_wait)
            result["real"] = {"describe": wl.describe, "state_bytes": wl.state_bytes(),
                              "runtime_s": time.perf_counter() - t0, "cells": recs, "systems": systems}
    if "emulated" in result:
        cells = result["emulated"]["cells"]
        # The result's shape: {interval: {system: it_per_s}} (emulated GPU workload), and the slowdowns.
        result["it_per_s"] = rpt.by_interval(cells, "it_per_s")
        result["slowdown"] = rpt.by_interval(cells, "slowdown")
        result["targets"] = rpt.targets(cells, args.iter_time)
    if "real" in result:
        result["real"]["it_per_s"] = rpt.by_interval(result["real"]["cells"], "it_per_s")
        result["real"]["slowdown"] = rpt.by_interval(result["real"]["cells"], "slowdown")
        # Real training allocates and frees activations every iteration, so its own peak RSS growth (the
        # none cell's) is subtracted there; the emulated workload allocates nothing and is judged raw.
        result["real"]["targets"] = rpt.targets(result["real"]["cells"], float("nan"), "peak_rss_growth_net_bytes")
    result["note"] = (
        "GPU EMULATED in 'emulated' (host sleeps iter_time, then SGD updates all state in place); "
        "'real' is a real MLP trained with Adam on this CPU. it/s over a steady-state window of iters "
        "iterations holding k checkpoint calls and the background work of k checkpoints; slowdown = "
        "it/s(none)/it/s(system), measured side by side in one run; Tw = pccheck start-to-durable time "
        "per checkpoint (persist_s - stall_s, median over the window)")
    result["config"] = {
        "size_bytes": args.size, "iter_time_s": args.iter_time, "intervals": list(args.intervals),
        "iters": args.iters, "repeats": args.repeats, "quiet_wait_s": args.quiet_wait, "systems": list(args.systems),
        "workloads": list(args.workloads),
        "real_intervals": list(args.real_intervals),
        "optimizer": f"emulated: SGD(lr={LR}, momentum=0); real: Adam(lr=1e-4)",
        "pccheck": {"writer_threads": 2, "chunk_size": CHUNK, "dram_budget": args.dram_budget or "default (2x state)",
                    "soft_cow": "default (on)", "when_busy": "block"},
        "targets": {"interval": rpt.TARGET_INTERVAL, "slowdown": rpt.TARGET_SLOWDOWN,
                    "extra_vs_dcp": rpt.TARGET_EXTRA_VS_DCP, "rss_slack_bytes": rpt.RSS_SLACK,
                    "flat_rss_tol_bytes": rpt.FLAT_RSS_TOL, "flat_faults_per_ckpt": rpt.FLAT_FAULTS_PER_CKPT},
        "dir": str(args.dir), "versions": versions(("numpy", "torch", "matplotlib", "pccheck")),
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
    p.add_argument("--spread", default=None,
                   help='the GoCkpt row instead (bench.gockpt\'s harness, results in bench/results/gockpt/latest-interval.json): '
                        'pccheck with spread_steps="auto" or an int against k=1, DCP async_save and none, AdamW '
                        'state of --size over an emulated copy link of S/(B t) = --link-ratio, one --intervals')
    p.add_argument("--link-ratio", type=float, default=4.0,
                   help="with --spread: S/(B t), iterations one snapshot needs on the emulated link (>= 3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 64MiB, intervals 1,10, short windows; writes bench/results/overhead/quick.* unless --json")
    p.add_argument("--json", type=Path, default=None,
                   help="JSON output; CSV and PNG go beside it (default: bench/results/overhead/latest.json)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    args = p.parse_args(argv)
    args.size = parse_size(args.size or ("64MiB" if args.quick else "1GiB"))
    if args.spread is not None:
        if args.spread != "auto" and not args.spread.isdigit():
            p.error('--spread takes "auto" or an integer >= 1')
        args.intervals = [int(args.intervals or 10)] if "," not in (args.intervals or "") else p.error(
            "--spread measures one interval: give --intervals N")
        return args
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
        args.json = result_path("overhead", quick=args.quick)
    if not args.intervals or min(args.intervals) < 1 or args.iter_time < 0 or args.size < 4 * N_PARAMS:
        p.error("need intervals >= 1, --iter-time >= 0 and --size of at least 16 bytes")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    args = _parse_args(argv)
    if args.spread is not None:
        return _spread_row(args, argv)
    t0 = time.perf_counter()
    result = run(args)
    result["runtime_s"] = time.perf_counter() - t0
    csv_rows: list[list[Any]] = []
    panels = []
    if "emulated" in result:
        title = f"emulated GPU (t = {args.iter_time * 1e3:g} ms, {format_size(args.size)})"
        csv_rows += rpt.report(result["emulated"]["cells"], args.systems, args.intervals, title)
        panels.append((f"GPU EMULATED: sleep {args.iter_time * 1e3:g} ms + SGD update of "
                       f"{format_size(args.size)}", result["emulated"]["cells"], args.systems, args.intervals))
    if "real" in result:
        title = "real MLP trained on the CPU (Adam)"
        csv_rows += rpt.report(result["real"]["cells"], result["real"]["systems"], args.real_intervals, title)
        panels.append((f"real CPU training: MLP + Adam, state {format_size(result['real']['state_bytes'])}",
                       result["real"]["cells"], result["real"]["systems"], args.real_intervals))
    if "targets" in result:
        rpt.print_targets(result["targets"], f"emulated GPU, interval {rpt.TARGET_INTERVAL} for the first two")
    if "real" in result:
        rpt.print_targets([t for t in result["real"]["targets"] if t["target"] in ("peak_rss", "no_alloc_per_ckpt")],
                          "real CPU workload, memory; informational: training itself allocates and frees "
                          "activations every iteration, so its RSS swings by tens of MiB")
    json_path: Path = args.json
    write_json(json_path, result)
    write_csv(json_path.with_suffix(".csv"), rpt.CSV_HEADERS, csv_rows)
    wrote = [json_path, json_path.with_suffix(".csv")]
    if panels and rpt.plot(json_path.with_suffix(".png"), panels, result["machine"], SYSTEMS):
        wrote.append(json_path.with_suffix(".png"))
    print(f"\nwrote {', '.join(str(p) for p in wrote)}  ({result['runtime_s']:.0f} s)")
    return 0


def _spread_row(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--spread``: GoCkpt mode against k = 1, DCP async_save and no checkpoints (bench.gockpt)."""
    from bench.modes import gockpt

    try:
        cfg = gockpt.make_config(args.size, args.iter_time, args.link_ratio, args.spread, args.intervals[0],
                                 2 if args.quick else 4, args.quiet_wait)
    except ValueError as exc:
        print(f"python -m bench.overhead: error: {exc}", file=sys.stderr)
        return 2
    json_path = args.json or result_path("gockpt", quick=args.quick, variant="interval")
    command = "python -m bench.overhead " + " ".join(argv if argv is not None else sys.argv[1:])
    return gockpt.run_and_report(cfg, gockpt.SYSTEMS, 1 if args.quick else args.repeats, args.dir, json_path, command)


if __name__ == "__main__":
    sys.exit(main())
