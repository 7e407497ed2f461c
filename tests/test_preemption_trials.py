"""The preemption targets, as trials: a training process gets its notice (SIGTERM, or a 200 from a
metadata endpoint) at a random point in a step, is SIGKILLed at ``grace_s``, then its machine is
lost (its disk and tmpfs directories deleted); a new process resumes from ``s3://`` and must load
a step at least as new as the last ``maybe_checkpoint`` that returned before the notice, equal bit
for bit to that step's state recomputed from scratch (``_preempt_child.train_state``).

The tiers are those of a spot job: memory at every step, disk every 50 steps, the remote (the
SeaweedFS test server) uploading every disk checkpoint. The faults: a SIGKILL in the middle of the
flush (every tier's newest committed step still loads), and the object store going down during
the flush (the disk copy completes; the FlushResult says the remote missed, and why). A second
SIGTERM during the flush is test_preemption.py's.
"""

from __future__ import annotations

import http.server
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import pccheck
from pccheck.persist.recovery import load_newest

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_preempt_child.py"
sys.path.insert(0, str(HERE))
from _preempt_child import train_state  # noqa: E402 - the child's own recomputation of a step

MIB = 1.0       # the state: w and m, 1 MiB together
GRACE = 20.0    # grace_s: the SIGKILL comes this long after the notice
SLEEP = 0.02    # a step's time besides its update
TIERS = ["--disk-every", "50", "--remote-every", "1"]


class Proc:
    """A child (or a torchrun agent): stdout lines and stderr lines collected by reader threads."""

    def __init__(self, argv: list[str], env: dict | None = None, group: bool = False) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
                                     start_new_session=group)
        self.readers = [threading.Thread(target=self._read, args=(s, d), daemon=True)
                        for s, d in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def steps(self) -> list[int]:
        return [int(x.split()[1]) for x in list(self.out) if x.startswith("STEP ")]

    def wait_for(self, pred, timeout: float = 60.0) -> None:
        t0 = time.monotonic()
        while not pred(self):
            assert self.proc.poll() is None, f"child ended early: {self.tail()}"
            assert time.monotonic() - t0 < timeout, f"timed out: {self.tail()}"
            time.sleep(0.002)

    def kill_at(self, t_kill: float, sig_group: bool = False) -> bool:
        """Waits for the process to end; SIGKILL at ``t_kill`` (time.monotonic()) if it has not.
        True if it was killed."""
        try:
            self.proc.wait(max(0.0, t_kill - time.monotonic()))
            killed = False
        except subprocess.TimeoutExpired:
            (os.killpg(self.proc.pid, signal.SIGKILL) if sig_group else self.proc.kill())
            self.proc.wait(30)
            killed = True
        for t in self.readers:
            t.join(10)
        return killed

    def tail(self) -> str:
        return "\n".join(self.out[-5:] + self.err[-30:])

    def flush(self) -> dict:
        got = [json.loads(x[6:]) for x in self.out if x.startswith("FLUSH ")]
        assert got, f"no flush printed: {self.tail()}"
        return got[-1]


def child(path: Path, mem: Path, *args: str) -> Proc:
    return Proc([sys.executable, str(CHILD), str(path), "--memory", str(mem), "--train", "--mib", str(MIB),
                 "--sleep", str(SLEEP), *args])


def assert_resumed(r, at_least: int, rank: int = 0, mib: float = MIB) -> None:
    """``r`` (a loaded checkpoint) holds a step >= ``at_least``, bit for bit that step's state."""
    assert r.step >= at_least, f"resumed at step {r.step}, the last returned maybe_checkpoint was {at_least}"
    want = train_state(r.step, mib, rank)
    assert int(r.state["step"][0]) == r.step
    for k in ("w", "m"):
        assert r.state[k].tobytes() == want[k].tobytes(), f"{k} of step {r.step} differs from its recomputation"


@pytest.fixture
def mem_dir():
    d = Path("/dev/shm") / f"pccheck-trial-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _notice_point(rng: random.Random, p: Proc) -> int:
    """Waits for a random number of steps (some runs past the disk checkpoint at step 50), then a
    random part of a step; returns the last step whose maybe_checkpoint had returned."""
    n = rng.randint(5, 75)
    p.wait_for(lambda c: len(c.steps()) >= n)
    time.sleep(rng.uniform(0.0, SLEEP * 1.5))
    return p.steps()[-1]


# -- a single process, SIGTERM -------------------------------------------------------------------

def _sigterm_trial(trial: int, tmp_path: Path, mem: Path, s3_url: str) -> None:
    rng = random.Random(4200 + trial)
    ck = tmp_path / "ck"
    p = child(ck, mem, "--remote", s3_url, "--grace", str(GRACE), *TIERS)
    last = _notice_point(rng, p)
    t0 = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    p.kill_at(t0 + GRACE)
    assert "flush of step" in "\n".join(p.err), p.tail()
    shutil.rmtree(ck, ignore_errors=True)  # the machine is lost: its disk and its RAM
    shutil.rmtree(mem, ignore_errors=True)
    assert_resumed(pccheck.load_latest(s3_url), last)


@pytest.mark.parametrize("trial", [0, 1])
def test_sigterm_trial_resumes_from_the_object_store(trial, tmp_path, mem_dir, s3_url):
    _sigterm_trial(trial, tmp_path, mem_dir, s3_url)


@pytest.mark.slow  # three more trials: ~25 s on 2 shared vCPUs
@pytest.mark.parametrize("trial", [2, 3, 4])
def test_sigterm_trial_resumes_from_the_object_store_more(trial, tmp_path, mem_dir, s3_url):
    _sigterm_trial(trial, tmp_path, mem_dir, s3_url)


# -- a single process, an HTTP notice and no signal ---------------------------------------------

class _Endpoint(http.server.BaseHTTPRequestHandler):
    """404 until the test raises the notice, then 200 with AWS's instance-action body."""

    notice = threading.Event()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self.notice.is_set():
            self.send_response(404)
            self.end_headers()
            return
        body = b'{"action": "terminate", "time": "2026-11-28T12:00:00Z"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_http_notice_trial_resumes_from_the_object_store(tmp_path, mem_dir, s3_url):
    _Endpoint.notice = threading.Event()
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Endpoint)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    rng = random.Random(4300)
    ck = tmp_path / "ck"
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/latest/meta-data/spot/instance-action"
        # the loop trains on after the flush (the notice runs no handler) until the SIGKILL
        p = child(ck, mem_dir, "--remote", s3_url, "--grace", str(GRACE), "--url", url, "--poll", "0.05",
                  "--no-signal", "--keep-going", *TIERS)
        last = _notice_point(rng, p)
        t0 = time.monotonic()
        _Endpoint.notice.set()
        p.wait_for(lambda c: any(x.startswith("FLUSH ") for x in c.out), timeout=GRACE)
        assert p.kill_at(t0 + min(GRACE, time.monotonic() - t0 + 1.0))  # still training: killed
    finally:
        srv.shutdown()
    f = p.flush()
    assert f["cause"] == f"notice {url}" and f["complete"] and f["step"] >= last, f
    shutil.rmtree(ck, ignore_errors=True)
    shutil.rmtree(mem_dir, ignore_errors=True)
    r = pccheck.load_latest(s3_url)
    assert_resumed(r, last)
    assert r.step >= f["step"]  # later steps never undid the flush


