"""One rank of a 2-rank job with the remote tier (gloo, FileStore rendezvous).

Usage: python _remote_dist.py PATH URL STEPS RANK WORLD INIT_FILE OUT [--resume|--lazy] [--replicated]
Trains STEPS steps (checkpoint every 2), waits for the remote, saves its final model state to
OUT/final-<rank>.pt. With --resume it first loads (local store, else the remote) and saves the
loaded state to OUT/loaded-<rank>.pt, printing "START step tier". With --lazy it restores from URL
with lazy=True instead (every rank its own part), runs a forward, waits, and saves the same."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def main(argv: list[str]) -> None:
    import logging
    import os

    import pccheck

    if os.environ.get("PCCHECK_TEST_LOG"):
        logging.basicConfig(level=logging.INFO, format=f"r{argv[3]} %(relativeCreated)d %(message)s")

    path, url, steps, rank, world, init, out = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4]), \
        argv[5], argv[6]
    torch.manual_seed(7)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if "--lazy" in argv:  # every local store is gone: each rank restores its own part lazily
        r = pccheck.load_latest(url, model=model, optimizer=optim, lazy=True)
        assert isinstance(r, pccheck.LazyRestore)
        model(torch.zeros(1, 16))  # a forward waits only for what it needs
        r.wait()
        print(f"START {r.step} lazy", flush=True)
        torch.save(model.state_dict(), f"{out}/loaded-{rank}.pt")
        dist.destroy_process_group()
        return
    if "--resume" in argv:
        r = pccheck.load_latest(path, model=model, optimizer=optim, remote=url)
        print(f"START {r.step} {r.tier}", flush=True)
        torch.save(model.state_dict(), f"{out}/loaded-{rank}.pt")
        dist.destroy_process_group()
        return
    ck = pccheck.Checkpointer(model, optim, path=path, interval=2, remote=url,
                              replicated="rank0" if "--replicated" in argv else None)
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(8, 16, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), torch.cos(x))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        ck.maybe_checkpoint(step)
    ck.wait()
    done = ck.wait(remote=True, timeout=120)
    print(f"REMOTE {done} {ck.stats().remote_step}", flush=True)
    ck.close()
    torch.save(model.state_dict(), f"{out}/final-{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
