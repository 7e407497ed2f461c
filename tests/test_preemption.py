"""Flushing on a preemption notice: real processes, real signals, a real HTTP notice endpoint,
the SeaweedFS test server for the remote tier, and a 2-rank torchrun (gloo) job.

Each child (_preempt_child.py) fills its state with the step number at every step and prints
"STEP n" once maybe_checkpoint(n) returned; after the notice, the step loaded from disk (the
memory tier's directory deleted first, as a lost machine would) or from the object store must
be at least the last step printed, and hold that step's values.
"""

from __future__ import annotations

import http.server
import json
import os
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
from pccheck.preemption import FlushResult
from pccheck.preemption.notice import is_notice
from pccheck.preemption.planner import verdict

HERE = Path(__file__).resolve().parent
CHILD = HERE / "_preempt_child.py"


class Child:
    """One child process; its stdout lines collected by a reader thread."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=HERE,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, pred, timeout: float = 30.0) -> None:
        t0 = time.monotonic()
        while not pred(self.lines):
            assert self.proc.poll() is None or pred(self.lines), f"child ended early: {self.finish()[1][-3000:]}"
            assert time.monotonic() - t0 < timeout, f"timed out; output {self.lines[-5:]}"
            time.sleep(0.01)

    def steps(self) -> list[int]:
        return [int(x.split()[1]) for x in list(self.lines) if x.startswith("STEP ")]

    def finish(self, timeout: float = 40.0) -> tuple[int, str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.reader.join(5)
        return self.proc.returncode, self.proc.stderr.read()

    def flush(self) -> dict:
        got = [json.loads(x[6:]) for x in self.lines if x.startswith("FLUSH ")]
        assert got, f"no flush printed: {self.lines[-5:]}"
        return got[-1]


@pytest.fixture
def mem_dir():
    d = Path("/dev/shm") / f"pccheck-preempt-{uuid.uuid4().hex[:8]}"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _terminate_after(child: Child, n_steps: int) -> int:
    """SIGTERM once the child printed ``n_steps`` steps; returns the last step printed before it."""
    child.wait_for(lambda lines: sum(x.startswith("STEP ") for x in lines) >= n_steps)
    last = child.steps()[-1]
    child.proc.send_signal(signal.SIGTERM)
    return last


def _check_state(r, at_least: int) -> None:
    assert r.step >= at_least
    assert np.all(r.state["w"] == r.step), "the loaded state is not the state of its step"


# -- single process ------------------------------------------------------------------------------

def test_sigterm_with_memory_tier_makes_the_last_returned_step_durable_on_disk(tmp_path, mem_dir):
    child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--disk-every", "1000")
    last = _terminate_after(child, 15)
    rc, err = child.finish()
    assert rc == -signal.SIGTERM, err[-2000:]  # the default handler ran after the flush
    assert "flush of step" in err and "disk reached" in err, err[-2000:]
    shutil.rmtree(mem_dir)  # the machine's RAM is gone: only the disk counts
    _check_state(load_newest(tmp_path / "ck"), last)
    _check_state(pccheck.load_latest(tmp_path / "ck"), last)


def test_without_memory_tier_the_next_step_boundary_is_checkpointed(tmp_path):
    child = Child(str(tmp_path / "ck"), "--disk-every", "1000", "--chain")
    last = _terminate_after(child, 10)
    rc, err = child.finish()
    assert rc == 3, err[-2000:]
    f = child.flush()
    assert f["source"] == "boundary" and f["step"] > last and f["complete"], f
    _check_state(load_newest(tmp_path / "ck"), f["step"])


def test_previous_python_handler_is_chained_after_the_flush(tmp_path, mem_dir):
    child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--chain")
    last = _terminate_after(child, 10)
    rc, err = child.finish()
    assert rc == 3 and "PREVIOUS" in child.lines, err[-2000:]
    f = child.flush()  # the previous handler ran after the flush, and saw it done
    assert f["cause"] == "signal SIGTERM" and f["complete"] and f["step"] >= last and f["source"] == "memory", f
    disk = [t for t in f["tiers"] if t["tier"] == "disk"][0]
    assert disk["reached"] and disk["at_s"] is not None and disk["at_s"] < 20.0
    shutil.rmtree(mem_dir)
    _check_state(load_newest(tmp_path / "ck"), last)


def test_second_sigterm_during_the_flush_starts_no_second_flush(tmp_path, mem_dir):
    child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--mib", "32")
    last = _terminate_after(child, 5)
    time.sleep(0.002)
    child.proc.send_signal(signal.SIGTERM)
    rc, err = child.finish()
    assert rc == -signal.SIGTERM
    assert err.count("preemption notice") == 1 and err.count("flush of step") == 1, err[-2000:]
    shutil.rmtree(mem_dir)
    _check_state(load_newest(tmp_path / "ck"), last)


def test_too_short_grace_reports_what_was_missed_and_keeps_the_last_complete_step(tmp_path, mem_dir):
    # 64 MiB, written to disk every 4 steps (the disk's rate is measured); a grace of 20 ms
    # cannot hold a disk write of it: the flush skips the disk and says so.
    child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--mib", "64", "--disk-every", "4",
                  "--grace", "0.02", "--chain", "--sleep", "0.05")
    last = _terminate_after(child, 10)
    rc, err = child.finish()
    assert rc == 3, err[-2000:]
    f = child.flush()
    disk = [t for t in f["tiers"] if t["tier"] == "disk"][0]
    assert not f["complete"] and not disk["reached"] and disk["note"].startswith("skipped: needs"), f
    memory = [t for t in f["tiers"] if t["tier"] == "memory"][0]
    assert memory["reached"] and memory["step"] >= last  # the most durable tier that fit
    shutil.rmtree(mem_dir)
    r = load_newest(tmp_path / "ck")
    assert r.step % 4 == 0 and np.all(r.state["w"] == r.step)  # the last complete disk step


def test_sigterm_commits_the_step_on_the_remote_tier(tmp_path, mem_dir, s3_url):
    child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--remote", s3_url, "--disk-every", "1000",
                  "--chain")
    last = _terminate_after(child, 10)
    rc, err = child.finish()
    assert rc == 3, err[-2000:]
    f = child.flush()
    remote = [t for t in f["tiers"] if t["tier"] == "remote"][0]
    assert f["complete"] and remote["reached"] and remote["step"] == f["step"] >= last, f
    shutil.rmtree(mem_dir)
    shutil.rmtree(tmp_path / "ck")  # the machine is gone: only the object store is left
    _check_state(pccheck.load_latest(s3_url), last)


class _Notice(http.server.BaseHTTPRequestHandler):
    """404 (no notice) for the first ``quiet`` requests, then 200 with AWS's instance-action body."""

    quiet = 5
    seen = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen += 1
        if type(self).seen <= type(self).quiet:
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


