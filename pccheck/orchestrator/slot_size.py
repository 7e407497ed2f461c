"""The slot capacity a checkpoint needs: its data region, then its manifest's upper bound with
slack (FORMAT.md §5). Building that bound means building a manifest of the layout, which costs
milliseconds per checkpoint of a few hundred arrays on the training thread, so the answer for the
previous arrays, metadata and tree is kept."""

from __future__ import annotations

import json
from typing import Any, Mapping

from ..native import _native
from ..persist.layout import Layout, manifest_upper_bound

__all__ = ["SlotSize", "MANIFEST_SLACK"]

BLOCK: int = _native.BLOCK
# Room kept in each slot beyond the manifest's size, so metadata can grow without a new generation.
MANIFEST_SLACK = 64 << 10


class SlotSize:
    """``size(layout, metadata, tree, epoch)``: bytes of a slot for a checkpoint of ``layout``
    (already aligned as its store writes it; ``incremental``: with its cells' fields)."""

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental
        self._last: tuple[Any, int] | None = None  # (key, answer) of the previous call

    def __call__(self, layout: Layout, metadata: Mapping[str, Any] | None, tree: Any = None,
                 epoch: int | None = None) -> int:
        try:  # the key holds the metadata as JSON: a caller may change its own dict in place later
            key = (layout.entries, layout.data_len, json.dumps(metadata, sort_keys=True), tree, epoch is None)
        except (TypeError, ValueError):
            key = None  # not JSON: build_manifest says why
        last = self._last
        if key is not None and last is not None and last[0] == key:
            return last[1]
        man = manifest_upper_bound(layout, metadata, tree=tree, epoch=epoch,
                                   incremental=self.incremental) + MANIFEST_SLACK
        need = layout.data_len + (man + BLOCK - 1) // BLOCK * BLOCK
        if key is not None:
            self._last = (key, need)
        return need
