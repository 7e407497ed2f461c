"""Sharded checkpoints on CPU ranks: save blocking time, time until durable, and a resharded load.

``python -m bench.sharded`` starts jobs of ``--world`` (default 4) gloo ranks on this machine, each
rank a ``bench/sharded_child.py`` process (its docstring describes the FSDP2 workload, ``--size``
of model + AdamW state over the whole job, and what is timed). Per system and repeat:

1. a *save* job of ``--world`` ranks takes ``--saves`` checkpoints; per save, the job's time is the
   slowest rank's: ``block_s`` (the call, plus pccheck's copy-on-write wait in the next step) and
   ``durable_s`` (from the call until the checkpoint is durable). Systems: ``pccheck``
   (``Checkpointer``), ``pccheck_dcp`` (``dcp.async_save`` + ``pccheck.dcp.Writer``), ``dcp_fs``
   (``dcp.async_save`` + ``FileSystemWriter``);
2. the checkpoint's files are made cold (``sync`` + ``posix_fadvise(DONTNEED)``) and a *load* job of
   ``--load-world`` (default 2) ranks loads the newest one into a fresh FSDP2 model (resharding):
   ``load_s``, the slowest rank's; then a second load job while the files are in the page cache:
   ``load_warm_s`` (what the load costs above the disk: both systems read the same bytes cold).

Reported: medians over repeats (and saves); the targets of issue 14 as ratios against
``dcp_fs`` in the same run. Writes ``--json`` (default ``bench/results/sharded.json``) and a PNG
beside it; ``--quick``: 64 MiB, 1 repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._common import fmt, format_size, host_info, machine_label, median_or_none, parse_size, \
    print_ratio_targets, print_table, pyplot, save_figure, scratch_dir, write_json
from bench.probes import cpu_busy_s, wait_quiet

__all__ = ["SYSTEMS", "TARGETS", "run_benchmark", "main"]

_BENCH_DIR = Path(__file__).resolve().parent
_CHILD = _BENCH_DIR / "sharded_child.py"
SYSTEMS: tuple[str, ...] = ("pccheck", "pccheck_dcp", "dcp_fs")
BASE = "dcp_fs"
# (what, system, measure, limit): system's median / dcp_fs's median must be <= limit
TARGETS = (("save blocking time", "pccheck", "block_s", 0.3), ("time until durable", "pccheck", "durable_s", 0.5),
           ("resharded load", "pccheck", "load_s", 0.5))
COLORS = {"pccheck": "#d62728", "pccheck_dcp": "#ff7f0e", "dcp_fs": "#1f77b4"}


def _path_first() -> list[str]:
    spec = importlib.util.find_spec("pccheck")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return [str(Path(locations[0]).parent)] if locations else []


def run_job(role: str, system: str, world: int, workdir: Path, cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``world`` ranks of the child in ``role``; each rank's JSON result (RuntimeError if one fails)."""
    init = workdir.parent / f"init-{random.random()}"
    base = {"role": role, "system": system, "dir": str(workdir), "world": world, "init": str(init),
            "nbytes": cfg["nbytes"], "blocks": cfg["blocks"], "saves": cfg["saves"],
            "path_first": _path_first(), "root": str(_BENCH_DIR.parent)}
    procs = [subprocess.Popen([sys.executable, str(_CHILD), json.dumps({**base, "rank": r})], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(world)]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=cfg["timeout_s"])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{system} {role}: no result within {cfg['timeout_s']} s") from None
        lines = out.strip().splitlines()
        res = json.loads(lines[-1]) if lines else {"error": err.strip()[-800:] or "no output"}
        if "error" in res:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{system} {role}: {res['error']} {err.strip()[-800:]}")
        results.append(res)
    init.unlink(missing_ok=True)
    return results


def make_cold(workdir: Path) -> None:
    os.sync()
    for path in workdir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(system: str, workdir: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """One repeat: the save job, then the cold resharded load job."""
    wait_quiet(cfg["quiet_wait_s"])
    busy0, t0 = cpu_busy_s(), time.perf_counter()
    saved = run_job("save", system, cfg["world"], workdir, cfg)
    saves = [{k: max(r["runs"][i][k] for r in saved) for k in ("call_s", "block_s", "durable_s")}
             for i in range(cfg["saves"])]
    make_cold(workdir)
    loaded = run_job("load", system, cfg["load_world"], workdir, cfg)
    warm = run_job("load", system, cfg["load_world"], workdir, cfg)  # the files are in the page cache now
    out: dict[str, Any] = {"saves": saves, "load_s": max(r["load_s"] for r in loaded),
                           "load_warm_s": max(r["load_s"] for r in warm),
                           "machine_busy_cpus": round((cpu_busy_s() - busy0) / (time.perf_counter() - t0), 2)}
    if system == "pccheck":
        out["bytes_read_per_rank"] = [r.get("bytes_read") for r in loaded]
    return out


def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"block_s": median_or_none([s["block_s"] for r in runs for s in r["saves"]]),
            "durable_s": median_or_none([s["durable_s"] for r in runs for s in r["saves"]]),
            "load_s": median_or_none([r["load_s"] for r in runs]),
            "load_warm_s": median_or_none([r["load_warm_s"] for r in runs])}


