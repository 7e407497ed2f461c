"""The tuner against a grid search: does ``pccheck-tune``'s choice match the best N x p x interval?

Run::

    python -m bench.tuner [--size 512MiB] [--iter-time 0.05] [--max-overhead 1.03] [--ns 1,2,3]
                          [--threads 1,2] [--intervals 1,4,8,12,16,24,32,48]
                          [--json bench/results/tuner/latest.json] [--dir bench/_scratch] [--quick]

**The GPU is emulated** (this machine has none): the workload is ``bench.overhead``'s emulated
iteration (``make_emulated``: the host sleeps ``--iter-time``, then ``torch.optim.SGD`` updates all
of the ``--size`` bytes of float32 parameters in place), checkpointed by
``pccheck.Checkpointer(model, optimizer)`` with soft copy-on-write, as in ``bench.overhead``.

1. **Tuner.** t is measured as a user would (the mean iteration time of the workload without
   checkpointing, 20 iterations after 3 of warm-up), then ``run_profile`` + ``choose`` (what
   ``pccheck-tune --size m --iter-time t --max-overhead q`` runs) pick N*, p*, b and f*. Its wall
   time (measuring t included) is the profiling time.
2. **Grid.** For every (N, p) with 64 MiB chunks (pccheck's default): one Checkpointer, warmed
   up (N+1 checkpoints: every slot written once), then for every interval f a baseline window
   without checkpoint calls (at most ``--baseline-iters`` iterations, nothing in flight) and a
   steady-state window of ``k*f`` iterations (at least ``--min-window``), opened right after a
   checkpoint call (in flight, as in a long run) and closed right after the k-th, then drained;
   one more baseline closes the group. Throughput X = it/s; slowdown = the mean of the baselines
   before and after the window / X (the machine's drift cancels).
3. **The tuner's choice** is measured the same way (its own group, N*, p*, b, f*).

The grid optimum under q is the smallest interval whose slowdown is <= q (the objective of §3.4:
checkpoint as often as the overhead bound allows), and among those cells the highest throughput.
Targets: the tuner's measured throughput >= 95% of the grid optimum's (each relative to its own
baseline, i.e. the ratio of 1/slowdown; the raw it/s ratio is reported too), and profiling < 5%
of the grid search's wall time. Also reported: the tuner's f* against the grid's smallest feasible
f, its measured slowdown against q, and the cost per checkpoint B the tuner measured against the B
that best fits each grid group's slowdowns (least squares of ``slowdown - 1 = B/(f t)``, a check
of the model that pools all windows of a group).

This is a shared 2-vCPU machine. The CPU time other processes use is measured for every window
and its baselines (from /proc/stat); a window where they used more than ``--max-foreign`` CPUs
is marked disturbed and left out of the optimum and the fit (the tuner's cell is measured again,
at most twice). Every number is noisier when others run.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import (
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

__all__ = ["run", "main"]

_BENCH_DIR = BENCH_DIR
_GRID_CHUNK = 64 << 20
TARGET_THROUGHPUT_RATIO = 0.95
TARGET_PROFILE_FRACTION = 0.05


# -- machine load ------------------------------------------------------------------------------------

def _busy_seconds() -> float:
    """CPU-seconds all processes spent non-idle since boot (/proc/stat, all CPUs)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class _Load:
    """CPUs used by *other* processes while a block runs (0 = quiet machine)."""

    def __enter__(self) -> _Load:
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc: Any) -> None:
        dt = time.perf_counter() - self.t0
        self.foreign = max(0.0, (_busy_seconds() - self.busy0) - (_own_seconds() - self.own0)) / dt if dt > 0 else 0.0


# -- measuring -----------------------------------------------------------------------------------------

def _settle() -> None:
    gc.collect()
    os.sync()


def _baseline(wl: Any, iters: int) -> float:
    """Iterations per second without checkpointing (after 2 untimed iterations)."""
    for _ in range(2):
        wl.step()
    t0 = time.perf_counter()
    for _ in range(iters):
        wl.step()
    return iters / (time.perf_counter() - t0)


def _window_iters(f: int, k: int, min_window: int) -> int:
    return max(k, math.ceil(min_window / f)) * f


