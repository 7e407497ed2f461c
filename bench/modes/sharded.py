"""Sharded checkpoints on CPU ranks: save blocking time, time until durable, and a resharded load.

``python -m bench.sharded`` starts jobs of ``--world`` (default 4) gloo ranks on this machine, each
rank a ``bench/modes/sharded_child.py`` process (its docstring describes the FSDP2 workload, ``--size``
of model + AdamW state over the whole job, and what is timed). Per system and repeat:

1. a *save* job of ``--world`` ranks takes ``--saves`` checkpoints (pccheck's once the Checkpointer's
   DRAM pool is faulted in, as it is after a job's first training steps: ``pool_touched_s``, untimed); per save, the job's time is the
   slowest rank's: ``block_s`` (the call, plus pccheck's copy-on-write wait in the next step) and
   ``durable_s`` (from the call until the checkpoint is durable). Systems: ``pccheck``
   (``Checkpointer``), ``pccheck_dcp`` (``dcp.async_save`` + ``pccheck.dcp.Writer``), ``dcp_fs``
   (``dcp.async_save`` + ``FileSystemWriter``);
2. for ``pccheck``, the physical floor of its load: ``--load-world`` processes read, at the same
   time, exactly the byte ranges each loading rank's load reads (its chunks of the newest set),
   raw, cold, by each of a few read methods (``FLOOR_METHODS`` in the child: threads, read size,
   prefetch hints; the files made cold before each): ``floor_methods_s``, the slowest rank's per
   method, ``floor_s`` the fastest method's; the same again right after the cold load
   (``floor_after_methods_s``, ``floor_after_s``): this disk's rate drifts by up to 1.6x between
   repeats, so the repeat's floor is, per method, the mean of the two, of the fastest
   method (``floor_bracket_s``, the ratio ``load_over_floor``; ``load_over_floor_before`` against
   the first reads alone);
3. the checkpoint's files are made cold (``sync`` + ``posix_fadvise(DONTNEED)`` on every file under
   the checkpoint directory: the same for every system and for the floor; ``resident_before_load``
   and ``resident_before_floor``, the fraction still in the page cache per ``mincore``, check it)
   and a *load* job of
   ``--load-world`` (default 2) ranks loads the newest one into a fresh FSDP2 model (resharding):
   ``load_s``, the slowest rank's; then a second load job while the files are in the page cache:
   ``load_warm_s`` (what the load costs above the disk: both systems read the same bytes cold).

Reported: medians over repeats with their ranges; save times apart for the first save of each job
(``block_first_s``: it also pays for what a fresh process sets up) and the later, *steady* ones
(``block_s``, ``durable_s``); the targets as ratios against ``dcp_fs`` in the
same run, and pccheck's cold load against its floor. Writes ``--json`` (default ``bench/results/sharded/latest.json``) and a PNG
beside it; ``--quick``: 64 MiB, 1 repeat (a smoke run).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import mmap
import os
import random
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import fmt, format_size, host_info, machine_label, median_or_none, parse_size, \
    print_ratio_targets, print_table, pyplot, save_figure, scratch_dir, write_json
from bench.harness.probes import cpu_busy_s, wait_quiet

__all__ = ["SYSTEMS", "TARGETS", "run", "main"]

_BENCH_DIR = BENCH_DIR
_CHILD = Path(__file__).resolve().with_name("sharded_child.py")
SYSTEMS: tuple[str, ...] = ("pccheck", "pccheck_dcp", "dcp_fs")
BASE = "dcp_fs"
# (what, system, measure, limit): system's median / dcp_fs's median must be <= limit (steady saves)
TARGETS = (("save blocking time, steady saves", "pccheck", "block_s", 0.3),
           ("time until durable, steady saves", "pccheck", "durable_s", 0.5),
           ("resharded load, cold", "pccheck", "load_s", 1.0))
FLOOR_LIMIT = 1.2  # pccheck's cold load / the raw read of the same bytes
COLORS = {"pccheck": "#d62728", "pccheck_dcp": "#ff7f0e", "dcp_fs": "#1f77b4"}


def _path_first() -> list[str]:
    spec = importlib.util.find_spec("pccheck")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return [str(Path(locations[0]).parent)] if locations else []


def run_job(role: str, system: str, world: int, workdir: Path, cfg: Mapping[str, Any],
            per_rank: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``world`` ranks of the child in ``role`` (rank r's spec extended by ``per_rank[r]``); each
    rank's JSON result (RuntimeError if one fails)."""
    init = workdir.parent / f"init-{random.random()}"
    base = {"role": role, "system": system, "dir": str(workdir), "world": world, "init": str(init),
            "nbytes": cfg["nbytes"], "blocks": cfg["blocks"], "saves": cfg["saves"],
            "path_first": _path_first(), "root": str(_BENCH_DIR.parent)}
    per_rank = per_rank or [{}] * world
    procs = [subprocess.Popen([sys.executable, str(_CHILD), json.dumps({**base, **per_rank[r], "rank": r})], text=True,
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


def resident_fraction(workdir: Path) -> float | None:
    """The fraction of the bytes of every file under ``workdir`` that is in the page cache
    (``mincore`` over a read-only mapping, which faults nothing in): checks that ``make_cold``
    reached every file. None where it cannot be asked (no libc mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "mincore"):
        return None
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, resident, total = os.sysconf("SC_PAGE_SIZE"), 0, 0
    for path in (p for p in workdir.rglob("*") if p.is_file()):
        size = path.stat().st_size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            ok = libc.mincore(ctypes.c_void_p(addr), size, vec) == 0
            libc.munmap(ctypes.c_void_p(addr), size)
            if not ok:
                return None
        finally:
            os.close(fd)
        resident += pages - bytes(vec).count(0)
        total += pages
    return resident / total if total else None


def load_ranges(path: Path, load_world: int) -> list[list[tuple[str, int, int]]]:
    """(file, offset, bytes) of every chunk each of ``load_world`` ranks reads when it loads the
    newest set under ``path`` into an FSDP2 model (Shard(0) on a 1-D mesh, optimizer state laid
    out like its parameter; a 0-d tensor whole on every rank), in file order: the ranges
    ``pccheck.sharded.load`` reads (``bytes_read`` of the load checks the total)."""
    from pccheck.persist.recovery import slot_base
    from pccheck.sharded.geometry import local_box, overlap
    from pccheck.sharded.index import newest_set

    cand = newest_set(path)
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(load_world)]
    for info in cand.tensors().values():
        for r in range(load_world):
            box = local_box(info.shape, (load_world,), (r,), [0]) if info.shape else None
            for c in info.chunks:
                if box is None or overlap(c.box, box) is not None:
                    m = cand.members[c.rank]
                    entry = m.entries[c.array][0]
                    out[r].append((str(m.image.path), slot_base(m.image, m.slot) + entry.offset, entry.nbytes))
    return [sorted(o) for o in out]


def _floor_methods(raw: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per raw read method of the floor job (``FLOOR_METHODS`` of the child), the slowest rank's
    seconds: the loading ranks read at the same time, as the load's do."""
    return {name: max(r["methods"][name] for r in raw) for name in raw[0]["methods"]}


def _floor_bracket(run: Mapping[str, Any]) -> float:
    """The repeat's floor: per raw method, the mean of its reads just before and just after the
    load (the disk's rate drifts within a repeat); the fastest method's mean."""
    before, after = run.get("floor_methods_s"), run.get("floor_after_methods_s")
    if before and after:
        return min((before[m] + after[m]) / 2 for m in before if m in after)
    return (run["floor_s"] + run.get("floor_after_s", run["floor_s"])) / 2


_SAVE_KEYS = ("call_s", "block_s", "durable_s", "prepare_s", "cow_wait_s", "backpressure_s", "copy_s")


def measure(system: str, workdir: Path, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """One repeat: the save job, (pccheck) the raw floor of its load, then the cold resharded
    load job and the warm one."""
    wait_quiet(cfg["quiet_wait_s"])
    busy0, t0 = cpu_busy_s(), time.perf_counter()
    saved = run_job("save", system, cfg["world"], workdir, cfg)
    saves = [{k: max(r["runs"][i][k] for r in saved) for k in _SAVE_KEYS if k in saved[0]["runs"][i]}
             for i in range(cfg["saves"])]
    floor: dict[str, Any] = {}
    if system == "pccheck":
        floor["pool_touched_s"] = max(r["pool_touched_s"] for r in saved)
        ranges = load_ranges(workdir, cfg["load_world"])
        make_cold(workdir)
        floor["resident_before_floor"] = resident_fraction(workdir)
        raw = run_job("floor", system, cfg["load_world"], workdir, cfg, [{"ranges": r} for r in ranges])
        by_method = _floor_methods(raw)
        floor.update(floor_s=min(by_method.values()), floor_methods_s=by_method,
                     floor_bytes_per_rank=[r["bytes_read"] for r in raw])
    make_cold(workdir)
    resident = resident_fraction(workdir)
    loaded = run_job("load", system, cfg["load_world"], workdir, cfg)
    warm = run_job("load", system, cfg["load_world"], workdir, cfg)  # the files are in the page cache now
    if system == "pccheck":  # the floor again, after the load: the disk's rate drifts within a repeat
        make_cold(workdir)
        raw = run_job("floor", system, cfg["load_world"], workdir, cfg, [{"ranges": r} for r in ranges])
        by_method = _floor_methods(raw)
        floor.update(floor_after_s=min(by_method.values()), floor_after_methods_s=by_method)
    out: dict[str, Any] = {"saves": saves, "load_s": max(r["load_s"] for r in loaded), **floor,
                           "load_warm_s": max(r["load_s"] for r in warm),
                           "load_s_per_rank": [r["load_s"] for r in loaded], "resident_before_load": resident,
                           "machine_busy_cpus": round((cpu_busy_s() - busy0) / (time.perf_counter() - t0), 2)}
    if system == "pccheck":
        out["bytes_read_per_rank"] = [r.get("bytes_read") for r in loaded]
    return out


def _spread(samples: Sequence[float]) -> dict[str, Any]:
    return {"median": median_or_none(samples), "min": min(samples, default=None), "max": max(samples, default=None),
            "n": len(samples)}


def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians (and, under ``spread``, median/min/max/n): the first save of each job apart from
    the steady ones (the later saves; all of them if a job takes one)."""
    steady = [s for r in runs for s in (r["saves"][1:] or r["saves"])]
    samples = {"block_first_s": [r["saves"][0]["block_s"] for r in runs],
               "durable_first_s": [r["saves"][0]["durable_s"] for r in runs],
               "block_s": [s["block_s"] for s in steady], "durable_s": [s["durable_s"] for s in steady],
               "load_s": [r["load_s"] for r in runs], "load_warm_s": [r["load_warm_s"] for r in runs]}
    if all("floor_s" in r for r in runs) and runs:
        samples["floor_s"] = [r["floor_s"] for r in runs]
        samples["load_over_floor_before"] = [r["load_s"] / r["floor_s"] for r in runs]
        # the repeat's floor: the mean of the raw reads just before and just after its load
        samples["floor_bracket_s"] = [_floor_bracket(r) for r in runs]
        samples["load_over_floor"] = [r["load_s"] / f for r, f in zip(runs, samples["floor_bracket_s"])]
    out: dict[str, Any] = {k: median_or_none(v) for k, v in samples.items()}
    out["spread"] = {k: _spread(v) for k, v in samples.items()}
    return out


def run(cfg: Mapping[str, Any], systems: Sequence[str], repeats: int, base_dir: Path,
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
    mine = results.get("pccheck", {}).get("summary", {}).get("spread", {}).get("load_over_floor")
    if mine:  # per repeat, both read in the same repeat: the median ratio and its worst
        out.append({"what": "resharded load, cold: pccheck / raw read of the same bytes, read just before and just "
                            "after it (median of repeats)",
                    "limit": FLOOR_LIMIT, "value": mine["median"], "worst": mine["max"],
                    "met": mine["median"] <= FLOOR_LIMIT, "met_every_repeat": mine["max"] <= FLOOR_LIMIT})
    return out


def _ranged(summary: Mapping[str, Any], key: str) -> str:
    sp = summary.get("spread", {}).get(key)
    if not sp or sp["median"] is None:
        return "-"
    return f"{sp['median']:.3f}" + (f" ({sp['min']:.2f}-{sp['max']:.2f})" if sp["n"] > 1 else "")


def report(res: Mapping[str, Any]) -> None:
    cfg = res["config"]
    rows = []
    for name, r in res["results"].items():
        if "failed" in r:
            rows.append([name, "FAILED: " + r["failed"][:80], "", "", "", "", ""])
            continue
        s = r["summary"]
        rows.append([name, _ranged(s, "block_first_s"), _ranged(s, "block_s"), _ranged(s, "durable_s"),
                     _ranged(s, "load_s"), _ranged(s, "floor_bracket_s"), _ranged(s, "load_warm_s")])
    print_table(f"sharded: FSDP2 + AdamW, {format_size(cfg['nbytes'])} over {cfg['world']} ranks, load on "
                f"{cfg['load_world']}; medians (min-max), seconds ({res['machine']})",
                ["system", "first save blocks", "steady saves block", "until durable (steady)",
                 f"load {cfg['world']}->{cfg['load_world']}, cold", "raw read of its bytes, cold", "load, warm cache"],
                rows)
    print_ratio_targets(res["targets"])
    runs = res["results"].get("pccheck", {}).get("runs", [])
    if runs and all("floor_after_s" in r for r in runs):
        print("pccheck cold load / floor per repeat (fastest raw method read before, after): " + ", ".join(
            f"{r['load_s'] / _floor_bracket(r):.2f} ({r['floor_s']:.2f}, {r['floor_after_s']:.2f})" for r in runs))


def plot(path: Path, res: Mapping[str, Any]) -> bool:
    plt = pyplot(path)
    ok = {n: r["summary"] for n, r in res["results"].items() if "summary" in r}
    if plt is None or not ok:
        return False
    fig, axes = plt.subplots(1, 4, figsize=(15, 4))
    cfg = res["config"]
    for ax, (key, label) in zip(axes, (("block_s", "steady saves: block training"),
                                        ("durable_s", "steady saves: until durable"),
                                        ("load_s", f"load {cfg['world']} -> {cfg['load_world']} ranks, cold"),
                                        ("load_warm_s", "the same load, files in the page cache"))):
        names = list(ok)
        med = [ok[n][key] or 0.0 for n in names]
        sp = [ok[n].get("spread", {}).get(key) or {} for n in names]
        err = [[m - (x.get("min") or m) for m, x in zip(med, sp)], [(x.get("max") or m) - m for m, x in zip(med, sp)]]
        ax.bar(names, med, yerr=err, capsize=3, color=[COLORS.get(n, "grey") for n in names])
        floor = ok.get("pccheck", {}).get("floor_bracket_s")
        if key == "load_s" and floor:
            ax.axhline(floor, color="black", ls="--", lw=1, label="raw read of pccheck's bytes, cold")
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_ylabel("seconds (median, min-max), lower is better")
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
    p.add_argument("--json", type=Path, default=None, help="default bench/results/sharded/latest.json (quick: quick.json)")
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
    a.json = a.json or result_path("sharded", quick=a.quick)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    a = _parse_args(args)
    cfg = {"nbytes": a.size, "blocks": a.blocks, "world": a.world, "load_world": a.load_world, "saves": a.saves,
           "timeout_s": a.timeout, "quiet_wait_s": a.quiet_wait}
    t0 = time.perf_counter()
    res = {"command": shlex.join(["python", "-m", "bench.sharded", *args]),
           **run(cfg, a.systems, a.repeats, a.dir)}
    res["runtime_s"] = time.perf_counter() - t0
    report(res)
    write_json(a.json, res)
    png = a.json.with_suffix(".png")
    print(f"wrote {a.json}" + (f", {png}" if plot(png, res) else ""))
    return 0 if all("summary" in r for r in res["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