def run_benchmark(cfg: Mapping[str, Any], systems: Sequence[str], repeats: int, base_dir: Path,
                  progress: Any = print) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    errors: dict[str, str] = {}
    with scratch_dir(base_dir) as work:
        host = host_info(work)
        for rep in range(repeats):
            for system in [s for s in systems if s not in errors]:
                progress(f"sharded: {system} {rep + 1}/{repeats}")
                with scratch_dir(work) as d:
                    try:
                        runs[system].append(measure(system, d / "ckpt", cfg))
                    except RuntimeError as exc:
                        errors[system] = str(exc)
                        progress(f"sharded: {system} FAILED: {exc}")
    results = {s: {"failed": errors[s]} if s in errors else {"summary": _summary(runs[s]), "runs": runs[s]}
               for s in systems}
    return {"benchmark": "bench.sharded", "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "machine": machine_label(host), "host": host, "config": dict(cfg), "results": results,
            "targets": _targets(results)}


def _targets(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    base = results.get(BASE, {}).get("summary", {})
    for what, system, key, limit in TARGETS:
        mine = results.get(system, {}).get("summary", {}).get(key)
        value = mine / base[key] if mine is not None and base.get(key) else None
        out.append({"what": f"{what}: {system} / {BASE}", "limit": limit, "value": value,
                    "met": None if value is None else value <= limit})
    return out


def print_report(res: Mapping[str, Any]) -> None:
    cfg = res["config"]
    rows = []
    for name, r in res["results"].items():
        if "failed" in r:
            rows.append([name, "FAILED: " + r["failed"][:80], "", "", ""])
            continue
        s = r["summary"]
        rows.append([name, fmt(s["block_s"], ".3f"), fmt(s["durable_s"], ".3f"), fmt(s["load_s"], ".3f"),
                     fmt(s["load_warm_s"], ".3f")])
    print_table(f"sharded: FSDP2 + AdamW, {format_size(cfg['nbytes'])} over {cfg['world']} ranks, load on "
                f"{cfg['load_world']} (cold); medians, seconds ({res['machine']})",
                ["system", "save blocks", "until durable", f"load {cfg['world']}->{cfg['load_world']}", "same, warm cache"],
                rows)
    print_ratio_targets(res["targets"])


def plot(path: Path, res: Mapping[str, Any]) -> bool:
    plt = pyplot(path)
    ok = {n: r["summary"] for n, r in res["results"].items() if "summary" in r}
    if plt is None or not ok:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(15, 4))
    cfg = res["config"]
    for ax, (key, label) in zip(axes, (("block_s", "save: blocks training"), ("durable_s", "save: until durable"),
                                        ("load_s", f"load {cfg['world']} -> {cfg['load_world']} ranks, cold"),
                                        ("load_warm_s", "the same load, files in the page cache"))):
        names = list(ok)
        ax.bar(names, [ok[n][key] or 0.0 for n in names], color=[COLORS.get(n, "grey") for n in names])
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("seconds (median), lower is better")
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"FSDP2 + AdamW, {format_size(cfg['nbytes'])} over {cfg['world']} gloo ranks; {res['machine']}",
                 fontsize=9)
    save_figure(fig, path)
    return True


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.sharded", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default=None, help="model + AdamW state over the job (default 1GiB; quick 64MiB)")
    p.add_argument("--world", type=int, default=4, help="ranks of the saving job (default 4)")
    p.add_argument("--load-world", type=int, default=2, help="ranks of the loading job (default 2)")
    p.add_argument("--blocks", type=int, default=8, help="FSDP2-wrapped Linear blocks (default 8)")
    p.add_argument("--saves", type=int, default=3, help="checkpoints per save job (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="jobs per system (default 3; quick 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="subset of: " + ",".join(SYSTEMS))
    p.add_argument("--quiet-wait", type=float, default=10.0, help="wait up to this long for a quiet machine (s)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one job may take (default 900)")
    p.add_argument("--json", type=Path, default=None, help="default bench/results/sharded.json (quick: -quick)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch", help="scratch directory (removed after)")
    p.add_argument("--quick", action="store_true", help="64MiB, 1 repeat: a smoke run")
    a = p.parse_args(argv)
    a.size = parse_size(a.size or ("64MiB" if a.quick else "1GiB"))
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not a.systems or set(a.systems) - set(SYSTEMS):
        p.error(f"unknown systems; choose from {','.join(SYSTEMS)}")
    if min(a.world, a.load_world, a.blocks, a.saves, a.repeats) < 1:
        p.error("--world, --load-world, --blocks, --saves and --repeats must be >= 1")
    a.json = a.json or _BENCH_DIR / "results" / ("sharded-quick.json" if a.quick else "sharded.json")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = _parse_args(args)
    cfg = {"nbytes": a.size, "blocks": a.blocks, "world": a.world, "load_world": a.load_world, "saves": a.saves,
           "timeout_s": a.timeout, "quiet_wait_s": a.quiet_wait}
    t0 = time.perf_counter()
    res = {"command": shlex.join(["python", "-m", "bench.sharded", *args]),
           **run_benchmark(cfg, a.systems, a.repeats, a.dir)}
    res["runtime_s"] = time.perf_counter() - t0
    print_report(res)
    write_json(a.json, res)
    png = a.json.with_suffix(".png")
    print(f"wrote {a.json}" + (f", {png}" if plot(png, res) else ""))
    return 0 if all("summary" in r for r in res["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