def test_notice_url_404_then_200_flushes_without_a_signal(tmp_path, mem_dir):
    srv = http.server.HTTPServer(("127.0.0.1", 0), _Notice)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/latest/meta-data/spot/instance-action"
        child = Child(str(tmp_path / "ck"), "--memory", str(mem_dir), "--url", url, "--poll", "0.1",
                      "--no-signal")
        rc, err = child.finish()
    finally:
        srv.shutdown()
    assert rc == 0, err[-2000:]
    assert _Notice.seen > _Notice.quiet  # it polled through the 404s
    f = child.flush()
    assert f["cause"] == f"notice {url}" and f["complete"] and f["source"] == "memory", f
    shutil.rmtree(mem_dir)
    assert load_newest(tmp_path / "ck").step == f["step"]


# -- in process ------------------------------------------------------------------------------------

def test_is_notice_reads_aws_and_gce_answers():
    assert is_notice(200, b'{"action": "stop"}') and is_notice(200, b"TRUE\n")
    assert not is_notice(200, b"FALSE") and not is_notice(200, b"false\n")  # GCE: not preempted
    assert not is_notice(404, b"") and not is_notice(500, b"")


def test_planner_skips_a_tier_that_does_not_fit():
    now = time.monotonic()
    assert verdict(1 << 30, 1e9, now + 10).attempt
    v = verdict(1 << 30, 1e8, now + 2)
    assert not v.attempt and v.need_s > 10 and v.note.startswith("skipped: needs")
    assert verdict(1 << 30, None, now + 1).attempt  # nothing measured yet: try


