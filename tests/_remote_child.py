"""A child for the remote tier's kill tests: commits step 1 remotely, then is SIGKILLed at one
point of step 2's remote commit (FORMAT.md §12.2): "parts" (after one part was sent), "manifest"
(every part sent, before the step manifest) or "pointer" (manifest written, before the pointer).
The kill is injected by wrapping the client's methods in this process; the server is real.
Usage: python _remote_child.py PATH URL MODE"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

import pccheck
from pccheck.tiers.remote import objstore

N = 5 << 19  # 10 MiB of float32: two parts of 8 MiB (the last one short)


def state_at(step: int) -> dict[str, np.ndarray]:
    return {"w": np.full(N, step, dtype=np.float32), "i": np.arange(7, dtype=np.int64) * step}  # test_remote._arrays


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main(path: str, url: str, mode: str) -> None:
    state = state_at(1)
    ck = pccheck.Checkpointer(state, path, remote=url, remote_part_size=8 << 20, remote_concurrency=1)
    ck.checkpoint(1)
    assert ck.wait(remote=True, timeout=60)
    print("REMOTE 1", flush=True)
    store = objstore.ObjectStore
    if mode == "parts":
        orig_part = store.upload_part

        def upload_part(self, rel, upload_id, number, data, **kw):
            etag = orig_part(self, rel, upload_id, number, data, **kw)
            _kill()  # one part is on the server, the rest never will be
            return etag
        store.upload_part = upload_part
    elif mode == "manifest":
        orig_new = store.put_new

        def put_new(self, rel, body):
            if rel.startswith("manifests/"):
                _kill()
            return orig_new(self, rel, body)
        store.put_new = put_new
    elif mode == "pointer":
        orig_swap = store.put_swap

        def put_swap(self, rel, body, etag):
            _kill()
        store.put_swap = put_swap
    for k, v in state_at(2).items():
        state[k][...] = v
    ck.checkpoint(2)
    ck.wait(remote=True, timeout=60)
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
