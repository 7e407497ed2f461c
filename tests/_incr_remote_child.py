"""A child for the incremental remote tier's kill test: commits steps 1 (in full) and 2 (the
changed arrays only) remotely, then is SIGKILLed during step 3's upload, once one part of it is
on the server. The kill is injected by wrapping the client's method in this process; the server
is real. Usage: python _incr_remote_child.py PATH URL"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import pccheck
from pccheck.tiers.remote import objstore

N = 3 << 20  # 12 MiB of float32 frozen: two parts of 8 MiB in step 1's object


def state_at(step: int) -> dict[str, np.ndarray]:
    return {"frozen": np.arange(N, dtype=np.float32), "adapter": np.full(5000, step, dtype=np.float32)}


def main(path: str, url: str) -> None:
    state = state_at(1)
    ck = pccheck.Checkpointer(state, path, incremental=True, interval=1, remote=url, remote_part_size=8 << 20,
                              remote_concurrency=1)
    for step in (1, 2):
        state["adapter"][:] = step
        ck.checkpoint(step)
        assert ck.wait(remote=True, timeout=60)
        print(f"REMOTE {ck.stats().remote['remote_step']}", flush=True)
    orig_part = objstore.ObjectStore.upload_part

    def upload_part(self, rel, upload_id, number, data, **kw):
        etag = orig_part(self, rel, upload_id, number, data, **kw)
        os.kill(os.getpid(), signal.SIGKILL)  # one part is on the server, the step never commits
        return etag

    objstore.ObjectStore.upload_part = upload_part
    state["adapter"][:] = 3
    ck.checkpoint(3)
    ck.wait(remote=True, timeout=60)
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
