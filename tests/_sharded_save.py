"""Saves a small DTensor model (Shard(0) and plain parameters on a CPU mesh of one gloo rank:
a sharded checkpoint, FORMAT.md §9) to BASE/ck, with the memory tier in BASE/mem and, when URL
is not empty, the remote tier at URL; its full model state to BASE/ref.pt.

Usage: python _sharded_save.py BASE URL
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(base: str, url: str) -> None:
    import pccheck
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{base}/init", rank=0, world_size=1)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Linear(9, 5))
    mesh = init_device_mesh("cpu", (1,))
    for name, p in list(m[0].named_parameters()):
        setattr(m[0], name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
    o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    o.step()
    remote = {"remote": url} if url else {}
    with pccheck.Checkpointer(m, o, f"{base}/ck", interval=1, memory_interval=1, memory_dir=f"{base}/mem",
                              **remote) as ck:
        ck.maybe_checkpoint(1)
        if url:
            assert ck.wait(remote=True, timeout=120)
    torch.save({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in m.state_dict().items()},
               f"{base}/ref.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
