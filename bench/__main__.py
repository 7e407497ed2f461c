"""``python -m bench all``: every benchmark, one CSV + PNG per figure, and ``all/latest.md`` with the targets.
(``python -m bench NAME ARGS...`` runs one: the same as ``python -m bench.NAME ARGS...``.)

Run::

    python -m bench all [--quick] [--out bench/results] [--dir bench/_scratch] [--traces andre,thorpe[,FILE.csv]]
                        [--only recovery,fig11,fig8,fig12,fig9]

Order (each later step uses numbers measured by the earlier ones, in the same run):

1. ``recovery``  cold load of one checkpoint (bench.recovery) -> recovery/latest.{csv,png,json}
2. ``fig11``     time to persist one checkpoint vs size (bench.fig11 over bench.persist) -> fig11/latest.*
3. ``fig8``      throughput vs checkpoint interval, emulated GPU and a real CPU model, every policy,
                 the tuner's pick (bench.fig8 over bench.overhead + bench.systems) -> fig8/latest.*
4. ``fig12``     sensitivity to N, writer threads, chunk size and DRAM budget (bench.fig12) -> fig12/latest.*
5. ``fig9``      goodput under preemption: the replay simulator (bench.goodput) fed with 1-3 ->
                 goodput/latest.{csv,png}, goodput/inputs.json, goodput/trace-*.csv (replay other
                 traces later with ``python -m bench.goodput --trace FILE.csv``)

and the summary with every target: all/latest.{md,json}. Paths are under ``--out`` (default
bench/results). ``--quick`` uses tiny sizes and short windows (smoke use, < 3 minutes) and writes
``quick.*`` files beside each ``latest.*``; its numbers mean nothing. The full run is what the README reports.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import RUNNABLE_FOLDERS
from bench.paper import fig8
from bench.paper import fig11
from bench.paper import fig12
from bench.paper import goodput
from bench.micro import recovery
from bench.harness.common import result_path, fmt, format_size, host_info, machine_label, write_csv, write_json

_BENCH_DIR = Path(__file__).resolve().parent
STEPS = ("recovery", "fig11", "fig8", "fig12", "fig9")
GOODPUT_TARGET = 2.5
GOODPUT_INTERVAL = 10
QUICK_STATE, FULL_STATE = 16 << 20, 1 << 30  # recovery at the size of Figure 8's emulated state


# -- progress ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A ``tick(label)`` called as each step starts: a rich progress bar if rich is importable, else
    tqdm, else a plain line per step."""
    t0 = time.perf_counter()
    count = [0]
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        Progress = None
    if Progress is not None:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), transient=False) as prog:
            task = prog.add_task("starting", total=total)

            def tick(label: str) -> None:
                prog.update(task, completed=min(count[0], total), description=label[:70])
                count[0] += 1

            yield tick
            prog.update(task, completed=total, description="done")
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total)

        def tick(label: str) -> None:
            if count[0]:
                bar.update(1)
            count[0] += 1
            bar.set_description(label[:60])

        yield tick
        bar.update(total - bar.n)
        bar.close()
        return

    def tick(label: str) -> None:
        count[0] += 1
        print(f"[{count[0]:>3}/{total} {time.perf_counter() - t0:6.0f} s] {label}", flush=True)

    yield tick


# -- goodput from the measurements ---------------------------------------------------------------------

def _load_times(rec: Mapping[str, Any]) -> dict[str, float]:
    """Measured load seconds per training system (see the goodput section of all/latest.md)."""
    r = rec["results"]
    out = {"pccheck": r["pccheck"]["median_s"]}
    if "torch_load" in r:
        out["torch_save"] = out["checkfreq"] = r["torch_load"]["median_s"]
    if "dcp" in r:
        out["dcp_async"] = r["dcp"]["median_s"]
    raw = r.get("raw_odirect_fresh", r.get("raw_odirect"))
    if raw:
        out["gpm"] = out["ideal"] = raw["median_s"]
    return out


