"""A real Lightning run for tests/test_lightning.py.

    python _lightning_child.py IO DIR MAX_STEPS RESUME WORLD [SLEEP]

IO: "pccheck" (pccheck.lightning.CheckpointIO, store in DIR/.pccheck) or "torch" (Lightning's
default TorchCheckpointIO); "fsdp-pccheck" / "fsdp-torch": FSDP2 (fully_shard in configure_model)
under pccheck.lightning.ModelParallelStrategy / Lightning's own, on WORLD CPU ranks over gloo;
"fsdp-full-pccheck" / "fsdp-full-torch": the same with save_distributed_checkpoint=False (full
checkpoints on rank 0), the pccheck one through pccheck.lightning.CheckpointIO too. A
ModelCheckpoint saves into DIR every 5 steps (all kept, plus last.ckpt; with a "+top1" suffix on
IO, only the newest). RESUME: "none", or the ckpt_path given to fit ("last", or a file). WORLD > 1: DDP on
gloo over CPU processes (Lightning launches the other ranks). Rank 0 prints ``LOSS <step> <loss>``
per training step (the step the update is about to make), flushed, with the loss's exact repr.
SLEEP: seconds each step sleeps (so that a test can kill the run mid-way).
"""

from __future__ import annotations

import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from _leave import leave


class Net(L.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.sleep = sleep
        # BatchNorm: buffers that forward changes (copied eagerly, never behind the step hook)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))

    def configure_model(self) -> None:
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0:
            print(f"LOSS {self.global_step} {loss.item()!r}", flush=True)
        if self.sleep:
            time.sleep(self.sleep)
        return loss

    def configure_optimizers(self) -> dict:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str]) -> None:
    io, root, max_steps, resume, world = argv[0], argv[1], int(argv[2]), argv[3], int(argv[4])
    io, _, keep = io.partition("+")
    sleep = float(argv[5]) if len(argv) > 5 else 0.0
    torch.set_num_threads(1)
    L.seed_everything(0, workers=True)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 1, generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    plugins = []
    if io in ("pccheck", "fsdp-full-pccheck"):
        import pccheck.lightning

        plugins.append(pccheck.lightning.CheckpointIO())
    strategy: object = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    if io.startswith("fsdp-"):
        import pccheck.lightning

        cls = pccheck.lightning.ModelParallelStrategy if io.endswith("-pccheck") else ModelParallelStrategy
        strategy = cls(data_parallel_size=world, tensor_parallel_size=1, process_group_backend="gloo",
                       save_distributed_checkpoint=not io.startswith("fsdp-full-"))
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=world, deterministic=True, logger=False, strategy=strategy,
        enable_progress_bar=False, enable_model_summary=False, plugins=plugins,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=5, save_top_k=1 if keep == "top1" else -1,
                                   save_last=True)])
    trainer.fit(Net(sleep), loader, ckpt_path=None if resume == "none" else resume)
    if world > 1:
        leave()


if __name__ == "__main__":
    main(sys.argv[1:])
