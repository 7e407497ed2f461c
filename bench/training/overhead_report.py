"""bench.overhead's results judged and shown: its targets, the printed tables, the CSV
rows and the throughput plot.

Targets, at interval ``TARGET_INTERVAL`` of the emulated workload, for every ``pccheck_N{n}`` cell:
slowdown <= ``TARGET_SLOWDOWN`` where ``Tw/N <= 10 t``; extra time per iteration <=
``TARGET_EXTRA_VS_DCP`` x DCP async_save's; and at every interval, peak RSS growth <= the DRAM budget +
``RSS_SLACK`` and no allocation per checkpoint (``|RSS drift| <= FLAT_RSS_TOL``, at most
``FLAT_FAULTS_PER_CKPT`` minor faults per checkpoint). A timing target measured while other processes
used more than ``NOISY_OTHER_CPUS`` is INCONCLUSIVE rather than met or missed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import fmt, interval_axes, print_table, pyplot, save_figure
from bench.harness.probes import NOISY_OTHER_CPUS

__all__ = ["TARGET_INTERVAL", "TARGET_SLOWDOWN", "TARGET_EXTRA_VS_DCP", "RSS_SLACK", "FLAT_RSS_TOL",
           "FLAT_FAULTS_PER_CKPT", "CSV_HEADERS", "by_interval", "targets", "print_targets", "report", "plot"]

MIB = 1 << 20
TARGET_INTERVAL = 10
TARGET_SLOWDOWN = 1.03          # pccheck slowdown at interval 10 when Tw/N <= 10 t
TARGET_EXTRA_VS_DCP = 0.3       # pccheck extra time per iteration / DCP async_save's
RSS_SLACK = 64 * MIB            # peak RSS growth <= dram_budget + this
FLAT_RSS_TOL = 8 * MIB          # |VmRSS(end) - VmRSS(start of window)| for "no allocation per checkpoint"
FLAT_FAULTS_PER_CKPT = 1024     # minor faults (4 KiB pages = 4 MiB) per checkpoint, same criterion


def by_interval(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, dict[str, float | None]]:
    """``{interval: {system: record[key]}}``, the shape of the result's it_per_s and slowdown."""
    out: dict[str, dict[str, float | None]] = {}
    for r in records:
        out.setdefault(str(r["interval"]), {})[r["system"]] = r[key]
    return out

def _cell(records: Sequence[Mapping[str, Any]], interval: int, system: str) -> Mapping[str, Any] | None:
    return next((r for r in records if r["interval"] == interval and r["system"] == system), None)


def targets(records: Sequence[Mapping[str, Any]], iter_time: float,
             rss_key: str = "peak_rss_growth_bytes") -> list[dict[str, Any]]:
    """The targets; peak RSS growth is judged on ``rss_key`` (raw, or net of the none cell's)."""
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
            cond = f"Tw/N = {fmt(tw, '.3f')}/{n} = {fmt(tw / n if tw else None, '.3f')} s vs 10 t = {10 * iter_time:.3f} s"
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


def print_targets(checks: Sequence[Mapping[str, Any]], title: str) -> None:
    """Print each target's verdict and its distance from the limit."""
    print(f"\nTargets ({title}):")
    for t in checks:
        if t["target"] == "slowdown":
            head = f"  {t['system']:<11} interval {t['interval']}: slowdown <= {t['limit']:.2f}x"
            if not t["applies"]:
                print(f"{head}: not applicable ({t['condition']} does not hold); measured {fmt(t['value'], '.3f')}x")
                continue
            v = t["value"]
            print(f"{head}: {v:.3f}x  {_judged(t, 'x')}  [{t['condition']}]{_noisy(t)}")
            print(f"{'':13} training blocked in pccheck {fmt(t['blocked_ms_per_iter'], '.1f')} ms/iteration "
                  f"(stall + blocked_copy + cow_wait) alone gives {fmt(t['blocked_slowdown_estimate'], '.3f')}x")
        elif t["target"] == "extra_vs_dcp":
            head = f"  {t['system']:<11} interval {t['interval']}: extra time/iter <= {t['limit']:.2f} x DCP's"
            if t["value"] is None:
                print(f"{head}: not evaluated (needs none and dcp_async at interval {t['interval']})")
                continue
            detail = f"({fmt(t['pccheck_extra_ms'], '.1f')} ms vs {fmt(t['dcp_extra_ms'], '.1f')} ms)"
            if not t["applies"]:
                print(f"{head}: not applicable (Tw/N > 10 t); measured {t['value']:.3f} {detail}")
                continue
            print(f"{head}: {t['value']:.3f} {detail}  {_judged(t, '')}{_noisy(t)}")
        elif t["target"] == "peak_rss":
            head = f"  {t['system']:<11} interval {t['interval']:>3}: peak RSS growth <= dram_budget + 64 MiB"
            if t["value"] is None:
                print(f"{head}: not measured (/proc/self/clear_refs not writable)")
                continue
            net = "" if t["net"] is None else f", net of none's {t['net'] / MIB:.0f} MiB"
            print(f"{head} = {t['limit'] / MIB:.0f} MiB: raw {t['raw'] / MIB:.0f} MiB{net}; judged on "
                  f"{'net' if t['measure'].endswith('net_bytes') else 'raw'}: "
                  f"{'MET' if t['met'] else 'MISSED'} by {abs(t['limit'] - t['value']) / MIB:.0f} MiB")
        else:
            print(f"  {t['system']:<11} interval {t['interval']:>3}: no allocation per checkpoint (|RSS drift| <= "
                  f"{FLAT_RSS_TOL // MIB} MiB, <= {FLAT_FAULTS_PER_CKPT} minor faults/ckpt): drift "
                  f"{t['value'] / MIB:+.1f} MiB, {fmt(t['minflt_per_ckpt'], '.0f')} faults/ckpt  "
                  f"{'MET' if t['met'] else 'MISSED'}")