def test_flush_on_demand_and_later_checkpoints_never_undo_it(tmp_path, mem_dir, s3_url):
    w = np.zeros(1 << 16, np.float32)
    ck = pccheck.Checkpointer({"w": w}, tmp_path / "ck", disk=pccheck.DiskOptions(every=1000),
                              memory=pccheck.MemoryOptions(every=1, dir=mem_dir),
                              remote=pccheck.RemoteOptions(url=s3_url, every=1000, keep_last=1))
    for step in range(1, 8):
        w[:] = step
        ck.maybe_checkpoint(step)
    r = ck.flush(timeout=30)
    assert isinstance(r, FlushResult) and r.step == 7 and r.complete and r.source == "memory", r
    assert [t.tier for t in r.tiers] == ["memory", "disk", "remote"]
    assert ck.stats().flush["step"] == 7 and not ck.preempted
    for step in range(8, 12):  # training goes on; nothing newer reaches the disk or the remote
        w[:] = step
        ck.maybe_checkpoint(step)
    ck.close()
    shutil.rmtree(mem_dir)
    assert load_newest(tmp_path / "ck").step == 7
    assert pccheck.load_latest(s3_url).step == 7


def test_the_flush_from_the_memory_tier_fingerprints_only_what_may_be_unchanged(tmp_path, mem_dir):
    # the memory tier's slot carries every array's crc32c: the incremental disk copy of it writes
    # an array whose crc32c differs from the disk's base without a fingerprint pass (it changed),
    # and fingerprints, then references, one whose crc32c equals the base's
    from pccheck.persist.recovery import read_manifest, read_store

    frozen, w = np.arange(1 << 18, dtype=np.float32), np.zeros(1 << 18, np.float32)
    ck = pccheck.Checkpointer({"frozen": frozen, "w": w}, tmp_path / "ck",
                              disk=pccheck.DiskOptions(every=10, incremental=True),
                              memory=pccheck.MemoryOptions(every=1, dir=mem_dir))
    try:
        for step in range(1, 14):
            w[:] = step
            ck.maybe_checkpoint(step)
        ck.wait()  # step 10 is the disk's base
        r = ck.flush(timeout=30)
        assert r.step == 13 and r.complete and r.source == "memory", r
    finally:
        ck.close()
    image = read_store(tmp_path / "ck" / "store-000001.pcc")
    with open(image.path, "rb", buffering=0) as f:
        man = read_manifest(image, image.word_slot, f.fileno())
    names = [e.name for e in man.arrays]
    assert man.step == 13 and man.cells.fps[names.index("w")] is None  # written unfingerprinted
    i = names.index("frozen")
    assert man.cells.fps[i] is not None and man.cells.cells[i] != image.word_slot  # step 10's cell
    shutil.rmtree(mem_dir)
    got = load_newest(tmp_path / "ck")
    assert got.step == 13 and np.all(got.state["w"] == 13) and np.array_equal(got.state["frozen"], frozen)


