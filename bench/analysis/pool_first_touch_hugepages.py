"""First touch of a fresh 2 GiB mapping with and without MADV_HUGEPAGE, then a copy into it (why the
chunk pool uses 4 KiB pages on VMs that return freed memory to their host)."""
import mmap, time, sys, numpy as np, ctypes
N = 2 << 30
PIECE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
src = np.ones(1 << 28, np.float32)  # 1 GiB source, touched
def trial(thp):
    m = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(m, np.uint8)
    addr = buf.ctypes.data
    if thp:
        m.madvise(mmap.MADV_HUGEPAGE)
    t0 = time.perf_counter()
    for off in range(0, N, PIECE):
        if libc.madvise(addr + off, PIECE, MADV_POPULATE_WRITE) != 0:
            raise OSError(ctypes.get_errno())
    pf = time.perf_counter() - t0
    dst = buf[: 1 << 30].view(np.float32)
    cps = []
    for _ in range(3):
        t0 = time.perf_counter(); np.copyto(dst, src); cps.append(time.perf_counter() - t0)
    del dst, buf
    m.close()
    return pf, min(cps)
for i in range(int(sys.argv[1])):
    for thp in (True, False):
        time.sleep(6)  # let free page reporting return the freed memory to the host, as for a new process
        pf, cp = trial(thp)
        print(f"thp={thp} prefault 2 GiB {pf:.3f}s = {2/pf:.2f} GiB/s; copy 1 GiB into it {cp:.3f}s = {1/cp:.2f} GiB/s", flush=True)
