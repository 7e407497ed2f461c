"""One rank of a small FSDP2 job saving and loading through torch.distributed.checkpoint with
pccheck.dcp (tests/test_dcp.py).

Usage: python _dcp_child.py MODE PATH RANK WORLD INIT_FILE OUT
  save      (WORLD 2) train and dcp.save twice, rank 0 writes the full state of the second save
            to OUT (torch.save, test side only); then a third save, in which rank 1 is SIGKILLed
            as its write_data begins (rank 0 commits its slot, the set stays incomplete)
  load      a fresh model of another seed, dcp.load, rank 0 writes the full state to OUT
  process   (WORLD 1) dcp.async_save with AsyncCheckpointerType.PROCESS, three times; writes
            the full state of the last save to OUT
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import pccheck.dcp

from _leave import leave


class _DiesInWrite(pccheck.dcp.Writer):
    """Fault injection: this rank is killed when its write_data begins (nothing committed)."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        os.kill(os.getpid(), signal.SIGKILL)


def _model(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(100 + step)
    x = torch.randn(6, 8)
    model(x).square().mean().backward()
    optim.step()
    optim.zero_grad()


def _state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def _full(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optim, options=opts)
    return {"model": msd, "optim": osd}


def main(mode: str, path: str, rank: int, world: int, init: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    if mode == "load":
        model, optim = _model(99, world)
        _train(model, optim, 0)  # creates the optimizer state the load fills
        sd = _state(model, optim)
        dcp.load(sd, storage_reader=pccheck.dcp.Reader(path))
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        full = _full(model, optim)
    elif mode == "process":
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        model, optim = _model(1, world)
        writer = pccheck.dcp.Writer(path, max_concurrent=2)
        for step in range(3):
            _train(model, optim, step)
            fut = dcp.async_save(_state(model, optim), storage_writer=writer,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS)
            fut.result()
        full = _full(model, optim)
    else:  # save
        model, optim = _model(1, world)
        writer = pccheck.dcp.Writer(path, max_concurrent=1)
        for step in range(2):
            _train(model, optim, step)
            dcp.save(_state(model, optim), storage_writer=writer)
        full = _full(model, optim)
        if rank == 0:
            torch.save(full, out)
        _train(model, optim, 2)
        if rank == 1:
            dcp.save(_state(model, optim), storage_writer=_DiesInWrite(path, max_concurrent=1))  # dies
        try:
            dcp.save(_state(model, optim), storage_writer=writer)
        except Exception:  # rank 1 died: the collective fails
            pass
        os._exit(0)  # the group is broken: skip its teardown
    if rank == 0:
        torch.save(full, out)
    dist.barrier()
    leave()  # every check is done and OUT is closed


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5])