def _goodput(res8: Mapping[str, Any], rec: Mapping[str, Any], traces: Mapping[str, goodput.Trace], out: Path,
             quick: bool) -> dict[str, Any]:
    stem = result_path("goodput", "", quick=quick, root=out)  # .../goodput/latest
    pre = "quick-" if quick else ""
    loads = _load_times(rec)
    cells = res8["emulated"]["cells"]
    models = goodput.models_from_results(cells, loads, ideal_load_s=loads.get("ideal", loads["pccheck"]))
    rows = goodput.evaluate(models, traces)
    write_json(stem.parent / f"{pre}inputs.json", {
        "workload": res8["emulated"]["describe"], "machine": res8["machine"],
        "load_s": loads, "models": [m.__dict__ for m in models],
        "note": "iter_s from Figure 8 (emulated), tw_s = median call-to-durable in the window, load_s from "
                "bench.recovery (pccheck: load_latest; torch_save/checkfreq: torch.load; dcp_async: dcp.load; "
                "gpm/ideal: raw O_DIRECT read into fresh memory)"})
    for name, tr in traces.items():
        goodput.write_trace_csv(tr, stem.parent / f"{pre}trace-{name}.csv")
    write_csv(stem.with_suffix(".csv"), list(rows[0]), [list(r.values()) for r in rows])
    goodput.plot(stem.with_suffix(".png"), rows, traces, res8["machine"],
                  "GPU EMULATED workload of Figure 8: " + res8["emulated"]["describe"].split(": ", 1)[-1]
                  + "; load times measured cold (bench.recovery)")
    head = fig8.headline_system(res8)
    tname = next(iter(traces))

    def gp(system: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["trace"] == tname and r["system"] == system
                     and r["interval"] == GOODPUT_INTERVAL), None)

    pc, cf = gp(head), gp("checkfreq")
    target = {"what": f"goodput {head} / checkfreq at interval {GOODPUT_INTERVAL}, trace '{tname}' (replay)",
              "value": None, "limit": GOODPUT_TARGET, "met": None}
    if pc and cf:
        target.update(value=pc["goodput_replay"] / cf["goodput_replay"],
                      closed_form=pc["goodput_closed_form"] / cf["goodput_closed_form"],
                      pccheck=pc, checkfreq=cf)
        target["met"] = target["value"] >= GOODPUT_TARGET
    best = {}
    for s in dict.fromkeys(r["system"] for r in rows if r["trace"] == tname):
        sub = [r for r in rows if r["trace"] == tname and r["system"] == s]
        top = max(sub, key=lambda r: r["goodput_replay"])
        best[s] = {"interval": top["interval"], "goodput": top["goodput_replay"]}
    return {"rows": rows, "target": target, "best": best, "loads": loads, "headline": head,
            "traces": {k: {"source": v.source, "failures": v.failures, "duration_s": v.duration_s}
                       for k, v in traces.items()}}


# -- summary ---------------------------------------------------------------------------------------------

