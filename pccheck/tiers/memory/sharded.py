"""Sharded (DTensor, FSDP2) state from the memory tier (FORMAT.md §9, §13).

A memory checkpoint of a sharded model is each rank's own slot: its local shards, and the
replicated tensors (plain tensors, ``Replicate()`` dims) only on the lowest rank holding them,
as on disk. After :func:`pccheck.tiers.memory.nearest.load_nearest` gave every rank its own slot
of the agreed step (own memory, a peer's replica or own disk, every array checked), each rank
still needs the chunks other ranks stored: the replicated tensors, and any box its own slot lacks.

Protocol (collective on pccheck's own gloo group, every wait bounded):

1. every rank publishes the shards section of its slot and the dtype and shape of each chunk
   array (JSON, bounds-checked like a manifest: pccheck.sharded.index);
2. each rank plans the loads of pccheck.sharded.load against its own model's layout
   (:func:`needed_arrays`) and asks each other rank for the chunk arrays it lacks;
3. each rank serves what it is asked, each array preceded by nothing but its crc32c computed
   from the checked bytes; the receiver checks every array against it before use;
4. each rank builds its state (:func:`build_state`) and the ranks vote: nothing is applied unless
   every rank built its part.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from ... import shutdown
from ...arrays import TORCH_DTYPES
from ...errors import ConfigError, CorruptCheckpointError, PCCheckError
from ...group.distributed import Group
from ...persist.layout import ArrayEntry, Manifest
from ...persist.reader import crc32c
from ...persist.recovery import Restored
from ...sharded.index import CheckpointSet, Member
from ...sharded.load import Decode, build_state, needed_arrays
from .replicate import MAX_DATA, TIMEOUT_S
from .wire import ReplicationError, gather_json, recv_bytes, send_bytes

__all__ = ["build_sharded"]

log = logging.getLogger("pccheck")

TAG = 1000  # the exchange's gloo tag (the restore's own pulls use the round number)
_CARRIERS = frozenset(TORCH_DTYPES.values())


@dataclass
class _HeldSet(CheckpointSet):
    """A set whose members' arrays are held in memory (this rank's slot and what it fetched)."""

    held: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)

    def read(self, rank: int, name: str, into: np.ndarray | None = None) -> np.ndarray:
        a = self.held.get(rank, {}).get(name)
        if a is None:
            raise CorruptCheckpointError(f"rank {rank}'s array {name!r} is not held here")
        if into is not None:
            if into.nbytes != a.nbytes:
                raise ValueError(f"array {name!r} holds {a.nbytes} bytes, the destination {into.nbytes}")
            into[:] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        with self._lock:
            self.bytes_read += a.nbytes
        return a

    def position(self, rank: int, name: str) -> tuple[int, int]:
        return rank, 0

    def close(self) -> None:
        pass


def _own(r: Restored, rank: int) -> Member:
    arrays = tuple(ArrayEntry(n, a.dtype, tuple(a.shape), 0, a.nbytes, r.torch_dtypes.get(n))
                   for n, a in r.state.items())
    man = Manifest(r.step, r.counter, 0, arrays, (0,) * len(arrays), r.metadata, r.tree, r.epoch)
    return Member(rank, SimpleNamespace(path=r.path, generation=r.generation), r.slot, man)  # type: ignore[arg-type]


def _describe(r: Restored) -> dict[str, Any]:
    """The shards section of this rank's slot and its chunk arrays' dtypes and shapes."""
    section = r.tree.get("shards") if isinstance(r.tree, dict) else None
    names = {c[0] for doc in (section or {}).values() if isinstance(doc, dict)
             for c in doc.get("chunks", ()) if isinstance(c, list) and c and isinstance(c[0], str)}
    arrays = {n: [r.state[n].dtype.str, r.torch_dtypes.get(n), list(r.state[n].shape)] for n in names if n in r.state}
    return {"shards": section, "arrays": arrays}


def _peer(rank: int, doc: Any, r: Restored) -> Member:
    """Another rank's published slot as a Member (untrusted: every field checked here, the
    shards section by pccheck.sharded.index when the set's tensors are merged)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("shards"), dict) or not isinstance(doc.get("arrays"), dict):
        raise CorruptCheckpointError(f"rank {rank} published no shards section")
    arrays = []
    for name, d in doc["arrays"].items():
        ok = isinstance(d, list) and len(d) == 3 and d[0] in _CARRIERS and (d[1] is None or d[1] in TORCH_DTYPES)
        shape = d[2] if ok else None
        if not ok or not isinstance(shape, list) or len(shape) > 64 or not all(
                type(v) is int and 0 <= v < 1 << 62 for v in shape):
            raise CorruptCheckpointError(f"rank {rank} published a malformed array {name!r}")
        dtype = np.dtype(d[0])
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_DATA:
            raise CorruptCheckpointError(f"rank {rank} published an array {name!r} of {nbytes} bytes")
        arrays.append(ArrayEntry(name, dtype, tuple(shape), 0, nbytes, d[1]))
    man = Manifest(r.step, 0, 0, tuple(arrays), (0,) * len(arrays), {}, {"shards": doc["shards"]}, r.epoch)
    where = SimpleNamespace(path=Path(f"rank-{rank}:memory"), generation=0)  # for messages only
    return Member(rank, where, -1, man)  # type: ignore[arg-type]


