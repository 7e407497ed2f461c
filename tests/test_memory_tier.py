"""The memory tier: tmpfs checkpoints every iteration, replicated to a peer node, restored
from the nearest tier. Two nodes are simulated on this machine: two torchrun agents on 127.0.0.1
with c10d rendezvous, each node with its own memory and disk directories (_tier_train.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import pccheck
from pccheck.errors import ConfigError, NoSpaceError
from pccheck.persist.recovery import read_store, slot_base, store_files
from pccheck.tiers.memory import group_of, replica_nodes, replica_ranks

CHILD = str(Path(__file__).with_name("_tier_train.py"))
STEPS = 14


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun agents (one rank each), started node 0 first: c10d orders the agents by
    (host, pid), so node 0's agent gets GROUP_RANK 0."""

    def __init__(self, base: Path, *args: str) -> None:
        port, self.lines, self.procs = _port(), [], []
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        for node in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=t{port}",
                   "--max-restarts=0", "--monitor-interval=0.1", "--local-addr=127.0.0.1", CHILD, str(base),
                   str(STEPS), *args]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=env, start_new_session=True))
            self.lines.append([])
            time.sleep(0.5 if node == 0 else 0)
        self.readers = [threading.Thread(target=self._read, args=(n,), daemon=True) for n in range(2)]
        for t in self.readers:
            t.start()

    def _read(self, n: int) -> None:
        for line in self.procs[n].stdout:  # type: ignore[union-attr]
            self.lines[n].append(line.strip())

    def _tagged(self, n: int, tag: str) -> list[list[str]]:
        return [l.split()[1:] for l in list(self.lines[n]) if l == tag or l.startswith(tag + " ")]

    def losses(self, n: int) -> dict[int, float]:
        return {int(a): float(b) for a, b in self._tagged(n, "LOSS")}

    def start(self, n: int, timeout: float = 180) -> tuple[int, str]:
        t0 = time.monotonic()
        while not (s := self._tagged(n, "START")):
            assert time.monotonic() - t0 < timeout and self.procs[n].poll() is None, \
                f"node {n} did not start: {self.lines[n][-5:]} {self.procs[n].stderr.read()[-3000:]}"
            time.sleep(0.02)
        return int(s[0][0]), s[0][1]

    def wait(self) -> None:
        for p in self.procs:
            p.wait(240)
        for t in self.readers:
            t.join(10)
        errs = [p.stderr.read() for p in self.procs if p.returncode != 0]  # type: ignore[union-attr]
        assert not errs, errs[0][-4000:]

    def kill_when(self, step: int, timeout: float = 180) -> None:
        """SIGKILLs every process of both nodes (agents and ranks) once both ranks printed ``step``."""
        t0 = time.monotonic()
        while not all(step in self.losses(n) for n in range(2)):
            assert time.monotonic() - t0 < timeout, f"no step {step}: {self.lines}"
            assert all(p.poll() is None for p in self.procs), [p.stderr.read()[-3000:] for p in self.procs]
            time.sleep(0.02)
        self.kill()

    def tag_when(self, n: int, tag: str, timeout: float = 180) -> list[str]:
        """The fields of node ``n``'s first ``tag`` line, once it printed one."""
        t0 = time.monotonic()
        while not (found := self._tagged(n, tag)):
            assert time.monotonic() - t0 < timeout, f"node {n} printed no {tag}: {self.lines}"
            time.sleep(0.02)
        return found[0]

    def kill(self) -> None:
        """SIGKILLs every process of both nodes (agents and ranks) still alive."""
        pids = [int(x[0]) for n in range(2) for x in self._tagged(n, "PID")]
        for p in self.procs:
            os.killpg(p.pid, signal.SIGKILL)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.wait(30)
        for pid in pids:  # the ranks are gone before anyone looks at their files
            while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                time.sleep(0.01)


def _check(job: Nodes, ref: dict, want_tiers: set[str]) -> int:
    starts = {job.start(n) for n in range(2)}
    steps = {s for s, _ in starts}
    assert len(steps) == 1, f"nodes resumed at different steps {starts}"
    start = steps.pop()
    assert {t for _, t in starts} <= want_tiers, starts
    for n in range(2):
        losses = job.losses(n)
        assert losses, job.lines[n][-5:]
        for s, v in losses.items():  # bit for bit: the same float as the uninterrupted run
            assert v == ref["losses"][n][s], (n, s)
    return start


def _compare_final(base: Path, ref: dict) -> None:
    for r in range(2):
        got = torch.load(base / f"final-{r}.pt", weights_only=True)
        for k, v in ref["final"][r].items():
            assert torch.equal(got[k], v), k


