"""One rank of a 2-rank job (gloo, FileStore) whose rank 1 lags: rank 0 commits steps 1-5 while
rank 1 stops after step 3, so the group's step is 3 while rank 0 ran ahead, changing array "b" at
steps 2, 4 and 5 (not 3). Both end by SIGKILL. For tests/test_incremental_group.py.

Usage: python _incr_lag_child.py MODE PATH RANK INIT_FILE

MODE "run" does the above; "load" loads the group's step and prints "LOADED step ok" (ok: every
array holds that step's values for this rank); "resume" loads it, then rank 0 commits steps 4
and 5 again (b changed) while rank 1 stops before them, and both end by SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from _leave import leave


def value(step: int) -> float:
    """Array b's value after ``step``: it changes at steps 2, 4 and 5."""
    return {1: 1.0, 2: 2.0, 3: 2.0, 4: 4.0, 5: 5.0}[step]


def main(mode: str, path: str, rank: int, init_file: str) -> None:
    import pccheck

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    m = torch.nn.Module()
    m.frozen = torch.nn.Parameter(torch.arange(20_000, dtype=torch.float32) + rank, requires_grad=False)
    m.b = torch.nn.Parameter(torch.zeros(5_000), requires_grad=False)
    m.a = torch.nn.Parameter(torch.zeros(3_000), requires_grad=False)
    if mode in ("load", "resume"):
        step = pccheck.load_latest(path, model=m).step
        ok = (torch.equal(m.b, torch.full((5_000,), value(step) + rank)) and torch.equal(m.a, torch.full((3_000,), step + rank))
              and torch.equal(m.frozen, torch.arange(20_000, dtype=torch.float32) + rank))
        print(f"LOADED {step} {ok}", flush=True)
        if mode == "load":
            leave()
        done = Path(path).parent / "rank0-resumed"
        ck = pccheck.Checkpointer(m, path=path, interval=1, incremental=True, max_concurrent=1)
        if rank == 1:
            while not done.exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        for again in (4, 5):  # two commits: between them they use every slot not held
            with torch.no_grad():
                m.b.fill_(value(again) + rank)
                m.a.fill_(again + rank)
            ck.maybe_checkpoint(again)
            ck.wait()
            print(f"COMMITTED {again}", flush=True)
        done.touch()
        os.kill(os.getpid(), signal.SIGKILL)
    done = Path(path).parent / "rank0-ran-ahead"
    ck = pccheck.Checkpointer(m, path=path, interval=1, incremental=True, max_concurrent=1)
    for step in range(1, 6):
        if rank == 1 and step == 4:
            while not done.exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        with torch.no_grad():
            m.b.fill_(value(step) + rank)
            m.a.fill_(step + rank)  # changes every step
        ck.maybe_checkpoint(step)
        ck.wait()
        print(f"COMMITTED {step}", flush=True)
    done.touch()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