# -- faults ----------------------------------------------------------------------------------------

def _newest_on_each_tier(ck: Path, mem: Path, s3_url: str, mib: float) -> dict[str, int | None]:
    """Each tier's newest committed step, loaded and checked bit for bit (None: the tier has none)."""
    got: dict[str, int | None] = {}
    for name, load in (("memory", lambda: load_newest(mem)), ("disk", lambda: load_newest(ck)),
                       ("remote", lambda: pccheck.load_latest(s3_url))):
        try:
            r = load()
        except pccheck.NoCheckpointError:
            got[name] = None
            continue
        assert_resumed(r, 0, mib=mib)
        got[name] = r.step
    return got


@pytest.mark.parametrize("trial", [0, pytest.param(1, marks=pytest.mark.slow)])  # ~25 s each
def test_sigkill_during_the_flush_leaves_every_tiers_newest_committed_step_loadable(
        trial, tmp_path, mem_dir, s3_url):
    # 48 MiB: the flush (a disk write, then an upload) lasts long enough to be cut in its middle
    rng = random.Random(4400 + trial)
    ck = tmp_path / "ck"
    p = Proc([sys.executable, str(CHILD), str(ck), "--memory", str(mem_dir), "--train", "--mib", "48",
              "--sleep", "0.02", "--remote", s3_url, "--grace", str(GRACE), "--disk-every", "8",
              "--remote-every", "1"])
    p.wait_for(lambda c: len(c.steps()) >= rng.randint(22, 28), timeout=120)  # steps 8 and 16 uploaded
    p.proc.send_signal(signal.SIGTERM)
    p.wait_for(lambda c: any("preemption notice" in x for x in c.err), timeout=GRACE)
    time.sleep(rng.uniform(0.0, 0.1))
    cut = not any("flush of step" in x for x in p.err)
    p.proc.kill()
    p.kill_at(time.monotonic())
    assert p.proc.returncode == -signal.SIGKILL
    got = _newest_on_each_tier(ck, mem_dir, s3_url, 48)
    assert None not in got.values(), (got, p.tail())
    # the remote uploads the disk's commits: never newer than the disk
    assert got["remote"] is None or got["remote"] <= got["disk"], got
    print(f"SIGKILL {'inside' if cut else 'after'} the flush: newest committed {got}")


