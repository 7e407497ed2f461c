"""Figures 12-14 analogs: pccheck's sensitivity to N, writer threads p, chunk size and DRAM budget.

Run::

    python -m bench.fig12 [--quick] [--out bench/results (root: files go to OUT/fig12/)] [--dir bench/_scratch]

All on the **emulated-GPU** workload of Figure 8 (bench.workloads' ``make_emulated``: the host sleeps
50 ms as it would wait for a GPU, then SGD updates all of m = 1 GiB of float32 state), measured with
bench.overhead's cells (each grid below is one interleaved group with its own ``none`` cell, so every
slowdown is against a baseline measured beside it):

(a) Figure 12: slowdown vs N at intervals 1, 10 and 25: the pccheck_N1..N4 cells of Figure 8 (passed
    in by ``python -m bench all``; measured here when run alone).
(b) Figure 13: slowdown vs writer threads p = 1, 2, 3 for N = 1, 2, 3 (64 MiB chunks, DRAM 2m). The
    paper uses interval 10 on OPT-350M, where T_w exceeds 10 iterations; on this workload T_w (~0.4 s)
    is below one 10-iteration period (~2.2 s), so p cannot matter there. Interval 1 (T_w > t) is the
    same regime as the paper's, and is what this panel measures.
(c) Figure 14: slowdown vs DRAM budget m/2, m, 2m for chunk sizes 16, 64 and 256 MiB (N = 2, p = 2)
    at interval 10 (the paper: interval 15).

Writes ``bench/results/fig12/latest.csv``, ``.json``, ``.png``.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, figure_parser, format_size, host_info, machine_label, pyplot, save_figure, scratch_dir, \
    write_csv, write_json
from bench.training.overhead import run_cells
from bench.harness.systems import parse_pccheck_name
from bench.harness.workloads import make_emulated

__all__ = ["Config", "plan", "run", "main"]


class Config:
    """Grids and window sizes of one run (full or quick)."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.size = (16 << 20) if quick else (1 << 30)
        self.iter_time = 0.005 if quick else 0.05
        self.budget = 10 if quick else 20     # panel (a) when measured here
        self.threads_budget = 10 if quick else 5  # 5 checkpoints per window at interval 1
        self.mem_budget = 10                      # 1 checkpoint per window at interval 10
        self.retries = 0 if quick else 2          # re-measure while other processes used > 0.3 CPUs
        self.iters = 10 if quick else None
        # Before each full-run cell, wait up to this long for other processes on the machine to go
        # quiet (bench.overhead's quiet_wait); the quick run does not wait.
        self.quiet_wait = 0.0 if quick else 2.0
        self.n_intervals = (1, 10) if quick else (1, 10, 25)
        self.ns = (1, 2) if quick else (1, 2, 3, 4)
        self.threads_interval = 1
        self.threads = (1, 2) if quick else (1, 2, 3)
        self.threads_ns = (1, 2) if quick else (1, 2, 3)
        self.mem_interval = 10
        self.budgets = (0.5, 2.0) if quick else (0.5, 1.0, 2.0)
        self.chunks_mib = (4,) if quick else (16, 64, 256)

    def threads_systems(self) -> list[str]:
        return ["none"] + [f"pccheck_N{n}_p{p}_c64" for n in self.threads_ns for p in self.threads]

    def mem_systems(self) -> list[str]:
        return ["none"] + [f"pccheck_N2_p2_c{c}_b{b:g}m" for c in self.chunks_mib for b in self.budgets]


def plan(quick: bool, have_n_cells: bool = True) -> int:
    c = Config(quick)
    n = len(c.threads_systems()) + len(c.mem_systems())
    if not have_n_cells:
        n += len(c.n_intervals) * (1 + len(c.ns))
    return n


