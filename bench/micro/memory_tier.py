"""The memory tier's design choice: a separate tmpfs store vs the DRAM chunk pool itself.

    python -m bench.memory_tier [--size 256MiB] [--repeats 7] [--json bench/results/memory_tier/latest.json]

State: 8 float32 numpy arrays of ``--size`` in all, touched before timing; one byte per array
changes before each checkpoint. Per repeat, each design makes one recoverable checkpoint of the
state in /dev/shm and is timed from the call until it is committed:

- ``tmpfs_store`` (what pccheck does): ``Checkpointer(arrays, path, interval=10**9,
  memory_interval=1, memory_dir=/dev/shm/...)``; ``maybe_checkpoint(s)`` then ``wait()``: the
  copy engine fills the memory tier's 64 MiB chunk pool, the writer threads copy each chunk into
  the tmpfs store (mmap mode), crc32c per array, manifest, the §4 commit. Two memcpys per byte.
- ``pool_is_tier`` (the alternative's floor): a shared mapping on /dev/shm of the state's size,
  created and touched once; per checkpoint one copy of each array into it (numpy, one thread),
  the crc32c of each array, and an 8-byte commit word written and msynced. One memcpy per byte,
  no manifest, no slots: the least a pool that *is* the tier could do.

Reports the median and range of each, their ratio, and what each holds in memory.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness.common import result_path, host_info, print_table, write_json, parse_size, format_size

__all__ = ["main"]


def _state(size: int) -> dict[str, np.ndarray]:
    n = size // 8 // 4
    return {f"a{i}": np.full(n, i, dtype=np.float32) for i in range(8)}


def _tmpfs_store(arrays: dict[str, np.ndarray], repeats: int, shm: Path) -> list[float]:
    import pccheck

    disk = Path(tempfile.mkdtemp(prefix="pcc-memtier-"))
    mem = shm / "bench-memory-tier"
    shutil.rmtree(mem, ignore_errors=True)
    times = []
    try:
        ck = pccheck.Checkpointer(arrays, disk, interval=10**9, memory_interval=1, memory_dir=mem)
        for s in range(1, repeats + 3):  # two warm-ups: every slot written once
            for a in arrays.values():
                a[0] += 1
            t0 = time.perf_counter()
            ck.maybe_checkpoint(s)
            ck.wait()
            if s > 2:
                times.append(time.perf_counter() - t0)
        ck.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(mem, ignore_errors=True)
    return times


def _pool_is_tier(arrays: dict[str, np.ndarray], repeats: int, shm: Path) -> list[float]:
    from pccheck.persist.reader import crc32c

    total = sum(a.nbytes for a in arrays.values())
    path = shm / "bench-pool-tier"
    with open(path, "w+b") as f:
        f.truncate(total + 4096)
        mm = mmap.mmap(f.fileno(), total + 4096)
    try:
        buf = np.frombuffer(mm, dtype=np.uint8)
        buf[:] = 0  # touched once, like the pool's prefault
        times = []
        for s in range(1, repeats + 3):
            for a in arrays.values():
                a[0] += 1
            t0 = time.perf_counter()
            off, crcs = 4096, []
            for a in arrays.values():
                dst = buf[off:off + a.nbytes]
                np.copyto(dst, a.view(np.uint8))
                crcs.append(crc32c(memoryview(dst)))
                off += a.nbytes
            buf[:8] = np.frombuffer(np.int64(s).tobytes(), dtype=np.uint8)  # the commit word
            mm.flush(0, 4096)
            if s > 2:
                times.append(time.perf_counter() - t0)
    finally:
        path.unlink()  # the mapping goes with its last view
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.memory_tier", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--json", default=str(result_path("memory_tier")))
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    arrays = _state(size)
    shm = Path(args.shm)
    res = {"tmpfs_store": _tmpfs_store(arrays, args.repeats, shm), "pool_is_tier": _pool_is_tier(arrays, args.repeats, shm)}
    med = {k: statistics.median(v) for k, v in res.items()}
    rows = [[k, f"{med[k] * 1e3:.1f}", f"{min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}", f"{size / med[k] / 1e9:.2f}"]
            for k, v in res.items()]
    print_table(f"one committed memory checkpoint of {format_size(size)} (ms)", ["design", "median", "range", "GB/s"], rows)
    ratio = med["tmpfs_store"] / med["pool_is_tier"]
    print(f"tmpfs_store / pool_is_tier = {ratio:.2f}x")
    out = {"bench": "memory_tier", "size": size, "repeats": args.repeats, "seconds": res,
           "median_s": med, "ratio_store_over_pool": ratio,
           "memory": {"tmpfs_store": "own store: 2 slots x state (single process; 6 in a replicated group) + 64 MiB pool",
                      "pool_is_tier": "the pool must keep (N+1) x state pinned in shared memory, instead of 2x "
                                      "state recycled chunk by chunk"},
           "host": host_info(args.shm), "cpus": os.cpu_count()}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