def test_object_store_down_during_the_flush_the_disk_completes_and_the_miss_is_reported(
        tmp_path, mem_dir, s3_server, s3_url):
    ck = tmp_path / "ck"
    grace = 8.0
    p = child(ck, mem_dir, "--remote", s3_url, "--grace", str(grace), "--chain", *TIERS)
    p.wait_for(lambda c: len(c.steps()) >= 12)
    last = p.steps()[-1]
    try:
        s3_server.stop(kill=True)  # the object store is gone when the flush begins to upload
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        p.kill_at(t0 + grace)
    finally:
        s3_server.start()
    assert p.proc.returncode == 3, p.tail()  # the flush ended by itself, and the previous handler ran
    f = p.flush()
    disk, remote = (next(t for t in f["tiers"] if t["tier"] == n) for n in ("disk", "remote"))
    assert disk["reached"] and f["step"] >= last and disk["at_s"] < grace, f
    assert not remote["reached"] and not f["complete"], f
    assert remote["note"].startswith("not committed by the deadline"), remote
    # the upload was started from the memory tier's slot beside the disk write, and its failure
    # did not hold the disk back
    assert f["source"] == "memory" and remote["started_s"] is not None and remote["started_s"] < grace, f
    shutil.rmtree(mem_dir)
    assert_resumed(load_newest(ck), last)


# -- two ranks on two simulated nodes ---------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCH_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}

LOADER = """
import sys, torch.distributed as dist, pccheck
from _leave import leave
from test_preemption_trials import assert_resumed
dist.init_process_group("gloo")
r = pccheck.load_latest(sys.argv[1])
assert_resumed(r, int(sys.argv[2]), dist.get_rank())
print(f"LOADED {dist.get_rank()} {r.step}", flush=True)
leave()
"""


def _agent(node: int, port: int, script: list[str]) -> Proc:
    """One node's torchrun agent: 1 worker of a 2-node job (static rendezvous on localhost)."""
    return Proc([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                 f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0",
                 "--monitor-interval=0.1", *script], env=TORCH_ENV, group=True)


@pytest.mark.slow  # 5 trials of 2 torchrun agents each, and a 2-rank load: ~3 min on 2 shared vCPUs
@pytest.mark.parametrize("trial", range(5))
def test_two_nodes_sigterm_trial_resumes_both_ranks_from_the_object_store(trial, tmp_path, s3_url):
    pytest.importorskip("torch")
    rng = random.Random(4500 + trial)
    port = _port()
    nodes = [(tmp_path / f"node{i}" / "ck", Path("/dev/shm") / f"pccheck-trial-{uuid.uuid4().hex[:8]}")
             for i in range(2)]
    agents = [_agent(i, port, [str(CHILD), str(ck), "--dist", "--memory", str(mem), "--train", "--mib", str(MIB),
                               "--sleep", str(SLEEP), "--remote", s3_url, "--grace", str(GRACE), *TIERS])
              for i, (ck, mem) in enumerate(nodes)]
    try:
        n = rng.randint(5, 60)
        agents[0].wait_for(lambda c: len(c.steps()) >= n, timeout=120)
        time.sleep(rng.uniform(0.0, SLEEP * 1.5))
        last = max(max(a.steps(), default=0) for a in agents)
        t0 = time.monotonic()
        for a in agents:  # the scheduler signals each node's agent; the agent forwards it to its worker
            a.proc.send_signal(signal.SIGTERM)
        for a in agents:
            a.kill_at(t0 + GRACE, sig_group=True)
    finally:
        for (ck, mem), a in zip(nodes, agents):
            if a.proc.poll() is None:
                os.killpg(a.proc.pid, signal.SIGKILL)
            shutil.rmtree(mem, ignore_errors=True)  # both machines are lost
            shutil.rmtree(ck.parent, ignore_errors=True)
    flushed = [x for a in agents for x in a.err if "flush of step" in x]
    assert len(flushed) == 2, "\n".join(a.tail() for a in agents)
    load = tmp_path / "load.py"
    load.write_text(LOADER)
    port = _port()
    loaders = [_agent(i, port, [str(load), s3_url, str(last)]) for i in range(2)]
    for lo in loaders:
        assert not lo.kill_at(time.monotonic() + 120, sig_group=True) and lo.proc.returncode == 0, lo.tail()
    got = sorted(x for lo in loaders for x in lo.out if x.startswith("LOADED "))
    assert len(got) == 2 and got[0].split()[2] == got[1].split()[2], got
    assert int(got[0].split()[2]) >= last
