"""A training loop whose data position and RNG states go through pccheck, for tests/test_data_position.py.

Usage:
  python _loader_child.py stateful PATH LOG STEPS   one process: a torchdata StatefulDataLoader
                                                    (2 workers, shuffled) in extra_state
  torchrun ... _loader_child.py sampler PATH LOG EPOCHS   each rank: a DistributedSampler wrapped
                                                    in pccheck.ResumableSampler, a DataLoader with 2 workers
  torchrun ... _loader_child.py rng-save PATH KIND  each rank seeds its RNGs by rank, checkpoints,
                                                    then prints the next draws ("DRAWS <json>")
  torchrun ... _loader_child.py rng-load PATH KIND  each rank seeds alike, loads, prints the next draws

stateful/sampler resume from the newest checkpoint when there is one ("RESUMED step") and append
"step index,index,..." for every batch consumed to LOG (LOG.<rank> for sampler). Each step is
checkpointed (interval 1). KIND: "plain" (each rank a whole model) or "fsdp" (FSDP2 on a CPU mesh).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import numpy as np
import torch

import pccheck


class Items(torch.utils.data.Dataset):
    """Item i is i: a batch names the items it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)



def _say(line: str) -> None:
    """One line in one write(2): two ranks share torchrun's stdout, and print() writes the text and
    its newline separately, so their lines could interleave ("RESUMED 6RESUMED 6")."""
    os.write(1, (line + "\n").encode())

def _log(fd: int, step: int, batch: torch.Tensor) -> None:
    os.write(fd, f"{step} {','.join(str(int(i)) for i in batch)}\n".encode())  # O_APPEND: one write a line


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> None:
    loss = (model(batch.float().unsqueeze(1)) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _resume(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict) -> int:
    try:
        step = pccheck.load_latest(path, model=model, optimizer=opt, extra_state=extra).step
    except pccheck.NoCheckpointError:
        return 0
    _say(f"RESUMED {step}")
    return step


def stateful(path: str, log: str, steps: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = StatefulDataLoader(Items(37), batch_size=4, shuffle=True, num_workers=2,
                                generator=torch.Generator().manual_seed(5))
    step = _resume(path, model, opt, {"loader": loader})
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with pccheck.Checkpointer(model, opt, path, interval=1, extra_state={"loader": loader}) as ck:
        while step < steps:
            for batch in loader:
                step += 1
                _log(fd, step, batch)
                _train(model, opt, batch)
                ck.maybe_checkpoint(step)
                time.sleep(0.01)
                if step == steps:
                    break
    _say("DONE")


def sampler(path: str, log: str, epochs: int) -> None:
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    s = pccheck.ResumableSampler(DistributedSampler(Items(29), shuffle=True, seed=3))
    loader = DataLoader(Items(29), batch_size=3, sampler=s, num_workers=2)
    step = _resume(path, model, opt, {"sampler": s})
    fd = os.open(f"{log}.{rank}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    with pccheck.Checkpointer(model, opt, path, interval=1, extra_state={"sampler": s}) as ck:
        for epoch in range(s.epoch, epochs):
            s.set_epoch(epoch)
            for batch in loader:
                s.advance(len(batch))
                step += 1
                _log(fd, step, batch)
                _train(model, opt, batch)
                ck.maybe_checkpoint(step)
                time.sleep(0.01)
    _say("DONE")
    from _leave import leave

    leave()


def _seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)


def _draws() -> dict:
    d = {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(3).tolist()}
    if torch.cuda.is_available():
        d["cuda"] = torch.rand(3, device="cuda").tolist()
    return d


def rng(mode: str, path: str, kind: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    if torch.cuda.is_available():
        torch.cuda.init()  # its states are captured only once CUDA is initialised
    if mode == "rng-save":
        _seed(100 + rank)
        _draws()  # the streams move on before the checkpoint
        with pccheck.Checkpointer(model, opt, path) as ck:
            ck.checkpoint(1)
            ck.wait()
        _say(f"DRAWS {json.dumps(_draws())}")
    else:
        _seed(7)  # every rank alike: only the load can make them differ again
        pccheck.load_latest(path, model=model, optimizer=opt)
        _say(f"DRAWS {json.dumps(_draws())}")
    from _leave import leave

    leave()


if __name__ == "__main__":
    # A rank whose peer was SIGKILLed can wait in a collective for a long time (gloo polls):
    # no test child outlives its test, whatever happened to the others.
    import threading
    watchdog = threading.Timer(300, os._exit, (4,))
    watchdog.daemon = True  # a child that ends normally does not wait for it
    watchdog.start()
    mode = sys.argv[1]
    torch.set_num_threads(1)
    if mode == "stateful":
        stateful(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif mode == "sampler":
        sampler(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        rng(mode, sys.argv[2], sys.argv[3])
