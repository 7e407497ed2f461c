"""Cold resharded load against raw-read methods: which way of reading the same bytes cold is the floor
(bench.sharded's floor). Kept as run.

``python bench/analysis/cold_read_floor_methods.py DIR save`` writes one pccheck checkpoint (4 ranks, 1 GiB) and one DCP
``FileSystemWriter`` checkpoint under DIR (absolute); ``... DIR run REPS JSON``
then, REPS rounds, for every variant of the JSON list: makes DIR cold (bench.modes.sharded's
``make_cold``) and times either a load job (``{"load": 1, "system": ...}``, bench.sharded's child)
or a raw read of exactly each loading rank's ranges by two processes at once (threads, piece,
direct, dest, crc, willneed), printing seconds and the block layer's counters around it
(the block layer's counters: /sys/block/*/stat). The ``env`` variants (PCCHECK_EXP_*)
drove a temporary experiment build of pccheck/sharded/load.py, not kept. Run with
PYTHONPATH=<worktree> under ``flock -x /tmp/pccheck-bench.lock``.
"""
import json, os, sys, time, threading, itertools, mmap
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
import multiprocessing as mp
from bench.modes import sharded as S

CFG = {"nbytes": 1 << 30, "blocks": 8, "world": 4, "load_world": 2, "saves": 3, "timeout_s": 900, "quiet_wait_s": 0}

def rawread(ranges, threads, piece, direct, dest, crc, barrier, q, willneed=False):
    try:
        _rawread(ranges, threads, piece, direct, dest, crc, barrier, q, willneed)
    except BaseException as e:
        q.put(f"ERR {e!r}")
        barrier.abort()

def _rawread(ranges, threads, piece, direct, dest, crc, barrier, q, willneed):
    from pccheck.native import _native
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in sorted({p for p, _, _ in ranges})}
    total = sum(n for _, _, n in ranges)
    if dest == "touched":
        big = mmap.mmap(-1, total + (1 << 21)); big[:] = b"\1" * len(big)  # noqa
        big = memoryview(big)
    elif dest == "fresh":
        big = memoryview(mmap.mmap(-1, total + (1 << 21)))
    else:
        big = None
    offs, o = [], 0
    for _, _, n in ranges:
        offs.append(o); o += (n + 4095) // 4096 * 4096
    bufs = [memoryview(mmap.mmap(-1, piece)) for _ in range(threads)]
    for b in bufs: b[:] = b"\1" * len(b)
    local, handed = threading.local(), itertools.count()
    def read(i):
        path, offset, nbytes = ranges[i]
        if not hasattr(local, "buf"):
            local.buf = bufs[next(handed)]
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done)
            if big is not None:
                v = big[offs[i] + done: offs[i] + done + n]
            else:
                v = local.buf[:n]
            at = offset + done
            if direct:
                at = at // 4096 * 4096
                n = (offset + done + n - at + 4095) // 4096 * 4096
                v = local.buf[:n]
            got = os.preadv(fds[path], [v], at)
            if direct:
                got = min(got - (offset + done - at), nbytes - done)
            if got <= 0: raise OSError("short")
            if crc: _native.crc32c(v[:got], 0)
            done += got
        return nbytes
    with ThreadPoolExecutor(threads) as pool:
        barrier.wait()
        t0 = time.perf_counter()
        if willneed:
            def hint():
                for p, o, n in ranges:
                    os.posix_fadvise(fds[p], o, n, os.POSIX_FADV_WILLNEED)
            th = threading.Thread(target=hint); th.start()
        tot = sum(pool.map(read, range(len(ranges))))
        q.put(time.perf_counter() - t0)

def floor(ranges_per_rank, **kw):
    ctx = mp.get_context("fork")
    b, q = ctx.Barrier(len(ranges_per_rank)), ctx.Queue()
    ps = [ctx.Process(target=rawread, args=(r,), kwargs=dict(barrier=b, q=q, **kw)) for r in ranges_per_rank]
    for p in ps: p.start()
    ts = [q.get(timeout=120) for _ in ps]
    if any(isinstance(t, str) for t in ts): raise RuntimeError(ts)
    for p in ps: p.join()
    return max(ts)

if __name__ == "__main__":
    work = Path(sys.argv[1]); what = sys.argv[2]
    if what == "save":
        work.mkdir(parents=True, exist_ok=True)
        S.run_job("save", "pccheck", 4, work, CFG)
        (work / "dcp").mkdir(exist_ok=True)
        S.run_job("save", "dcp_fs", 4, work / "dcp", CFG); sys.exit()
    ranges = S.load_ranges(work, 2)
    if what == "info":
        for r in ranges: print(len(r), sum(n for _,_,n in r), r[:3])
        sys.exit()
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    variants = json.loads(sys.argv[4]) if len(sys.argv) > 4 else [{}]
    for rep in range(reps):
        for v0 in variants:
            v = dict(v0)
            S.make_cold(work)
            st0 = [int(x) for x in open("/sys/block/vda/stat").read().split()]
            if v.get("load"):
                sysname = v.get("system", "pccheck")
                d = work / "dcp" if sysname == "dcp_fs" else work
                S.make_cold(d)
                for k in ("PCCHECK_EXP_THREADS", "PCCHECK_EXP_AHEAD"):
                    os.environ.pop(k, None)
                os.environ.update(v.get("env", {}))
                res = S.run_job("load", sysname, 2, d, CFG)
                t = max(r["load_s"] for r in res)
            else:
                time.sleep(v.pop("delay", 0))
                kw = dict(threads=4, piece=8 << 20, direct=False, dest="none", crc=False); kw.update(v)
                t = floor(ranges, **kw)
            st1 = [int(x) for x in open("/sys/block/vda/stat").read().split()]
            d = [a - b for a, b in zip(st1, st0)]
            print(rep, json.dumps(v0), f"{t:.3f}", f"ios={d[0]} merges={d[1]} MB={d[2]*512/1e6:.0f} rticks={d[3]} ioticks={d[9]} avgKB={d[2]*512/1024/max(1,d[0]):.0f}", flush=True)
