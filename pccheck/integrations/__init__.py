"""Bridges from other checkpointing APIs onto the pccheck store (front-end layer).

:mod:`pccheck.integrations.dcp` is the torch.distributed.checkpoint (DCP) storage layer, public as
``pccheck.dcp``; :mod:`pccheck.integrations.lightning` is Lightning's ``CheckpointIO`` plugin,
public as ``pccheck.lightning``; :mod:`pccheck.integrations.named` keeps the file names those
frameworks give checkpoints as pointers into the store. Nothing here is imported by ``import pccheck``: these modules import torch.
"""

__all__: list[str] = []