def _margin(value: float | None, limit: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    ok = value >= limit if higher_is_better else value <= limit
    diff = abs(value - limit)
    pct = 100 * diff / limit
    d = f"{diff:.3f}" if diff < 0.1 else f"{diff:.2f}"
    return f"**met** by {d}x ({pct:.1f}%)" if ok else f"**missed** by {d}x ({pct:.1f}% of the target)"


def _cell(cells: Sequence[Mapping[str, Any]], system: str, interval: int) -> Mapping[str, Any] | None:
    return next((c for c in cells if c["system"] == system and c["interval"] == interval), None)


def _why_persist(t: Mapping[str, Any]) -> str:
    if t["value"] is None or t["met"]:
        return ""
    return (f"pccheck took {t['pccheck_s']:.3f} s vs {t['raw_s']:.3f} s for the raw write of the same bytes; "
            "the difference is the copy into DRAM chunks plus the commit (two barriers) that the raw write "
            "does not do. See fig11/latest.csv for every run.")


def _why_slowdown(res8: Mapping[str, Any], t: Mapping[str, Any]) -> str:
    c = _cell(res8["emulated"]["cells"], t["system"], t["interval"])
    if c is None or t["met"]:
        return ""
    w = (c.get("pccheck") or {}).get("window", {})
    extra = c.get("extra_s_per_iter")
    parts = [f"{extra * 1e3:.0f} ms extra per iteration" if extra is not None else ""]
    for k in ("median_cow_wait_s", "median_stall_s", "median_blocked_copy_s"):
        if w.get(k) is not None:
            parts.append(f"{k.removeprefix('median_')} {w[k] * 1e3:.0f} ms/ckpt")
    parts.append(f"CPU util {c['cpu_util']:.2f} of 2 cores; other load {c.get('foreign_cpu_util', float('nan')):.2f} CPUs")
    return ("; ".join(p for p in parts if p) + ". On 2 vCPUs the copy, the crc32c and the writer threads take "
            "CPU time from the SGD update itself (the update is a real memory pass over the state).")


def _why_goodput(g: Mapping[str, Any], res8: Mapping[str, Any]) -> str:
    t = g["target"]
    if t["value"] is None or t["met"]:
        return ""
    cf, pc = t["checkfreq"], t["pccheck"]
    f = GOODPUT_INTERVAL
    cells = res8.get("emulated", {}).get("cells", [])
    cfc, pcc = _cell(cells, "checkfreq", f), _cell(cells, g["headline"], f)
    tr = g["traces"][next(iter(g["traces"]))]
    thr = pc["throughput"] / cf["throughput"]
    mean_gap = tr["duration_s"] / max(1, tr["failures"])
    stall = ("its T_w is shorter than the 10-iteration period, so the one-in-flight rule itself rarely blocks; "
             "its cost is the snapshot the next update waits for and torch.save's CPU time on 2 cores"
             if cf["tw_s"] < f * cf["iter_s"] else
             "its T_w exceeds the 10-iteration period, so each checkpoint call waits for the previous one")
    return (f"with {tr['failures']} events in {tr['duration_s'] / 3600:.1f} h (one every {mean_gap / 60:.0f} min), a "
            f"failure costs {pc['load_s']:.2f} s (pccheck) / {cf['load_s']:.2f} s (CheckFreq) of loading plus a few "
            f"iterations of {1e3 * pc['iter_s']:.0f}-{1e3 * cf['iter_s']:.0f} ms, so goodput is within a few % of "
            f"failure-free throughput and the ratio is the throughput ratio at interval {f}: {thr:.2f}x "
            f"({pc['throughput']:.2f} vs {cf['throughput']:.2f} it/s). CheckFreq is "
            f"{fmt(cfc and cfc['slowdown'], '.2f')}x slower than no checkpointing here (T_w = {cf['tw_s']:.2f} s, "
            f"period {f * cf['iter_s']:.2f} s: {stall}); {g['headline']} is {fmt(pcc and pcc['slowdown'], '.3f')}x. "
            f"2.5x would need CheckFreq >= {2.5 * (pcc['slowdown'] if pcc else 1):.2f}x slower, the regime of the "
            "paper's 2.86x, where one checkpoint takes many iteration periods to write (multi-GB states on pd-ssd).")


def _why_load(rec: Mapping[str, Any]) -> str:
    r = rec["results"]
    t = rec["target"]
    if t["value"] is None or t["met"]:
        return ""
    pc, raw = r["pccheck"]["median_s"], r["raw_odirect"]["median_s"]
    fresh = r.get("raw_odirect_fresh", {}).get("median_s")

    def best(k: str) -> float | None:
        return r.get(k, {}).get("min_s")

    crc = best("crc32c")
    ft_range = (r.get("first_touch", {}).get("min_s"), r.get("first_touch", {}).get("max_s"))
    return (f"pccheck {pc:.2f} s vs raw O_DIRECT {raw:.2f} s into pre-touched memory ({fmt(fresh, '.2f')} s into "
            f"fresh memory, which is what a restarted process has). pccheck reads the slot's data region with "
            f"O_DIRECT (2 threads, 32 MiB pieces) into one fresh huge-page mapping, a third thread faulting the "
            f"pieces in ahead of the reads, and checksums each piece as it lands (crc32c alone: best "
            f"{fmt(crc, '.2f')} s). What is left over the raw read is the first touch of fresh memory, which on "
            f"this VM varies from {fmt(ft_range[0], '.2f')} s to {fmt(ft_range[1], '.2f')} s for {rec['size']} "
            f"(first_touch in recovery.csv): the reads wait for it whenever it is slower than the device."
            + (f" `load_latest(zero_copy=True)` (verified read-only views of the file's page cache, no fresh "
               f"anonymous memory) takes {zc:.2f} s, {raw / zc:.2f}x the raw read." if (zc := r.get(
                   "pccheck_zero_copy", {}).get("median_s")) else ""))


_LOAD_PROPOSAL = """**Next step for the load path.** `load_latest(model=..., optimizer=...)` copies the loaded arrays into
the model's existing (already touched) tensors. Reading straight into those tensors, where their
storage is contiguous and page-aligned, would skip the fresh mapping and its first touch entirely."""


def _remeasured(run: Mapping[str, Any]) -> str:
    """Says which step's JSON comes from a later standalone run (``summary`` rebuilds from the files)."""
    rc = run.get("recovery") or {}
    if rc.get("date") and rc["date"] != run["date"]:
        return (f" The recovery step was measured again alone at {rc['date']} (`python -m bench.recovery "
                f"--repeats {rc.get('repeats', '?')}`) after a change to the load path.")
    return ""


def _summary(run: Mapping[str, Any], out: Path, path: Path) -> Path:
    """Write the summary (all/latest.md); return its path."""
    L: list[str] = []
    q = " (QUICK smoke run: tiny sizes, numbers mean nothing)" if run["quick"] else ""
    L.append(f"# pccheck benchmark summary{q}\n")
    L.append(f"`python -m bench all{' --quick' if run['quick'] else ''}` on {run['machine']}, "
             f"{run['date']}; total {run['runtime_s'] / 60:.1f} min. Every ratio compares systems measured side by "
             f"side in the same run.{_remeasured(run)}\n")
    L.append("| target | measured | limit | result | workload |")
    L.append("|---|---|---|---|---|")
    notes: list[str] = []
    if "fig11" in run:
        for t in run["fig11"]["targets"]:
            L.append(f"| persist 1 GiB: pccheck speed / raw O_DIRECT | {fmt(t['value'], '.2f')}x "
                     f"({fmt(t['pccheck_s'], '.3f')} s vs {fmt(t['raw_s'], '.3f')} s) | >= {t['limit']}x | {_margin(t['value'], t['limit'])} "
                     "| no training; 4 float32 arrays in RAM |")
            if (w := _why_persist(t)):
                notes.append(f"- persist: {w}")
    if "fig8" in run:
        r8 = run["fig8"]
        tt = fig8.TARGET_INTERVAL
        t_s = fig8._none_iter_s(r8["emulated"]["cells"])
        t_ms = 1e3 * t_s if t_s else float("nan")
        none = _cell(r8["emulated"]["cells"], "none", tt)
        for t in sorted(r8["targets"], key=lambda t: (not t["headline"], t["system"])):
            star = " (headline)" if t["headline"] else ""
            res = _margin(t["value"], t["limit"], higher_is_better=False) if t["applies"] else \
                f"n/a: {t['condition']} does not hold"
            runs = t.get("runs_it_per_s") or []
            noise = (f"; it/s of the {len(runs)} runs {', '.join(f'{x:.2f}' for x in runs)} (none: "
                     f"{', '.join(f'{x:.2f}' for x in (none or {}).get('it_per_s_runs') or [])})" if len(runs) > 1 else "")
            L.append(f"| slowdown at interval {tt}, {t['system']}{star} | {fmt(t['value'], '.3f')}x | <= {t['limit']}x | "
                     f"{res} | GPU EMULATED, {format_size(r8['emulated']['state_bytes'])}, t = {t_ms:.0f} ms; "
                     f"{t['condition']}; other load {fmt(t.get('foreign_cpu_util'), '.2f')} CPUs{noise} |")
            if t["headline"] and (w := _why_slowdown(r8, t)):
                notes.append(f"- slowdown ({t['system']}): {w}")
    if "fig9" in run:
        g = run["fig9"]
        t = g["target"]
        L.append(f"| goodput / CheckFreq policy, interval {GOODPUT_INTERVAL}, André-rate trace ({g['headline']}) | "
                 f"{fmt(t['value'], '.2f')}x (closed form {fmt(t.get('closed_form'), '.2f')}x) | >= {t['limit']}x | "
                 f"{_margin(t['value'], t['limit'])} | GPU EMULATED (Figure 8), replayed |")
        if (w := _why_goodput(g, run.get("fig8", {}))):
            notes.append(f"- goodput: {w}")
    if "recovery" in run:
        rc = run["recovery"]
        t = rc["target"]
        r = rc["results"]
        L.append(f"| load {rc['size']} ({'cold' if rc['cold'] else 'WARM cache'}): pccheck speed / raw O_DIRECT read | "
                 f"{fmt(t['value'], '.2f')}x ({r['pccheck']['median_s']:.2f} s vs {r['raw_odirect']['median_s']:.2f} s) | "
                 f">= {t['limit']}x | {_margin(t['value'], t['limit'])} | no training; load path only |")
        if (w := _why_load(rc)):
            notes.append(f"- load: {w}")
    L.append("")
    L.append("A slowdown below 1.00x is measurement noise (checkpointing cannot speed training up): this "
             "2-vCPU machine is shared, and \"other load\" is the CPU other processes used during the window. "
             "Cells are re-measured (up to twice) when that exceeds 0.3 CPUs; fig8/latest.csv has it per cell.\n")
    if notes:
        L.append("Why targets were missed (numbers from this run):\n")
        L += notes
        L.append("")
    if "recovery" in run and not run["recovery"]["target"]["met"]:
        L.append(_LOAD_PROPOSAL + "\n")
    L += _details(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(L) + "\n", encoding="utf-8")
    return path


def _fig8_table(cells: Sequence[Mapping[str, Any]]) -> list[str]:
    """Markdown rows: one per system, it/s (slowdown) per interval, `*` on a disturbed cell."""
    ivs = sorted({c["interval"] for c in cells})
    L = ["| system | " + " | ".join(f"interval {i}" for i in ivs) + " |", "|---|" + "---|" * len(ivs)]
    for s in dict.fromkeys(c["system"] for c in cells):
        row = []
        for i in ivs:
            c = _cell(cells, s, i)
            row.append("-" if c is None else f"{c['it_per_s']:.2f} ({fmt(c['slowdown'], '.2f')}x)"
                       + (" *" if fig8.disturbed(c) else ""))
        L.append(f"| {s} | " + " | ".join(row) + " |")
    return L


def _details(run: Mapping[str, Any]) -> list[str]:
    L: list[str] = []
    sfx = "quick" if run["quick"] else "latest"  # the figures sit in ../<figure>/ beside all/
    if "fig8" in run:
        r8 = run["fig8"]
        L.append(f"## Figure 8 analog: iterations/s (slowdown) [fig8/{sfx}.png](../fig8/{sfx}.png)\n")
        L.append(f"GPU EMULATED: {r8['emulated']['describe'].split(': ', 1)[-1]}.\n")
        L += _fig8_table(r8["emulated"]["cells"])
        L.append(f"\n`*`: disturbed cell (other processes used > {fig8.NOISY_CPUS} CPUs during its window even "
                 "after re-measuring; hollow marker in the plot).")
        tn = r8.get("tuner", {})
        L.append("")
        if tn.get("available"):
            L.append(f"Tuner's pick (pccheck.tuner, {tn['seconds']:.0f} s of profiling, t = {tn['iter_time_s'] * 1e3:.0f} ms): "
                     f"N = {tn['max_concurrent']}, p = {tn['writer_threads']}, chunk {format_size(tn['chunk_size'])}, "
                     f"interval f* = {tn['interval']} (T_w = {tn['tw_s']:.3f} s, expected slowdown "
                     f"{tn['expected_slowdown']:.3f}).\n")
        else:
            L.append(f"Tuner's pick: not shown ({tn.get('reason', '?')}).\n")
        real = r8["real"]
        L.append(f"REAL CPU training: {real['describe'].split(': ', 1)[-1]}, state {format_size(real['state_bytes'])}.\n")
        L += _fig8_table(real["cells"])
        L.append("")
    if "fig11" in run:
        r = run["fig11"]
        L.append(f"## Figure 11 analog: seconds until durable [fig11/{sfx}.png](../fig11/{sfx}.png)\n")
        L.append("| size | " + " | ".join(fig11.SYSTEMS) + " | pccheck / raw |")
        L.append("|---|" + "---|" * (len(fig11.SYSTEMS) + 1))
        for rec in r["results"]:
            cells = [fmt(rec.get(f"{s}_s"), ".3f") for s in fig11.SYSTEMS]
            L.append(f"| {rec['size']} | " + " | ".join(cells) + f" | {fmt(rec.get('pccheck_over_raw_odirect'), '.2f')}x |")
        for n in r.get("notes", []):
            L.append(f"\n{n}")
        L.append("")
    if "recovery" in run:
        rc = run["recovery"]
        L.append(f"## Recovery: load {rc['size']}, {rc['cache']} [recovery/{sfx}.png](../recovery/{sfx}.png)\n")
        L.append("| what | median s | GB/s |")
        L.append("|---|---|---|")
        for k, v in rc["results"].items():
            L.append(f"| {k} | {v['median_s']:.3f} | {v['gbps']:.2f} |")
        L.append("")
    if "fig12" in run:
        r = run["fig12"]
        L.append(f"## Figures 12-14 analogs: sensitivity [fig12/{sfx}.png](../fig12/{sfx}.png)\n")
        for key, title in (("threads_cells", f"writer threads, interval {r['threads_interval']}"),
                           ("mem_cells", f"chunk size x DRAM budget, interval {r['mem_interval']}")):
            L.append(f"{title}: " + ", ".join(f"{c['system']} {fmt(c['slowdown'], '.2f')}x"
                                              for c in r[key] if c["system"] != "none") + "\n")
    if "fig9" in run:
        g = run["fig9"]
        L.append(f"## Figure 9 analog: goodput under preemption [goodput/{sfx}.png](../goodput/{sfx}.png)\n")
        for k, v in g["traces"].items():
            L.append(f"- trace `{k}`: {v['failures']} events in {v['duration_s'] / 3600:.1f} h; {v['source']}")
        L.append("- load times used (s): " + ", ".join(f"{k} {v:.2f}" for k, v in g["loads"].items()))
        L.append("- best interval per system on the first trace: " +
                 ", ".join(f"{s} f={b['interval']} ({b['goodput']:.3f} it/s)" for s, b in g["best"].items()))
        ex = goodput.paper_example()
        L.append(f"- simulator check against §5.2.3 (tests/test_bench.py): text's arithmetic gives "
                 f"{ex['pccheck_text'].useful_iterations:.0f} vs {ex['checkfreq_text'].useful_iterations:.0f} iterations "
                 f"(paper 5587 vs 3147), ratio {ex['pccheck_text'].goodput / ex['checkfreq_text'].goodput:.3f}x (paper 1.77x)")
        L.append("")
    return L


# -- main ------------------------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["all", "summary"],
                   help="all: run every benchmark; summary: rebuild the goodput replay and all/latest.md from the "
                        "JSON files of an earlier run in --out (no measurement)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, short windows: a smoke run (< 3 min)")
    p.add_argument("--out", type=Path, default=_BENCH_DIR / "results", help="results root: files go to OUT/<bench>/latest.* (default: %(default)s)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    p.add_argument("--traces", default="andre,thorpe",
                   help="goodput traces: andre, thorpe (synthetic at the published rates) and/or CSV files; the "
                        "first one carries the target (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    p.add_argument("--only", default=",".join(STEPS), help="subset of " + ",".join(STEPS) +
                   " (fig9 needs recovery and fig8)")
    p.add_argument("--no-tuner", action="store_true", help="leave the tuner's pick out of Figure 8")
    a = p.parse_args(argv)
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    if set(a.only) - set(STEPS):
        p.error(f"--only takes {','.join(STEPS)}")
    if "fig9" in a.only and not {"recovery", "fig8"} <= set(a.only):
        p.error("fig9 (goodput) needs recovery and fig8 in the same run")
    return a


