"""Restore from the nearest tier that holds the newest step every rank can obtain.

Tiers, nearest first (``TIERS``): this rank's own memory store, a peer's replica of it (pulled
over a gloo group of pccheck's own), this rank's own disk store, and (with ``remote=``) this
rank's part of a step committed on the remote tier (the newest ``PLAN_STEPS`` committed steps,
from one listing and their manifests: pccheck.tiers.remote.inventory.rank_steps). So one rank
may take the remote while another takes its own memory.

Protocol (every rank, collective, at most ``MAX_ROUNDS`` rounds):

1. Each rank scans its own tiers and the replicas it holds, meta records and manifests only
   (every slot checked as FORMAT.md §7 says, a remote step's manifests as §12.2 says, the array
   data not yet read), and publishes the (epoch, step) keys as JSON, minus the ones it found
   damaged in an earlier round.
2. Every rank computes the same plan from the same messages: the newest key every rank can obtain
   (own tiers, or a replica some peer holds), and for each rank the nearest tier holding it.
3. Peers send what the plan asks of them; every rank loads its part and checks every array's
   crc32c (a pulled replica too, before anything of it is used).
4. A vote: if any rank's load failed, that (tier, key) is excluded and the next round plans
   again: the next tier, or an older step. Nothing is put into the model before the vote passed
   (the caller restores only what this returns).
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ... import shutdown
from ...group.distributed import Group
from ...errors import CorruptCheckpointError, NoCheckpointError, PCCheckError
from ...persist.files import rank_dir
from ...persist.layout import MAX_MANIFEST_BYTES, parse_manifest
from ...persist.reader import Prefaulter, fresh_buffer
from ...persist.recovery import Restored, load_slot, read_store, scan, slot_base, slot_manifests
from .replicate import MAX_DATA, TIMEOUT_S, ArrayChecker, arrays_of, data_end, read_raw_manifest
from .paths import memory_rank_dir, replica_dir
from .wire import WIRE_CHUNK, ReplicationError, gather_json, recv_bytes, send_bytes

__all__ = ["TIERS", "load_nearest", "MAX_ROUNDS"]

log = logging.getLogger("pccheck")

TIERS = ("memory", "peer", "disk", "remote")  # nearest first
MAX_ROUNDS = 6
Key = tuple[int, int]  # (epoch, step)


@dataclass(frozen=True)
class _Entry:
    file: Path
    slot: int
    counter: int
    end: int    # bytes of the data region holding arrays
    mlen: int   # manifest bytes


def _scan(directory: Path, world: int, rank: int) -> dict[Key, _Entry]:
    """Every checkpoint of a store directory that passes the meta and manifest checks, written by
    ``rank`` of a job of ``world`` ranks; the newest generation wins a duplicate key."""
    found: dict[Key, _Entry] = {}
    if not directory.is_dir():
        return found
    for gen in scan(directory):
        image = gen.image
        if image is None or (image.header["world_size"], image.header["rank"]) != (world, rank):
            continue
        for st, man in slot_manifests(gen.path, image):
            key = (man.epoch or 0, man.step)
            if key not in found:
                found[key] = _Entry(gen.path, st.slot, man.counter, data_end(man), st.meta["manifest_len"])
    return found


def _load_local(e: _Entry, tier: str, verify: bool) -> Restored:
    image = read_store(e.file)
    with open(e.file, "rb", buffering=0) as f:
        r = load_slot(image, e.slot, fd=f.fileno(), verify=verify)
    return dataclasses.replace(r, tier=tier)


def load_nearest(path: Path, memory_root: Path, group: Group | None, *, verify: bool = True,
                 remote: str | None = None) -> Restored:
    """The newest checkpoint every rank can obtain, each rank's part from its nearest tier
    (memory, a peer's replica, disk, then the remote tier at ``remote``, an ``s3://`` URL).
    Raises NoCheckpointError (naming the ranks that lack it) when no step is complete."""
    if group is None:
        return _load_single(path, memory_root, verify, remote)
    return _Restore(path, memory_root, group, verify, remote).run()


def _remote_keys(url: str | None, rank: int, world: int) -> dict[Key, tuple[int, int]]:
    """(epoch, step) -> (generation, step) the remote tier offers this rank (nothing without a
    URL, or when the prefix cannot be read: logged, and the remote tier's own load still follows
    the plan in load_latest)."""
    if url is None:
        return {}
    from ..remote.inventory import rank_steps

    try:
        return rank_steps(url, rank, world)
    except (PCCheckError, OSError) as exc:
        log.warning("pccheck: rank %d: the remote tier %s offers nothing to the restore plan: %s", rank, url, exc)
        return {}


def _load_remote(url: str, at: tuple[int, int], rank: int, world: int) -> Restored:
    from ..remote.inventory import load_rank_step

    return load_rank_step(url, at[0], at[1], rank, world)


def _load_single(path: Path, memory_root: Path, verify: bool, remote: str | None) -> Restored:
    tiers: dict[str, dict[Key, Any]] = {"memory": _scan(memory_rank_dir(memory_root, None), 1, 0),
                                        "disk": _scan(path, 1, 0), "remote": _remote_keys(remote, 0, 1)}
    keys = sorted({k for t in tiers.values() for k in t}, key=lambda k: (k[1], k[0]), reverse=True)
    for key in keys:
        for tier in ("memory", "disk", "remote"):
            if key in tiers[tier]:
                try:
                    if tier == "remote":
                        assert remote is not None
                        return _load_remote(remote, tiers[tier][key], 0, 1)
                    return _load_local(tiers[tier][key], tier, verify)
                except (CorruptCheckpointError, OSError) as exc:  # OSError: RemoteError too
                    log.warning("pccheck: step %d in the %s tier is damaged (%s); trying the next", key[1], tier, exc)
    raise NoCheckpointError(f"no valid checkpoint in the memory tier {memory_root} nor on disk at {path}"
                            + (f" nor in the newest committed steps of {remote}" if remote else ""))


class _Restore:
    """One collective restore (see the module docstring)."""

    def __init__(self, path: Path, root: Path, group: Group, verify: bool, remote: str | None = None) -> None:
        self.group, self.verify, self.me, self.world = group, verify, group.rank, group.world_size
        self.remote = remote
        # nearest first; "remote" maps a key to its (generation, step), the others to a slot
        self.own: dict[str, dict[Key, Any]] = {
            "memory": _scan(memory_rank_dir(root, self.me), self.world, self.me),
            "disk": _scan(rank_dir(path, self.me), self.world, self.me),
            "remote": _remote_keys(remote, self.me, self.world)}
        self.reps: dict[int, dict[Key, _Entry]] = {}
        for d in root.glob("replica-*") if root.is_dir() else ():
            m = re.fullmatch(r"replica-(\d+)", d.name)
            if m and int(m.group(1)) < self.world and int(m.group(1)) != self.me:
                self.reps[int(m.group(1))] = _scan(d, self.world, int(m.group(1)))
        self.bad: set[tuple[str, int, int, int]] = set()  # (tier, peer or -1, epoch, step) this rank failed
        # pccheck's own gloo group (group.detect_group: made once per job, never the training
        # collectives); every wait on it below is bounded.
        self.pg = group.pg

    def _message(self) -> dict[str, Any]:
        own = {t: [list(k) for k in es if (t, -1, *k) not in self.bad] for t, es in self.own.items()}
        reps = {str(s): [[*k, e.end, e.mlen, e.counter] for k, e in es.items()] for s, es in self.reps.items()}
        return {"own": own, "rep": reps, "bad": sorted(map(list, self.bad))}

    def run(self) -> Restored:
        for rnd in range(MAX_ROUNDS):
            msgs = gather_json(self.pg, self.world, self._message(), TIMEOUT_S)
            key, plan = _plan(msgs, self.world)
            mine = plan[self.me]
            t0 = time.perf_counter()
            result, failure = self._execute(key, plan, msgs, rnd)
            if failure is not None:
                self.bad.add(failure)
            t1 = time.perf_counter()
            votes = gather_json(self.pg, self.world, failure is None, TIMEOUT_S)
            if all(votes):
                assert result is not None
                # the vote's wait is the slowest rank's part (bench.tiers reads these two figures)
                log.info("pccheck: rank %d restored step %d from the %s tier (its part %.3f s, the vote %.3f s)",
                         self.me, key[1], mine[0], t1 - t0, time.perf_counter() - t1)
                return result
        raise NoCheckpointError(f"no checkpoint could be restored on every rank after {MAX_ROUNDS} rounds")

    def _execute(self, key: Key, plan: list[tuple[str, int]], msgs: list[Any], rnd: int
                 ) -> tuple[Restored | None, tuple[str, int, int, int] | None]:
        sends = [r for r, (tier, p) in enumerate(plan) if tier == "peer" and p == self.me]
        errors: list[BaseException] = []
        sender = shutdown.thread(self._serve, "pccheck-replica-serve", (sends, key, rnd, errors))
        tier, peer = plan[self.me]
        try:
            if tier == "peer":
                info = next(x for x in msgs[peer]["rep"][str(self.me)] if tuple(x[:2]) == key)
                return self._pull(peer, key, info, rnd), None
            if tier == "remote":
                assert self.remote is not None
                return _load_remote(self.remote, self.own[tier][key], self.me, self.world), None
            return _load_local(self.own[tier][key], tier, self.verify), None
        except (CorruptCheckpointError, ReplicationError, OSError) as exc:  # OSError: RemoteError too
            log.warning("pccheck: rank %d: step %d from the %s tier failed (%s); falling back", self.me, key[1],
                        tier, exc)
            return None, (tier, peer, *key)
        finally:
            sender.join(TIMEOUT_S * 2)
            if errors:
                log.warning("pccheck: rank %d: serving a replica failed: %s", self.me, errors[0])

    def _serve(self, ranks: list[int], key: Key, rnd: int, errors: list[BaseException]) -> None:
        for r in ranks:
            try:
                e = self.reps[r][key]
                image = read_store(e.file)
                with open(e.file, "rb", buffering=0) as f:
                    raw = read_raw_manifest(image, e.slot, f.fileno())
                    if len(raw) != e.mlen:
                        raise CorruptCheckpointError("the replica changed since it was scanned")
                    send_bytes(self.pg, r, np.frombuffer(bytearray(raw), dtype=np.uint8), rnd, TIMEOUT_S)
                    # straight from the tmpfs pages: no copy, no fresh memory to fault in
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
                        data = np.frombuffer(mm, dtype=np.uint8, count=e.end, offset=slot_base(image, e.slot))
                        send_bytes(self.pg, r, data, rnd, TIMEOUT_S)
                        del data
            except BaseException as exc:  # noqa: BLE001 - the receiver's checks catch what is missing
                errors.append(exc)

    def _pull(self, peer: int, key: Key, info: list[Any], rnd: int) -> Restored:
        end, mlen, counter = (int(x) for x in info[2:5])
        if not (0 <= end <= MAX_DATA and 0 < mlen <= MAX_MANIFEST_BYTES):
            raise CorruptCheckpointError(f"rank {peer} announced a replica of implausible size")
        # Fresh pages, populated a wire chunk at a time by a thread of their own ahead of the
        # receive (reader.Prefaulter): the first touch (here slower than the transfer itself when
        # the kernel's copy faults page by page) overlaps the chunks already on the wire.
        data = fresh_buffer(end)
        pre = Prefaulter(data, WIRE_CHUNK)
        try:
            raw = np.empty(mlen, dtype=np.uint8)
            recv_bytes(self.pg, peer, raw, rnd, TIMEOUT_S)
            try:
                man = parse_manifest(raw.tobytes(), step=key[1], counter=counter, data_len_limit=MAX_DATA)
                if (man.epoch or 0) != key[0] or data_end(man) != end:
                    raise CorruptCheckpointError(f"rank {peer}'s replica is not the one it announced")
            except CorruptCheckpointError:  # the peer sends it anyway: keep the pair in step
                recv_bytes(self.pg, peer, data, rnd, TIMEOUT_S, ready=pre.wait)
                raise
            # every array checked as its last chunk lands, while the next chunks are on the wire
            check = ArrayChecker(man, data) if self.verify else None
            recv_bytes(self.pg, peer, data, rnd, TIMEOUT_S, on_chunk=check, ready=pre.wait)
            if check is not None:
                check.finish()
        finally:
            pre.close()  # invariant (populate's): nothing is populated once bytes may have landed
        state = arrays_of(man, data, torch_views=False)  # raw carriers; torch_dtypes says the rest
        return Restored(man.step, state, man.metadata, man.counter, 0, -1, Path(f"peer:rank-{peer}"),
                        {e.name: e.torch_dtype for e in man.arrays if e.torch_dtype}, man.tree, man.epoch,
                        tier="peer")


def _plan(msgs: list[Any], world: int) -> tuple[Key, list[tuple[str, int]]]:
    """The newest key every rank can obtain, and for each rank (tier, peer or -1). Pure: every
    rank computes the same plan from the same messages."""
    bad = {(r, b[0], int(b[1]), int(b[2]), int(b[3])) for r, m in enumerate(msgs) for b in m["bad"]}
    own = [{t: {tuple(map(int, k)) for k in ks} for t, ks in m["own"].items()} for m in msgs]
    held: dict[int, dict[Key, list[int]]] = {r: {} for r in range(world)}
    for p, m in enumerate(msgs):
        for s, entries in m["rep"].items():
            s = int(s)
            for x in entries:
                k = (int(x[0]), int(x[1]))
                if 0 <= s < world and s != p and (s, "peer", p, *k) not in bad:
                    held[s].setdefault(k, []).append(p)
    obtain = [set().union(*own[r].values()) | set(held[r]) for r in range(world)]
    common = set.intersection(*obtain) if obtain else set()
    if not common:
        every = set().union(*obtain)
        if not every:
            raise NoCheckpointError(f"no rank of {world} holds any checkpoint (memory, peers, disk or remote)")
        newest = max(every, key=lambda k: (k[1], k[0]))
        missing = [r for r in range(world) if newest not in obtain[r]]
        raise NoCheckpointError(f"no step can be restored on every rank: ranks {missing} cannot obtain step "
                                f"{newest[1]} (nor any step the others hold) from memory, a peer, disk or the "
                                f"remote tier; their node's memory and its replicas are gone, their disk holds "
                                f"none, and no remote= prefix holds one for them")
    key = max(common, key=lambda k: (k[1], k[0]))
    plan: list[tuple[str, int]] = []
    for r in range(world):  # nearest first (TIERS)
        if key in own[r].get("memory", set()):
            plan.append(("memory", -1))
        elif key in held[r]:
            plan.append(("peer", min(held[r][key])))
        elif key in own[r].get("disk", set()):
            plan.append(("disk", -1))
        else:  # key is in obtain[r]: the remote tier holds it
            plan.append(("remote", -1))
    return key, plan
