"""Replication of memory checkpoints to peer nodes, in the background (FORMAT.md §10).

Transport: a gloo group of pccheck's own (never the training collectives), every wait bounded
(``TIMEOUT_S``). For each memory checkpoint that commits, the sender thread (newest first: a
checkpoint committed while a send runs replaces the pending one) puts a JSON header in the
job's key-value store under ``rep/e<epoch>/<src>><dst>/<seq>`` (step, epoch, counter, the
manifest, the crc32c of every wire chunk), then sends the slot's data region chunk by chunk.
Invariant (wire.py): the receiver posts a receive only after it read the header. The receiver
thread of each source checks each chunk's crc32c as it arrives, then every array's crc32c
against the manifest, and only then writes the replica into ``replica-<src>/``, a store of two
slots committed with the protocol of §4 (so a peer holds only committed replicas, the newest two).
While a slot is being sent the memory coordinator keeps it from reuse (shm_store.MemoryCoordinator).
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...distributed import Group
from ...errors import ConfigError, CorruptCheckpointError, PCCheckError
from ...orchestrator.copy_engine import CpuCopyEngine
from ...orchestrator.options import EngineOptions
from ...orchestrator.orchestrator import CommitInfo, Orchestrator
from ...persist.layout import Manifest, parse_manifest, plan
from ...persist.reader import crc32c
from ...persist.recovery import read_manifest, read_store, slot_base
from .placement import node_of_this_process, replica_ranks
from .wire import WIRE_CHUNK, ReplicationError, gather_json, recv_bytes, send_bytes

__all__ = ["ReplicaLinks", "Replicator", "TIMEOUT_S", "data_end", "check_arrays", "arrays_of"]

log = logging.getLogger("pccheck")

TIMEOUT_S = 120.0        # one wire chunk, or one collective, at most
MAX_DATA = 1 << 46       # bytes of one replica a receiver accepts
_POLL_S = 0.2


@dataclass(frozen=True)
class ReplicaLinks:
    """Who sends to whom: ``peers`` hold this rank's replicas, this rank holds ``sources``'."""

    rank: int
    world: int
    peers: tuple[int, ...]
    sources: tuple[int, ...]
    nodes: tuple[int, ...]
    pg: Any = None
    group: Group | None = None

    @classmethod
    def single(cls, replicas: int) -> "ReplicaLinks":
        if replicas > 1:
            raise _too_few_nodes(replicas)
        return cls(0, 1, (), (), (0,))

    @classmethod
    def connect(cls, group: Group, replicas: int) -> "ReplicaLinks":
        """Gathers every rank's node, places the replicas (Gemini's groups) and, with replicas >
        1, makes the gloo group they travel on. Collective."""
        import torch.distributed as dist
        from datetime import timedelta

        nodes = tuple(int(n) for n in gather_json(group.pg, group.world_size, node_of_this_process(), TIMEOUT_S))
        n_nodes = len(set(nodes))
        if replicas > n_nodes:
            raise _too_few_nodes(replicas, n_nodes)
        if replicas == 1:
            return cls(group.rank, group.world_size, (), (), nodes)
        holders = [replica_ranks(r, nodes, replicas) for r in range(group.world_size)]
        pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=TIMEOUT_S))  # collective
        sources = tuple(r for r in range(group.world_size) if group.rank in holders[r])
        return cls(group.rank, group.world_size, tuple(holders[group.rank]), sources, nodes, pg, group)


def _too_few_nodes(replicas: int, nodes: int = 1) -> ConfigError:
    return ConfigError(f"replicas={replicas} needs at least {replicas} nodes (each copy on another node); this "
                       f"job has {nodes} node(s): lower replicas, or set PCCHECK_NODE / GROUP_RANK per node")


def data_end(man: Manifest) -> int:
    """Bytes of a slot's data region that hold arrays (rounded up to a block, within data_len)."""
    end = max((e.offset + e.nbytes for e in man.arrays), default=0)
    return min(man.data_len, (end + 4095) // 4096 * 4096)


def check_arrays(man: Manifest, buf: np.ndarray) -> None:
    """CorruptCheckpointError unless every array lies in ``buf`` and matches its crc32c."""
    for e, want in zip(man.arrays, man.crcs):
        if e.offset + e.nbytes > buf.nbytes:
            raise CorruptCheckpointError(f"array {e.name!r} lies beyond the {buf.nbytes} bytes received")
        if e.nbytes and crc32c(memoryview(buf[e.offset:e.offset + e.nbytes])) != want:
            raise CorruptCheckpointError(f"array {e.name!r} checksum mismatch")


def arrays_of(man: Manifest, buf: np.ndarray, torch_views: bool = True) -> dict[str, Any]:
    """The arrays of a checked buffer as views (with ``torch_views``, torch views where numpy
    lacks the dtype; else numpy carriers of the raw bits)."""
    out: dict[str, Any] = {}
    for e in man.arrays:
        a = buf[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
        if e.torch_dtype and torch_views:
            import torch

            from ...arrays import torch_dtype

            a = torch.from_numpy(a).view(torch_dtype(e.torch_dtype))
        out[e.name] = a
    return out


def _chunk_crcs(view: np.ndarray) -> list[int]:
    return [crc32c(memoryview(view[o:o + WIRE_CHUNK])) for o in range(0, view.nbytes, WIRE_CHUNK)]


class Replicator:
    """The sender thread and one receiver thread per source rank (see the module docstring)."""

    def __init__(self, links: ReplicaLinks, root: Path, engine: EngineOptions, epoch: int, coord: Any) -> None:
        import torch.distributed as dist

        self.links, self.root, self.coord = links, root, coord
        self._engine = replace(engine, max_concurrent=1, writer_threads=1)
        self._kv = dist.PrefixStore(f"rep/e{epoch}/", links.group.store)
        self._cv = threading.Condition()
        self._pending: CommitInfo | None = None
        self._stopping = False
        self._dead: set[int] = set()          # peers a send to failed: no more sends to them
        self.sent_step: int | None = None     # newest step every live peer received
        self.held: dict[int, int] = {}        # source rank -> newest replica step committed here
        self._stores: dict[int, Orchestrator] = {}
        self._bufs: dict[int, np.ndarray] = {}
        self._recv_stop = threading.Event()
        self._threads = [threading.Thread(target=self._send_loop, name="pccheck-replica-send", daemon=True)]
        self._threads += [threading.Thread(target=self._recv_loop, args=(s,), name=f"pccheck-replica-recv-{s}",
                                           daemon=True) for s in links.sources]
        for t in self._threads:
            t.start()

    # -- sending ----------------------------------------------------------------------------------

    def offer(self, info: CommitInfo) -> None:
        """A memory checkpoint committed (commit thread): send it next, replacing an older one."""
        with self._cv:
            self._pending = info
            self._cv.notify()

    def _send_loop(self) -> None:
        seq = 0
        while True:
            with self._cv:
                while self._pending is None and not self._stopping:
                    self._cv.wait()
                info, self._pending = self._pending, None
            if info is None:
                break
            if self.coord is not None:
                self.coord.set_sending(info.step)
            try:
                if self._send(info, seq):
                    seq += 1
            except Exception:
                log.exception("pccheck: replicating the memory checkpoint of step %d failed", info.step)
            finally:
                if self.coord is not None:
                    self.coord.set_sending(None)
        for dst in self.links.peers:  # tells each receiver that nothing more comes
            if dst not in self._dead:
                try:
                    self._kv.set(f"{self.links.rank}>{dst}/{seq}", json.dumps({"end": True}))
                except Exception:
                    log.warning("pccheck: could not tell rank %d that replication ended", dst)

    def _send(self, info: CommitInfo, seq: int) -> bool:
        image = read_store(info.store_file)
        with open(info.store_file, "rb", buffering=0) as f:
            try:
                man = read_manifest(image, info.slot, f.fileno())
            except CorruptCheckpointError as exc:
                log.warning("pccheck: memory slot %d of step %d not sent: %s", info.slot, info.step, exc)
                return False
            if man.counter != info.counter:
                return False  # superseded and reused already (cannot happen while held; defence)
            raw = read_raw_manifest(image, info.slot, f.fileno())
            end = data_end(man)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                view = np.frombuffer(mm, dtype=np.uint8, count=end, offset=slot_base(image, info.slot))
                doc = {"step": man.step, "epoch": man.epoch or 0, "counter": man.counter, "data": end,
                       "manifest": raw.decode(), "crcs": _chunk_crcs(view)}
                for dst in self.links.peers:
                    if dst in self._dead:
                        continue
                    try:
                        self._kv.set(f"{self.links.rank}>{dst}/{seq}", json.dumps(doc))
                        send_bytes(self.links.pg, dst, view, self.links.rank, TIMEOUT_S)
                    except Exception as exc:  # noqa: BLE001 - a dead peer: stop sending to it
                        log.error("pccheck: replica of step %d to rank %d failed (%s); no more replicas go "
                                  "to it", man.step, dst, exc)
                        self._dead.add(dst)
                del view
        self.sent_step = info.step
        return True

    # -- receiving --------------------------------------------------------------------------------

    def _wait_key(self, key: str) -> str | None:
        from datetime import timedelta

        while not self._recv_stop.is_set():
            try:
                self._kv.wait([key], timedelta(seconds=_POLL_S))
                v = self._kv.get(key).decode()
                self._kv.delete_key(key)
                return v
            except Exception:  # a timeout (the store raises), or a store that went away
                self._recv_stop.wait(0.01)
        return None

    def _recv_loop(self, src: int) -> None:
        seq = 0
        while (v := self._wait_key(f"{src}>{self.links.rank}/{seq}")) is not None:
            seq += 1
            try:
                doc = json.loads(v)
            except ValueError:
                log.error("pccheck: a malformed replica header from rank %d; replication from it stops", src)
                return
            if not isinstance(doc, dict) or doc.get("end") is True:
                return
            try:
                self._receive(src, doc)
            except CorruptCheckpointError as exc:  # every byte arrived: the link is still in step
                log.error("pccheck: replica from rank %d discarded: %s", src, exc)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dead peer: the pair is gone
                log.error("pccheck: receiving a replica from rank %d failed (%s); replication from it stops",
                          src, exc)
                return

    def _receive(self, src: int, doc: dict) -> None:
        man, end, crcs = _parse_header(doc)
        buf = self._bufs.get(src)
        if buf is None or buf.nbytes < end:
            buf = self._bufs[src] = np.empty(end, dtype=np.uint8)
        view = buf[:end]
        recv_bytes(self.links.pg, src, view, src, TIMEOUT_S)
        if _chunk_crcs(view) != crcs:
            raise CorruptCheckpointError(f"step {man.step}: a chunk arrived damaged (crc32c)")
        check_arrays(man, view)
        arrays = arrays_of(man, view)
        orch = self._store(src, arrays)
        # Returns once every byte is in DRAM chunks: the buffer may be reused; commits behind.
        orch.start(man.step, arrays, man.metadata, tree=man.tree, epoch=man.epoch)

    def _store(self, src: int, arrays: dict[str, Any]) -> Orchestrator:
        from .shm_store import replica_dir

        orch = self._stores.get(src)
        if orch is None:
            def committed(info: CommitInfo, src: int = src) -> None:
                self.held[src] = info.step

            orch = Orchestrator(replica_dir(self.root, src), plan(arrays), self._engine,
                                copy_engine=CpuCopyEngine(threads=1), on_error=_log_error,
                                world_size=self.links.world, rank=src, on_commit=committed)
            self._stores[src] = orch
        return orch

    def newest(self) -> dict[str, Any]:
        return {"replicated": self.sent_step, "peer_replicas": dict(sorted(self.held.items()))}

    def close(self, deadline_s: float = TIMEOUT_S) -> None:
        """Sends what is pending, ends the sender, waits (bounded) for every source's end."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._threads[0].join(deadline_s)
        for t in self._threads[1:]:
            t.join(deadline_s)
        self._recv_stop.set()
        for t in self._threads[1:]:
            t.join(5)
        for orch in self._stores.values():
            orch.close()


def _log_error(exc: PCCheckError) -> None:
    log.error("pccheck: writing a replica failed: %s", exc)


def read_raw_manifest(image: Any, slot: int, fd: int) -> bytes:
    """A slot's manifest bytes as stored (read_manifest has checked them already)."""
    import os

    from ...persist.recovery import manifest_region

    off, n = manifest_region(image, slot)
    return os.pread(fd, n, off)


def _int(doc: dict, key: str, lo: int, hi: int) -> int:
    v = doc.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise CorruptCheckpointError(f"replica header field {key!r} is missing or out of range")
    return v


def _parse_header(doc: dict) -> tuple[Manifest, int, list[int]]:
    """Checks a replica header (untrusted: bounds on every field) and parses its manifest."""
    step = _int(doc, "step", -(2**63), 2**63 - 1)
    counter = _int(doc, "counter", 1, 2**56 - 1)
    end = _int(doc, "data", 0, MAX_DATA)
    crcs, raw = doc.get("crcs"), doc.get("manifest")
    n_chunks = (end + WIRE_CHUNK - 1) // WIRE_CHUNK
    if not isinstance(crcs, list) or len(crcs) != n_chunks or not all(type(c) is int for c in crcs):
        raise CorruptCheckpointError("replica header has a bad chunk checksum list")
    if not isinstance(raw, str):
        raise CorruptCheckpointError("replica header lacks the manifest")
    man = parse_manifest(raw.encode(), step=step, counter=counter, data_len_limit=MAX_DATA)
    if data_end(man) != end:
        raise CorruptCheckpointError("replica header's data length disagrees with its manifest")
    return man, end, crcs
