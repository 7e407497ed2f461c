"""Messages between ranks for the memory tier: JSON (never pickle) and raw bytes, on a gloo group
of pccheck's own, every wait bounded.

Invariant: a receive is only ever posted when the sender is known to be sending (its header was
read from the key-value store, or the restore plan every rank computed says so): a gloo receive
that times out closes the pair for good.
"""

from __future__ import annotations

import errno
import json
import threading
from collections import deque
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from ...errors import PCCheckError, ReplicationError
from ...group.keys import wait_key
from ...orchestrator.copy_engine import CpuCopyEngine, Sources, abandon, acquire_chunk_for

__all__ = ["ReplicationError", "gather_json", "send_bytes", "recv_bytes", "send_views", "recv_views", "wire_bytes",
           "private_store", "MAX_JSON", "WIRE_CHUNK", "WINDOW", "KeyWaiter", "WireCopyEngine"]

MAX_JSON = 64 << 20          # bytes of one rank's JSON in gather_json
WIRE_CHUNK = 16 << 20        # bytes per gloo send/recv
WINDOW = 4                   # chunks in flight per transfer (bench: 16 MiB x 1 ran ~1.5x one 256 MiB send)
WAIT_SLICE = timedelta(milliseconds=500)  # KeyWaiter: one blocking wait; a thread sees its stop within it

# Array bytes this process put on the wire and took off it, all links together (wire_bytes): what an
# incremental replica saves is measured here, where the bytes travel, not by the planner's count.
_counted = {"sent": 0, "received": 0}
_count_lock = threading.Lock()


def _count(kind: str, n: int) -> None:
    with _count_lock:
        _counted[kind] += int(n)


def wire_bytes() -> dict[str, int]:
    """Bytes this process sent and received with send_bytes / recv_bytes / send_views /
    recv_views / WireCopyEngine since it started (replicas and restores served together)."""
    with _count_lock:
        return dict(_counted)


def gather_json(pg: Any, world: int, obj: Any, timeout_s: float) -> list[Any]:
    """Every rank's ``obj`` (JSON-able), in rank order. Collective on ``pg``."""
    import torch
    import torch.distributed as dist

    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_JSON:
        raise ReplicationError(f"a message of {len(data)} bytes exceeds {MAX_JSON}")
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _wait(dist.all_gather(sizes, n, group=pg, async_op=True), timeout_s, "gathering message sizes")
    top = max(int(s.item()) for s in sizes)
    if not 0 <= top <= MAX_JSON:
        raise ReplicationError(f"a peer announced a message of {top} bytes (limit {MAX_JSON})")
    buf = torch.zeros(max(1, top), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    outs = [torch.zeros(max(1, top), dtype=torch.uint8) for _ in range(world)]
    _wait(dist.all_gather(outs, buf, group=pg, async_op=True), timeout_s, "gathering messages")
    docs = []
    for size, out in zip(sizes, outs):
        try:
            docs.append(json.loads(out[:int(size.item())].numpy().tobytes().decode()))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise ReplicationError("a peer sent a message that is not JSON") from None
    return docs


def private_store(shared: Any, prefix: str, timeout_s: float) -> Any:
    """A key-value store for the tier's threads under ``prefix``: a connection of its own to the
    job's TCPStore when there is one (a TCPStore client serialises its operations, and
    pccheck.distributed's followers hold the shared one in 200 ms blocking waits), else ``shared``.
    Collective only in that every rank must use the same prefix."""
    return _private(shared, prefix, timeout_s)[0]


def _private(shared: Any, prefix: str, timeout_s: float) -> tuple[Any, bool]:
    """private_store's store, and whether it is a connection of its own (blocking waits on it
    hold up nobody else)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    inner = c10d._get_default_store()
    while isinstance(inner, dist.PrefixStore):
        inner = inner.underlying_store
    if isinstance(inner, dist.TCPStore):
        own = dist.TCPStore(inner.host, inner.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        return dist.PrefixStore(f"pccheck-tiers/{prefix}", own), True
    return dist.PrefixStore(f"tiers/{prefix}", shared), False


class KeyWaiter:
    """One thread's waits for keys under ``prefix`` (private_store's namespace). On a TCPStore it
    has a connection of its own and blocks in the server's wait, ``WAIT_SLICE`` at a time (to see
    ``stop``): the key is seen as soon as it is set, at a few requests a second, where polling
    every 10 ms cost each waiting thread and the store's server ~0.01 CPU-s per 0.4 s
    iteration. Elsewhere (a store shared with others) it polls (``wait_key(blocking=False)``). Use it
    from one thread only: a blocking wait holds its connection."""

    def __init__(self, store: Any, own: bool) -> None:
        self.store, self._own = store, own  # own: a connection nobody else uses (blocking waits)

    @classmethod
    def connect(cls, shared: Any, prefix: str, timeout_s: float) -> "KeyWaiter":
        """A waiter in private_store's namespace ``prefix``, on a connection of its own if it can."""
        return cls(*_private(shared, prefix, timeout_s))

    def wait(self, key: str, stop: Any) -> str | None:
        """The value of ``key`` once it is set, or None once ``stop`` (a threading.Event) is set."""
        return wait_key(self.store, key, stop.is_set, blocking=self._own, slice_s=WAIT_SLICE.total_seconds())


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise ReplicationError(f"{what}: {exc}") from None


