"""One rank of a 2-rank job (torchrun on localhost, gloo) with the memory, disk and remote tiers,
for the per-rank restore plan tests (tests/test_restore_plan.py).

Usage: torchrun --standalone --nproc-per-node=2 _plan_child.py KIND BASE URL STEPS [--resume]

KIND: "plain" (an MLP, AdamW) or "fsdp" (_sharded_child's FSDP2 model on a CPU mesh of both
ranks: sharded state). Rank r keeps its disk store under BASE/rank-r/disk and its memory tier
under BASE/rank-r/mem (replicas=1: no peer holds a replica of it), and uploads to URL.

Without --resume: trains STEPS steps, a memory checkpoint every step and a disk one (uploaded to
URL) every STEPS steps, waits for the remote, and saves the state (model and optimizer; FSDP:
gathered to full tensors) to BASE/final-<r>.pt. With --resume: load_latest(disk,
memory_dir=mem, remote=URL), prints "START step tier", and saves the loaded state to
BASE/loaded-<r>.pt the same way. Before it, both ranks print "REFUSED <message>" for a lazy
load from the local store; after it (plain) rank 0 alone prints "REFUSED <message>" for
zero_copy= on its rank store and "SOLO step tier" for distributed=False on it.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from _leave import leave
from _sharded_child import build, full_state, step


def _plain() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _state(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer, world: int) -> dict[str, torch.Tensor]:
    if kind == "fsdp":
        return full_state(model, opt, world)
    flat = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        flat.update({f"optim.{i}.{k}": v.detach().clone() for k, v in st.items()})
    return flat


def main(argv: list[str]) -> None:
    import pccheck

    kind, base, url, steps = argv[0], argv[1], argv[2], int(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    disk, mem = f"{base}/rank-{rank}/disk", f"{base}/rank-{rank}/mem"
    model, opt = build("fsdp", world) if kind == "fsdp" else _plain()
    if "--resume" in argv:
        try:  # the group-only rows of REFUSED, before anything is read
            pccheck.load_latest(disk, model=model, lazy=True, remote=url)
        except pccheck.ConfigError as exc:
            print(f"REFUSED {exc}", flush=True)
        r = pccheck.load_latest(disk, model=model, optimizer=opt, memory_dir=mem, remote=url)
        print(f"START {r.step} {r.tier}", flush=True)
        torch.save(_state(kind, model, opt, world), f"{base}/loaded-{rank}.pt")
        if rank == 0 and kind == "plain":  # rank 0 alone: no collective may run
            try:
                pccheck.load_latest(disk, zero_copy=True)
            except pccheck.ConfigError as exc:
                print(f"REFUSED {exc}", flush=True)
            solo = pccheck.load_latest(f"{disk}/rank-0", distributed=False)
            print(f"SOLO {solo.step} {solo.tier}", flush=True)
        leave()
    ck = pccheck.Checkpointer(model, opt, path=disk, interval=steps, memory_interval=1, memory_dir=mem,
                              replicas=1, remote=url)
    for s in range(1, steps + 1):
        if kind == "fsdp":
            step("fsdp", model, opt, s)
        else:
            g = torch.Generator().manual_seed(s * 100 + rank)
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), torch.cos(x))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        ck.maybe_checkpoint(s)
    ck.wait()
    done = ck.wait(remote=True, timeout=120)
    print(f"REMOTE {done} {ck.stats().remote_step}", flush=True)
    ck.close()
    torch.save(_state(kind, model, opt, world), f"{base}/final-{rank}.pt")
    leave()


if __name__ == "__main__":
    main(sys.argv[1:])
