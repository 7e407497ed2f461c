"""A training loop that flushes on a preemption notice, for the preemption tests.

Usage: python _preempt_child.py PATH [--memory DIR] [--remote URL] [--disk-every K] [--grace S]
       [--url URL] [--poll S] [--no-signal] [--chain] [--mib M] [--sleep S] [--steps N] [--dist]
       [--grace-by-rank S0,S1,...]

The state is one float32 array (M MiB) filled with the step number at every step, so a loaded
checkpoint's values say which step's state it holds. Prints "STEP n" once maybe_checkpoint(n)
returned. --chain installs a Python SIGTERM handler before the Checkpointer's (chained): it prints
"PREVIOUS" and the last flush as "FLUSH <json>" and exits 3. Without it, a default SIGTERM ends the
process after the flush. With --url and --no-signal the loop stops once ck.preempted is set and the
flush has ended, and prints the flush. --dist: a torch.distributed (gloo) rank under torchrun.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--memory")
    ap.add_argument("--remote")
    ap.add_argument("--remote-every", type=int, default=1000)
    ap.add_argument("--disk-every", type=int, default=50)
    ap.add_argument("--grace", type=float, default=20.0)
    ap.add_argument("--grace-by-rank", help="comma-separated grace_s per rank (a group)")
    ap.add_argument("--url")
    ap.add_argument("--poll", type=float, default=0.1)
    ap.add_argument("--no-signal", action="store_true")
    ap.add_argument("--chain", action="store_true")
    ap.add_argument("--mib", type=float, default=1.0)
    ap.add_argument("--sleep", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--dist", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import pccheck

    ck_box: list = []
    if a.chain:
        def previous(signum, frame):
            print("PREVIOUS", flush=True)
            print("FLUSH " + json.dumps(ck_box[0].stats().flush), flush=True)
            os._exit(3)
        signal.signal(signal.SIGTERM, previous)
    path = a.path
    if a.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    w = np.zeros(int(a.mib * (1 << 20)) // 4, dtype=np.float32)
    kw = {}
    if a.memory:
        kw["memory"] = pccheck.MemoryOptions(every=1, dir=a.memory)
    if a.remote:
        kw["remote"] = pccheck.RemoteOptions(url=a.remote, every=a.remote_every)
    ck = pccheck.Checkpointer({"w": w}, path, disk=pccheck.DiskOptions(every=a.disk_every), **kw)
    ck_box.append(ck)
    grace = float(a.grace_by_rank.split(",")[int(os.environ["RANK"])]) if a.grace_by_rank else a.grace
    ck.on_preemption(grace_s=grace, signals=() if a.no_signal else (signal.SIGTERM,), notice_url=a.url,
                     poll_s=a.poll)
    print("READY", flush=True)
    for step in range(1, a.steps + 1):
        w[:] = step  # the "training step"
        if a.dist:
            import torch
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)  # the ranks step together, as data-parallel training does
        time.sleep(a.sleep)
        ck.maybe_checkpoint(step)
        print(f"STEP {step}", flush=True)
        if ck.preempted and a.no_signal:
            while ck.stats().flush is None:  # the flush runs on a thread of pccheck's
                time.sleep(0.01)
            print("FLUSH " + json.dumps(ck.stats().flush), flush=True)
            break
    ck.close()
    if a.dist:
        from _leave import leave

        leave()


if __name__ == "__main__":
    main()