def _run_group(wl: Any, workdir: Path, *, n: int, p: int, chunk: int, intervals: Sequence[int], k: int,
               min_window: int, baseline_iters: int, step: int, label: str,
               max_foreign: float) -> tuple[list[dict[str, Any]], int, float]:
    """One (N, p, chunk): one Checkpointer, and for every interval a baseline window (no checkpoint
    calls, nothing in flight) followed by a steady-state window; a last baseline closes the group.
    A window's slowdown is the mean of the baselines before and after it over its throughput, so
    the machine's drift between windows cancels."""
    import pccheck

    _settle()
    t_group = time.perf_counter()
    cell_dir = workdir / f"{label}-N{n}-p{p}"
    records: list[dict[str, Any]] = []
    baselines: list[tuple[float, float]] = []  # (it/s, other processes' CPUs)
    ck = pccheck.Checkpointer(wl.model, wl.optimizer, path=cell_dir, interval=1, max_concurrent=n,
                              writer_threads=p, chunk_size=chunk)
    try:
        for _ in range(n + 1):  # every slot written once: no timed write converts unwritten extents
            wl.step()
            ck.checkpoint(step)
            step += 1
        ck.wait()
        for f in intervals:
            ck.interval = f
            iters = _window_iters(f, k, min_window)
            with _Load() as load0:
                x0 = _baseline(wl, min(iters, baseline_iters))
            baselines.append((x0, load0.foreign))
            s0 = -(-step // f) * f
            wl.step()
            ck.maybe_checkpoint(s0)  # c0: in flight when the window opens, as in a long run
            with _Load() as load:
                t0 = time.perf_counter()
                for s in range(s0 + 1, s0 + iters + 1):
                    wl.step()
                    ck.maybe_checkpoint(s)
                elapsed = time.perf_counter() - t0
            ck.wait()
            stats = [c for c in ck.stats().checkpoints if s0 <= c.step <= s0 + iters and c.outcome != "failed"]
            records.append({
                "group": label, "n": n, "writer_threads": p, "chunk_size": chunk, "interval": f,
                "iters": iters, "checkpoints": iters // f, "elapsed_s": elapsed, "it_per_s": iters / elapsed,
                "tw_s": statistics.median(c.persist_s - c.stall_s for c in stats) if stats else None,
                "blocked_s": statistics.median(c.blocked_copy_s + c.cow_wait_s for c in stats) if stats else None,
                "stall_s": statistics.median(c.stall_s for c in stats) if stats else None,
                "foreign_cpus": load.foreign,
            })
            step = s0 + iters + 1
        with _Load() as load0:
            x0 = _baseline(wl, baseline_iters)
        baselines.append((x0, load0.foreign))
    finally:
        ck.close()
        shutil.rmtree(cell_dir, ignore_errors=True)
    for i, r in enumerate(records):
        (b0, l0), (b1, l1) = baselines[i], baselines[i + 1]
        r["baseline_it_per_s"] = (b0 + b1) / 2
        r["baseline_it_per_s_before_after"] = [b0, b1]
        r["baseline_foreign_cpus"] = max(l0, l1)
        r["slowdown"] = r["baseline_it_per_s"] / r["it_per_s"]
        r["contaminated"] = max(r["foreign_cpus"], l0, l1) > max_foreign
        print(f"  [{label}] N={n} p={p} chunk={format_size(chunk)} f={r['interval']:>3}: {r['it_per_s']:6.3f} it/s, "
              f"slowdown {r['slowdown']:.3f} (baseline {b0:.3f}/{b1:.3f} it/s; {r['iters']} it; other load "
              f"{r['foreign_cpus']:.2f} CPUs)", flush=True)
    return records, step, time.perf_counter() - t_group


def _fitted_blocked(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """B per checkpoint that best explains a group's slowdowns: least squares of
    ``slowdown - 1 = B / (f * t)`` over the windows where no checkpoint waits for another
    (``f * t >= 1.25 * T_w / N``), t = 1 / baseline it/s. A diagnostic beside the tuner's B: it
    pools every window of the group instead of trusting any single noisy one."""
    xs, ys = [], []
    for r in records:
        t = 1.0 / r["baseline_it_per_s"]
        if not r["contaminated"] and r["tw_s"] is not None and r["interval"] * t >= 1.25 * r["tw_s"] / r["n"]:
            xs.append(1.0 / (r["interval"] * t))
            ys.append(r["slowdown"] - 1.0)
    b = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) if xs else None
    return {"blocked_s": b, "windows": len(xs)}


def _grid_optimum(records: Sequence[Mapping[str, Any]], q: float) -> Mapping[str, Any] | None:
    """The smallest interval with slowdown <= q, then the highest it/s, among windows no other
    process disturbed (see ``--max-foreign``)."""
    ok = [r for r in records if r["slowdown"] <= q and not r["contaminated"]]
    if not ok:
        return None
    fmin = min(r["interval"] for r in ok)
    return max((r for r in ok if r["interval"] == fmin), key=lambda r: r["it_per_s"])


@dataclass
class _Tuned:
    """Step 1: what the tuner chose, and what that cost."""

    iter_time: float       # t, measured as a user would
    profile: Any           # pccheck.tuner.samples.Profile
    choice: Any            # pccheck.tuner.search.Choice
    seconds: float         # profiling wall time, measuring t included
    foreign_cpus: float    # other processes' load meanwhile


@dataclass
class _Measured:
    """Steps 2 and 3: every grid window, and every attempt at the tuner's cell."""

    grid: list[dict[str, Any]] = field(default_factory=list)
    grid_s: float = 0.0
    tuned: list[dict[str, Any]] = field(default_factory=list)
    tuned_s: float = 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The tuner, then the grid with the tuner's cell measured mid-run; returns the result document."""
    import torch

    from bench.training.overhead import make_emulated

    result: dict[str, Any] = {"benchmark": "bench.tuner"}
    with scratch_dir(args.dir) as workdir:
        host = host_info(workdir)
        result["machine"], result["host"] = machine_label(host), host
        print(f"bench.tuner on {result['machine']}; torch {torch.__version__}")
        wl = make_emulated(args.size, args.iter_time)
        m = wl.state_bytes()
        print(f"{wl.describe}; state {format_size(m)}; q = {args.max_overhead}")
        tuned = _run_tuner(wl, m, workdir, args)
        measured = _run_grid(wl, workdir, args, tuned.choice)
        del wl
        gc.collect()
    result.update(_results(args, m, tuned, measured))
    return result


def _run_tuner(wl: Any, m: int, workdir: Path, args: argparse.Namespace) -> _Tuned:
    """1. the tuner, as a user runs it: t measured without checkpoints, then profile and choose."""
    import pccheck
    from pccheck.tuner.profile import ProfileSpec, run_profile
    from pccheck.tuner.search import Constraints, choose

    _settle()
    with _Load() as load_tune:
        t_tune = time.perf_counter()
        for _ in range(3):
            wl.step()
        t0 = time.perf_counter()
        for _ in range(20):
            wl.step()
        t = (time.perf_counter() - t0) / 20
        spec = ProfileSpec(path=workdir / "tune", state_bytes=m, iter_time=t, dram_budget=2 * m,
                           storage_budget=(max(args.ns) + 1) * m, n_cap=max(args.ns),
                           max_overhead=args.max_overhead)
        profile = run_profile(spec, pccheck.Checkpointer)
        choice = choose(profile, Constraints(m, t, args.max_overhead, 2 * m, (max(args.ns) + 1) * m))
        tune_s = time.perf_counter() - t_tune
    print(f"\ntuner: t = {t * 1e3:.1f} ms measured; profiled in {tune_s:.1f} s (other load "
          f"{load_tune.foreign:.2f} CPUs): N*={choice.max_concurrent} p*={choice.writer_threads} "
          f"b={format_size(choice.chunk_size)} f*={choice.interval} (eq. 3: {choice.interval_eq3}, blocked term "
          f"{choice.interval_blocked}; T_w {choice.tw_s:.3f} s, B {choice.blocked_s * 1e3:.1f} ms), "
          f"expected slowdown {choice.expected_slowdown:.3f}")
    for note in choice.notes:
        print(f"  note: {note}")
    return _Tuned(t, profile, choice, tune_s, load_tune.foreign)


def _run_grid(wl: Any, workdir: Path, args: argparse.Namespace, choice: Any) -> _Measured:
    """2. the grid, and 3. the tuner's choice, measured the same way (mid-run, so drift hits it
    like the grid; again, at most twice, if other processes disturbed it)."""
    out = _Measured()
    step = 1
    groups = [(n, p) for n in args.ns for p in args.threads]
    window = {"k": args.k, "min_window": args.min_window, "baseline_iters": args.baseline_iters,
              "max_foreign": args.max_foreign}
    print(f"\ngrid: N in {list(args.ns)} x p in {list(args.threads)} x f in {list(args.intervals)}, "
          f"{format_size(_GRID_CHUNK)} chunks; k = {args.k} checkpoints per window (>= {args.min_window} it)")
    for i, (n, p) in enumerate(groups):
        recs, step, secs = _run_group(wl, workdir, n=n, p=p, chunk=_GRID_CHUNK, intervals=args.intervals,
                                      step=step, label="grid", **window)
        out.grid += recs
        out.grid_s += secs
        if i == len(groups) // 2:  # the tuner's cell mid-run, so drift hits it like the grid
            for _attempt in range(3):  # measured again (at most twice) if other processes disturbed it
                recs, step, secs = _run_group(wl, workdir, n=choice.max_concurrent, p=choice.writer_threads,
                                              chunk=choice.chunk_size, intervals=[choice.interval], step=step,
                                              label="tuner", **window)
                out.tuned += recs
                out.tuned_s += secs
                if not recs[0]["contaminated"]:
                    break
    return out


def _results(args: argparse.Namespace, m: int, tuned: _Tuned, measured: _Measured) -> dict[str, Any]:
    """The result document: the configuration, the tuner's and the grid's numbers, the comparison
    and the targets."""
    q, choice, profile, grid = args.max_overhead, tuned.choice, tuned.profile, measured.grid
    best = _grid_optimum(grid, q)
    clean_tuned = [r for r in measured.tuned if not r["contaminated"]]
    mine = clean_tuned[-1] if clean_tuned else measured.tuned[-1]
    same = [r for r in grid if (r["n"], r["writer_threads"], r["interval"]) ==
            (choice.max_concurrent, choice.writer_threads, choice.interval) and choice.chunk_size == _GRID_CHUNK]
    # throughput relative to the no-checkpoint baseline measured beside it (1 / slowdown): raw it/s
    # of windows minutes apart differ by the machine's drift as much as by the configuration
    ratio = best["slowdown"] / mine["slowdown"] if best else None
    raw_ratio = mine["it_per_s"] / best["it_per_s"] if best else None
    fraction = tuned.seconds / measured.grid_s
    fits = {f"N{n}-p{p}": _fitted_blocked([r for r in grid if (r["n"], r["writer_threads"]) == (n, p)])
            for n, p in sorted({(r["n"], r["writer_threads"]) for r in grid})}
    fitted = [v["blocked_s"] for v in fits.values() if v["blocked_s"] is not None]
    return {
        "note": ("GPU EMULATED: the host sleeps iter_time, then SGD(momentum=0) updates all state in place "
                 "(bench.overhead.make_emulated); throughput = it/s over steady-state windows, slowdown vs a "
                 "baseline window of the same group, all measured in one run"),
        "config": {"size_bytes": args.size, "state_bytes": m, "iter_time_s": args.iter_time,
                   "max_overhead": q, "ns": list(args.ns), "threads": list(args.threads),
                   "intervals": list(args.intervals), "k": args.k, "min_window": args.min_window,
                   "baseline_iters": args.baseline_iters, "grid_chunk_size": _GRID_CHUNK,
                   "max_foreign": args.max_foreign},
        "tuner": {"measured_iter_time_s": tuned.iter_time, "profile_s": tuned.seconds,
                  "profile_phases_s": profile.phases, "foreign_cpus": tuned.foreign_cpus,
                  "choice": choice.as_dict(),
                  "profile": {"copy": [c.__dict__ for c in profile.copy],
                              "storage": [{**s.__dict__, "samples": list(s.samples)} for s in profile.storage],
                              "write": [w.__dict__ for w in profile.write]},
                  "measured": mine, "grid_cell_same_config": same[0] if same else None},
        "grid": {"cells": grid, "seconds": measured.grid_s, "optimum": best, "fitted_blocked": fits,
                 "fitted_blocked_median_s": statistics.median(fitted) if fitted else None,
                 "smallest_feasible_interval": best["interval"] if best else None},
        "tuner_cell_seconds": measured.tuned_s,
        "tuner_cell_attempts": measured.tuned,
        "disturbed_windows": sum(r["contaminated"] for r in grid),
        "comparison": {"throughput_ratio": ratio, "raw_it_per_s_ratio": raw_ratio, "profile_fraction": fraction,
                       "tuner_blocked_s": choice.blocked_s,
                       "grid_fitted_blocked_s": statistics.median(fitted) if fitted else None,
                       "tuner_interval": choice.interval,
                       "grid_interval": best["interval"] if best else None,
                       "tuner_measured_slowdown": mine["slowdown"],
                       "tuner_expected_slowdown": choice.expected_slowdown},
        "targets": _targets(ratio, fraction),
    }


def _targets(ratio: float | None, fraction: float) -> list[dict[str, Any]]:
    """The two targets: throughput near the grid optimum's, and profiling far cheaper than the grid."""
    return [
        {"target": "tuner throughput / grid optimum throughput (each relative to its baseline)", "value": ratio,
         "limit": TARGET_THROUGHPUT_RATIO,
         "met": None if ratio is None else ratio >= TARGET_THROUGHPUT_RATIO},
        {"target": "profiling time / grid search time", "value": fraction, "limit": TARGET_PROFILE_FRACTION,
         "met": fraction < TARGET_PROFILE_FRACTION},
    ]


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(res: Mapping[str, Any], q: float) -> list[list[Any]]:
    cells = res["grid"]["cells"]
    intervals = sorted({r["interval"] for r in cells})
    groups = sorted({(r["n"], r["writer_threads"]) for r in cells})
    pivot = []
    for n, p in groups:
        row: list[Any] = [f"N={n} p={p}"]
        for f in intervals:
            r = next((c for c in cells if (c["n"], c["writer_threads"], c["interval"]) == (n, p, f)), None)
            row.append("-" if r is None else f"{r['slowdown']:.3f}" + ("*" if r["slowdown"] <= q else "")
                       + ("!" if r["contaminated"] else ""))
        pivot.append(row)
    print()
    print_table(f"grid: slowdown vs the group's baseline (* = within q = {q}; ! = disturbed by other processes, "
                "left out)",
                ["group"] + [f"f={f}" for f in intervals], pivot)
    ch, best, mine = res["tuner"]["choice"], res["grid"]["optimum"], res["tuner"]["measured"]
    rows = [
        ["tuner (pccheck-tune)", ch["max_concurrent"], ch["writer_threads"], format_size(ch["chunk_size"]),
         ch["interval"], f"{mine['it_per_s']:.3f}", f"{mine['slowdown']:.3f}", f"{ch['expected_slowdown']:.3f}",
         f"{res['tuner']['profile_s']:.1f} s"],
    ]
    if best:
        rows.append(["grid optimum", best["n"], best["writer_threads"], format_size(best["chunk_size"]),
                     best["interval"], f"{best['it_per_s']:.3f}", f"{best['slowdown']:.3f}", "-",
                     f"{res['grid']['seconds']:.1f} s"])
    print_table("tuner vs grid (GPU EMULATED; smallest interval with slowdown <= q, then highest it/s)",
                ["", "N", "p", "chunk", "interval", "it/s", "slowdown", "model's", "time"], rows)
    ratio = res["comparison"]["throughput_ratio"]
    ratio_s = "no grid cell within q" if ratio is None else f"{ratio:.3f}"
    raw = res["comparison"]["raw_it_per_s_ratio"]
    print(f"\nthroughput tuner / grid optimum (1/slowdown each): {ratio_s} (raw it/s: {_f(raw, '.3f')}); "
          f"interval {res['comparison']['tuner_interval']} vs {res['comparison']['grid_interval']}; "
          f"profiling / grid time: {res['comparison']['profile_fraction']:.3f}")
    print(f"windows disturbed by other processes (> {res['config']['max_foreign']} CPUs), left out: "
          f"{res['disturbed_windows']} of {len(cells)}; tuner cell disturbed: {mine['contaminated']}")
    fb = res["comparison"]["grid_fitted_blocked_s"]
    print(f"cost per checkpoint B: the tuner measured {res['comparison']['tuner_blocked_s'] * 1e3:.1f} ms; the grid's "
          f"slowdowns fit {_f(None if fb is None else fb * 1e3, '.1f')} ms (median over groups of a least-squares "
          "fit of slowdown - 1 = B / (f t))")
    print("Targets:")
    for t in res["targets"]:
        met = "not evaluated" if t["met"] is None else ("MET" if t["met"] else "MISSED")
        print(f"  {t['target']}: {_f(t['value'], '.3f')} (limit {t['limit']}) {met}")
    return [[r["group"], r["n"], r["writer_threads"], r["chunk_size"], r["interval"], r["iters"], r["elapsed_s"],
             r["it_per_s"], r["baseline_it_per_s"], r["slowdown"], r["tw_s"], r["blocked_s"], r["stall_s"],
             r["foreign_cpus"], r["contaminated"]] for r in cells + [mine]]


def plot(path: Path, res: Mapping[str, Any], q: float) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    cells = res["grid"]["cells"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, p in sorted({(r["n"], r["writer_threads"]) for r in cells}):
        pts = sorted((r["interval"], r["slowdown"]) for r in cells if (r["n"], r["writer_threads"]) == (n, p))
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", lw=1, label=f"grid N={n} p={p}")
    mine = res["tuner"]["measured"]
    ax.plot([mine["interval"]], [mine["slowdown"]], marker="*", ms=16, color="k", ls="none",
            label=f"tuner: N={mine['n']} p={mine['writer_threads']} f={mine['interval']}")
    ax.axhline(q, color="r", ls="--", lw=1, label=f"q = {q}")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval f (iterations)")
    ax.set_ylabel("slowdown (lower is better)")
    ax.set_ylim(0.95, min(3.0, max(r["slowdown"] for r in cells) * 1.05))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"pccheck-tune vs grid search (GPU EMULATED)\n{res['machine']}", fontsize=9)
    save_figure(fig, path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.tuner", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=None, help="emulated state size (default 512MiB; 128MiB with --quick)")
    p.add_argument("--iter-time", type=float, default=0.05, help="seconds the host waits per iteration")
    p.add_argument("--max-overhead", type=float, default=1.03, help="q, the slowdown bound")
    p.add_argument("--ns", default=None, help="N values of the grid (default 1,2,3; --quick 1,2)")
    p.add_argument("--threads", default=None, help="writer threads of the grid (default 1,2; --quick 2)")
    p.add_argument("--intervals", default=None, help="intervals of the grid")
    p.add_argument("--k", type=int, default=None, help="checkpoints per window (default 3; --quick 2)")
    p.add_argument("--min-window", type=int, default=20, help="least iterations per window")
    p.add_argument("--baseline-iters", type=int, default=24, help="iterations of each baseline window")
    p.add_argument("--max-foreign", type=float, default=0.25,
                   help="CPUs other processes may use during a window (or its baselines) before the window "
                        "counts as disturbed and is left out of the optimum and the fit")
    p.add_argument("--json", default=str(result_path("tuner")), help="result file (also .csv, .png)")
    p.add_argument("--dir", default=str(_BENCH_DIR / "_scratch"), help="scratch directory on the disk under test")
    p.add_argument("--quick", action="store_true", help="a small, fast run (smoke test)")
    a = p.parse_args(argv)
    a.size = parse_size(a.size or ("128MiB" if a.quick else "512MiB"))
    a.ns = _ints(a.ns or ("1,2" if a.quick else "1,2,3"))
    a.threads = _ints(a.threads or ("2" if a.quick else "1,2"))
    a.intervals = _ints(a.intervals or ("1,4,8,16,32" if a.quick else "1,4,8,12,16,24,32,48"))
    a.k = a.k or (2 if a.quick else 3)
    if a.max_overhead < 1 or min(a.ns) < 1 or min(a.threads) < 1 or min(a.intervals) < 1 or a.k < 1:
        p.error("need --max-overhead >= 1 and positive --ns, --threads, --intervals and --k")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    res = run(args)
    csv_rows = report(res, args.max_overhead)
    out = Path(args.json)
    write_json(out, res)
    write_csv(out.with_suffix(".csv"), ["group", "n", "writer_threads", "chunk_size", "interval", "iters", "elapsed_s",
                                         "it_per_s", "baseline_it_per_s", "slowdown", "tw_s", "blocked_s", "stall_s",
                                         "foreign_cpus", "disturbed"], csv_rows)
    plot(out.with_suffix(".png"), res, args.max_overhead)
    print(f"\nwrote {out}, {out.with_suffix('.csv')}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