def _rec_ticks(quick: bool) -> int:
    return len(recovery.SYSTEMS) * (1 + (1 if quick else 3)) + 1


def _bench_main(name: str) -> Callable[[list[str]], Any] | None:
    """The ``main`` of ``python -m bench.NAME`` (bench/__init__.py: a module in one of the folders,
    or gpu, a folder with a __main__), or None when NAME is no bench."""
    if name == "gpu":
        name = "gpu.gpu"
    elif not any((_BENCH_DIR / folder / f"{name}.py").is_file() for folder in RUNNABLE_FOLDERS):
        return None
    return getattr(importlib.import_module(f"bench.{name}"), "main", None)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    one = _bench_main(args[0]) if args and not args[0].startswith("-") else None
    if one is not None:  # `python -m bench NAME ARGS...` = `python -m bench.NAME ARGS...`
        return one(args[1:]) or 0
    a = _parse_args(argv)
    if a.command == "summary":
        return _resummarize(a)
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    traces = goodput.load_traces(a.traces, a.seed) if "fig9" in a.only else {}
    total = ((_rec_ticks(a.quick) if "recovery" in a.only else 0) + (fig11.plan(a.quick) if "fig11" in a.only else 0)
             + (fig8.plan(a.quick, not a.no_tuner) if "fig8" in a.only else 0)
             + (fig12.plan(a.quick, "fig8" in a.only) if "fig12" in a.only else 0) + ("fig9" in a.only))
    t0 = time.perf_counter()
    run: dict[str, Any] = {"quick": a.quick, "machine": machine_label(host_info(a.dir if a.dir.exists() else _BENCH_DIR)),
                           "date": time.strftime("%Y-%m-%d %H:%M %Z"), "steps": a.only}
    timings: dict[str, float] = {}
    with _progress(total) as tick:
        if "recovery" in a.only:
            s = time.perf_counter()
            rc = recovery.run(QUICK_STATE if a.quick else FULL_STATE, 1 if a.quick else 3, a.dir,
                                        progress=tick)
            rc["date"] = run["date"]  # part of this run
            recovery.report(rc, out, a.quick)
            run["recovery"] = rc
            timings["recovery"] = time.perf_counter() - s
        if "fig11" in a.only:
            gc.collect()  # every step starts with the previous one's memory returned
            s = time.perf_counter()
            run["fig11"] = fig11.run(out, a.quick, a.dir, tick)
            timings["fig11"] = time.perf_counter() - s
        if "fig8" in a.only:
            gc.collect()
            s = time.perf_counter()
            run["fig8"] = fig8.run(out, a.quick, a.dir, tick, tuner=not a.no_tuner)
            timings["fig8"] = time.perf_counter() - s
        if "fig12" in a.only:
            gc.collect()
            s = time.perf_counter()
            cells = run["fig8"]["emulated"]["cells"] if "fig8" in run else None
            run["fig12"] = fig12.run(out, a.quick, a.dir, tick, fig8_cells=cells)
            timings["fig12"] = time.perf_counter() - s
        if "fig9" in a.only:
            s = time.perf_counter()
            tick("fig9: goodput replay")
            run["fig9"] = _goodput(run["fig8"], run["recovery"], traces, out, run["quick"])
            timings["fig9"] = time.perf_counter() - s
    run["runtime_s"] = time.perf_counter() - t0
    run["step_runtime_s"] = timings
    _finish(run, out)
    return 0


