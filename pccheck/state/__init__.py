"""A PyTorch training state as pccheck stores it: named arrays plus a JSON tree (FORMAT.md §5, §9).

- ``torch_state.py``: :class:`TorchState` (a model, its optimizer, extra state and the RNGs: the
  snapshot, and putting a checkpoint back in place), :class:`Flattener` (the tree encoding, also
  used by the integrations for a framework's checkpoint dict), :func:`rebuild` (its inverse), and
  the lazy restore's first-use ``order``.
- ``sources.py``: what a Checkpointer reads at each checkpoint: a TorchState, or a mapping of
  arrays (:class:`ArraysState`), chosen by :func:`make_source`.

Invariants owned here: the tree holds JSON values only (anything else is refused, or with
``serialize_other`` stored by ``torch.save`` and read back only with ``weights_only=True``); tensors
are stored as their raw bytes, never cast; tied tensors are stored once; buffers and marked names
are eager (copied before ``maybe_checkpoint`` returns); a DTensor stores only its local shard, once
per replica set (FORMAT.md §9).
"""

__all__: list[str] = []
