"""256 MiB over gloo on loopback received into fresh memory vs into touched memory (why the peer
restore prefaults its receive buffer). Two ranks: RANK=0/1 PORT=... python bench/analysis/loopback_recv_fresh_vs_touched.py."""
import os, sys, time, json, mmap, statistics
from datetime import timedelta
import numpy as np, torch, torch.distributed as dist
sys.path.insert(0, os.environ.get("PCCHECK_TREE", "."))
from pccheck.tiers.memory import wire
from pccheck.persist.reader import fresh_buffer, crc32c

SIZE = 256 << 20
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}", rank=rank, world_size=2)
pg = dist.new_group(backend="gloo")
shm = f"/dev/shm/pccheck-analysis-link-{rank}"
with open(shm, "wb") as f:
    f.write(np.random.default_rng(rank).integers(0, 255, SIZE, dtype=np.uint8).tobytes())
src_anon = np.ones(SIZE, dtype=np.uint8)

def own_load():
    # like rank 0's own restore from memory: read the tmpfs file into fresh memory, crc
    buf = fresh_buffer(SIZE)
    with open(shm, "rb", buffering=0) as f:
        v = memoryview(buf); d = 0
        while d < SIZE:
            n = os.preadv(f.fileno(), [v[d:d + (8 << 20)]], d); crc32c(v[d:d + n]); d += n

def variant(name, chunk, window, dst_kind, src_kind, check, busy):
    wire.WIRE_CHUNK, wire.WINDOW = chunk, window
    if rank == 0:
        if src_kind == "mmap":
            f = open(shm, "rb", buffering=0); mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            view = np.frombuffer(mm, dtype=np.uint8, count=SIZE)
        else:
            view = src_anon
    else:
        dst = {"fresh_thp": lambda: fresh_buffer(SIZE), "np_empty": lambda: np.empty(SIZE, np.uint8),
               "touched": lambda: TOUCHED}[dst_kind]()
    th = None
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    if rank == 0:
        if busy:
            import threading
            th = threading.Thread(target=own_load); th.start()
        if chunk == 0:
            dist.send(torch.from_numpy(view), 1)
        else:
            wire.send_bytes(pg, 1, view, 7, 60)
        if th: th.join()
    else:
        on = None
        if check:
            st = {"c": 0}
            def on(off, n): st["c"] = crc32c(memoryview(dst[off:off + n]), st["c"])
        if chunk == 0:
            dist.recv(torch.from_numpy(dst), 0)
            if check: crc32c(memoryview(dst))
        else:
            wire.recv_bytes(pg, 0, dst, 7, 60, on_chunk=on)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    dist.barrier()
    if rank == 0 and src_kind == "mmap":
        del view; mm.close(); f.close()
    return dt, dc

TOUCHED = np.ones(SIZE, dtype=np.uint8) if rank == 1 else None
V = [  # name, chunk, window, dst, src, check, busy
    ("raw_single_np_empty", 0, 0, "np_empty", "anon", False, False),
    ("raw_single_touched", 0, 0, "touched", "anon", False, False),
    ("raw_single_thp", 0, 0, "fresh_thp", "anon", False, False),
    ("chunk16x4_touched", 16 << 20, 4, "touched", "anon", False, False),
    ("chunk16x4_thp", 16 << 20, 4, "fresh_thp", "anon", False, False),
    ("chunk16x4_thp_mmap", 16 << 20, 4, "fresh_thp", "mmap", False, False),
    ("chunk16x4_thp_mmap_crc", 16 << 20, 4, "fresh_thp", "mmap", True, False),
    ("chunk16x4_thp_mmap_crc_busy", 16 << 20, 4, "fresh_thp", "mmap", True, True),
    ("chunk64x2_touched", 64 << 20, 2, "touched", "anon", False, False),
    ("chunk4x8_touched", 4 << 20, 8, "touched", "anon", False, False),
    ("chunk256x1_touched", 256 << 20, 1, "touched", "anon", False, False),
]
only = os.environ.get("ONLY")
if only: V = [v for v in V if v[0] in only.split(",")]
res = {v[0]: [] for v in V}
for rep in range(int(os.environ.get("REPS", 3))):
    for v in V:
        res[v[0]].append(variant(*v))
if rank == 1:
    for k, xs in res.items():
        print(f"{k:32s} wall {statistics.median(x[0] for x in xs):.3f} [{min(x[0] for x in xs):.3f}-{max(x[0] for x in xs):.3f}]  cpu(r1) {statistics.median(x[1] for x in xs):.3f}", flush=True)
else:
    for k, xs in res.items():
        print(f"R0 {k:29s} cpu(r0) {statistics.median(x[1] for x in xs):.3f}", file=sys.stderr, flush=True)
os.unlink(shm)
dist.destroy_process_group()
