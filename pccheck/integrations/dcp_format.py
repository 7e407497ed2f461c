"""What a DCP save puts into one rank's slot, and the DCP ``Metadata`` a set of slots stands for.

Writing (FORMAT.md §9, "DCP"): each write item of a rank's plan becomes one array of that rank's
slot: a tensor chunk as its raw bytes (C order, no torch.save), a BYTE_IO item as a 1-D uint8
array of its bytes. The manifest's tree carries the §9 ``"shards"`` section (keyed by DCP's fqn)
and a ``"dcp"`` section: ``{"version": 1, "bytes": {fqn: array}, "planner_data": {...}}``.

Reading: :func:`set_metadata` rebuilds DCP's ``Metadata`` from a complete set's manifests only
(no array data is read). Everything it reads is untrusted: the shards go through
``CheckpointSet.tensors`` (bounds-checked), the ``"dcp"`` section is checked here. Nothing is
unpickled here; a BYTE_IO item's bytes go to DCP's own planner (``LoadPlanner.load_bytes``),
which is where DCP itself deserialises them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..arrays import TORCH_DTYPES, torch_dtype
from ..errors import CorruptCheckpointError, UnsupportedDtypeError
from ..sharded.index import CheckpointSet

__all__ = ["Written", "Located", "slot_contents", "set_metadata", "DCP_VERSION"]

DCP_VERSION = 1


@dataclass(frozen=True)
class Written:
    """``WriteResult.storage_data``: where one item went (the set's (epoch, step), rank, array);
    ``kept`` is False when a newer save of that rank committed first and the slot was freed;
    ``base``: the remote base the save's plan leased (incremental s3:// saves), for ``finish``."""

    epoch: int
    step: int
    rank: int
    array: str
    kept: bool = True
    base: int | None = None


@dataclass(frozen=True)
class Located:
    """``Metadata.storage_data`` value: the array of rank ``rank``'s slot that holds an item."""

    rank: int
    array: str


def _array_name(fqn: str, offsets: tuple[int, ...], whole: bool, taken: set[str]) -> str:
    name = fqn if whole else f"{fqn}@{','.join(map(str, offsets))}"
    base, i = name, 1
    while name in taken:  # fqns are free text: keep names unique whatever they contain
        name, i = f"{base}#{i}", i + 1
    taken.add(name)
    return name


def _json_planner_data(planner: Any) -> dict[str, list] | None:
    """DefaultSavePlanner's flattening map (fqn -> path in the nested state_dict), as JSON."""
    mappings = getattr(planner, "mappings", None)
    if not isinstance(mappings, Mapping):
        return None
    out = {}
    for fqn, path in mappings.items():
        if isinstance(fqn, str) and isinstance(path, (tuple, list)) and all(isinstance(p, (str, int)) for p in path):
            out[fqn] = list(path)
    return out


def slot_contents(items: list[tuple[Any, Any]], planner: Any, rank: int) -> tuple[dict[str, Any], dict, dict]:
    """(arrays, tree, array name per item index) for ``items``: (WriteItem, resolved data) pairs."""
    from torch.distributed.checkpoint.planner import WriteItemType

    arrays: dict[str, Any] = {}
    shards: dict[str, dict[str, Any]] = {}
    blobs: dict[str, str] = {}
    names: dict[Any, str] = {}
    taken: set[str] = set()
    for item, data in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            buf = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            name = _array_name(fqn, (), True, taken)
            arrays[name] = np.frombuffer(buf, dtype=np.uint8) if buf else np.zeros(0, np.uint8)
            blobs[fqn] = name
        else:
            td = item.tensor_data
            offsets = tuple(int(o) for o in td.chunk.offsets)
            dtype = str(td.properties.dtype).removeprefix("torch.")
            if dtype not in TORCH_DTYPES:
                raise UnsupportedDtypeError(f"{fqn}: dtype {dtype} cannot be stored (pccheck stores "
                                            f"{', '.join(sorted(TORCH_DTYPES))})")
            shape = [int(s) for s in td.size]
            whole = not any(offsets) and list(td.chunk.sizes) == shape
            name = _array_name(fqn, offsets, whole, taken)
            t = data.detach()
            if tuple(t.shape) != tuple(td.chunk.sizes):
                t = t.reshape(tuple(td.chunk.sizes))
            arrays[name] = t
            entry = shards.setdefault(fqn, {"dtype": dtype, "shape": shape, "chunks": []})
            entry["chunks"].append([name, list(offsets)])
        names[item.index] = name
    tree = {"shards": shards,
            "dcp": {"version": DCP_VERSION, "bytes": blobs, "planner_data": _json_planner_data(planner)}}
    return arrays, tree, names


def _dcp_section(cand: CheckpointSet, m: Any) -> tuple[dict[str, str], dict[str, list]]:
    """A member's checked ``"dcp"`` section: (bytes fqn -> array, planner_data); empty for a set a
    Checkpointer wrote."""
    tree = m.manifest.tree
    sec = tree.get("dcp") if isinstance(tree, dict) else None
    if sec is None:
        return {}, {}
    where = f"{m.image.path} slot {m.slot}: dcp section"
    if not isinstance(sec, dict) or sec.get("version") != DCP_VERSION or not isinstance(sec.get("bytes"), dict):
        raise CorruptCheckpointError(f"{where}: malformed or of an unknown version")
    entries = m.entries
    for fqn, name in sec["bytes"].items():
        e = entries.get(name) if isinstance(name, str) else None
        if e is None or e[0].dtype != np.dtype(np.uint8) or len(e[0].shape) != 1:
            raise CorruptCheckpointError(f"{where}: bytes item {fqn!r} names no 1-D uint8 array")
    pd = sec.get("planner_data")
    if pd is not None and not (isinstance(pd, dict) and all(
            isinstance(v, list) and all(isinstance(p, (str, int)) for p in v) for v in pd.values())):
        raise CorruptCheckpointError(f"{where}: malformed planner_data")
    return sec["bytes"], pd or {}


def dcp_fqn(fqn: str, written_by_dcp: bool) -> str:
    """The DCP fqn of a set's tensor: as stored for a Writer's set; for a Checkpointer's set the
    tree path with "/" as "." ("model/0.weight" -> "model.0.weight")."""
    return fqn if written_by_dcp else fqn.replace("/", ".")


def set_metadata(cand: CheckpointSet) -> tuple[Any, dict[tuple[str, tuple[int, ...] | None], Located]]:
    """DCP ``Metadata`` for a complete set, and where each (fqn, chunk offsets) item lies."""
    import torch
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    by_dcp = isinstance(cand.members[0].manifest.tree, dict) and "dcp" in cand.members[0].manifest.tree
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Located] = {}
    where: dict[tuple[str, tuple[int, ...] | None], Located] = {}
    for info in cand.tensors().values():
        fqn = dcp_fqn(info.fqn, by_dcp)
        if fqn in sd_meta:
            raise CorruptCheckpointError(f"tensors {info.fqn!r} and another map to the same DCP fqn {fqn!r}")
        chunks = sorted(info.chunks, key=lambda c: c.box.offsets)
        sd_meta[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch_dtype(info.dtype)), size=torch.Size(info.shape),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c.box.offsets), sizes=torch.Size(c.box.sizes))
                    for c in chunks])
        for c in chunks:
            loc = Located(c.rank, c.array)
            storage[MetadataIndex(fqn, c.box.offsets)] = loc
            where[(fqn, tuple(c.box.offsets))] = loc
    planner_data: dict[str, tuple] = {}
    for m in cand.members:
        blobs, pd = _dcp_section(cand, m)
        planner_data.update({k: tuple(v) for k, v in pd.items()})
        for fqn, name in blobs.items():
            if fqn in sd_meta and not isinstance(sd_meta[fqn], BytesStorageMetadata):
                raise CorruptCheckpointError(f"{fqn!r} is both a tensor and a bytes item in step {cand.step}")
            sd_meta[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn)] = where[(fqn, None)] = Located(m.rank, name)
    meta = Metadata(state_dict_metadata=sd_meta, planner_data=planner_data or None, storage_data=storage)
    return meta, where
