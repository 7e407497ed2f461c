"""bench.remote's DCP row, in a process of its own: ``dcp.async_save`` with ``FsspecWriter`` (s3fs).

    PYTHONPATH=S3FS_DIR:. python -m bench.remote_dcp_child SIZE ITER_TIME EVERY ITERS URL

s3fs pins a botocore older than the one boto3 (the remote tier's client) needs, so it lives in a
directory of its own (``pip install --target S3FS_DIR s3fs``) put first on this process's path
only. Prints one JSON object: the loop with no checkpoint, the loop with one ``async_save`` in
flight (a save first waits for the previous one, as users write it), each save's time from the
call until its upload completed, and a cold load with ``FsspecReader``. The GPU is emulated as in
bench/workloads.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from bench.harness.common import parse_size
    from bench.harness.workloads import make_emulated

    warnings.filterwarnings("ignore")
    size, t, every, iters, url = parse_size(argv[0]), float(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    opts = {"client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}}
    wl = make_emulated(size, t)
    wl.step()
    t0 = time.perf_counter()
    for _ in range(iters):
        wl.step()
    none = time.perf_counter() - t0
    calls: dict[int, float] = {}
    done: dict[int, float] = {}
    fut = None
    t0 = time.perf_counter()
    for step in range(1, iters + 1):
        wl.step()
        if step % every == 0:
            if fut is not None:
                fut.result()  # one in flight
            calls[step] = time.time()
            fut = dcp.async_save(wl.model.state_dict(), storage_writer=FsspecWriter(f"{url}/dcp-{step}", **opts),
                                 no_dist=True)
            fut.add_done_callback(lambda f, s=step: done.__setitem__(s, time.time()))
    wall = time.perf_counter() - t0
    fut.result()
    last = max(calls)
    sd = {k: torch.empty_like(v) for k, v in wl.model.state_dict().items()}
    t0 = time.perf_counter()
    dcp.load(sd, storage_reader=FsspecReader(f"{url}/dcp-{last}", **opts), no_dist=True)
    wl.model.load_state_dict(sd)
    load_s = time.perf_counter() - t0
    print(json.dumps({"none_wall_s": none, "wall_s": wall, "saves": len(calls),
                      "to_remote_s": [done[s] - calls[s] for s in sorted(done)],
                      "upload_gbps": [size / (done[s] - calls[s]) / 1e9 for s in sorted(done)],
                      "cold_load_s": load_s}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
