"""A small deterministic training run on CUDA, as a child process of tests/test_gpu.py.

Deterministic cuBLAS (CUBLAS_WORKSPACE_CONFIG, set before torch is imported), deterministic
algorithms, fixed seeds; dropout draws from the CUDA RNG, so resuming bit for bit needs its state.
AdamW and a cosine LR schedule. Each step's batch comes from its own generator on the device, so
the data never depends on the global RNG state.

Usage: python _gpu_train.py PATH STEPS INTERVAL [--resume] [--final FILE] [--sleep S] [--device D]
prints "START step" once, then "LOSS step <float.hex() of the loss>" per step, flushed.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402  (after the cuBLAS setting)

from _torch_train import train_step  # noqa: E402  (one training step for both children)

IN, WIDTH, OUT, BATCH = 64, 512, 64, 256


def setup() -> None:
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(1234)  # seeds the CUDA generators too


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(IN, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.drop1 = torch.nn.Dropout(0.2)
        self.mid = torch.nn.Linear(WIDTH, WIDTH)
        self.drop2 = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop1(torch.nn.functional.gelu(self.norm(self.embed(x))))
        h = self.drop2(torch.relu(self.mid(h)))
        return self.head(h)


def make(device: str, steps: int):
    model = Net().to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=steps, eta_min=1e-4)
    return model, optim, sched


def batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(10_000 + step)
    x = torch.randn(BATCH, IN, generator=g, device=device)
    return x, torch.sin(x * 1.5)


def _opt(argv: list[str], name: str, default: str | None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def main(argv: list[str]) -> None:
    import pccheck

    path, steps, interval = argv[0], int(argv[1]), int(argv[2])
    device = _opt(argv, "--device", "cuda")
    pause = float(_opt(argv, "--sleep", "0"))
    setup()
    model, optim, sched = make(device, steps)
    start = 0
    if "--resume" in argv:
        try:
            start = pccheck.load_latest(path, model=model, optimizer=optim, extra_state={"sched": sched}).step
        except pccheck.NoCheckpointError:
            start = 0  # killed before the first checkpoint was durable: start over
    ck = pccheck.Checkpointer(model, optim, extra_state={"sched": sched}, path=path, interval=interval,
                              max_concurrent=2, chunk_size=256 << 10)
    print(f"START {start}", flush=True)
    for step in range(start + 1, steps + 1):
        loss = train_step(model, optim, sched, step, batch(step, device))
        ck.maybe_checkpoint(step)
        print(f"LOSS {step} {loss.hex()}", flush=True)
        if pause:
            time.sleep(pause)  # gives the parent time to kill at the step it picked
    ck.close()
    final = _opt(argv, "--final", None)
    if final:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, final)


if __name__ == "__main__":
    main(sys.argv[1:])
