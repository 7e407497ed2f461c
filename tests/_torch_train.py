"""A small deterministic training run for the PyTorch tests (and their child processes).

The model has BatchNorm (buffers that forward changes), dropout (consumes the global torch RNG),
tied weights (one Parameter in two places), AdamW and an LR scheduler. Batches come from a
per-step generator, so the data order never depends on the global RNG state.
Usage as a child: python _torch_train.py PATH STEPS INTERVAL [--resume] [--no-rng] [--final FILE]
prints "LOSS step value" per step, flushed.
"""

from __future__ import annotations

import sys

import torch


def setup() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(1234)


class Net(torch.nn.Module):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(32, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(0.3)
        self.mid = torch.nn.Linear(width, width)
        self.mid2 = torch.nn.Linear(width, width)
        self.mid2.weight = self.mid.weight  # tied: one Parameter, two places in the state_dict
        self.head = torch.nn.Linear(width, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.embed(x))))
        h = torch.relu(self.mid2(torch.relu(self.mid(h))))
        return self.head(h)


def make(width: int = 512, opt: str = "adamw"):
    model = Net(width)
    if opt == "adamw":
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    elif opt == "adam_foreach":
        optim = torch.optim.Adam(model.parameters(), lr=3e-3, foreach=True)
    elif opt == "adam_loop":
        optim = torch.optim.Adam(model.parameters(), lr=3e-3, foreach=False)
    elif opt == "adamw_fused":
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    elif opt == "sgd_momentum":
        optim = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        raise ValueError(opt)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.7)
    return model, optim, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(64, 32, generator=g)
    return x, torch.sin(x * 1.5)


def train_step(model, optim, sched, step: int, xy: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """One step on ``xy`` (default: this file's batch of ``step``); returns the loss."""
    model.train()
    x, y = xy if xy is not None else batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()
    sched.step()
    return loss.item()


def main(argv: list[str]) -> None:
    import pccheck

    path, steps, interval = argv[0], int(argv[1]), int(argv[2])
    setup()
    model, optim, sched = make()
    start = 0
    if "--resume" in argv:
        try:
            start = pccheck.load_latest(path, model=model, optimizer=optim, extra_state={"sched": sched}).step
        except pccheck.NoCheckpointError:
            start = 0  # killed before the first checkpoint was durable: start over
    ck = pccheck.Checkpointer(model, optim, path=path, extra_state={"sched": sched}, interval=interval,
                              max_concurrent=3, chunk_size=64 << 10, capture_rng="--no-rng" not in argv)
    print(f"START {start}", flush=True)
    for step in range(start + 1, steps + 1):
        loss = train_step(model, optim, sched, step)
        ck.maybe_checkpoint(step)
        print(f"LOSS {step} {loss!r}", flush=True)
    ck.close()
    if "--final" in argv:
        torch.save(model.state_dict(), argv[argv.index("--final") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