def _finish(run: dict[str, Any], out: Path) -> None:
    """Write all/latest.md and all/latest.json (quick: all/quick.*); print the target table."""
    doc = result_path("all", ".json", quick=run["quick"], root=out)
    path = _summary(run, out, doc.with_suffix(".md"))
    write_json(doc, {
        "quick": run["quick"], "machine": run["machine"], "date": run["date"], "runtime_s": run["runtime_s"],
        "step_runtime_s": run["step_runtime_s"],
        "targets": {
            "persist": run.get("fig11", {}).get("targets"),
            "slowdown": run.get("fig8", {}).get("targets"),
            "goodput": {k: v for k, v in run.get("fig9", {}).get("target", {}).items() if k not in ("pccheck", "checkfreq")},
            "load": run.get("recovery", {}).get("target"),
        }})
    print(path.read_text(encoding="utf-8").split("\n## ")[0])
    print(f"wrote {path} and the figures under {out}; the measurements took {run['runtime_s'] / 60:.1f} min "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in run['step_runtime_s'].items())})")


def _resummarize(a: argparse.Namespace) -> int:
    """``summary``: rebuild the goodput replay and all/latest.md from the JSON files a run left in --out
    (no measurement; the run's date and step times come from its summary JSON)."""
    out = a.out
    run: dict[str, Any] = {"quick": a.quick}
    for step in ("recovery", "fig11", "fig8", "fig12"):
        f = result_path(step, ".json", quick=a.quick, root=out)
        if f.exists():
            run[step] = json.loads(f.read_text(encoding="utf-8"))
    prev_path = result_path("all", ".json", quick=a.quick, root=out)
    prev = json.loads(prev_path.read_text(encoding="utf-8")) if prev_path.exists() else {}
    run["machine"] = prev.get("machine") or run.get("fig8", run.get("fig11", {})).get("machine", "?")
    run["date"] = prev.get("date", "?")
    run["runtime_s"] = prev.get("runtime_s", 0.0)
    run["step_runtime_s"] = prev.get("step_runtime_s", {})
    if "fig8" in run and "recovery" in run:
        pre = "quick-" if a.quick else ""
        saved = {p.stem.removeprefix(f"{pre}trace-"): p for p in sorted((out / "goodput").glob(f"{pre}trace-*.csv"))}
        traces = {k: goodput.read_trace_csv(p) for k, p in saved.items()} or goodput.load_traces(a.traces, a.seed)
        if saved:  # keep the synthetic traces' citation, which the CSV does not carry
            for k, tr in list(traces.items()):
                if k in goodput.PUBLISHED_RATES:
                    traces[k] = goodput.Trace(tr.duration_s, tr.events,
                                              f"synthetic '{k}' (seed {a.seed}): {goodput.PUBLISHED_RATES[k][2]}")
            order = [t.strip() for t in a.traces.split(",") if t.strip() in traces]
            traces = {k: traces[k] for k in order + [k for k in traces if k not in order]}
        run["fig9"] = _goodput(run["fig8"], run["recovery"], traces, out, run["quick"])
    _finish(run, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
