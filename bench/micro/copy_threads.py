"""The CPU copy engine's throughput with 1 and 2 (or more) copy threads.

    python -m bench.copy_threads [--size 1GiB] [--threads 1,2] [--repeats 7]
                                 [--json bench/results/copy_threads/latest.json] [--dir bench/_scratch]

The state: 16 float32 numpy arrays totalling ``--size``, written once (every page touched). One
``Checkpointer`` per thread count, ``copy_engine=CpuCopyEngine(threads=t)``, on the disk under
``--dir``; no optimizer, so ``checkpoint()`` copies the whole snapshot into the (prefaulted) DRAM
chunks before it returns, on the calling thread and ``t - 1`` helpers. Timed: the copy, as
``ck.stats()`` records it (``blocked_copy_s``); the writers persist the chunks meanwhile (their
checksums share the CPUs, as they do in training). Untimed: a warm-up checkpoint per slot, then
``wait()`` after each timed one. Thread counts are interleaved per repeat; medians are reported.
The reference: one ``numpy.copyto`` of the same bytes into a touched buffer (single-threaded memcpy).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import format_size, gbps, host_info, machine_label, parse_size, print_table, scratch_dir, \
    write_json

N_ARRAYS = 16
_BENCH_DIR = BENCH_DIR


def make_state(nbytes: int) -> dict[str, np.ndarray]:
    n = max(1, nbytes // 4 // N_ARRAYS)
    return {f"a{i}": np.full(n, float(i), dtype=np.float32) for i in range(N_ARRAYS)}


def memcpy_reference(state: dict[str, np.ndarray], repeats: int) -> float:
    """Median seconds of one single-threaded numpy copy of every array into touched buffers."""
    dst = {k: np.empty_like(v) for k, v in state.items()}
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for k, v in state.items():
            np.copyto(dst[k], v)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def run(nbytes: int, thread_counts: Sequence[int], repeats: int, base: Path) -> dict[str, Any]:
    import pccheck
    from pccheck.orchestrator.copy_engine import CpuCopyEngine

    state = make_state(nbytes)
    size = sum(a.nbytes for a in state.values())
    copy_s: dict[int, list[float]] = {t: [] for t in thread_counts}
    with scratch_dir(base) as work:
        host = host_info(work)
        # full checkpoints: the copy of the whole state is timed (one array changes per checkpoint)
        cks = {t: pccheck.Checkpointer(state, path=work / f"t{t}", interval=1, max_concurrent=2,
                                       copy_engine=CpuCopyEngine(threads=t), incremental=False)
               for t in thread_counts}
        try:
            step = 0
            for ck in cks.values():  # every slot written once: no timed write converts extents
                for _ in range(3):
                    step += 1
                    ck.checkpoint(step)
                ck.wait()
            for _ in range(repeats):
                for t, ck in cks.items():
                    step += 1
                    state["a0"][0] = step  # a new state per checkpoint
                    ck.checkpoint(step)
                    ck.wait()
                    copy_s[t].append(ck.stats().as_dict()["checkpoints"][-1]["blocked_copy_s"])
        finally:
            for ck in cks.values():
                ck.close()
    ref = memcpy_reference(state, repeats)
    rows = {t: {"copy_s": statistics.median(v), "gb_per_s": gbps(size, statistics.median(v)), "runs_s": v}
            for t, v in copy_s.items()}
    out: dict[str, Any] = {"benchmark": "bench.copy_threads", "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                           "machine": machine_label(host), "host": host, "state_bytes": size,
                           "repeats": repeats, "threads": rows,
                           "memcpy_1thread": {"copy_s": ref, "gb_per_s": gbps(size, ref)}}
    if 1 in rows and len(rows) > 1:
        best = max((t for t in rows if t > 1), key=lambda t: rows[t]["gb_per_s"])
        out["speedup"] = {"threads": best, "vs_1": rows[1]["copy_s"] / rows[best]["copy_s"]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.copy_threads", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=result_path("copy_threads"))
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch")
    args = p.parse_args(argv)
    threads = sorted({int(x) for x in args.threads.split(",") if x.strip()})
    if not threads or min(threads) < 1 or args.repeats < 1:
        p.error("--threads takes integers >= 1 and --repeats must be >= 1")
    res = run(parse_size(args.size), threads, args.repeats, args.dir)
    res["command"] = "python -m bench.copy_threads " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = [[str(t), f"{r['copy_s'] * 1e3:.1f}", f"{r['gb_per_s']:.1f}"] for t, r in res["threads"].items()]
    rows.append(["numpy.copyto, 1 thread", f"{res['memcpy_1thread']['copy_s'] * 1e3:.1f}",
                 f"{res['memcpy_1thread']['gb_per_s']:.1f}"])
    print_table(f"CPU copy engine, {format_size(res['state_bytes'])} snapshot; medians of {args.repeats} "
                f"({res['machine']})", ["copy threads", "copy ms", "GB/s"], rows)
    if "speedup" in res:
        print(f"{res['speedup']['threads']} threads copy {res['speedup']['vs_1']:.2f}x as fast as 1")
    write_json(args.json, res)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
