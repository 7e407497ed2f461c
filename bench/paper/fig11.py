"""Figure 11 analog: time to persist one checkpoint vs its size, pccheck against the device limit and peers.

Run::

    python -m bench.fig11 [--quick] [--out bench/results (root: files go to OUT/fig11/)] [--dir bench/_scratch]

The measurement is :mod:`bench.micro.persist`'s (same systems, same method: state pre-touched, every system
set up and warmed up untimed, repetitions interleaved round-robin, ``gc.collect()`` + ``os.sync()``
before each, median reported). No training runs here: the state is 4 float32 arrays in host memory
(no GPU, emulated or otherwise), and the time is from the call that starts the checkpoint until it
is durable. Sizes 64 MiB, 256 MiB and 1 GiB measure all systems together (3 repetitions); at 4 GiB
each system runs alone (2 repetitions for pccheck and raw O_DIRECT, 1 for the slower peers), because all of them at once would need ~20 GiB of RAM
(state, pccheck's 2x DRAM pool, the raw buffer, DCP's staging copy). Where the machine has too little
free memory for 4 GiB it falls back to 2 GiB and says so.

Writes ``bench/results/fig11/latest.csv``, ``.json``, ``.png`` (log-log).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.micro import persist
from bench.harness.common import result_path, figure_parser, format_size, pyplot, save_figure, write_csv, write_json
from bench.harness.systems import COLORS

__all__ = ["SYSTEMS", "plan", "run", "targets", "main"]

SYSTEMS = ("pccheck", "raw_odirect", "torch_save", "safetensors", "dcp_async")
TARGET_SIZE = 1 << 30
TARGET_RATIO = 0.9


def _sizes(quick: bool) -> tuple[list[int], list[int]]:
    """(sizes measured with all systems together, sizes measured one system at a time)."""
    if quick:
        return [4 << 20, 16 << 20], []
    return [64 << 20, 256 << 20, 1 << 30], [4 << 30]


def plan(quick: bool) -> int:
    together, alone = _sizes(quick)
    return len(together) + len(alone) * len(SYSTEMS)


def _mem_available() -> int:
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def run(out: Path, quick: bool, workdir: Path, tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    tick = tick or (lambda label: None)
    together, alone = _sizes(quick)
    repeats = 1 if quick else 3
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    machine = ""
    for size in together:
        tick(f"fig11: {format_size(size)}, all systems")
        gc.collect()  # a closed pccheck.Checkpointer keeps its DRAM pool until the cyclic GC frees it
        r = persist.run([size], list(SYSTEMS), repeats, workdir)
        machine = r["machine"]
        records += r["results"]
    for size in alone:
        gc.collect()
        need = 3 * size + (2 << 30)  # state + pccheck's 2x pool, with room to spare
        if _mem_available() < need:
            notes.append(f"{format_size(size)} skipped for {format_size(size // 2)}: MemAvailable "
                         f"{_mem_available() / 2**30:.1f} GiB < {need / 2**30:.1f} GiB")
            size //= 2
        merged: dict[str, Any] = {}
        for system in SYSTEMS:
            tick(f"fig11: {format_size(size)}, {system} alone")
            gc.collect()  # the previous system's buffers (a closed Checkpointer's pool) go first
            # 2 timed runs for the target's pair, 1 for the slow peers (each also has 1 untimed warm-up)
            r = persist.run([size], [system], 2 if system in ("pccheck", "raw_odirect") else 1, workdir)
            merged.update({k: v for k, v in r["results"][0].items() if k not in merged})
        for peer in persist.PEERS:
            if f"{peer}_gbps" in merged and "pccheck_gbps" in merged:
                merged[f"pccheck_over_{peer}"] = merged["pccheck_gbps"] / merged[f"{peer}_gbps"]
        merged["measured"] = "one system at a time"
        records.append(merged)
    res = {"benchmark": "bench.fig11", "quick": quick, "machine": machine, "systems": list(SYSTEMS),
           "repeats": repeats, "results": records, "notes": notes, "runtime_s": time.perf_counter() - t0}
    res["targets"] = targets(res)
    stem = result_path("fig11", "", quick=quick, root=out)
    write_json(stem.with_suffix(".json"), res)
    rows = []
    for rec in records:
        for s in SYSTEMS:
            if f"{s}_s" in rec:
                rows.append([rec["size_bytes"], rec["size"], s, rec[f"{s}_s"], rec[f"{s}_gbps"], rec[f"{s}_min_s"],
                             rec[f"{s}_max_s"], len(rec[f"{s}_runs_s"]), rec.get(f"{s}_stall_s"),
                             rec.get(f"pccheck_over_{s}"), rec.get("measured", "all systems interleaved")])
    write_csv(stem.with_suffix(".csv"), ["size_bytes", "size", "system", "median_s", "gbps", "min_s", "max_s", "n",
                                    "stall_s", "pccheck_speed_over_system", "measured"], rows)
    plot(stem.with_suffix(".png"), res)
    return res


def targets(res: Mapping[str, Any]) -> list[dict[str, Any]]:
    """pccheck >= 0.9x raw O_DIRECT at 1 GiB (GB/s ratio, measured interleaved in the same run)."""
    rec = next((r for r in res["results"] if r["size_bytes"] == TARGET_SIZE), None)
    val = None if rec is None else rec.get("pccheck_over_raw_odirect")
    return [{"what": "persist 1 GiB: pccheck GB/s / raw O_DIRECT GB/s", "value": val, "limit": TARGET_RATIO,
             "met": None if val is None else val >= TARGET_RATIO,
             "pccheck_s": None if rec is None else rec.get("pccheck_s"),
             "raw_s": None if rec is None else rec.get("raw_odirect_s")}]


def plot(path: Path, res: Mapping[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for s in SYSTEMS:
        pts = sorted((r["size_bytes"], r[f"{s}_s"]) for r in res["results"] if f"{s}_s" in r)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s, color=COLORS.get(s),
                linestyle=":" if s == "raw_odirect" else "-", linewidth=2.5 if s == "pccheck" else 1.5)
    sizes = sorted({r["size_bytes"] for r in res["results"]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.set_xlabel("checkpoint size")
    ax.set_ylabel("seconds until durable (median; log scale), lower is better")
    t = res["targets"][0]
    note = f"; at 1 GiB pccheck = {t['value']:.2f}x raw O_DIRECT speed" if t["value"] else ""
    ax.set_title("Time to persist one checkpoint (Figure 11 analog)\nno training: 4 float32 arrays in host "
                 f"memory (no GPU){note}\n{res['machine']}", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    a = figure_parser("python -m bench.fig11", __doc__).parse_args(argv)
    res = run(a.out, a.quick, a.dir, lambda label: print(f"-- {label}", flush=True))
    print(res["targets"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
