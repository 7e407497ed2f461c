"""One rank of a 2-rank job (gloo, FileStore rendezvous) whose flush gives up an older step's
remote upload in progress.

Usage: python _flush_supersede_child.py PATH URL RANK INIT_FILE

Each rank: 64 MiB of host state; the disk every step, the remote every 2 steps in 8 MiB parts
sent one at a time. Step 2 is waited for on the remote (an upload measured), step 4's upload then
runs while step 5 is committed, and ``ck.flush()`` asks for step 5. Prints "BEFORE <step>" (the
newest remote step just before the flush, on rank 0) and "FLUSH <json>" (the FlushResult).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch.distributed as dist


def main(argv: list[str]) -> None:
    import pccheck

    path, url, rank, init = argv[0], argv[1], int(argv[2]), argv[3]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    w = np.zeros(16 << 20, np.float32)
    ck = pccheck.Checkpointer({"w": w}, path, disk=pccheck.DiskOptions(every=1),
                              remote=pccheck.RemoteOptions(url=url, every=2, part_size=8 << 20, concurrency=1))
    for step in range(1, 6):
        w[:] = step * 10 + rank
        ck.maybe_checkpoint(step)
        if step == 2:
            ck.wait(remote=True, timeout=120)
    ck.wait()
    print("BEFORE", ck.stats().remote_step, flush=True)
    r = ck.flush(timeout=120)
    print("FLUSH", json.dumps(r.as_dict()), flush=True)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
