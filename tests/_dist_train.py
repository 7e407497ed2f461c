"""One rank of a small DDP job for the distributed tests.

Usage: python _dist_train.py PATH STEPS INTERVAL RANK WORLD INIT_FILE [--resume] [--final FILE] [--sleep S]
Prints "START s" and "LOSS step value" lines, flushed; with --sleep, pauses S seconds after each
(so that a test's kill lands at the step it chose).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from _leave import leave


def main(argv: list[str]) -> None:
    import pccheck

    path, steps, interval, rank, world, init_file = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), \
        int(argv[4]), argv[5]
    pause = float(argv[argv.index("--sleep") + 1]) if "--sleep" in argv else 0.0
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(256, 16))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    if "--resume" in argv:
        try:
            start = pccheck.load_latest(path, model=model, optimizer=optim).step
        except pccheck.NoCheckpointError:
            start = 0
    if start == 0:
        torch.manual_seed(1000 + rank)  # each rank's dropout stream; on resume it comes from the checkpoint
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # DDP rebuilds its gradient buckets after the first backward, which changes how gradients
    # are laid out in the allreduce; with more than 2 ranks that changes the order of the sums.
    # A warm-up backward that changes no state (eval mode, RNG forked, grads dropped) makes a
    # fresh and a resumed run use the same buckets from their first real step on.
    with torch.random.fork_rng():
        model.eval()
        ddp(torch.zeros(2, 16)).sum().backward()
        model.train()
    optim.zero_grad(set_to_none=True)
    ck = pccheck.Checkpointer(model, optim, path=path, interval=interval, max_concurrent=2, chunk_size=64 << 10)
    print(f"START {start}", flush=True)
    for step in range(start + 1, steps + 1):
        g = torch.Generator().manual_seed(step * 100 + rank)
        x = torch.randn(32, 16, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), torch.cos(x))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        ck.maybe_checkpoint(step)
        print(f"LOSS {step} {loss.item()!r}", flush=True)
        time.sleep(pause)
    ck.close()
    if "--final" in argv:
        torch.save(model.state_dict(), argv[argv.index("--final") + 1])
    leave()


if __name__ == "__main__":
    main(sys.argv[1:])