def test_a_given_up_upload_stops_sending_its_part_in_flight(s3_url):
    # a part's body is read block by block as it is sent; once its upload is given up, the next
    # read ends the request: the part stops taking bandwidth at once, and the caller aborts
    from pccheck.tiers.remote.objstore import BodyCancelled, ObjectStore

    store = ObjectStore(s3_url)
    body = memoryview(np.ones(64 << 20, np.uint8))
    sent = [0]

    def stop() -> bool:
        sent[0] += 1
        return sent[0] > 4  # a few blocks go out, then the upload is given up

    from pccheck.persist.reader import crc32c

    upload_id = store.start_multipart("data/given-up.bin", crc32c=True)
    with pytest.raises(BodyCancelled):
        store.upload_part("data/given-up.bin", upload_id, 1, body, crc32c=crc32c(body), stop=stop)
    # asked before each block read, and once more as the request failed (no retry, which would
    # read the body again): of the 64 MiB body's thousands of blocks, none after it said stop
    assert sent[0] == 6, sent
    store.abort_multipart("data/given-up.bin", upload_id)
    upload_id = store.start_multipart("data/whole.bin", crc32c=False)  # the client still works
    etag = store.upload_part("data/whole.bin", upload_id, 1, body[: 8 << 20], stop=lambda: False)
    store.complete_multipart("data/whole.bin", upload_id, [etag])
    assert [o.size for o in store.list("data/whole.bin")] == [8 << 20]


def test_a_given_up_upload_stops_reading_its_part_within_one_slice(tmp_path):
    # the read of a part from the local store is asked to stop between slices: the flush's own
    # upload waits for one slice of the given-up one's read (4 MiB), not for its whole part
    from pccheck.tiers.remote.upload import _READ_SLICE, Cancelled, _read_part

    f = tmp_path / "store"
    f.write_bytes(b"\x07" * (4 * _READ_SLICE))
    asked = []
    out = bytearray(4 * _READ_SLICE)
    fd = os.open(f, os.O_RDONLY)
    try:
        with pytest.raises(Cancelled):
            _read_part(fd, memoryview(out), 0, f.name, lambda: asked.append(1) or len(asked) >= 2)
        assert out.count(7) == 2 * _READ_SLICE and len(asked) == 2  # two slices read, then it stopped
        _read_part(fd, memoryview(out), 0, f.name, lambda: False)
        assert out.count(7) == len(out)
    finally:
        os.close(fd)


def test_the_flush_uploads_from_the_memory_tier_while_the_disk_writes(tmp_path, mem_dir, s3_url):
    # 256 MiB that only the memory tier holds at the flush: the remote upload reads the memory
    # tier's slot and begins before the disk's copy of the same step is durable (the disk write
    # takes ~0.3 s here, the upload's start ~0.03 s, 0.11 s on a loaded host); the disk's commit
    # then queues no second upload of the step (one remote commit, no lost race)
    from pccheck.tiers.remote.commit import committed
    from pccheck.tiers.remote.objstore import ObjectStore

    w = np.zeros(64 << 20, np.float32)
    ck = pccheck.Checkpointer({"w": w}, tmp_path / "ck", disk=pccheck.DiskOptions(every=1000),
                              memory=pccheck.MemoryOptions(every=1, dir=mem_dir),
                              remote=pccheck.RemoteOptions(url=s3_url, every=1000))
    try:
        for step in range(1, 4):
            w[:] = step
            ck.maybe_checkpoint(step)
        r = ck.flush(timeout=120)
        disk, remote = r.tier("disk"), r.tier("remote")
        assert r.step == 3 and r.complete and r.source == "memory", r
        assert remote.started_s is not None and "memory tier" in remote.note, remote
        assert disk.started_s is None and disk.at_s is not None, disk
        assert remote.started_s < disk.at_s, r  # the upload began while the disk was still writing
        assert ck.wait(remote=True, timeout=60)
        st = ck.stats()
        assert st.remote_step == 3 and st.remote["remote_uploads"] == 1 and st.remote["remote_error"] is None, st
    finally:
        ck.close()
    shutil.rmtree(mem_dir)
    assert [s for _, s in committed(ObjectStore(s3_url))] == [3]
    assert load_newest(tmp_path / "ck").step == 3
    got = pccheck.load_latest(s3_url)
    assert got.step == 3 and np.all(got.state["w"] == 3)


