"""Bridges from other checkpointing APIs onto the pccheck store (front-end layer).

:mod:`pccheck.integrations.dcp` is the torch.distributed.checkpoint (DCP) storage layer, public as
``pccheck.dcp``. Nothing here is imported by ``import pccheck``: these modules import torch.
"""

__all__: list[str] = []