def _damage_newest(directory: Path) -> int:
    """Flips a byte in the array data of the newest committed slot of a store; returns its step."""
    _, file = store_files(directory)[0]
    image = read_store(file)
    st = max((s for s in image.slots if s.meta), key=lambda s: s.meta["counter"])
    with open(file, "r+b") as f:
        off = slot_base(image, st.slot) + 100
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    return st.meta["step"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted two-node run in the default memory options (keep_last=0): its losses, its
    final tensors, and its memory directories (the footprint test reads their store files)."""
    base = tmp_path_factory.mktemp("ref")
    job = Nodes(base, "--final")
    job.wait()
    return {"losses": [job.losses(n) for n in range(2)], "base": base,
            "final": [torch.load(base / f"final-{r}.pt", weights_only=True) for r in range(2)]}


def _footprint(mem: Path, source: int) -> tuple[int, int, float]:
    """(own slots, replica slots, tmpfs bytes of both store files over one slot's capacity) of a
    node's memory directory holding its rank's own store and the replicas of ``source``; beyond
    the slots each file holds its header and one meta block per slot, nothing more."""
    images = []
    for store in (mem / f"rank-{1 - source}", mem / f"replica-{source}"):
        (_, file), = store_files(store)
        image = read_store(file)
        h = image.header
        assert file.stat().st_size == h["file_size"] == h["slots_offset"] + h["num_slots"] * h["slot_capacity"]
        assert h["slots_offset"] <= (2 + h["num_slots"]) * 4096, h
        images.append((image, file.stat().st_size))
    (own, own_bytes), (rep, rep_bytes) = images
    assert own.header["slot_capacity"] == rep.header["slot_capacity"]  # a replica slot holds a whole own slot
    return len(own.slots), len(rep.slots), (own_bytes + rep_bytes) / own.header["slot_capacity"]


def test_footprint_is_four_slots_of_the_state_per_rank_at_replicas_2(reference):
    """The default memory options at replicas=2 (the reference run's stores, on both nodes): the
    own store 2 slots (in flight, the newest replicated everywhere) and the replica store 2 (the
    newest replica, the one being received): 4 slots of the state per rank, plus headers and meta
    blocks (a few KiB). keep_last=1's 3 + 3 is checked by the node-loss tests below."""
    for node in range(2):
        own, rep, ratio = _footprint(reference["base"] / f"node-{node}" / "mem", 1 - node)
        assert (own, rep) == (2, 2) and 4 < ratio < 4.5, (node, own, rep, ratio)


def test_footprint_of_a_group_without_replicas_is_the_global_step_and_keep_last_more(tmp_path, reference):
    """replicas=1 on two nodes, keep_last=1: each rank's own store has 4 slots (1 in flight, the
    newest, §8's global step, one older global step) and no replica store; the run is bit for bit
    the reference's."""
    job = Nodes(tmp_path, "--final", "--replicas", "1", "--keep-last", "1")
    job.wait()
    _check(job, reference, {"none"})
    _compare_final(tmp_path, reference)
    for node in range(2):
        mem = tmp_path / f"node-{node}" / "mem"
        assert not list(mem.glob("replica-*"))
        (_, file), = store_files(mem / f"rank-{node}")
        assert len(read_store(file).slots) == 4
        assert len(_committed_steps(mem / f"rank-{node}")) == 4  # the newest four steps, all still valid


def test_two_nodes_crash_node_loss_damaged_replica_and_group_loss(tmp_path, reference):
    """One chain of faults on two simulated nodes (replicas=2, memory every step with
    keep_last=1, disk every 4):
    1. SIGKILL of every process, then node 1 lost (its memory and disk wiped) and the newest
       replica of rank 1 on node 0 damaged: rank 0 resumes from its own memory, rank 1 pulls the
       older intact replica from node 0, never the damaged one; bit for bit to the end (node 1's
       disk is gone with it: the older replica is rank 1's only copy, so with keep_last=1 a
       replica store keeps two committed replicas and the own store the two steps they pair with);
    2. both nodes' memory gone (the whole group), disks left: resume from disk, bit for bit."""
    job = Nodes(tmp_path, "--sleep", "0.3", "--keep-last", "1")
    job.kill_when(6)
    own, rep, ratio = _footprint(tmp_path / "node-0" / "mem", 1)  # 3 slots own, 3 per replica source
    assert (own, rep) == (3, 3) and 6 < ratio < 6.5, (own, rep, ratio)
    shutil.rmtree(tmp_path / "node-1")
    damaged = _damage_newest(tmp_path / "node-0" / "mem" / "replica-1")
    job = Nodes(tmp_path, "--resume", "--final", "--keep-last", "1")
    job.wait()
    start = _check(job, reference, {"memory", "peer"})
    assert [job.start(n)[1] for n in range(2)] == ["memory", "peer"] and 1 <= start < damaged
    _compare_final(tmp_path, reference)
    for n in range(2):
        shutil.rmtree(tmp_path / f"node-{n}" / "mem")
    job = Nodes(tmp_path, "--resume", "--final", "--keep-last", "1")
    job.wait()
    assert _check(job, reference, {"disk"}) == STEPS // 4 * 4  # the newest disk checkpoint
    _compare_final(tmp_path, reference)


def _wait_committed(directory: Path, step: int, timeout: float = 30) -> None:
    t0 = time.monotonic()
    while step not in (got := _committed_steps(directory)):
        assert time.monotonic() - t0 < timeout, f"{directory} never committed step {step}: {got}"
        time.sleep(0.02)


@pytest.mark.parametrize("keep_last", [pytest.param(1, marks=pytest.mark.slow), 0])  # keep_last=1: 30-40 s more
def test_node_loss_with_the_newest_replica_damaged(tmp_path, reference, keep_last):
    """Rank 1 dies while sending its replica of step 6 (node 0 holds its replica of 5, and of 4
    with keep_last=1), rank 0 commits its own 6; then every process is killed, node 1 lost (its
    memory and disk wiped; the disk holds no checkpoint yet: disk every 100) and rank 1's newest
    replica on node 0 (step 5) damaged.
    keep_last=1: rank 0 resumes from its own memory at step 4, rank 1 from the older replica,
    bit for bit to the end.
    keep_last=0 (default): node 0 holds no older replica of rank 1 that rank 0 still pairs with
    (its own store: 5 and 6): the memory tier holds no step every rank can obtain, and with no
    tier after it (no remote=) load_latest raises NoCheckpointError on every rank, naming rank 1;
    the script reports it and starts over at step 0 (bit for bit against the reference too)."""
    k = str(keep_last)
    job = Nodes(tmp_path, "--sleep", "0.3", "--die-mid-send", "1:6", "--disk-interval", "100", "--keep-last", k)
    assert job.tag_when(1, "MIDSEND") == ["6"]
    _wait_committed(tmp_path / "node-0" / "mem" / "rank-0", 6)
    job.kill()
    own = _committed_steps(tmp_path / "node-0" / "mem" / "rank-0")
    held = _committed_steps(tmp_path / "node-0" / "mem" / "replica-1")
    assert max(held) == 5 and ({4, 5} <= held if keep_last else True) and {5, 6} <= own, (held, own)
    shutil.rmtree(tmp_path / "node-1")
    assert _damage_newest(tmp_path / "node-0" / "mem" / "replica-1") == 5
    job = Nodes(tmp_path, "--resume", "--final", "--disk-interval", "100", "--keep-last", k)
    job.wait()
    if keep_last:
        assert _check(job, reference, {"memory", "peer"}) == 4
        assert [job.start(n)[1] for n in range(2)] == ["memory", "peer"]
    else:
        assert _check(job, reference, {"none"}) == 0
        for n in range(2):
            (why,) = job._tagged(n, "NOCHECKPOINT")
            assert "ranks [1] cannot obtain step" in " ".join(why), why
    _compare_final(tmp_path, reference)


def _committed_steps(directory: Path) -> set[int]:
    """The steps of every committed slot of the store in ``directory`` (meta and manifest checked)."""
    from pccheck.persist.recovery import slot_manifests

    return {man.step for _, file in store_files(directory) for _, man in slot_manifests(file, read_store(file))}


@pytest.mark.slow  # three two-node jobs (~40-60 s on 2 vCPUs): `make test-slow`
def test_sender_killed_mid_transfer_then_peer_killed_while_serving(tmp_path, reference):
    """Two faults of the wire, on two simulated nodes (replicas=2, memory every step):
    1. rank 1 is SIGKILLed after the first 4 KiB of its replica of step 6 went out: node 0 never
       commits that replica (it holds older ones only); then every process is killed and node 1
       lost (its directories wiped);
    2. the resume: rank 0 serves rank 1 the newest intact replica and is SIGKILLed after its
       first chunk: rank 1's load_latest raises a PCCheckError and its model keeps its initial
       values (nothing of the half-received replica is loaded);
    3. the job restarts: rank 0 from its own memory, rank 1 from node 0's replica, at the newest
       step replicated before the kill (older than 6), bit for bit to the end."""
    job = Nodes(tmp_path, "--sleep", "0.3", "--die-mid-send", "1:6")
    assert job.tag_when(1, "MIDSEND") == ["6"]
    job.kill()
    held = _committed_steps(tmp_path / "node-0" / "mem" / "replica-1")
    assert held and max(held) < 6, held  # the half-sent replica was never committed
    shutil.rmtree(tmp_path / "node-1")
    job = Nodes(tmp_path, "--resume", "--die-mid-serve", "0")
    job.tag_when(0, "MIDSERVE")
    failed = job.tag_when(1, "RESTOREFAILED")
    assert job.tag_when(1, "UNTOUCHED") == ["True"], failed
    assert not job.losses(1) and not job._tagged(1, "START")
    job.kill()
    job = Nodes(tmp_path, "--resume", "--final")
    job.wait()
    start = _check(job, reference, {"memory", "peer"})
    assert [job.start(n)[1] for n in range(2)] == ["memory", "peer"] and start == max(held)
    _compare_final(tmp_path, reference)


@pytest.mark.slow  # three two-node jobs (~40-60 s on 2 vCPUs): `make test-slow`
def test_fsdp2_state_node_loss_resumes_from_the_peer_bit_for_bit(tmp_path):
    """FSDP2 (DTensor shards on a CPU mesh, gloo) through the memory tier, replicas=2, every step:
    SIGKILL of every process after step 6, node 1 lost (its memory and disk wiped): rank 0 resumes
    from its own memory, rank 1 from node 0's replica of its shards (and rank 0's copy of the
    tensors only rank 0 stores), bit for bit against an uninterrupted run."""
    ref_job = Nodes(tmp_path / "ref", "--fsdp", "--final")
    ref_job.wait()
    ref = {"losses": [ref_job.losses(n) for n in range(2)],
           "final": [torch.load(tmp_path / "ref" / f"final-{r}.pt", weights_only=True) for r in range(2)]}
    job = Nodes(tmp_path / "run", "--fsdp", "--sleep", "0.3")
    job.kill_when(6)
    shutil.rmtree(tmp_path / "run" / "node-1")
    job = Nodes(tmp_path / "run", "--fsdp", "--resume", "--final")
    job.wait()
    start = _check(job, ref, {"memory", "peer"})
    # replication lags by at most 1 step (a memory checkpoint waits for the previous one's)
    assert [job.start(n)[1] for n in range(2)] == ["memory", "peer"] and start >= 2, start
    _compare_final(tmp_path / "run", ref)


@pytest.mark.slow  # a longer round: `make test-slow`
def test_two_nodes_every_rank_killed_resumes_from_own_memory(tmp_path, reference):
    """SIGKILL of every process twice: both ranks resume from their own memory, bit for bit,
    having lost at most the checkpoints in flight."""
    job = Nodes(tmp_path, "--sleep", "0.3")
    job.kill_when(5)
    for _ in range(2):
        job = Nodes(tmp_path, "--resume", "--sleep", "0.3")
        start = job.start(0)[0]
        job.kill_when(min(STEPS, start + 3))
        assert _check(job, reference, {"memory"}) >= 2


def _single(base: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CHILD, str(base), str(STEPS), "--single", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _output(p: subprocess.Popen) -> str:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    return out


def _tag(out: str, tag: str) -> list[list[str]]:
    return [l.split()[1:] for l in out.splitlines() if l.startswith(tag + " ")]


def test_single_process_sigkill_resumes_from_memory_bit_for_bit(tmp_path):
    """One process, memory every step and disk every 4: SIGKILL right after step 6 printed (the
    disk holds step 4 at most), resume from memory at step >= 5, bit for bit to the end."""
    ref = _single(tmp_path / "ref", "--final")
    want = {int(a): float(b) for a, b in _tag(_output(ref), "LOSS")}
    p = _single(tmp_path / "run", "--sleep", "0.25")
    seen = []
    for line in p.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if line.startswith("LOSS 6 "):
            os.kill(p.pid, signal.SIGKILL)
            break
    p.wait(30)
    out = _output(_single(tmp_path / "run", "--resume", "--final"))
    got = _tag(out, "LOSS")
    (start, tier), = [(int(a), b) for a, b in _tag(out, "START")]
    assert tier == "memory" and start >= 5, (start, tier)
    assert {int(a): float(b) for a, b in got} == {s: v for s, v in want.items() if s > start}
    a = torch.load(tmp_path / "ref" / "final-0.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final-0.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_placement_groups_and_mixed():
    assert group_of(3, 4, 2) == [2, 3] and replica_nodes(0, 4, 2) == [1]
    # 5 nodes, m = 2: one group of 2, then a ring of 3
    assert [replica_nodes(n, 5, 2) for n in range(5)] == [[1], [0], [3], [4], [2]]
    assert [replica_nodes(n, 7, 3) for n in range(7)][3:] == [[4, 5], [5, 6], [3, 6], [3, 4]]
    assert replica_ranks(1, [0, 0, 1, 1], 2) == [3]
    with pytest.raises(ConfigError, match="replicas=3 needs at least 3 nodes"):
        replica_nodes(0, 2, 3)


def test_replicas_beyond_nodes_is_a_clear_error(tmp_path):
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="replicas=2 needs at least 2 nodes"):
        pccheck.Checkpointer(m, torch.optim.SGD(m.parameters(), lr=0.1), tmp_path / "ck", memory_interval=1,
                             memory_dir=tmp_path / "mem", replicas=2)


def test_memory_need_counts_the_slots_of_each_keep_last():
    """check_room's size: own slots (2 single-process and with replication, 3 in a group without:
    §8's global step; keep_last more) and 2 + keep_last per source rank whose replicas this rank
    holds, each slot with its meta block, plus headers."""
    from pccheck.tiers.memory.shm_store import BLOCK, memory_need, own_slots, replica_slots

    assert [own_slots(k, False, False) for k in (0, 1)] == [2, 3]    # single process
    assert [own_slots(k, True, False) for k in (0, 1)] == [3, 4]     # a group, no replicas
    assert [own_slots(k, True, True) for k in (0, 1)] == [2, 3]      # replicated
    assert [replica_slots(k) for k in (0, 1)] == [2, 3]
    slot = 1 << 20
    assert memory_need(slot, 2, 0, 2) == 2 * slot + 3 * BLOCK
    assert memory_need(slot, 2, 1, 2) == 4 * slot + 6 * BLOCK   # replicas=2: 4 x the state
    assert memory_need(slot, 3, 1, 3) == 6 * slot + 8 * BLOCK   # replicas=2, keep_last=1: 6 x
    assert memory_need(slot, 2, 2, 2) == 6 * slot + 9 * BLOCK   # replicas=3


def test_memory_every_keep_last_and_keep_every_as_the_tier_table_says(tmp_path):
    """memory.every=3 beside disk.every=5 over steps 1..10: RAM takes 3, 6, 9 into 2 slots; with
    keep_last=1 over steps 1..12 one more slot keeps an older checkpoint (6 beside 9, 12); keep_last
    above 1 and keep_every are ConfigErrors naming the disk tier's fields; the 0.1.0 keywords
    memory_interval/memory_dir are silent aliases."""
    import warnings

    state = {"w": np.zeros(1000, dtype=np.float32)}
    mem = tmp_path / "mem"
    with pccheck.Checkpointer(state, tmp_path / "ck", disk=pccheck.DiskOptions(every=5),
                              memory=pccheck.MemoryOptions(every=3, dir=mem)) as ck:
        for step in range(1, 11):
            state["w"][...] = step
            ck.maybe_checkpoint(step)
            ck.wait()
        assert [c.step for c in ck._memory.recent] == [3, 6, 9]
        assert ck.stats().tiers["memory"] == 9 and ck.last_durable_step == 10
    assert _committed_steps(mem) == {6, 9} and len(read_store(store_files(mem)[0][1]).slots) == 2
    older = tmp_path / "mem-older"
    with pccheck.Checkpointer(state, tmp_path / "ck2", disk=pccheck.DiskOptions(every=5),
                              memory=pccheck.MemoryOptions(every=3, dir=older, keep_last=1)) as ck:
        for step in range(1, 13):
            state["w"][...] = step
            ck.maybe_checkpoint(step)
            ck.wait()
    # 12 went into the slot freed longest ago (3's): 2 slots would hold 9 and 12 only
    assert _committed_steps(older) == {6, 9, 12} and len(read_store(store_files(older)[0][1]).slots) == 3
    for kw in ({"keep_last": 2}, {"keep_last": None}):
        with pytest.raises(ConfigError, match="at most one older checkpoint.*DiskOptions.keep_last"):
            pccheck.MemoryOptions(every=1, **kw)
    with pytest.raises(ConfigError, match="keep_every must be None.*DiskOptions.keep_every"):
        pccheck.MemoryOptions(every=1, keep_every=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opts = pccheck.Options().updated(memory_interval=3, memory_dir=mem, replicas=1)
        assert opts.memory == pccheck.MemoryOptions(every=3, dir=mem) == \
            pccheck.MemoryOptions(memory_interval=3, memory_dir=mem)
        assert (opts.memory.memory_interval, opts.memory.memory_dir) == (3, mem)
    with pytest.raises(ConfigError, match="memory.every"):
        pccheck.Options().updated(memory_interval=0)


def test_memory_dir_too_small_is_a_clear_error(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        m = torch.nn.Linear(512, 512)  # 1 MiB of weights: with its slots it cannot fit in 1 MiB
        with pytest.raises(NoSpaceError, match="the memory tier needs .* MiB"):
            pccheck.Checkpointer(m, torch.optim.SGD(m.parameters(), lr=0.1), tmp_path / "ck", memory_interval=1,
                                 memory_dir=small)
    finally:
        subprocess.run(["umount", str(small)], check=True)


def _msg(own_mem=(), own_disk=(), rep=None, bad=()):
    return {"own": {"memory": [list(k) for k in own_mem], "disk": [list(k) for k in own_disk]},
            "rep": {str(s): [[*k, 4096, 100, 1] for k in ks] for s, ks in (rep or {}).items()},
            "bad": [list(b) for b in bad]}


def test_restore_plan_nearest_tier_fallbacks_and_missing_ranks():
    from pccheck.errors import NoCheckpointError
    from pccheck.tiers.memory.nearest import _plan

    # rank 1's node is gone: its step 9 comes from rank 0's replica; rank 0 from its own memory
    key, plan = _plan([_msg(own_mem=[(1, 8), (1, 9)], own_disk=[(1, 8)], rep={1: [(1, 8), (1, 9)]}), _msg()], 2)
    assert key == (1, 9) and plan == [("memory", -1), ("peer", 0)]
    # that replica failed its checksums on rank 1: the older replica
    key, plan = _plan([_msg(own_mem=[(1, 8), (1, 9)], rep={1: [(1, 8), (1, 9)]}), _msg(bad=[("peer", 0, 1, 9)])], 2)
    assert key == (1, 8) and plan == [("memory", -1), ("peer", 0)]
    # both nodes' memory gone, disks kept
    assert _plan([_msg(own_disk=[(1, 8)]), _msg(own_disk=[(1, 4), (1, 8)])], 2) == ((1, 8), [("disk", -1)] * 2)
    # a whole group gone, no disk: the error names the ranks that cannot obtain the newest step
    with pytest.raises(NoCheckpointError, match=r"ranks \[1\] cannot obtain step 9"):
        _plan([_msg(own_mem=[(1, 9)]), _msg()], 2)


@pytest.mark.parametrize("doc,why", [
    ({}, "step"),
    ({"step": 1, "counter": 0, "data": 0}, "counter"),
    ({"step": 1, "counter": 1, "data": -4096}, "data"),
    ({"step": 1, "counter": 1, "data": 1 << 50}, "data"),
    ({"step": 1, "counter": 1, "data": 4096, "manifest": 5}, "manifest"),
    ({"step": 1, "counter": 1, "data": 4096, "manifest": "not json"}, "JSON"),
])
def test_replica_headers_are_untrusted(doc, why):
    from pccheck.errors import CorruptCheckpointError
    from pccheck.tiers.memory.replicate import _parse_header

    with pytest.raises(CorruptCheckpointError, match=why):
        _parse_header(doc)


@pytest.mark.parametrize("kw", [{"lazy": True}, {"zero_copy": True}])
def test_memory_dir_refuses_lazy_and_zero_copy(tmp_path, kw):
    """A memory-tier load is eager and copies: lazy=/zero_copy= with memory_dir= are refused up
    front, not silently loaded from the disk store instead."""
    pccheck.Checkpointer({"w": np.arange(8.0)}, tmp_path / "ck", interval=1).close()
    with pytest.raises(ConfigError, match="memory_dir= loads eagerly"):
        pccheck.load_latest(tmp_path / "ck", memory_dir=tmp_path / "mem", **kw)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_array_checker_checks_each_array_as_its_chunks_land(chunk):
    """The pull's progressive check (ArrayChecker as recv_bytes's on_chunk): any chunk size, arrays
    spanning chunks, empty arrays; a flipped byte or a transfer cut short is reported at finish()."""
    from types import SimpleNamespace as NS

    from pccheck.errors import CorruptCheckpointError
    from pccheck.persist.reader import crc32c
    from pccheck.tiers.memory.replicate import ArrayChecker

    buf = np.random.default_rng(0).integers(0, 255, 100_000, dtype=np.uint8)
    arrays = [NS(offset=0, nbytes=10_000, name="a"), NS(offset=12_288, nbytes=50_000, name="b"),
              NS(offset=70_000, nbytes=0, name="z"), NS(offset=70_000, nbytes=30_000, name="c")]
    man = NS(arrays=arrays, crcs=[crc32c(memoryview(buf[a.offset:a.offset + a.nbytes])) for a in arrays])

    def feed(data: np.ndarray, upto: int) -> ArrayChecker:
        check = ArrayChecker(man, data)
        for off in range(0, upto, chunk):
            check(off, min(chunk, upto - off))
        return check

    feed(buf, buf.nbytes).finish()
    bad = buf.copy()
    bad[20_000] ^= 1
    with pytest.raises(CorruptCheckpointError, match="'b' checksum mismatch"):
        feed(bad, bad.nbytes).finish()
    with pytest.raises(CorruptCheckpointError, match="'c' was not received whole"):
        feed(buf, 80_000).finish()


def test_expected_crcs_that_do_not_match_are_never_committed(tmp_path):
    """A replica's store is told the manifest's crc32c (StartArgs.expect_crcs): the writers' own
    checksums must match, else the checkpoint fails before its commit and the store keeps the
    older one (no checksum pass of the replica's own on the receiver)."""
    from pccheck.errors import CorruptCheckpointError
    from pccheck.orchestrator.args import StartArgs
    from pccheck.orchestrator.copy_engine import CpuCopyEngine
    from pccheck.orchestrator.options import EngineOptions
    from pccheck.orchestrator.orchestrator import Orchestrator
    from pccheck.persist.layout import plan
    from pccheck.persist.reader import crc32c

    arrays = {"w": np.arange(5000, dtype=np.float32), "b": np.ones(7, dtype=np.int64)}
    right = {k: crc32c(memoryview(v).cast("B")) for k, v in arrays.items()}
    errors: list = []
    orch = Orchestrator(tmp_path / "store", plan(arrays), EngineOptions(max_concurrent=1, writer_threads=1,
                                                                         chunk_size=1 << 16, storage="mmap"),
                        copy_engine=CpuCopyEngine(threads=1), on_error=errors.append)
    try:
        orch.start(1, arrays, {}, StartArgs(expect_crcs=right))
        orch.wait()
        orch.start(2, arrays, {}, StartArgs(expect_crcs={**right, "b": right["b"] ^ 1}))
        orch.wait()
    finally:
        orch.close()
    assert len(errors) == 1 and isinstance(errors[0], CorruptCheckpointError), errors
    assert _committed_steps(tmp_path / "store") == {1}


@pytest.mark.parametrize("nbytes", [1, 4096, (3 << 20) + 123])
def test_prefaulter_populates_ahead_and_keeps_what_was_written(nbytes):
    """The pull's receive buffer (persist.reader.Prefaulter, populate): every byte readable as
    zero, a piece written after its wait keeps its bytes while later pieces are populated, and a
    buffer not starting on a page (the fallback) works too."""
    from pccheck.persist.reader import Prefaulter, fresh_buffer, populate

    buf = fresh_buffer(nbytes)
    piece = 1 << 20
    pre = Prefaulter(buf, piece)
    try:
        for off in range(0, nbytes, piece):
            end = min(nbytes, off + piece)
            pre.wait(end)
            assert not buf[off:end].any()
            buf[off:end] = (off // piece) % 251 + 1  # written in order, as recv_bytes does
    finally:
        pre.close()
    for off in range(0, nbytes, piece):
        assert (buf[off:min(nbytes, off + piece)] == (off // piece) % 251 + 1).all()
    odd = fresh_buffer(3 * 4096)[5:]  # not page-aligned: MADV_POPULATE_WRITE / a write per page
    populate(odd, 0, odd.nbytes)
    assert not odd.any()


def test_prefaulter_close_stops_it_early():
    from pccheck.persist.reader import Prefaulter, fresh_buffer

    buf = fresh_buffer(64 << 20)
    pre = Prefaulter(buf, 1 << 20)
    pre.close()
    pre.wait(buf.nbytes)  # never blocks once closed
    buf[:] = 7
    assert (buf[::4096] == 7).all()


def test_store_populate_keeps_committed_bytes_and_stops_at_close(tmp_path):
    """A memory store's mapping is faulted in at open (SlotStore populate=True, native
    Store.populate): every byte committed before stays as it was, a populate after close does
    nothing, and a close during a populate ends it (no access to an unmapped range)."""
    from pccheck.native import _native
    from pccheck.orchestrator.args import StartArgs
    from pccheck.orchestrator.copy_engine import CpuCopyEngine
    from pccheck.orchestrator.options import EngineOptions
    from pccheck.orchestrator.orchestrator import Orchestrator
    from pccheck.persist.layout import plan

    arrays = {"w": np.arange(300_000, dtype=np.float32)}
    opts = EngineOptions(max_concurrent=1, writer_threads=1, chunk_size=1 << 16, storage="mmap")
    orch = Orchestrator(tmp_path / "s", plan(arrays), opts, copy_engine=CpuCopyEngine(threads=1),
                        on_error=pytest.fail, populate_store=True)
    try:
        orch.start(1, arrays, {}, StartArgs())
        orch.wait()
    finally:
        orch.close()
    (_, file), = store_files(tmp_path / "s")
    before = file.read_bytes()
    st = _native.Store(str(file), "mmap")
    assert st.populate() == len(before)
    assert file.read_bytes() == before
    st.close()
    assert st.populate() == 0
    st = _native.Store(str(file), "mmap")
    t = threading.Thread(target=st.populate)
    t.start()
    st.close()
    t.join(10)
    assert not t.is_alive() and file.read_bytes() == before
    assert _committed_steps(tmp_path / "s") == {1}


def test_key_waiter_sees_a_key_set_later_and_ends_at_stop():
    """KeyWaiter (wire.py): a blocking wait on a connection of its own returns a key set by
    another connection while it waits, and returns None once its stop event is set."""
    from datetime import timedelta

    import torch.distributed as dist
    from pccheck.tiers.memory import wire

    srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", srv.port, is_master=False, timeout=timedelta(seconds=30))
    waiter = wire.KeyWaiter(dist.PrefixStore("p/", client), own=True)
    stop = threading.Event()
    other = dist.PrefixStore("p/", srv)
    threading.Timer(0.7, lambda: other.set("k", "v")).start()  # after at least one slice ran out
    assert waiter.wait("k", stop) == "v"
    threading.Timer(0.2, stop.set).start()
    assert waiter.wait("never", stop) is None


def test_throttle_waits_for_the_previous_checkpoint_and_stops_when_it_cannot_replicate():
    """Replicator.throttle (the slots and the node-loss bound): the memory checkpoint of step s
    waits until the previous one (LAG = 1 back) is replicated everywhere while that can still
    happen (queued, being sent, or sent within COMMIT_GRACE_S); one that never committed here (its
    commit failed) is not waited for; one that committed here but cannot be replicated everywhere
    any more (a failure of it or of a link reported in the replication log, a peer dropped, sent
    too long ago) stops the tier: throttle returns False from then on, so the own store keeps the
    newest step replicated everywhere instead of writing over it."""
    import time
    from collections import deque
    from types import SimpleNamespace

    from pccheck.tiers.memory import replicate

    def fresh() -> replicate.Replicator:
        r = replicate.Replicator.__new__(replicate.Replicator)  # the throttle's state only: no links
        r._cv, r._queue, r._sending, r._sending_step = threading.Condition(), deque(), False, None
        r._sent_at, r._started, r._stopping, r._dead = {}, deque(maxlen=replicate.LAG), False, set()
        r._committed, r.stopped, r.links, r._failed, r._broken = set(), None, SimpleNamespace(rank=0), set(), False
        r.replicated, r.throttled_s = None, 0.0
        return r

    assert replicate.LAG == 1
    r = fresh()
    assert r.throttle(1)  # nothing before it
    with r._cv:
        r._committed.add(1)
        r._sent_at[1] = time.monotonic()  # step 1 sent: the peers are committing it
    waiter = threading.Thread(target=r.throttle, args=(2,))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # waits for step 1 to be replicated everywhere
    with r._cv:
        r.replicated = 1
        r._cv.notify_all()
    waiter.join(10)
    assert not waiter.is_alive() and list(r._started) == [2] and r.stopped is None
    assert r.throttle(3)  # step 2 never committed here (its commit failed): its slot is free, no wait
    with r._cv:
        r._committed.add(3)
        r._sent_at[3] = time.monotonic() - replicate.COMMIT_GRACE_S - 1  # sent long ago, never replicated
    t0 = time.monotonic()
    assert not r.throttle(4) and r.stopped and not r.throttle(5)  # stopped for good: step 1..3's slot kept
    assert time.monotonic() - t0 < replicate.COMMIT_GRACE_S and list(r._started) == [3]
    r = fresh()
    assert r.throttle(1)
    with r._cv:
        r._committed.add(1)
        r._sending, r._sending_step, r._dead = True, 1, {1}  # still sending 1, but a peer was dropped
    assert not r.throttle(2) and "dropped" in r.stopped
    for failed, broken, why in ((1, False, "failed"), (None, True, "broke")):
        r = fresh()
        assert r.throttle(1)
        with r._cv:
            r._committed.add(1)
            r._sent_at[1] = time.monotonic()  # sent just now: the peers would be committing it
        waiter = threading.Thread(target=r.throttle, args=(2,))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        with r._cv:  # the log follower read "!1" (a replica of step 1 failed) or "!*" (a link broke)
            r._failed, r._broken = {failed} - {None}, broken
            r._cv.notify_all()
        waiter.join(10)
        assert not waiter.is_alive() and why in r.stopped, r.stopped
