"""Faulting 256 MiB in: MAP_POPULATE vs MADV_POPULATE_WRITE vs the native prefault (whole / 16 MiB pieces)."""
import mmap, time, numpy as np, sys
import os; sys.path.insert(0, os.environ.get("PCCHECK_TREE", "."))
from pccheck.native import _native
SIZE = 256 << 20
def mp():
    return mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
def pw():
    mm = mmap.mmap(-1, SIZE); mm.madvise(23); return mm
def npf():
    mm = mmap.mmap(-1, SIZE); _native.prefault(memoryview(mm)); return mm
def npf16():
    mm = mmap.mmap(-1, SIZE); v = memoryview(mm)
    for o in range(0, SIZE, 16 << 20): _native.prefault(v[o:o + (16 << 20)])
    return mm
F = {"MAP_POPULATE": mp, "MADV_POPULATE_WRITE": pw, "native.prefault": npf, "native.prefault16M": npf16}
res = {k: [] for k in F}
order = list(F)
for rep in range(4):
    for k in (order if rep % 2 == 0 else order[::-1]):
        t0 = time.perf_counter(); mm = F[k](); res[k].append(time.perf_counter() - t0)
        a = np.frombuffer(mm, np.uint8); t1 = time.perf_counter(); a[::4096] = 3; w = time.perf_counter() - t1
        res.setdefault(k+"_after", []).append(w)
        del a; mm.close()
for k, v in list(res.items()): print(f"{k:22s}", " ".join(f"{x:.3f}" for x in v))
