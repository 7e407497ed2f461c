"""``pccheck.lightning``: pccheck as PyTorch Lightning's ``CheckpointIO`` plugin.

    import lightning, pccheck.lightning
    trainer = lightning.Trainer(plugins=[pccheck.lightning.CheckpointIO()], ...)
    trainer.fit(model, ckpt_path="last")

The implementation lives in :mod:`pccheck.integrations.lightning`; ``import pccheck`` does not
import this module (it imports torch and Lightning: ``pip install 'pccheck[lightning]'``).
"""

from .integrations.lightning import CheckpointIO

__all__ = ["CheckpointIO"]