def send_bytes(pg: Any, dst: int, view: np.ndarray, tag: int, timeout_s: float) -> None:
    """Sends a uint8 array chunk by chunk (``WIRE_CHUNK``) to group rank ``dst``, ``WINDOW``
    chunks in flight (a wait per chunk would leave the link idle for a round trip each time)."""
    send_views(pg, dst, [view], tag, timeout_s)


def send_views(pg: Any, dst: int, views: list[np.ndarray], tag: int, timeout_s: float) -> None:
    """send_bytes of several uint8 arrays, one after the other, ``WINDOW`` chunks in flight across
    them (an incremental replica's changed arrays: no round trip per array). The receiver posts
    :func:`recv_views` of arrays of the same sizes."""
    import torch
    import torch.distributed as dist

    pending: deque = deque()
    for view in views:
        for off in range(0, view.nbytes, WIRE_CHUNK):
            t = torch.from_numpy(view[off:off + WIRE_CHUNK])
            pending.append(dist.isend(t, group_dst=dst, group=pg, tag=tag))
            if len(pending) >= WINDOW:
                _wait(pending.popleft(), timeout_s, f"sending to rank {dst}")
    while pending:
        _wait(pending.popleft(), timeout_s, f"sending to rank {dst}")
    _count("sent", sum(v.nbytes for v in views))


def recv_bytes(pg: Any, src: int, into: np.ndarray, tag: int, timeout_s: float,
               on_chunk: Callable[[int, int], None] | None = None,
               ready: Callable[[int], None] | None = None) -> None:
    """Receives ``into.nbytes`` bytes from group rank ``src`` in the chunks send_bytes used,
    ``WINDOW`` posted at a time; ``on_chunk(offset, nbytes)`` runs for each chunk as it completes,
    in order, while the later ones are still arriving (a checksum then overlaps the transfer).
    ``ready(end)`` runs before each chunk's receive is posted (a reader.Prefaulter's wait: the
    chunk's pages populated first, so the kernel's copy does not fault them one by one)."""
    import torch
    import torch.distributed as dist

    pending: deque = deque()

    def done() -> None:
        work, off, n = pending.popleft()
        _wait(work, timeout_s, f"receiving from rank {src}")
        if on_chunk is not None:
            on_chunk(off, n)

    for off in range(0, into.nbytes, WIRE_CHUNK):
        t = torch.from_numpy(into[off:off + WIRE_CHUNK])
        if ready is not None:
            ready(off + t.numel())
        pending.append((dist.irecv(t, group_src=src, group=pg, tag=tag), off, t.numel()))
        if len(pending) >= WINDOW:
            done()
    while pending:
        done()
    _count("received", into.nbytes)


def recv_views(pg: Any, src: int, views: list[np.ndarray], tag: int, timeout_s: float) -> None:
    """Receives what :func:`send_views` sent into arrays of the same sizes, ``WINDOW`` chunks
    posted at a time across them."""
    import torch
    import torch.distributed as dist

    pending: deque = deque()
    for view in views:
        for off in range(0, view.nbytes, WIRE_CHUNK):
            t = torch.from_numpy(view[off:off + WIRE_CHUNK])
            pending.append(dist.irecv(t, group_src=src, group=pg, tag=tag))
            if len(pending) >= WINDOW:
                _wait(pending.popleft(), timeout_s, f"receiving from rank {src}")
    while pending:
        _wait(pending.popleft(), timeout_s, f"receiving from rank {src}")
    _count("received", sum(v.nbytes for v in views))


