"""A training loop that flushes on a preemption notice, for the preemption tests.

Usage: python _preempt_child.py PATH [--memory DIR] [--remote URL] [--disk-every K] [--grace S]
       [--url URL] [--poll S] [--no-signal] [--chain] [--mib M] [--sleep S] [--steps N] [--dist]
       [--grace-by-rank S0,S1,...] [--train] [--keep-going]

The state is one float32 array (M MiB) filled with the step number at every step, so a loaded
checkpoint's values say which step's state it holds. Prints "STEP n" once maybe_checkpoint(n)
returned. --chain installs a Python SIGTERM handler before the Checkpointer's (chained): it prints
"PREVIOUS" and the last flush as "FLUSH <json>" and exits 3. Without it, a default SIGTERM ends the
process after the flush. With --url and --no-signal the loop stops once ck.preempted is set and the
flush has ended, and prints the flush (--keep-going: it prints the flush and trains on, until it is
killed). --dist: a torch.distributed (gloo) rank under torchrun.

--train: the state is a training step's instead ({"w", "m", "step"}: weights, a momentum and the
step, updated in place from a per-step seeded gradient, see ``advance``), so a loaded step can be
compared bit for bit with ``train_state``'s recomputation of that step from scratch.
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


def say(line: str) -> None:
    """One line in one write: the ranks of a job share torchrun's stdout, and print() writes the
    line and its newline apart (unbuffered), so two ranks' lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def advance(state: dict, step: int, rank: int = 0) -> None:
    """One training step, in place: momentum SGD on a gradient seeded by (rank, step)."""
    g = np.random.default_rng((rank, step)).standard_normal(state["w"].shape[0], dtype=np.float32)
    state["m"] *= np.float32(0.9)
    state["m"] += g
    state["w"] -= np.float32(0.01) * state["m"]
    state["step"][0] = step


def fresh_state(mib: float) -> dict:
    n = int(mib * (1 << 20)) // 8  # w and m: mib MiB together
    return {"w": np.zeros(n, np.float32), "m": np.zeros(n, np.float32), "step": np.zeros(1, np.int64)}


def train_state(step: int, mib: float, rank: int = 0) -> dict:
    """The state after ``step`` steps, recomputed from scratch."""
    state = fresh_state(mib)
    for s in range(1, step + 1):
        advance(state, s, rank)
    return state


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
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--keep-going", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(relativeCreated)d %(message)s")
    logging.getLogger("pccheck").setLevel(os.environ.get("PCCHECK_TEST_LOG", "WARNING"))  # DEBUG: every step

    import pccheck

    ck_box: list = []
    if a.chain:
        def previous(signum, frame):
            say("PREVIOUS")
            say("FLUSH " + json.dumps(ck_box[0].stats().flush))
            os._exit(3)
        signal.signal(signal.SIGTERM, previous)
    path = a.path
    if a.dist:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    state = fresh_state(a.mib) if a.train else {"w": np.zeros(int(a.mib * (1 << 20)) // 4, dtype=np.float32)}
    w = state["w"]
    kw = {}
    if a.memory:
        kw["memory"] = pccheck.MemoryOptions(every=1, dir=a.memory)
    if a.remote:
        kw["remote"] = pccheck.RemoteOptions(url=a.remote, every=a.remote_every)
    ck = pccheck.Checkpointer(state, path, disk=pccheck.DiskOptions(every=a.disk_every), **kw)
    ck_box.append(ck)
    grace = float(a.grace_by_rank.split(",")[rank]) if a.grace_by_rank else a.grace
    ck.on_preemption(grace_s=grace, signals=() if a.no_signal else (signal.SIGTERM,), notice_url=a.url,
                     poll_s=a.poll)
    say("READY")
    flushed = False
    for step in range(1, a.steps + 1):
        if a.train:
            time.sleep(a.sleep / 2)  # a notice lands anywhere in a step: before, inside, after the update
            advance(state, step, rank)
        else:
            w[:] = step  # the "training step"
        if a.dist:
            import torch
            import torch.distributed as dist

            t = torch.ones(1)
            dist.all_reduce(t)  # the ranks step together, as data-parallel training does
        time.sleep(a.sleep / 2 if a.train else a.sleep)
        ck.maybe_checkpoint(step)
        say(f"STEP {step}")
        if ck.preempted and a.no_signal and not flushed:
            while ck.stats().flush is None:  # the flush runs on a thread of pccheck's
                time.sleep(0.01)
            say("FLUSH " + json.dumps(ck.stats().flush))
            flushed = True
            if not a.keep_going:
                break
    ck.close()
    if a.dist:
        from _leave import leave

        leave()


if __name__ == "__main__":
    main()