def _serve(pg: Any, held: dict[str, np.ndarray], asks: list[tuple[int, list[str]]],
           errors: list[BaseException]) -> None:
    """Sends each asking rank its arrays, in the order asked, each preceded by its crc32c."""
    for dst, names in asks:
        try:
            for n in names:
                a = np.ascontiguousarray(held[n]).reshape(-1).view(np.uint8)
                send_bytes(pg, dst, np.array([crc32c(memoryview(a))], dtype="<u4").view(np.uint8), TAG, TIMEOUT_S)
                send_bytes(pg, dst, a, TAG, TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - the asking rank's checks catch what is missing
            errors.append(exc)


def _fetch(group: Group, cand: _HeldSet, need: dict[int, list[str]] | None) -> None:
    """Step 2 and 3 of the module docstring; collective (``need`` None: this rank asks nothing,
    it failed already, but still serves). Raises ReplicationError / CorruptCheckpointError."""
    me = group.rank
    asked = gather_json(group.pg, group.world_size, {str(s): ns for s, ns in (need or {}).items()}, TIMEOUT_S)
    mine = cand.held[me]
    asks = []
    for r, doc in enumerate(asked):
        names = doc.get(str(me), []) if isinstance(doc, dict) and r != me else []
        if not isinstance(names, list) or not all(isinstance(n, str) and n in mine for n in names):
            raise ReplicationError(f"rank {r} asked for arrays this rank's slot does not hold")
        if names:
            asks.append((r, names))
    errors: list[BaseException] = []
    server = shutdown.thread(_serve, "pccheck-shard-serve", (group.pg, mine, asks, errors))
    try:
        for src, names in sorted((need or {}).items()):
            entries = cand.members[src].entries
            got = cand.held.setdefault(src, {})
            for n in names:
                entry = entries[n][0]
                crc = np.empty(4, dtype=np.uint8)
                recv_bytes(group.pg, src, crc, TAG, TIMEOUT_S)
                buf = np.empty(entry.nbytes, dtype=np.uint8)
                recv_bytes(group.pg, src, buf, TAG, TIMEOUT_S)
                if crc32c(memoryview(buf)) != int(crc.view("<u4")[0]):
                    raise CorruptCheckpointError(f"rank {src}'s array {n!r} arrived damaged (crc32c)")
                got[n] = buf.view(entry.dtype).reshape(entry.shape)
    finally:
        server.join(TIMEOUT_S * 2)
    if errors:
        log.warning("pccheck: rank %d: serving shards failed: %s", me, errors[0])


def build_sharded(r: Restored, group: Group | None, state: Any, map_location: Any, *, decode: Decode) -> Restored:
    """The nested state of a sharded memory-tier checkpoint, built on this rank from its own
    slot ``r`` (load_nearest's) and the chunks the other ranks hold; with ``state`` (a
    TorchState) applied once every rank built its part. Collective in a group. Raises
    CorruptCheckpointError naming the ranks that failed (then nothing was applied, though the
    model's and optimizer's tensors may hold parts: the caller loads another checkpoint)."""
    me, world = (group.rank, group.world_size) if group is not None else (0, 1)
    own = _own(r, me)
    why: Any = None
    members, need = [own], None
    if group is not None:
        docs = gather_json(group.pg, world, _describe(r), TIMEOUT_S)
        try:
            members = [own if i == me else _peer(i, d, r) for i, d in enumerate(docs)]
        except CorruptCheckpointError as exc:
            why = str(exc)
    cand = _HeldSet(r.epoch or 0, r.step, world, members, held={me: r.state})
    nested: dict[str, Any] | None = None
    why = ("corrupt", why) if why else None
    for phase in ("plan", "fetch", "build"):  # every rank passes every collective, whatever it met
        try:
            if phase == "plan" and why is None and group is not None:
                need = {}
                for src, name in sorted(needed_arrays(cand, me, state)):
                    if src != me:
                        need.setdefault(src, []).append(name)
            elif phase == "fetch" and group is not None:
                _fetch(group, cand, need if why is None else None)
            elif phase == "build" and why is None:
                nested, _ = build_state(cand, me, state, map_location, decode)
        except ConfigError as exc:
            why = why or ("config", str(exc))
        except (PCCheckError, OSError) as exc:
            why = why or ("corrupt", str(exc))
    votes = gather_json(group.pg, world, why, TIMEOUT_S) if group is not None else [why]
    config = [f"rank {i}: {w[1]}" for i, w in enumerate(votes) if w and w[0] == "config"]
    if config:
        raise ConfigError("; ".join(config))
    failed = [f"rank {i}: {w[1]}" for i, w in enumerate(votes) if w]
    if failed:
        raise CorruptCheckpointError(f"step {r.step} from the memory tier could not be built: {'; '.join(failed)}")
    assert nested is not None
    if state is not None:
        state.apply(nested)
    nested["step"] = r.step
    return Restored(r.step, nested, r.metadata, r.counter, r.generation, r.slot, r.path, {}, r.tree, r.epoch,
                    bytes_read=cand.bytes_read, tier=r.tier)