def run(out: Path, quick: bool, workdir: Path, tick: Callable[[str], None] | None = None,
        fig8_cells: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    cfg = Config(quick)
    tick = tick or (lambda label: None)
    t0 = time.perf_counter()
    res: dict[str, Any] = {"benchmark": "bench.fig12", "quick": quick}
    with scratch_dir(workdir) as work:
        res["machine"] = machine_label(host_info(work))
        wl = make_emulated(cfg.size, cfg.iter_time)
        res["workload"] = {"describe": wl.describe, "state_bytes": wl.state_bytes()}
        if fig8_cells:
            n_cells = [dict(c) for c in fig8_cells
                       if c["interval"] in cfg.n_intervals and (c["system"] == "none" or
                                                                c["system"] in [f"pccheck_N{n}" for n in cfg.ns])]
            res["n_source"] = "Figure 8 cells of this run"
        else:
            n_cells = run_cells(wl, ["none"] + [f"pccheck_N{n}" for n in cfg.ns], cfg.n_intervals,
                                cfg.iters, cfg.budget, work, quiet_wait=cfg.quiet_wait, retries=cfg.retries,
                                on_cell=lambda s, i: tick(f"fig12 N: interval {i}, {s}"))
            res["n_source"] = "measured here"
        res["n_cells"] = n_cells
        res["threads_interval"] = cfg.threads_interval
        res["threads_cells"] = run_cells(
            wl, cfg.threads_systems(), [cfg.threads_interval], cfg.iters, cfg.threads_budget, work,
            quiet_wait=cfg.quiet_wait, retries=cfg.retries,
            on_cell=lambda s, i: tick(f"fig12 threads: interval {i}, {s}"))
        res["mem_interval"] = cfg.mem_interval
        res["mem_cells"] = run_cells(
            wl, cfg.mem_systems(), [cfg.mem_interval], cfg.iters, cfg.mem_budget, work,
            quiet_wait=cfg.quiet_wait, retries=cfg.retries,
            on_cell=lambda s, i: tick(f"fig12 memory: interval {i}, {s}"))
        del wl
        gc.collect()
    res["runtime_s"] = time.perf_counter() - t0
    stem = result_path("fig12", "", quick=quick, root=out)
    write_json(stem.with_suffix(".json"), res)
    write_csv(stem.with_suffix(".csv"), ["panel", "interval", "system", "N", "writer_threads", "chunk_mib",
                                    "dram_budget_x_m", "it_per_s", "slowdown", "tw_s", "foreign_cpu_util"], _rows(res))
    plot(stem.with_suffix(".png"), res)
    return res


def _rows(res: Mapping[str, Any]) -> list[list[Any]]:
    rows = []
    for panel, key in (("a_N", "n_cells"), ("b_threads", "threads_cells"), ("c_memory", "mem_cells")):
        for c in res[key]:
            cfg = parse_pccheck_name(c["system"]) or {}
            rows.append([panel, c["interval"], c["system"], cfg.get("n"), cfg.get("p"),
                         cfg["chunk"] >> 20 if cfg else None,
                         cfg.get("budget_x") or (2.0 if cfg else None), c["it_per_s"], c["slowdown"], c.get("tw_s"),
                         c.get("foreign_cpu_util")])
    return rows


def plot(path: Path, res: Mapping[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for iv in sorted({c["interval"] for c in res["n_cells"]}):
        pts = sorted((parse_pccheck_name(c["system"])["n"], c["slowdown"]) for c in res["n_cells"]
                     if c["interval"] == iv and c["system"] != "none")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"interval {iv}")
    ax.set_xticks(sorted({parse_pccheck_name(c["system"])["n"] for c in res["n_cells"] if c["system"] != "none"}))
    ax.set_xlabel("N (concurrent checkpoints)")
    ax.set_title("(a) Fig. 12 analog: slowdown vs N\n(p = 2, 64 MiB chunks, DRAM 2m)", fontsize=8)
    ax = axes[1]
    by_n: dict[int, list[tuple[int, float]]] = {}
    for c in res["threads_cells"]:
        cfg = parse_pccheck_name(c["system"])
        if cfg:
            by_n.setdefault(cfg["n"], []).append((cfg["p"], c["slowdown"]))
    for n, pts in sorted(by_n.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"N = {n}")
    ax.set_xlabel("writer threads p")
    ax.set_xticks(sorted({p for pts in by_n.values() for p, _ in pts}))
    ax.set_title(f"(b) Fig. 13 analog: slowdown vs writer threads, interval {res['threads_interval']}\n"
                 "(64 MiB chunks, DRAM 2m)", fontsize=8)
    ax = axes[2]
    by_c: dict[int, list[tuple[float, float]]] = {}
    for c in res["mem_cells"]:
        cfg = parse_pccheck_name(c["system"])
        if cfg:
            by_c.setdefault(cfg["chunk"] >> 20, []).append((cfg["budget_x"], c["slowdown"]))
    for chunk, pts in sorted(by_c.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{chunk} MiB chunks")
    xs = sorted({b for pts in by_c.values() for b, _ in pts})
    ax.set_xticks(xs, [{0.5: "m/2", 1.0: "m", 2.0: "2m"}.get(x, f"{x:g}m") for x in xs])
    ax.set_xlabel("DRAM budget (m = checkpoint size)")
    ax.set_title(f"(c) Fig. 14 analog: slowdown vs DRAM budget and chunk size, interval {res['mem_interval']}\n"
                 "(N = 2, p = 2)", fontsize=8)
    for ax in axes:
        ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel("slowdown vs no checkpointing (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    wl = res["workload"]
    fig.suptitle(f"pccheck sensitivity. GPU EMULATED: {wl['describe'].split(': ', 1)[-1]} "
                 f"(state {format_size(wl['state_bytes'])}); {res['machine']}", fontsize=8)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    a = figure_parser("python -m bench.fig12", __doc__).parse_args(argv)
    run(a.out, a.quick, a.dir, lambda label: print(f"-- {label}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
