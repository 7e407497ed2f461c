"""Child process for the crash-torture tests: trains forever, checkpointing every step.

Contents are a deterministic function of the step (see ``state_for``), so the parent can check
any recovered checkpoint byte for byte. After every checkpoint it prints ``DURABLE <step>`` when
``last_durable_step`` advanced, flushing at once, until it is SIGKILLed.
Usage: python _crash_child.py PATH STORAGE [incremental]
"""

from __future__ import annotations

import sys

import numpy as np


def state_for(step: int) -> dict:
    n = 40_000
    return {
        "w": (np.arange(n, dtype=np.float32) * 0.5 + step),
        "m": np.full((100, 37), step * 7, dtype=np.int64),
        "b": (np.arange(3 * 1024 + 5, dtype=np.uint16) + step).astype(np.uint16),
        "s": np.array(step, dtype=np.int64),
        "e": np.zeros((0, 3), dtype=np.float64),
        # arrays that change rarely or never: an incremental run references them
        "slow": np.arange(20_000, dtype=np.int32) + step // 4,
        "frozen": np.arange(30_000, dtype=np.float64),
    }


def fill(state: dict, step: int) -> None:
    for k, v in state_for(step).items():
        state[k][...] = v


def main() -> None:
    import pccheck

    path, storage = sys.argv[1], sys.argv[2]
    incremental = sys.argv[3:] == ["incremental"]
    try:
        start = pccheck.load_latest(path).step
    except pccheck.NoCheckpointError:
        start = 0
    state = state_for(start)
    ck = pccheck.Checkpointer(state, path=path, interval=1, max_concurrent=3, writer_threads=2,
                              chunk_size=64 << 10, storage=storage, incremental=incremental)
    print(f"READY {start} {ck.storage}", flush=True)
    last = None
    step = start
    while True:
        step += 1
        fill(state, step)
        ck.maybe_checkpoint(step)
        d = ck.last_durable_step
        if d != last:
            print(f"DURABLE {d}", flush=True)
            last = d


if __name__ == "__main__":
    main()