CSV_HEADERS = ["workload", "interval", "system", "iters", "checkpoints", "elapsed_s", "it_per_s", "it_per_s_runs",
                "slowdown", "extra_ms_per_iter", "ckpt_call_median_ms", "cpu_util", "foreign_cpu_util",
                "peak_rss_growth_mib", "peak_rss_growth_net_mib", "rss_drift_mib", "minflt_per_iter", "minflt_per_ckpt",
                "pccheck_tw_s", "pccheck_median_stall_s", "pccheck_median_blocked_copy_s", "pccheck_median_cow_wait_s",
                "pccheck_max_cow_wait_s", "pccheck_median_copy_s", "pccheck_median_backpressure_s",
                "pccheck_median_persist_s", "pccheck_dram_budget_mib"]


def _mib(x: float | None) -> float | None:
    return None if x is None else x / MIB


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def report(records: Sequence[Mapping[str, Any]], systems: Sequence[str], intervals: Sequence[int],
            title: str) -> list[list[Any]]:
    """Print the pivot, detail and pccheck tables; return CSV rows."""
    pivot = []
    for i in intervals:
        row: list[Any] = [i]
        for s in systems:
            r = _cell(records, i, s)
            row.append("-" if r is None else f"{r['it_per_s']:.2f} ({fmt(r['slowdown'], '.2f')}x)")
        pivot.append(row)
    print()
    print_table(f"{title}: iterations/s (slowdown vs none)", ["interval"] + list(systems), pivot)
    rows, pc_rows, csv_rows = [], [], []
    for r in records:
        pcw = r.get("pccheck", {}).get("window", {})
        runs = "/".join(f"{x:.2f}" + ("*" if o > NOISY_OTHER_CPUS else "")
                        for x, o in zip(r["it_per_s_runs"], r["foreign_cpu_util_runs"]))
        rows.append([r["interval"], r["system"], r["iters"], r["checkpoints"], runs, fmt(r["slowdown"], ".3f"),
                     fmt(_ms(r["extra_s_per_iter"]), ".1f"), fmt(_ms(r["ckpt_call_median_s"]), ".1f"),
                     f"{r['cpu_util']:.2f}", f"{r['foreign_cpu_util']:.2f}",
                     fmt(_mib(r["peak_rss_growth_bytes"]), ".0f") + " / " + fmt(_mib(r["peak_rss_growth_net_bytes"]), ".0f"),
                     f"{r['rss_drift_bytes'] / MIB:+.1f}", fmt(r["minflt_per_ckpt"], ".0f")])
        if "pccheck" in r:
            n = int(r["system"].removeprefix("pccheck_N"))
            pc_rows.append([r["interval"], r["system"], pcw["count"], fmt(pcw["tw_s"], ".3f"),
                            fmt(None if pcw["tw_s"] is None else pcw["tw_s"] / n, ".3f"),
                            fmt(_ms(pcw["median_stall_s"]), ".1f"), fmt(_ms(pcw["median_blocked_copy_s"]), ".1f"),
                            fmt(_ms(pcw["median_cow_wait_s"]), ".1f") + " / " + fmt(_ms(pcw["max_cow_wait_s"]), ".1f"),
                            fmt(_ms(pcw["median_copy_s"]), ".0f"), fmt(_ms(pcw["median_backpressure_s"]), ".0f"),
                            fmt(_ms(pcw["median_persist_s"]), ".0f"), f"{r['pccheck']['dram_budget_bytes'] / MIB:.0f}"])
        csv_rows.append([r["workload"], r["interval"], r["system"], r["iters"], r["checkpoints"], r["elapsed_s"],
                         r["it_per_s"], runs, r["slowdown"], _ms(r["extra_s_per_iter"]), _ms(r["ckpt_call_median_s"]),
                         r["cpu_util"], r["foreign_cpu_util"], _mib(r["peak_rss_growth_bytes"]),
                         _mib(r["peak_rss_growth_net_bytes"]), r["rss_drift_bytes"] / MIB, r["minflt_per_iter"],
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


def plot(path: Path, panels: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[str], Sequence[int]]],
         label: str, order: Sequence[str]) -> bool:
    """Throughput vs checkpoint interval (log x), one line per system, one panel per workload; a
    system's colour is its place in ``order``, the same in every panel."""
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, records, systems, intervals) in zip(axes[0], panels):
        for s in systems:  # one colour per system in every panel; hollow markers: a run had other load
            color = colors[order.index(s) % len(colors)] if s in order else None
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
        interval_axes(ax, intervals, ylabel="training iterations/s (higher is better)", title=title)
    fig.suptitle(f"Training throughput while checkpointing (Figure 8 analog)\n{label}; hollow marker: other "
                 f"processes used > {NOISY_OTHER_CPUS} CPUs during a run of that cell", fontsize=9)
    save_figure(fig, path)
    return True
