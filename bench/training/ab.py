"""An A/B of the library before and after a change: the same benches, from this bench/ folder,
run alternately against two source trees of pccheck, round after round, so both sides share the
machine's drift.

    python -m bench.ab --before /path/to/old/checkout --after . [--rounds 3] [--cells persist,loop]

Each tree must hold an importable ``pccheck`` with its native core built (``make setup`` there, or
the built ``_native*.so`` copied into ``pccheck/native/`` when the change leaves the core as it
is). The figures, lower is better for every one:

- ``persist_1GiB_s``: seconds until 1 GiB of host state is durable (bench.persist, pccheck, the
  median of 3 repeats per round);
- ``loop_i10``, ``loop_i1``: the emulated training loop's slowdown with pccheck (N=2) checkpointing
  256 MiB every 10 and every iteration against no checkpoints (bench.overhead, 0.05 s iterations);
- ``tiers_memory_loop``, ``tiers_crash_restore``, ``tiers_peer_restore``: bench.tiers on two
  simulated nodes, 64 MiB per rank: the loop's slowdown with the memory tier every iteration and
  ``replicas=2``; a crash restore from memory over a cold disk load; a node-loss restore from the
  peer's replica over raw gloo send/recv of the same bytes;
- ``upload_raw_over_pccheck``: bench.remote ``--upload-only`` at 256 MiB: the raw client's upload
  rate over pccheck's ``upload_slot`` from a committed slot (below 1: pccheck is faster).

Verdict per figure (the rule the project's refactors are held to): ``ok`` when each side's median
lies within the other side's range, or the after side's median is lower than the before side's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from bench.harness.common import BENCH_DIR, host_info, machine_label, print_table, result_path, write_json

CELLS: dict[str, tuple[list[str], dict[str, Callable[[dict[str, Any]], float]]]] = {
    # each cell's argument list ends with the flag that names its JSON output
    "persist": (["-m", "bench.persist", "--sizes", "1GiB", "--systems", "pccheck", "--repeats", "3", "--json"],
                {"persist_1GiB_s": lambda d: d["results"][0]["pccheck_s"]}),
    "loop": (["-m", "bench.overhead", "--size", "256MiB", "--iter-time", "0.05", "--intervals", "10,1",
              "--systems", "none,pccheck_N2", "--workloads", "emulated", "--quiet-wait", "10",
              "--json"],
             {"loop_i10": lambda d: d["slowdown"]["10"]["pccheck_N2"],
              "loop_i1": lambda d: d["slowdown"]["1"]["pccheck_N2"]}),
    "tiers": (["-m", "bench.tiers", "--configs", "none,memory,disk", "--size", "64MiB", "--iters", "20",
               "--restore-repeats", "3", "--loss-trials", "0", "--remote", "off", "--json"],
              {"tiers_memory_loop": lambda d: d["slowdown"]["memory"],
               "tiers_crash_restore": lambda d: d["ratios"]["crash_restore_memory_over_disk"],
               "tiers_peer_restore": lambda d: 1.0 / d["ratios"]["peer_vs_raw_gloo"]}),
    "remote": (["-m", "bench.remote", "--upload-only", "--size", "256MiB", "--repeat", "3", "--out"],
               {"upload_raw_over_pccheck": lambda d: 1.0 / d["summary"]["ratio_median"]}),
}


def _one(tree: Path, cell: str, work: Path) -> dict[str, float]:
    """One run of ``cell`` with ``tree``'s pccheck; its figures."""
    args, figures = CELLS[cell]
    out = work / f"{cell}.json"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # from a directory holding only this bench/ (a link), so `import pccheck` finds the tree's
    p = subprocess.run([sys.executable, *args, str(out)], cwd=work,
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{cell} against {tree} failed:\n{p.stderr[-2000:]}")
    doc = json.loads(out.read_text())
    return {name: float(get(doc)) for name, get in figures.items()}


def _commit(tree: Path) -> str | None:
    """The commit a source tree is checked out at (its uncommitted changes are not named)."""
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
    return p.stdout.strip() or None if p.returncode == 0 else None


def _verdict(before: list[float], after: list[float]) -> str:
    mb, ma = statistics.median(before), statistics.median(after)
    within = min(before) <= ma <= max(before) and min(after) <= mb <= max(after)
    return "ok" if within or ma < mb else "worse"


def run(before: Path, after: Path, rounds: int, cells: list[str]) -> dict[str, Any]:
    runs: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="pccheck-ab-") as tmp:
        work = Path(tmp)
        (work / "bench").symlink_to(BENCH_DIR, target_is_directory=True)
        for rnd in range(rounds):
            for side, tree in (("before", before), ("after", after)) if rnd % 2 == 0 else \
                    (("after", after), ("before", before)):
                for cell in cells:
                    for name, v in _one(tree, cell, work).items():
                        runs.setdefault(name, {"before": [], "after": []})[side].append(v)
                    print(f"round {rnd + 1}/{rounds} {side} {cell} done", flush=True)
    figures = {name: {"before": r["before"], "after": r["after"], "before_median": statistics.median(r["before"]),
                      "after_median": statistics.median(r["after"]), "verdict": _verdict(r["before"], r["after"])}
               for name, r in runs.items()}
    host = host_info(BENCH_DIR)
    return {"benchmark": "bench.ab", "machine": machine_label(host), "host": host, "date": host["date"],
            "before": str(before), "after": str(after), "before_commit": _commit(before),
            "after_commit": _commit(after), "rounds": rounds, "cells": cells,
            "note": "lower is better for every figure; rounds alternate which side runs first",
            "figures": figures}


def report(res: dict[str, Any]) -> None:
    print_table(f"A/B, {res['rounds']} rounds interleaved ({res['machine']})",
                ["figure", "before (median, runs)", "after (median, runs)", "verdict"],
                [[k, f"{v['before_median']:.3f} [{', '.join(f'{x:.3f}' for x in v['before'])}]",
                  f"{v['after_median']:.3f} [{', '.join(f'{x:.3f}' for x in v['after'])}]", v["verdict"]]
                 for k, v in res["figures"].items()])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, type=Path, help="source tree of the library before the change")
    ap.add_argument("--after", default=Path(BENCH_DIR.parent), type=Path, help="after the change (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cells", default=",".join(CELLS), help=f"comma-separated subset of {','.join(CELLS)}")
    ap.add_argument("--json", default=str(result_path("ab")))
    a = ap.parse_args(argv)
    cells = [c for c in a.cells.split(",") if c]
    unknown = sorted(set(cells) - set(CELLS))
    if unknown:
        ap.error(f"unknown cells {unknown}; valid: {', '.join(CELLS)}")
    res = run(a.before.resolve(), a.after.resolve(), a.rounds, cells)
    res["command"] = "python -m bench.ab " + " ".join(argv if argv is not None else sys.argv[1:])
    report(res)
    write_json(a.json, res)
    print(f"wrote {a.json}")
    return 0 if all(v["verdict"] == "ok" for v in res["figures"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
