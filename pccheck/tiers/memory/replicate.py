"""Replication of memory checkpoints to peer nodes, in the background (FORMAT.md §13).

Transport: a gloo group of pccheck's own (never the training collectives), every wait bounded
(``TIMEOUT_S``). Every memory checkpoint that commits is sent, in step order (every rank sends
the same steps, so replicas pair across ranks by (epoch, step) at a restore); at most ``QUEUE``
wait, and the memory checkpoint before the next one (``LAG`` = 1) must be replicated everywhere,
else the next memory checkpoint waits (``throttle``): a node lost at any moment costs at most the
checkpoint in flight and the one being replicated. The sender thread puts a
JSON header in the job's key-value store under ``rep/e<epoch>/<src>><dst>/<seq>`` (step, epoch,
counter, the manifest with the crc32c of every array), then sends the slot's data region chunk by
chunk (wire.py: a few in flight). Invariant (wire.py): the receiver posts a receive only after it
read the header. The receiver thread of each source writes the received bytes into
``replica-<src>/``, a store of 2 + keep_last slots (shm_store.replica_slots: the newest committed
replica, keep_last = ``MemoryOptions.keep_last`` older ones, and the one being received) committed
with the protocol of §4, telling it the
manifest's crc32c (``StartArgs.expect_crcs``): the writers' own checksums must match every array
before the commit, so a damaged replica is never committed and a peer holds only committed,
checked replicas at the cost of no checksum pass of the tier's own on either end.
Each replica commit adds 1 to ``rc/<step>``; the commit that brings it to world × (replicas - 1)
appends the step to ``rlog``: the newest step *replicated everywhere*, which every rank follows
and its memory coordinator keeps, with keep_last older ones (shm_store.MemoryCoordinator): the
steps a lost peer's replicas pair with, its newest or (keep_last=1), that one damaged, the older.
With keep_last=0 a lost rank whose newest replica is damaged has no older one: the restore falls
back to the next tier (nearest.py, pccheck.restore).
"""

from __future__ import annotations

import json
import logging
import mmap
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ... import shutdown
from ...group.distributed import Group
from ...errors import ConfigError, CorruptCheckpointError, PCCheckError
from ...orchestrator.args import StartArgs
from ...orchestrator.options import EngineOptions
from ...orchestrator.orchestrator import CommitInfo, Orchestrator
from ...orchestrator.retention import KeepOlder
from ...persist.layout import Manifest, parse_manifest, plan
from ...persist.reader import crc32c
from ...persist.recovery import read_manifest, read_store, slot_base
from .placement import node_of_this_process, replica_ranks
from .delta import receive_needed, send_needed
from .wire import KeyWaiter, WireCopyEngine, gather_json, private_store, recv_bytes, send_bytes

__all__ = ["ReplicaLinks", "Replicator", "TIMEOUT_S", "data_end", "arrays_of", "ArrayChecker"]

log = logging.getLogger("pccheck")

TIMEOUT_S = 120.0        # one wire chunk, or one collective, at most
MAX_DATA = 1 << 46       # bytes of one replica a receiver accepts
QUEUE = 2                # committed memory checkpoints waiting to be sent, at most
LAG = 1                  # memory checkpoints not replicated everywhere when the next one starts, at most
COMMIT_GRACE_S = TIMEOUT_S  # how long a sent step is waited for to be replicated everywhere, no failure reported


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


class ArrayChecker:
    """Checks every array of ``man`` in ``buf`` against its crc32c as the bytes arrive: call it
    with each received (offset, nbytes), in order (wire.recv_bytes's ``on_chunk``), then
    :meth:`finish`, which raises CorruptCheckpointError for the first array that did not match.
    It never raises before: the transfer must be received whole to keep the link in step."""

    def __init__(self, man: Manifest, buf: np.ndarray) -> None:
        self.buf, self.problem = buf, None
        self.todo = sorted(((e.offset, e.nbytes, want, e.name) for e, want in zip(man.arrays, man.crcs) if e.nbytes),
                           reverse=True)  # by offset, popped from the end
        beyond = [name for off, n, _, name in self.todo if off + n > buf.nbytes]
        if beyond:
            self.problem, self.todo = f"array {beyond[0]!r} lies beyond the {buf.nbytes} bytes received", []
        self.crc, self.at = 0, 0  # the running crc of the array being received, and how far it got

    def __call__(self, off: int, n: int) -> None:
        end = off + n
        while self.todo and self.problem is None:
            a_off, a_n, want, name = self.todo[-1]
            lo, hi = max(a_off, self.at), min(a_off + a_n, end)
            if lo < hi:
                self.crc = crc32c(memoryview(self.buf[lo:hi]), self.crc)
                self.at = hi
            if a_off + a_n > end:
                return  # the rest of this array comes with a later chunk
            if self.crc != want:
                self.problem = f"array {name!r} checksum mismatch"
            self.todo.pop()
            self.crc = 0

    def finish(self) -> None:
        if self.problem is None and self.todo:
            self.problem = f"array {self.todo[-1][3]!r} was not received whole"
        if self.problem is not None:
            raise CorruptCheckpointError(self.problem)


