"""``pccheck.lightning``: pccheck as PyTorch Lightning's ``CheckpointIO`` plugin, and Lightning's
``ModelParallelStrategy`` (FSDP2, tensor parallel) with its distributed checkpoints in pccheck.

    import lightning, pccheck.lightning
    trainer = lightning.Trainer(plugins=[pccheck.lightning.CheckpointIO()], ...)
    trainer = lightning.Trainer(strategy=pccheck.lightning.ModelParallelStrategy(), ...)
    trainer.fit(model, ckpt_path="last")

The implementations live in :mod:`pccheck.integrations.lightning` and
:mod:`pccheck.integrations.lightning_parallel`; ``import pccheck`` does not import this module (it
imports torch and Lightning: ``pip install 'pccheck[lightning]'``).
"""

from .integrations.lightning import CheckpointIO
from .integrations.lightning_parallel import ModelParallelStrategy

__all__ = ["CheckpointIO", "ModelParallelStrategy"]
