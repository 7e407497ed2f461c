"""The cluster-loss child: trains _torch_train's model with the remote tier, printing "LOSS step
value" and "REMOTE step" (the newest remotely committed step) per step; with --resume it loads
from the local store, falling back to the remote (the local one was deleted), and continues in the
same prefix. Usage: python _remote_train.py PATH URL STEPS [--resume] [--final FILE]"""

from __future__ import annotations

import sys

import torch

import _torch_train as tt
import pccheck


def main(argv: list[str]) -> None:
    path, url, steps = argv[0], argv[1], int(argv[2])
    tt.setup()
    model, optim, sched = tt.make(width=64)
    start = 0
    if "--resume" in argv:
        r = pccheck.load_latest(path, model=model, optimizer=optim, extra_state={"sched": sched}, remote=url)
        start = r.step
        print(f"tier {r.tier}", flush=True)
    ck = pccheck.Checkpointer(model, optim, path=path, extra_state={"sched": sched}, interval=2, remote=url)
    print(f"START {start}", flush=True)
    for step in range(start + 1, steps + 1):
        loss = tt.train_step(model, optim, sched, step)
        ck.maybe_checkpoint(step)
        if step % 2 == 0:
            ck.wait(remote=True, timeout=60)  # so the parent can kill after a known remote step
        print(f"LOSS {step} {loss!r}", flush=True)
        print(f"REMOTE {ck.stats().remote_step}", flush=True)
    ck.close()
    if "--final" in argv:
        torch.save(model.state_dict(), argv[argv.index("--final") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