class Replicator:
    """The sender thread and one receiver thread per source rank (see the module docstring)."""

    def __init__(self, links: ReplicaLinks, root: Path, engine: EngineOptions, epoch: int, coord: Any,
                 keep_last: int = 0, incremental: bool = False) -> None:
        self.links, self.root, self.coord, self.keep_last = links, root, coord, keep_last
        # incremental: a replica carries only the arrays the receiver's slot lacks, which the
        # receiver names in its answer to the header (it knows its slot; the sender never guesses)
        self.incremental = incremental
        self.sends: deque[dict[str, Any]] = deque(maxlen=64)  # per step sent: bytes sent and kept per peer
        # "block": a replica store never skips a start (WireCopyEngine receives inside it: a
        # skipped start would leave the sender's bytes unreceived and the pair out of step). One
        # pool chunk: replicas are received in place, into the slot (even where the own tier holds
        # a device snapshot's pool, a replica store never needs one).
        self._engine = replace(engine, max_concurrent=1, writer_threads=1, when_busy="block",
                               dram_budget=int(engine.chunk_size))
        self._kv = private_store(links.group.store, f"rep/e{epoch}/", TIMEOUT_S)
        # one KeyWaiter (a connection of its own) per waiting thread: receivers and the log follower
        self._waiters = {name: KeyWaiter.connect(links.group.store, f"rep/e{epoch}/", TIMEOUT_S)
                         for name in ["log", "send", *links.sources]}
        self._cv = threading.Condition()
        self._queue: deque[CommitInfo] = deque()
        self._sending = False
        self._sending_step: int | None = None          # the step the sender is sending (under _cv)
        self._sent_at: dict[int, float] = {}            # step -> monotonic time its send ended (under _cv)
        self._started: deque[int] = deque(maxlen=LAG)  # the last LAG memory checkpoints started
        self._committed: set[int] = set()              # steps committed here (offered), recent ones
        self._stopping = False
        self.stopped: str | None = None       # why the tier takes no more memory checkpoints
        self._failed: set[int] = set()        # steps some rank reported will not replicate (rlog "!s")
        self._broken = False                  # some rank reported a broken link (rlog "!*")
        self.throttled_s = 0.0                # time memory checkpoints waited for the queue
        self._dead: set[int] = set()          # peers a send to failed: no more sends to them
        self.sent_step: int | None = None     # newest step every live peer received
        self.held: dict[int, int] = {}        # source rank -> newest replica step committed here
        self.replicated: int | None = None    # newest step replicated everywhere (rlog)
        self._stores: dict[int, Orchestrator] = {}
        self._bufs: dict[int, np.ndarray] = {}
        self._map: tuple[Path, mmap.mmap] | None = None  # the sender's mapping of its store file
        self._recv_stop = threading.Event()
        self._threads = [shutdown.thread(self._send_loop, "pccheck-replica-send"),
                         shutdown.thread(self._follow_replicated, "pccheck-replica-log")]
        self._threads += [shutdown.thread(self._recv_loop, f"pccheck-replica-recv-{s}", (s,)) for s in links.sources]

    # -- sending ----------------------------------------------------------------------------------

    def offer(self, info: CommitInfo) -> None:
        """A memory checkpoint committed (commit thread): queue it for sending."""
        with self._cv:
            self._queue.append(info)
            self._committed.add(info.step)
            self._cv.notify_all()

    def throttle(self, step: int) -> bool:
        """Before the memory checkpoint of ``step`` (training thread): waits while ``QUEUE``
        checkpoints wait to be sent, and while the previous memory checkpoint started (``LAG`` =
        1 back) is not replicated everywhere yet but still may be (:meth:`_awaits`). Returns
        whether the checkpoint may start.

        Invariant (the slots, MemoryCoordinator): a memory checkpoint starts only once the one
        before it is replicated everywhere, so every own store and every replica store holds the
        newest step replicated everywhere, R (and with keep_last=1 the one before, R'), and no
        rank writes over them: the one slot beyond them is the one written. When the
        previous one committed here but cannot be replicated everywhere any more (a peer was
        dropped; a failure of it was reported in the replication log: a replica failed its checks,
        a rank's commit of it failed, a pair's link broke (:meth:`report_failed`); or its replicas
        were not all committed within COMMIT_GRACE_S of being sent, the last resort), this returns
        False from then on: the tier stops taking memory checkpoints (an error logged; the disk
        tier goes on) rather than write over the oldest kept step, which the peers' replicas pair
        with (the own store has no slot beyond). A previous one that never committed here (its commit
        failed) left its slot free: no wait. Bounded: a peer that stopped receiving is dropped by
        the sender after TIMEOUT_S."""
        t0 = time.perf_counter()
        with self._cv:
            if self.stopped is None:
                need = self._started[0] if len(self._started) == LAG else None
                while not self._stopping and (len(self._queue) + self._sending > QUEUE or self._awaits(need)):
                    self._cv.wait(0.05)
                if need is not None and need in self._committed and not self._stopping and (
                        self.replicated is None or self.replicated < need):
                    why = ("a peer was dropped" if self._dead else "replication broke on a link" if self._broken
                           else "a replica or a rank's commit of it failed" if need in self._failed
                           else f"not replicated everywhere within {COMMIT_GRACE_S:.0f} s of being sent")
                    self.stopped = f"the memory checkpoint of step {need} could not be replicated everywhere ({why})"
                    log.error("pccheck: %s; the memory tier takes no more checkpoints on rank %d (its store keeps "
                              "step %s, the newest replicated everywhere, which the peers' replicas pair with)",
                              self.stopped, self.links.rank, self.replicated)
            if self.stopped is None:
                self._started.append(step)
                for old in [s for s in self._sent_at if need is None or s < need]:
                    del self._sent_at[old]
                self._committed = {s for s in self._committed if need is None or s >= need}
                self._failed = {s for s in self._failed if need is None or s >= need}
        self.throttled_s += time.perf_counter() - t0
        return self.stopped is None

    def _awaits(self, step: int | None) -> bool:
        """Whether ``step`` is not replicated everywhere yet but still may be (under ``_cv``):
        this rank has it queued or is sending it, or sent it less than COMMIT_GRACE_S ago (the
        peers are committing it; the log follower sees it). False once a peer was dropped or a
        failure of it (or of a link) was reported."""
        if step is None or self._dead or self._broken or step in self._failed or (
                self.replicated is not None and self.replicated >= step):
            return False
        if self._sending_step == step or any(info.step == step for info in self._queue):
            return True
        sent = self._sent_at.get(step)
        return sent is not None and time.monotonic() - sent < COMMIT_GRACE_S

    def _send_loop(self) -> None:
        seq = 0
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    break
                info = self._queue.popleft()
                self._sending, self._sending_step = True, info.step
            sent = False
            try:
                log.debug("pccheck: sending step %d", info.step)
                sent = self._send(info, seq)
                if sent:
                    seq += 1
                log.debug("pccheck: sent step %d", info.step)
            except Exception:
                log.exception("pccheck: replicating the memory checkpoint of step %d failed", info.step)
            finally:
                if not sent:
                    self.report_failed(info.step)
                with self._cv:
                    self._sending, self._sending_step = False, None
                    if sent:  # its peers are committing it now (throttle may wait for that)
                        self._sent_at[info.step] = time.monotonic()
                    self._cv.notify_all()
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
            mm = self._mapping(info.store_file, f.fileno())
            view = np.frombuffer(mm, dtype=np.uint8, count=end, offset=slot_base(image, info.slot))
            doc = {"step": man.step, "epoch": man.epoch or 0, "counter": man.counter, "data": end,
                   "manifest": raw.decode()}
            if self.incremental:
                doc["incremental"] = True
            sent: dict[int, int] = {}
            for dst in self.links.peers:
                if dst in self._dead:
                    continue
                try:
                    self._kv.set(f"{self.links.rank}>{dst}/{seq}", json.dumps(doc))
                    if self.incremental:
                        sent[dst] = send_needed(self.links.pg, self.links.rank, dst, seq, man, view,
                                                self._waiters["send"], self._recv_stop, TIMEOUT_S)
                    else:
                        send_bytes(self.links.pg, dst, view, self.links.rank, TIMEOUT_S)
                        sent[dst] = end
                except Exception as exc:  # noqa: BLE001 - a dead peer: stop sending to it
                    log.error("pccheck: replica of step %d to rank %d failed (%s); no more replicas go "
                              "to it", man.step, dst, exc)
                    self._dead.add(dst)  # throttle stops the tier: the own store keeps R
                    self.report_failed(None)
                    with self._cv:
                        self._cv.notify_all()
            del view
        total = sum(e.nbytes for e in man.arrays)
        self.sends.append({"step": man.step, "sent": sent, "kept": {d: max(0, total - n) for d, n in sent.items()}})
        self.sent_step = info.step
        return True

    def _mapping(self, path: Path, fd: int) -> mmap.mmap:
        """A private, never written mapping of the store file ``path``, kept from one send to the
        next (sender thread only): a fresh mapping per send faulted all of the slot's pages in
        again (4096 faults per 256 MiB). Unwritten pages of a private file mapping are the file's
        page-cache pages, so it sees every later commit; the slot read is held (never rewritten)
        while it is queued or sent (MemoryCoordinator). A new store generation gets a new mapping."""
        if self._map is None or self._map[0] != path:
            self._unmap()
            self._map = (path, mmap.mmap(fd, 0, access=mmap.ACCESS_COPY))
        return self._map[1]

    def _unmap(self) -> None:
        if self._map is not None:
            try:
                self._map[1].close()
            except BufferError:  # a view is still alive: the mapping goes with its last reference
                pass
            self._map = None

    # -- receiving --------------------------------------------------------------------------------

    def _wait_key(self, who: int | str, key: str, delete: bool = True) -> str | None:
        w = self._waiters[who]
        v = w.wait(key, self._recv_stop)
        if v is not None and delete:
            try:
                w.store.delete_key(key)
            except Exception:  # noqa: BLE001 - only a little memory in the store
                pass
        return v

    def _recv_loop(self, src: int) -> None:
        seq = 0
        while (v := self._wait_key(src, f"{src}>{self.links.rank}/{seq}")) is not None:
            seq += 1
            try:
                doc = json.loads(v)
            except ValueError:
                log.error("pccheck: a malformed replica header from rank %d; replication from it stops", src)
                self.report_failed(None)
                return
            if not isinstance(doc, dict) or doc.get("end") is True:
                if not isinstance(doc, dict):
                    self.report_failed(None)
                return
            try:
                self._receive(src, doc, seq - 1)
            except CorruptCheckpointError as exc:  # every byte arrived: the link is still in step
                log.error("pccheck: replica from rank %d discarded: %s", src, exc)
                self.report_failed(doc["step"] if type(doc.get("step")) is int else None)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dead peer: the pair is gone
                log.error("pccheck: receiving a replica from rank %d failed (%s); replication from it stops",
                          src, exc)
                self.report_failed(None)
                return

    def _receive(self, src: int, doc: dict, seq: int) -> None:
        man, end = _parse_header(doc)
        buf = self._bufs.get(src)
        if buf is None or buf.nbytes < end:
            # touched only on the fallback path: the arrays' descriptions otherwise (never read)
            buf = self._bufs[src] = np.empty(end, dtype=np.uint8)
        view = buf[:end]
        arrays = arrays_of(man, view)
        if doc.get("incremental") is True:
            receive_needed(self._kv, self.links.pg, self.links.rank, src, seq, man, arrays, view,
                           self._store(src, arrays), TIMEOUT_S)
            return
        orch = self._store(src, arrays)
        wire: WireCopyEngine = orch.copy_engine
        layout = plan(arrays)
        same = [(e.name, e.offset, e.nbytes) for e in layout.entries] == [(e.name, e.offset, e.nbytes)
                                                                           for e in man.arrays]
        if orch.engine is not None and same and wire.fits(end, layout.data_len):
            wire.expect((self.links.pg, src, src, TIMEOUT_S, end))  # received into the pool's chunks
            log.debug("pccheck: receiving the replica of step %d from rank %d into the pool", man.step, src)
        else:  # the first replica (no pool yet), or a layout the pool's chunks do not match
            wire.expect(None)
            recv_bytes(self.links.pg, src, view, src, TIMEOUT_S)
        # Returns once every byte is in DRAM chunks; commits behind, and only if the writers'
        # crc32c of every array matches the manifest's (expect_crcs): a damaged replica is never
        # committed.
        try:
            orch.start(man.step, arrays, man.metadata, StartArgs(
                tree=man.tree, epoch=man.epoch, expect_crcs={e.name: c for e, c in zip(man.arrays, man.crcs)}))
        finally:
            wire.expect(None)

    def _store(self, src: int, arrays: dict[str, Any]) -> Orchestrator:
        from .paths import replica_dir

        orch = self._stores.get(src)
        if orch is None:
            def committed(info: CommitInfo, src: int = src) -> None:
                self.held[src] = info.step
                log.debug("pccheck: replica of step %d from rank %d committed", info.step, src)
                self._count_replica(info.step)

            orch = Orchestrator(replica_dir(self.root, src), plan(arrays), self._engine,
                                copy_engine=WireCopyEngine(), on_error=_log_error, retention=KeepOlder(self.keep_last),
                                world_size=self.links.world, rank=src, on_commit=committed, populate_store=True,
                                on_finished=self.finished, in_slot=self.incremental)
            self._stores[src] = orch
        return orch

    def _count_replica(self, step: int) -> None:
        """A replica of ``step`` committed here; the last of all world × (m - 1) logs the step."""
        try:
            pairs = self.links.world * len(self.links.peers)
            if self._kv.add(f"rc/{step}", 1) == pairs:
                i = self._kv.add("rlog", 1)
                self._kv.set(f"rlog/{i}", str(step))
        except Exception as exc:  # noqa: BLE001 - the store went away: nothing more is counted
            log.warning("pccheck: counting the replica of step %d failed: %s", step, exc)

    def finished(self, st: Any) -> None:
        """A checkpoint of a store this rank writes ended (on_finished of the own memory store and
        of each replica store): one that failed will never be replicated everywhere."""
        if st.outcome == "failed":
            self.report_failed(st.step)

    def report_failed(self, step: int | None) -> None:
        """Tells every rank, through the replication log, that ``step`` will never be replicated
        everywhere (``None``: that no later step will, a link broke), so their throttles stop the
        tier at once instead of after COMMIT_GRACE_S. Not while closing (the end of the job)."""
        if self._stopping:
            return
        try:
            i = self._kv.add("rlog", 1)
            self._kv.set(f"rlog/{i}", "!*" if step is None else f"!{int(step)}")
        except Exception as exc:  # noqa: BLE001 - the store went away: the throttle's bound remains
            log.warning("pccheck: reporting a replication failure failed: %s", exc)

    def _follow_replicated(self) -> None:
        i = 1
        while (v := self._wait_key("log", f"rlog/{i}", delete=False)) is not None:
            i += 1
            if v.startswith("!"):  # report_failed's entry
                with self._cv:
                    if v == "!*":
                        self._broken = True
                    else:
                        self._failed.add(int(v[1:]))
                    self._cv.notify_all()
                continue
            step = int(v)
            if self.replicated is None or step > self.replicated:
                if self.coord is not None:  # the slot before it is free before throttle lets the next start
                    self.coord.set_replicated(step)
                with self._cv:  # throttle waits for it
                    self.replicated = step
                    self._cv.notify_all()

    def newest(self) -> dict[str, Any]:
        """The newest step this rank sent to every live peer, the newest replicated everywhere,
        and per source rank the newest replica committed here."""
        out = {"sent": self.sent_step, "replicated": self.replicated, "peer_replicas": dict(sorted(self.held.items())),
               "replication_wait_s": self.throttled_s, "memory_stopped": self.stopped}
        if self.incremental:  # per step sent: array bytes sent to each peer, and left in its slot
            out["replica_bytes"] = list(self.sends)
        return out

    def close(self, deadline_s: float = TIMEOUT_S) -> None:
        """Sends what is pending, ends the sender, waits (bounded) for every source's end."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._threads[0].join(deadline_s)
        if not self._threads[0].is_alive():
            self._unmap()
        for t in self._threads[2:]:  # the receivers end at their source's end marker
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


def _parse_header(doc: dict) -> tuple[Manifest, int]:
    """Checks a replica header (untrusted: bounds on every field) and parses its manifest."""
    step = _int(doc, "step", -(2**63), 2**63 - 1)
    counter = _int(doc, "counter", 1, 2**56 - 1)
    end = _int(doc, "data", 0, MAX_DATA)
    raw = doc.get("manifest")
    if not isinstance(raw, str):
        raise CorruptCheckpointError("replica header lacks the manifest")
    man = parse_manifest(raw.encode(), step=step, counter=counter, data_len_limit=MAX_DATA)
    if data_end(man) != end:
        raise CorruptCheckpointError("replica header's data length disagrees with its manifest")
    return man, end
