"""bench.preempt's training process: one system's loop until its SIGTERM (sent by bench.preempt).

    python -m bench.preempt_child pccheck|dcp SIZE ITER_TIME DIR MEMDIR URL GRACE

The state: ``w`` (SIZE bytes of float32) and ``step`` (int64). A step sleeps ITER_TIME (the
emulated GPU), then writes the step's number into the first 1/16 of ``w``, then into ``step``:
two writes, so a state copied between them is torn (``w[0] != step``), as a real step's would
be. Prints "STEP n" once step n's checkpoint call returned, then one "RESULT <json>" when its
SIGTERM handler is done, and exits.

* ``pccheck``: memory tier every step (MEMDIR), disk every 50 steps (DIR), the remote tier (URL)
  uploading each disk checkpoint; ``ck.on_preemption(grace_s=GRACE)`` flushes on SIGTERM, then
  runs the handler installed before it (this module's: it prints the FlushResult).
* ``dcp``: ``torch.distributed.checkpoint.async_save`` to DIR every 50 steps (one in flight; the
  remote is not involved: DCP writes the local disk here), and the user's own SIGTERM handler:
  it waits for the save in flight, calls ``async_save`` of the live state, waits for it to be
  durable, and prints the step it saved and whether the state it copied was torn.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

EVERY = 50


def main(argv: list[str]) -> int:
    system, size, iter_time, where, mem, url, grace = argv[0], int(argv[1]), float(argv[2]), argv[3], argv[4], \
        argv[5], float(argv[6])
    state = {"w": np.zeros(size // 4, np.float32), "step": np.zeros(1, np.int64)}
    head = state["w"][: max(1, state["w"].shape[0] // 16)]
    state["w"][:] = 0.5  # touched once, outside the loop
    save = _pccheck(state, where, mem, url, grace) if system == "pccheck" else _dcp(state, where)
    print("READY", flush=True)
    step = 0
    while True:
        step += 1
        time.sleep(iter_time)
        head[:] = step          # the step's update: two writes
        state["step"][0] = step
        save(step)
        print(f"STEP {step}", flush=True)


def _pccheck(state: dict, where: str, mem: str, url: str, grace: float):
    import logging

    import pccheck

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    box: list = []

    def previous(signum, frame) -> None:  # the user's handler, run by pccheck after its flush
        flush = box[0].stats().flush
        # the remote uploads: (step, local commit time, remote commit time, bytes, upload seconds)
        ups = [list(h) for h in box[0]._remote.progress.history]
        print("RESULT " + json.dumps({"flush": flush, "uploads": ups}), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, previous)
    ck = pccheck.Checkpointer(state, where, disk=pccheck.DiskOptions(every=EVERY),
                              memory=pccheck.MemoryOptions(every=1, dir=mem),
                              remote=pccheck.RemoteOptions(url=url, every=1, keep_last=1))
    box.append(ck)
    ck.on_preemption(grace_s=grace)
    return ck.maybe_checkpoint


def _dcp(state: dict, where: str):
    import torch
    import torch.distributed.checkpoint as dcp

    sd = {k: torch.from_numpy(v) for k, v in state.items()}  # views: the live state
    inflight: list = [None, None]  # the future, its step
    durable: list[int] = []

    def save(step: int) -> None:
        if step % EVERY:
            return
        if inflight[0] is not None:
            inflight[0].result()
            durable.append(inflight[1])
        inflight[0], inflight[1] = dcp.async_save(sd, checkpoint_id=os.path.join(where, f"step-{step}"),
                                                  no_dist=True), step

    def handler(signum, frame) -> None:  # the user's own: save now, then exit
        t0 = time.monotonic()
        if inflight[0] is not None:
            inflight[0].result()
            durable.append(inflight[1])
        step = int(state["step"][0])
        torn = bool(state["w"][0] != step)
        fut = dcp.async_save(sd, checkpoint_id=os.path.join(where, f"sigterm-{step}"), no_dist=True)
        staged = time.monotonic() - t0
        fut.result()
        print("RESULT " + json.dumps({"step": step, "torn": torn, "staged_s": staged,
                                      "durable_s": time.monotonic() - t0,
                                      "periodic": max(durable, default=None)}), flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, handler)
    return save


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
