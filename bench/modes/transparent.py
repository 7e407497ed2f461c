"""Transparent mode (CRIU) against a plain ``criu dump``, on a process with ``--rss`` of memory.

    python -m bench.transparent [--rss 1GiB] [--repeats 3] [--window 40] [--json bench/results/transparent/latest.json]

Needs root and a working criu (``PCCHECK_CRIU``, see scripts/get-criu.sh). The process: a numpy
array of ``--rss`` bytes written once (every page touched), then iterations of 10 ms (a sleep)
plus a write to one 4 KiB page each, printing a line per iteration. Measured, ``--repeats`` times,
interleaved:

- freeze per dump: ``pccheck.transparent.Supervisor.dump_now`` (CRIU's dump into tmpfs, with
  pccheck's post-dump action) against a plain ``criu dump --leave-running`` into tmpfs (the
  freeze alone, CRIUgpu's way without the disk);
- time until the image is durable: pccheck (dump + hand-off to the DRAM pool + persist and commit)
  against a plain ``criu dump --leave-running`` into a directory on the disk under ``--dir``
  followed by an fsync of every image file and the directory (CRIU never fsyncs);
- the process's slowdown: iterations per second over ``--window`` seconds under ``pccheck run``
  with a dump every 30 s and every 5 s, against the same window with no dumps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Sequence

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import fmt, format_size, host_info, machine_label, parse_size, print_table, pyplot, \
    save_figure, scratch_dir, write_json

_BENCH_DIR = BENCH_DIR

WORKLOAD = textwrap.dedent("""
    import sys, time
    import numpy as np
    state = np.ones(int(sys.argv[1]) // 8)       # every page touched
    i = 0
    while True:
        state[(i * 512) % state.size] += 1.0     # one 4 KiB page written per iteration
        print(i, time.monotonic(), flush=True)
        i += 1
        time.sleep(0.01)
""")


def _wait_output(path: Path, lines: int, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not path.exists() or path.read_text().count("\n") < lines:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the workload did not start ({path})")
        time.sleep(0.05)


def _rate(log: Path, t_from: float, t_to: float) -> float:
    """Iterations per second the workload logged between two monotonic times."""
    stamps = [float(ln.split()[1]) for ln in log.read_text().splitlines() if len(ln.split()) == 2]
    inside = [t for t in stamps if t_from <= t <= t_to]
    return (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 1 else 0.0


def _start_plain(script: Path, rss: int, out: Path) -> int:
    out.unlink(missing_ok=True)  # a fresh log: the wait below counts this process's lines only
    with open(out, "ab") as f:
        p = subprocess.Popen([sys.executable, str(script), str(rss)], stdin=subprocess.DEVNULL, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
    _wait_output(out, 5)
    return p.pid


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.02)


def _fsync_tree(d: Path) -> None:
    for entry in os.scandir(d):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_dumps(criu: Any, script: Path, rss: int, work: Path, dumps: int = 3) -> dict[str, Any]:
    """Plain criu dumps of the workload, as many as pccheck's and of the same process, so that both
    are timed in the same steady state (the last one): into tmpfs (the freeze), then into the
    disk + fsync."""
    from pccheck.transparent.supervisor import tmpfs_dir

    pid = _start_plain(script, rss, work / "plain.out")
    freezes, dumped, durable = [], [], []
    try:
        for _ in range(dumps):
            shm = Path(tempfile.mkdtemp(prefix="bench-criu-", dir=tmpfs_dir()))
            try:
                freezes.append(criu.dump(pid, shm))
            finally:
                shutil.rmtree(shm, ignore_errors=True)
        for _ in range(dumps):
            disk = work / "plain-images"
            disk.mkdir()
            os.sync()
            t0 = time.perf_counter()
            criu.dump(pid, disk)
            dumped.append(time.perf_counter() - t0)
            _fsync_tree(disk)
            durable.append(time.perf_counter() - t0)
            image = sum(e.stat().st_size for e in os.scandir(disk))
            shutil.rmtree(disk)
    finally:
        _kill(pid)
    return {"freeze_tmpfs_s": freezes[-1], "disk_dump_s": dumped[-1], "disk_durable_s": durable[-1],
            "image_bytes": image, "freeze_all_s": freezes, "durable_all_s": durable}


def pccheck_dumps(script: Path, rss: int, work: Path, dumps: int = 3) -> dict[str, float]:
    """pccheck's dumps of the workload: the freeze and the time until each is durable."""
    from pccheck.transparent import Supervisor

    path = work / "pccheck"
    sup = Supervisor.start([sys.executable, str(script), str(rss)], path)
    try:
        _wait_output(path / "output.log", 5)
        freezes, durable, parts = [], [], []
        for _ in range(dumps):
            os.sync()
            t0 = time.perf_counter()
            st = sup.dump_now()
            sup.flush()
            durable.append(time.perf_counter() - t0)
            assert st is not None and st.outcome == "committed", st
            freezes.append(st.freeze_s)
            parts.append({"freeze_s": st.freeze_s, "start_s": st.start_s, "persist_s": st.persist_s})
        image = st.image_bytes
    finally:
        if sup.pid is not None:
            _kill(sup.pid)
        sup.close()
        shutil.rmtree(path, ignore_errors=True)
    # the first dumps also open the store and fault the DRAM pool in: the steady state is the last one
    return {"freeze_s": freezes[-1], "durable_s": durable[-1], "image_bytes": image,
            "freeze_all_s": freezes, "durable_all_s": durable, "parts": parts}


def slowdown(script: Path, rss: int, work: Path, every: float | None, window: float) -> float:
    """Iterations per second of the workload over ``window`` s under `pccheck run --every`."""
    path = work / f"run-{every}"
    cmd = [sys.executable, "-m", "pccheck.commands.cli", "run", "--path", str(path)]
    if every is not None:
        cmd += ["--every", str(every)]
    sup = subprocess.Popen([*cmd, "--", sys.executable, str(script), str(rss)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_output(path / "output.log", 20)
        t0 = time.monotonic()
        time.sleep(window)
        rate = _rate(path / "output.log", t0, time.monotonic())
    finally:
        os.killpg(sup.pid, signal.SIGTERM)  # a final dump, then the workload is stopped
        try:
            sup.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(sup.pid, signal.SIGKILL)
            sup.wait()
        shutil.rmtree(path, ignore_errors=True)
    return rate


def run(rss: int, repeats: int, window: float, base: Path) -> dict[str, Any]:
    from pccheck.transparent import Criu

    criu = Criu()
    version = criu.check()
    runs: dict[str, list[Any]] = {"plain": [], "pccheck": [], "rate": []}
    with scratch_dir(base) as work:
        host = host_info(work)
        script = work / "workload.py"
        script.write_text(WORKLOAD)
        for rep in range(repeats):
            print(f"transparent: round {rep + 1}/{repeats}", flush=True)
            runs["plain"].append(plain_dumps(criu, script, rss, work))
            runs["pccheck"].append(pccheck_dumps(script, rss, work))
            runs["rate"].append({str(e): slowdown(script, rss, work, e, window) for e in (None, 30.0, 5.0)})
    med = statistics.median
    plain = {k: med(r[k] for r in runs["plain"]) for k in ("freeze_tmpfs_s", "disk_dump_s", "disk_durable_s",
                                                           "image_bytes")}
    mine = {k: med(r[k] for r in runs["pccheck"]) for k in ("freeze_s", "durable_s", "image_bytes")}
    rates = {k: med(r[k] for r in runs["rate"]) for k in ("None", "30.0", "5.0")}
    targets = [
        {"what": "freeze per dump, pccheck / a dump to tmpfs alone", "limit": 1.2,
         "value": mine["freeze_s"] / plain["freeze_tmpfs_s"]},
        {"what": "time to a durable image, plain criu dump to disk + fsync / pccheck", "limit": 1.5,
         "value": plain["disk_durable_s"] / mine["durable_s"], "higher_is_better": True},
    ]
    for t in targets:
        t["met"] = t["value"] >= t["limit"] if t.get("higher_is_better") else t["value"] <= t["limit"]
    return {"benchmark": "bench.transparent", "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine_label(host),
            "host": host, "criu": version, "rss_bytes": rss, "window_s": window, "repeats": repeats, "runs": runs,
            "plain": plain, "pccheck": mine,
            "it_per_s": rates, "slowdown": {"every_30s": rates["None"] / rates["30.0"] if rates["30.0"] else None,
                                            "every_5s": rates["None"] / rates["5.0"] if rates["5.0"] else None},
            "targets": targets}


def plot(path: Path, res: dict[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    p, m = res["plain"], res["pccheck"]
    names = ["freeze\n(plain, tmpfs)", "freeze\n(pccheck)", "durable\n(plain dump + fsync)", "durable\n(pccheck)"]
    ax.bar(names, [p["freeze_tmpfs_s"], m["freeze_s"], p["disk_durable_s"], m["durable_s"]],
           color=["#999", "#2a7", "#999", "#2a7"])
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title(f"CRIU image of a {format_size(res['rss_bytes'])}-RSS process; {res['machine']}", fontsize=8)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.transparent", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rss", default="1GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=float, default=40.0, help="seconds per throughput window")
    ap.add_argument("--json", type=Path, default=result_path("transparent"))
    ap.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.window <= 0:
        ap.error("--repeats must be >= 1 and --window > 0")
    res = run(parse_size(args.rss), args.repeats, args.window, args.dir)
    res["command"] = "python -m bench.transparent " + " ".join(argv if argv is not None else sys.argv[1:])
    p, m = res["plain"], res["pccheck"]
    print_table(f"transparent mode, {format_size(res['rss_bytes'])} RSS (image {format_size(int(m['image_bytes']))}); "
                f"medians of {args.repeats} ({res['machine']})", ["measure", "plain criu", "pccheck"],
                [["freeze per dump (s)", fmt(p["freeze_tmpfs_s"], ".3f"), fmt(m["freeze_s"], ".3f")],
                 ["until durable (s)", fmt(p["disk_durable_s"], ".3f"), fmt(m["durable_s"], ".3f")]])
    for k, v in res["slowdown"].items():
        print(f"slowdown, a dump {k.replace('_', ' ')}: {fmt(v, '.3f')}x")
    for t in res["targets"]:
        print(f"target: {t['what']}: {t['value']:.2f} (limit {t['limit']}) {'MET' if t['met'] else 'MISSED'}")
    write_json(args.json, res)
    plot(args.json.with_suffix(".png"), res)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