class WireCopyEngine(CpuCopyEngine):
    """A replica store's copy engine: with a link set (:meth:`expect`), a checkpoint's chunks are
    *received*, as send_bytes sent them (``WIRE_CHUNK`` pieces, ``WINDOW`` in flight), and handed
    to the writers as each lands; without one it copies like the CPU engine. An in-place job (a
    tmpfs replica store: ``Job.in_place``) receives straight into the slot's mapping, so a replica
    costs the kernel's copy alone and the writers only checksum it; otherwise into the pool's
    (prefaulted) chunks. Every byte is still checked: the writers' crc32c must match the
    manifest's (StartArgs.expect_crcs) before the commit. A link needs the replica's layout to put
    every array where the sender's manifest has it (:func:`fits`)."""

    name = "wire"

    def __init__(self) -> None:
        super().__init__(threads=1)
        self._link: tuple[Any, int, int, float, int] | None = None

    def fits(self, end: int, data_len: int) -> bool:
        """Whether ``end`` bytes sent in WIRE_CHUNK pieces land whole in this pool's chunks of a
        stream of ``data_len`` bytes (the caller has checked that the offsets match)."""
        chunk = self.native_engine.chunk_size if self.native_engine is not None else 0
        return 0 < end <= data_len and chunk > 0 and (chunk % WIRE_CHUNK == 0 or end <= min(chunk, WIRE_CHUNK))

    def expect(self, link: tuple[Any, int, int, float, int] | None) -> None:
        """(pg, src, tag, timeout_s, end) for the next copy (receiver thread only), or None."""
        self._link = link

    def copy(self, job: Any, src: Sources, until: int = 0) -> None:
        if self._link is None:
            super().copy(job, src, until)
            return
        import ctypes

        pg, peer, tag, timeout_s, end = self._link
        self._link = None
        in_place = job.in_place
        pending: deque = deque()  # (works, k, pool chunk id or None in place), oldest first
        got = 0
        try:
            while (k := job.claim()) >= 0:
                n, base = job.chunk_len(k), k * self.native_engine.chunk_size
                if in_place:
                    cid, addr = None, job.in_place_chunk(k)  # OSError: k skipped, the job failed
                else:
                    cid = acquire_chunk_for(job, k)
                    addr = self.native_engine.chunk_address(cid)
                mem = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))
                have = max(0, min(n, end - base))
                got += have
                mem[have:] = 0  # beyond the bytes sent: the slot's padding
                pending.append(([_irecv(pg, peer, mem[o:min(have, o + WIRE_CHUNK)], tag)
                                 for o in range(0, have, WIRE_CHUNK)], k, cid))
                if len(pending) >= WINDOW:
                    _landed(pending, job, peer, timeout_s)
            while pending:
                _landed(pending, job, peer, timeout_s)
            _count("received", got)
        except BaseException:
            # Invariant: memory a receive may still be posted into is never reused: a pool chunk
            # never goes back to the pool (a late write would land in another checkpoint's chunk),
            # and an in-place slot is only released into a store that takes no more transfers
            # (the receiver stops on every failure but a checksum mismatch, which comes only after
            # every byte landed). The pair is broken: this replica store takes no more.
            for _, k, cid in pending:
                job.skip(k, errno.EIO)
                if cid is None:
                    job.release_in_place()
            abandon(job, errno.EIO)
            raise


def _irecv(pg: Any, src: int, into: np.ndarray, tag: int) -> Any:
    import torch
    import torch.distributed as dist

    return dist.irecv(torch.from_numpy(into), group_src=src, group=pg, tag=tag)


def _landed(pending: deque, job: Any, src: int, timeout_s: float) -> None:
    """Waits for the oldest chunk's receives, then hands it to the writers (it leaves ``pending``
    only then: if a wait fails, the caller still sees it)."""
    works, k, cid = pending[0]
    for w in works:
        _wait(w, timeout_s, f"receiving from rank {src}")
    pending.popleft()
    if cid is None:
        job.submit_in_place(k)
    else:
        job.submit(k, cid)
