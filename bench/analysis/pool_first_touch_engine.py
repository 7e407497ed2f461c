"""The chunk pool's first touch with the built engine (Engine.wait_prefaulted), as in a restarted process."""
import sys, time
import os
sys.path.insert(0, os.environ.get("PCCHECK_TREE", "."))
from pccheck.native import _native
for i in range(4):
    time.sleep(6)  # freed memory reported back to the host first, as for a new process
    t0 = time.perf_counter(); e = _native.Engine(64 << 20, 32, 2); t1 = time.perf_counter()
    ok = e.wait_prefaulted(120.0); t2 = time.perf_counter()
    print(f"engine 32 x 64 MiB: made in {t1-t0:.4f} s, faulted in {t2-t1:.3f} s ({2/(t2-t1):.2f} GiB/s) ok={ok}", flush=True)
    e.close()
