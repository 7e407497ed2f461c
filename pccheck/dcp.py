"""``pccheck.dcp``: torch.distributed.checkpoint storage backed by the pccheck store.

    import torch.distributed.checkpoint as dcp, pccheck.dcp
    dcp.save(state_dict, storage_writer=pccheck.dcp.Writer("ckpt"))
    fut = dcp.async_save(state_dict, storage_writer=pccheck.dcp.Writer("ckpt"))
    dcp.load(state_dict, storage_reader=pccheck.dcp.Reader("ckpt"))

The implementation lives in :mod:`pccheck.integrations.dcp`; ``import pccheck`` does not import
this module (it imports torch).
"""

from .integrations.dcp import Reader, Writer

__all__ = ["Writer", "Reader"]