def test_on_preemption_refuses_bad_arguments(tmp_path):
    with pccheck.Checkpointer({"w": np.zeros(16, np.float32)}, tmp_path / "ck") as ck:
        with pytest.raises(pccheck.ConfigError, match="grace_s"):
            ck.on_preemption(grace_s=0)
        with pytest.raises(pccheck.ConfigError, match="notice_url"):
            ck.on_preemption(signals=(), notice_url="ftp://x")
        with pytest.raises(pccheck.ConfigError, match="signals or a notice_url"):
            ck.on_preemption(signals=())
        errors = []
        t = threading.Thread(target=lambda: _catch(errors, ck.on_preemption))
        t.start()
        t.join()
        assert errors and "main thread" in str(errors[0])
        ck.on_preemption(grace_s=5, signals=(signal.SIGUSR1,))
        with pytest.raises(pccheck.ConfigError, match="already"):
            ck.on_preemption()
        before = signal.getsignal(signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) != before  # close() put the previous handler back


def _catch(errors: list, fn) -> None:
    try:
        fn()
    except pccheck.ConfigError as exc:
        errors.append(exc)


# -- a group ---------------------------------------------------------------------------------------

def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOADER = """
import sys, numpy as np, torch.distributed as dist, pccheck
from _leave import leave
dist.init_process_group("gloo")
r = pccheck.load_latest(sys.argv[1])
assert np.all(r.state["w"] == r.step)
sys.stdout.write(f"LOADED {dist.get_rank()} {r.step}\\n")  # one write: the ranks share stdout
sys.stdout.flush()
leave()
"""


def _torchrun(script: list[str], port: int) -> subprocess.Popen:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
                             f"--master-port={port}", "--max-restarts=0", "--monitor-interval=0.1", *script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE,
                            start_new_session=True)


def _group_round(tmp_path: Path, mem: Path, *args: str) -> tuple[list[dict], int, list[str]]:
    """A 2-rank job SIGTERMed together after 6 steps each; (each rank's flush, the last step
    printed, and what a new 2-rank job loaded with the memory tier gone)."""
    pytest.importorskip("torch")
    job = _torchrun([str(CHILD), str(tmp_path / "ck"), "--dist", "--memory", str(mem), "--chain", *args], _port())
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    t0 = time.monotonic()
    while sum(x.startswith("STEP ") for x in lines) < 2 * 6:
        assert job.poll() is None and time.monotonic() - t0 < 60, lines[-5:]
        time.sleep(0.02)
    last = max(int(x.split()[1]) for x in list(lines) if x.startswith("STEP "))
    os.killpg(job.pid, signal.SIGTERM)  # every rank gets the notice, as torchrun forwards it
    job.wait(60)
    reader.join(5)
    flushes = [json.loads(x[6:].strip()) for x in lines if x.startswith("FLUSH ")]
    assert len(flushes) == 2, (lines[-6:], job.stderr.read()[-3000:])
    shutil.rmtree(mem)  # the memory tier is gone: each rank's disk store counts
    (tmp_path / "load.py").write_text(LOADER)
    load = _torchrun([str(tmp_path / "load.py"), str(tmp_path / "ck")], _port())
    out, err = load.communicate(timeout=60)
    got = sorted(x for x in out.splitlines() if x.startswith("LOADED "))
    assert len(got) == 2, (out[-2000:], err[-3000:])
    return flushes, last, got


@pytest.mark.slow  # two torchrun jobs: 50-75 s on 2 shared vCPUs
def test_two_ranks_flush_the_same_step_on_sigterm_and_load_it_together(tmp_path, mem_dir):
    flushes, last, got = _group_round(tmp_path, mem_dir, "--disk-every", "1000", "--sleep", "0.02")
    step = flushes[0]["step"]
    # the ranks step together (an all_reduce per step): one of them may be a step behind
    assert flushes[1]["step"] == step >= last - 1 and all(f["complete"] for f in flushes), flushes
    assert got == [f"LOADED 0 {step}", f"LOADED 1 {step}"]


