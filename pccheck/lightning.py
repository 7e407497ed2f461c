"""``pccheck.lightning``: pccheck as PyTorch Lightning's ``CheckpointIO`` plugin, and Lightning's
``ModelParallelStrategy`` (FSDP2, tensor parallel) with its distributed checkpoints in pccheck.

    import lightning, pccheck.lightning
    trainer = lightning.Trainer(plugins=[pccheck.lightning.CheckpointIO()], ...)
    trainer = lightning.Trainer(strategy=pccheck.lightning.ModelParallelStrategy(), ...)
    trainer.fit(model, ckpt_path="last")

The implementations live in :mod:`pccheck.integrations.lightning` and
:mod:`pccheck.integrations.lightning_parallel` (imported on first use: it needs torch >= 2.3
for FSDP2, the plugin does not); ``import pccheck`` does not import this module (it imports
torch and Lightning: ``pip install 'pccheck[lightning]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .integrations.lightning import CheckpointIO

if TYPE_CHECKING:  # for type checkers and editors; at run time imported on first use
    from .integrations.lightning_parallel import ModelParallelStrategy

__all__ = ["CheckpointIO", "ModelParallelStrategy"]


def __getattr__(name: str) -> Any:
    if name == "ModelParallelStrategy":
        from .integrations.lightning_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module 'pccheck.lightning' has no attribute {name!r}")