@pytest.mark.slow
def test_a_rank_that_cannot_flush_in_time_leaves_no_mixed_step(tmp_path, mem_dir):
    # rank 1's grace (20 ms) holds no disk write of 64 MiB: rank 0 commits the flushed step, rank 1
    # does not, and the group loads the older step both committed (disk every 4 steps).
    flushes, last, got = _group_round(tmp_path, mem_dir, "--disk-every", "4", "--mib", "64",
                                      "--grace-by-rank", "15,0.02", "--sleep", "0.05")
    disk = [[t for t in f["tiers"] if t["tier"] == "disk"][0] for f in flushes]
    assert sorted(d["reached"] for d in disk) == [False, True], flushes
    flushed = next(f["step"] for f, d in zip(flushes, disk) if d["reached"])
    older = int(got[0].split()[2])
    assert got == [f"LOADED 0 {older}", f"LOADED 1 {older}"] and older < flushed and older % 4 == 0, (got, flushes)


@pytest.mark.parametrize("measured,incremental", [(True, False), (False, False), (True, True)])
def test_flush_supersedes_an_older_upload_in_progress_when_its_own_fits(tmp_path, s3_url, measured, incremental,
                                                                         monkeypatch):
    # 64 MiB in 8 MiB parts, one at a time. With an upload measured before (step 1), the upload
    # of step 2 still running when the flush asks for step 3 is given up, and step 3's starts at
    # once: the given-up upload is aborted on the abort thread, full or incremental, never on the
    # upload thread that the flush's upload needs. With none measured, nothing says step 3's fits:
    # step 2's upload is left to finish.
    import threading

    import pccheck.tiers.remote.uploader as uploader
    from pccheck.tiers.remote.commit import committed
    from pccheck.tiers.remote.objstore import ObjectStore

    aborts: list[str] = []
    real_abort = uploader.abort_after

    def abort_after(*args):
        aborts.append(threading.current_thread().name)
        return real_abort(*args)

    monkeypatch.setattr(uploader, "abort_after", abort_after)
    w = np.zeros(16 << 20, np.float32)
    ck = pccheck.Checkpointer({"w": w}, tmp_path / "ck", disk=pccheck.DiskOptions(every=1, incremental=incremental),
                              remote=pccheck.RemoteOptions(url=s3_url, every=1, part_size=8 << 20, concurrency=1))
    try:
        steps = (1, 2, 3) if measured else (2, 3)
        for step in steps:
            w[:] = step
            ck.maybe_checkpoint(step)
            ck.wait(remote=step == 1)
        if ck.stats().remote_step != (1 if measured else None):
            pytest.skip("step 2's upload ended before the flush: nothing left to supersede")
        r = ck.flush(timeout=120)
        assert r.complete and r.tier("remote").step == 3, r
    finally:
        ck.close()
    assert sorted(s for _, s in committed(ObjectStore(s3_url))) == ([1, 3] if measured else [2, 3])
    assert aborts == (["pccheck-remote-abort_0"] if measured else []), aborts
    got = pccheck.load_latest(s3_url)
    assert got.step == 3 and np.all(got.state["w"] == 3)


def test_two_ranks_flush_gives_up_an_older_steps_upload_in_progress(tmp_path, s3_url):
    # each rank's part of step 4 is still uploading when the flush asks for step 5: every rank
    # gives up its part at its next one, rank 0 abandons step 4 (a step lacking a part is never
    # committed) and commits step 5; the remote holds steps 2 and 5 only
    from pccheck.tiers.remote.commit import committed
    from pccheck.tiers.remote.objstore import ObjectStore

    init = tmp_path / "init"
    procs = [subprocess.Popen([sys.executable, str(HERE / "_flush_supersede_child.py"), str(tmp_path / "ck"), s3_url,
                               str(r), str(init)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    before = [int(x.split()[1]) if x.split()[1] != "None" else None
              for x in outs[0][0].splitlines() if x.startswith("BEFORE")][0]
    flushes = [json.loads(x[6:]) for o, _ in outs for x in o.splitlines() if x.startswith("FLUSH ")]
    assert len(flushes) == 2 and all(f["step"] == 5 and f["complete"] for f in flushes), flushes
    if before == 4:
        pytest.skip("step 4's upload ended before the flush: nothing left to give up")
    assert sorted(s for _, s in committed(ObjectStore(s3_url))) == [2, 5]

