"""Transparent mode: a process that knows nothing of pccheck, dumped by CRIU, persisted
and committed by pccheck, killed and restored. Needs root and a criu that passes `criu check`
(``make test`` fetches one with scripts/get-criu.sh); skips with the reason otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import pccheck
from pccheck.commands.cli import app
from pccheck.ops.inventory import survey
from pccheck.persist.recovery import read_manifest, read_store, store_files
from pccheck.transparent import Criu, Supervisor
from pccheck.transparent.openfiles import tree_pids
from pccheck.transparent.supervisor import OUTPUT_LOG


def _usable_criu() -> str | None:
    try:
        Criu().check()
    except pccheck.PCCheckError as exc:
        return str(exc)
    return None


WHY = _usable_criu()
needs_criu = pytest.mark.skipif(WHY is not None, reason=f"no usable criu: {WHY}")

N = 1 << 20  # float64 elements: an 8 MiB state

SCRIPT = textwrap.dedent(f"""
    import os, sys, time
    import numpy as np
    total = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else {N}
    own = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "own.log"), "w")  # not O_APPEND
    state = np.zeros(n)
    for step in range(total):
        state += 1.0                     # every element holds step + 1
        print(step, float(state.sum()), flush=True)
        own.write(f"{{step}} {{float(state.sum())}}\\n")
        own.flush()
        time.sleep(0.01)
    print("done", flush=True)
    own.write("done\\n")
""")


def _script(tmp_path: Path) -> Path:
    p = tmp_path / "count.py"
    p.write_text(SCRIPT)
    return p


def _lines(path: Path) -> list[str]:
    return (path / OUTPUT_LOG).read_text().splitlines()


def _wait_lines(path: Path, n: int, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while len(_lines(path)) < n:
        assert time.monotonic() - t0 < timeout, "the process did not get going"
        time.sleep(0.02)


def _check_log(lines: list[str], total: int, n: int = N) -> list[int]:
    """Every line is `step checksum` with checksum = (step + 1) * n, or "done" last; a restore
    may repeat steps after the dump, never skip one. Returns where each run (re)started."""
    assert lines[-1] == "done", lines[-3:]
    starts, prev = [], -1
    body = lines[:-1]
    for k, ln in enumerate(body):
        whole = f"{prev + 1} {float((prev + 2) * n)}"
        if ln and ln != whole and whole.startswith(ln) and k + 1 < len(body) and int(body[k + 1].split()[0]) <= prev + 1:
            continue  # the killed process's last line, torn by the SIGKILL (ended by the resume)
        step_s, csum = ln.split()
        step = int(step_s)
        assert float(csum) == (step + 1) * n, ln
        assert step <= prev + 1, f"a gap before {ln!r}"
        if step != prev + 1:
            starts.append(step)
        prev = step
    assert prev == total - 1
    return starts


def _kill_tree(sup: Supervisor) -> None:
    os.killpg(sup.pid, signal.SIGKILL)
    assert sup.wait(30) == -signal.SIGKILL


@needs_criu
def test_kill_and_resume_continue_from_the_committed_dump(tmp_path):
    path, total = tmp_path / "ck", 400
    sup = Supervisor.start([sys.executable, str(_script(tmp_path)), str(total)], path)
    _wait_lines(path, 30)
    first = sup.dump_now()
    sup.flush()
    _wait_lines(path, len(_lines(path)) + 20)  # it ran on after the dump
    _kill_tree(sup)
    sup.close()
    assert first is not None and first.outcome == "committed" and first.freeze_s > 0 and first.files > 3
    assert first.image_bytes > N * 8  # the state is in the image
    killed_at = int(_lines(path)[-1].split()[0])

    sup2 = Supervisor.resume(path)
    assert sup2.pid == sup.pid and sup2.next_step == 2  # CRIU restores the pid; dumps go on from step 2
    assert sup2.wait(120) == 0
    sup2.close()
    starts = _check_log(_lines(path), total)
    assert len(starts) == 1 and starts[0] < killed_at  # resumed from the dump, before the kill
    # The script's own log (open for writing, not appending) grew after the dump: it was cut back
    # to its size at the dump and the later lines set aside, so it reads as one clean run.
    own = (tmp_path / "own.log").read_text().splitlines()
    assert _check_log(own, total) == []
    aside = (tmp_path / "own.log.pcc-after-1").read_text().splitlines()
    # The script prints a step, then writes it to its own log: a dump between the two leaves that
    # step in the output but not yet in own.log, so the set-aside lines begin one step earlier.
    first = int(aside[0].split()[0]) if aside else -1
    assert first in (starts[0] - 1, starts[0]), (first, starts[0])
    assert [int(ln.split()[0]) for ln in aside] == list(range(first, first + len(aside)))
    assert first + len(aside) - 1 <= killed_at
    r = CliRunner().invoke(app, ["verify", str(path)])  # an image is a checkpoint like any other
    assert r.exit_code == 0, r.output


def _gone(pid: int, timeout: float = 30.0) -> None:
    """Waits until ``pid`` no longer exists, reaping it if it came to this process (pytest is a
    child subreaper once a Supervisor ran in it)."""
    t0 = time.monotonic()
    while os.path.exists(f"/proc/{pid}"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        assert time.monotonic() - t0 < timeout, f"process {pid} did not go away"
        time.sleep(0.02)


def _until(sup: subprocess.Popen, found: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``found()`` until it answers (truthy) while supervisor ``sup`` runs; its answer."""
    t0 = time.monotonic()
    while True:
        assert sup.poll() is None, sup.stderr.read().decode()[-2000:]  # type: ignore[union-attr]
        got = found()
        if got:
            return got
        assert time.monotonic() - t0 < timeout, what
        time.sleep(0.05)


def _work(sup: subprocess.Popen) -> list[int] | None:
    """The one count.py process under supervisor ``sup``, if it runs."""
    work = [c for c in tree_pids(sup.pid)[1:] if _cmdline(c).find(b"count.py") >= 0]
    return work if len(work) == 1 else None


def _committed(path: Path) -> bool:
    """Whether the store under ``path`` holds a committed image (from the meta records)."""
    try:
        return any(s.status == "latest" for g in survey(path) for s in g.slots)
    except (OSError, pccheck.PCCheckError):  # no store yet
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone between the listing and the read
        return b""


@pytest.mark.slow  # a long round (five kills, ~48 s): `make test-slow`; test_kill_and_resume_... is the one-round check
@needs_criu
def test_five_rounds_of_killing_the_tree_and_its_supervisor(tmp_path):
    """`pccheck run --every 1` of a process with a 200 MB state, then five times: SIGKILL the
    supervisor (with any criu it runs) and the whole process tree at a random moment, `pccheck
    resume`. The log ends complete, every line consistent, no step skipped."""
    import random

    rng = random.Random(16)
    path, total, n = tmp_path / "ck", 500, 25_000_000
    cmd = [sys.executable, "-m", "pccheck.commands.cli"]
    sup = subprocess.Popen([*cmd, "run", "--every", "1", "--path", str(path), "--", sys.executable,
                            str(_script(tmp_path)), str(total), str(n)], start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    resumed = 0
    for _ in range(5):
        # started or restored (a slow restore must not read as a lost process)
        _until(sup, lambda: _work(sup), 60, "no single count.py under the supervisor")
        if not resumed:  # a kill before the first image would leave nothing to resume from
            _until(sup, lambda: _committed(path), 120, "no image committed")
        time.sleep(rng.uniform(2.5, 4.0))  # a dump committed, another possibly in flight
        work = _until(sup, lambda: _work(sup), 60, "no single count.py under the supervisor")
        os.killpg(sup.pid, signal.SIGKILL)  # the supervisor and a criu it may be running
        os.killpg(work[0], signal.SIGKILL)  # the training process's own session
        sup.wait()
        _gone(work[0])
        sup = subprocess.Popen([*cmd, "resume", "--every", "1", "--path", str(path)], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        resumed += 1
    _, err = sup.communicate(timeout=180)
    assert sup.returncode == 0, err.decode()[-2000:]
    starts = _check_log(_lines(path), total, n)
    assert 1 <= len(starts) <= resumed  # every resume went back to a committed image, never past the kill
    assert _check_log((tmp_path / "own.log").read_text().splitlines(), total, n) == []  # cut back each time
    assert len(list(tmp_path.glob("own.log.pcc-after-*"))) >= 1


def _flip_newest_image_byte(path: Path, step: int) -> None:
    for _, file in store_files(path):
        image = read_store(file)
        for s in image.slots:
            if s.meta and s.meta["step"] == step:
                with open(file, "rb") as f:
                    man = read_manifest(image, s.slot, f.fileno())
                entry = max(man.arrays, key=lambda e: e.nbytes)
                off = image.header["slots_offset"] + s.slot * image.header["slot_capacity"] + entry.offset + 7
                with open(file, "r+b") as f:
                    f.seek(off)
                    b = f.read(1)
                    f.seek(off)
                    f.write(bytes([b[0] ^ 0x10]))
                return
    raise AssertionError(f"no slot of step {step}")


@needs_criu
def test_a_damaged_newest_image_falls_back_to_the_previous_one(tmp_path, caplog):
    path, total = tmp_path / "ck", 300
    sup = Supervisor.start([sys.executable, str(_script(tmp_path)), str(total)], path)
    _wait_lines(path, 20)
    a = sup.dump_now()
    sup.flush()
    at_a = len(_lines(path))
    _wait_lines(path, at_a + 40)
    b = sup.dump_now()
    sup.flush()
    _kill_tree(sup)
    sup.close()
    assert a is not None and b is not None and (a.step, b.step) == (1, 2)
    _flip_newest_image_byte(path, 2)
    with caplog.at_level("WARNING", logger="pccheck"):
        sup2 = Supervisor.resume(path)
    assert sup2.wait(120) == 0
    sup2.close()
    starts = _check_log(_lines(path), total)
    # restored from dump 1: it restarted at most where dump 1 left it, before dump 2 was taken
    assert len(starts) == 1 and starts[0] <= at_a
    assert _check_log((tmp_path / "own.log").read_text().splitlines(), total) == []
    assert "crc" in caplog.text.lower() or "fall" in caplog.text.lower()


@needs_criu
def test_resume_refuses_while_the_dumped_pid_is_in_use(tmp_path):
    path = tmp_path / "ck"
    sup = Supervisor.start([sys.executable, str(_script(tmp_path)), "100000"], path)
    try:
        _wait_lines(path, 5)
        sup.dump_now()
        sup.flush()
        with pytest.raises(pccheck.CriuError, match=f"PID {sup.pid}.*in use.*wait until it has exited"):
            Supervisor.resume(path)
    finally:
        _kill_tree(sup)
        sup.close()


@needs_criu
def test_cli_run_forwards_output_and_returns_the_exit_code(tmp_path):
    path = tmp_path / "ck"
    p = subprocess.run([sys.executable, "-m", "pccheck.commands.cli", "run", "--every", "0.3", "--path", str(path), "--",
                        sys.executable, str(_script(tmp_path)), "60"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "done" and p.stdout.splitlines()[0].startswith("0 ")
    assert "committed" in p.stderr
    p = subprocess.run([sys.executable, "-m", "pccheck.commands.cli", "run", "--path", str(tmp_path / "e"), "--",
                        sys.executable, "-c", "raise SystemExit(7)"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 7, p.stderr


def test_bad_input_is_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("PCCHECK_CRIU", str(tmp_path / "no-such-criu"))
    with pytest.raises(pccheck.CriuError, match="PCCHECK_CRIU.*get-criu.sh"):
        Criu()
    runner = CliRunner()
    r = runner.invoke(app, ["run", "--every", "0", "--path", str(tmp_path / "a"), "--", "true"])
    assert r.exit_code == 2 and "--every" in r.output
    r = runner.invoke(app, ["run", "--path", str(tmp_path / "a")])
    assert r.exit_code == 2 and "command" in r.output
    r = runner.invoke(app, ["run", "--path", str(tmp_path / "a"), "--", "true"])
    assert r.exit_code == 2 and "PCCHECK_CRIU" in r.output  # no criu: a clear error, nothing run
    assert not (tmp_path / "a" / OUTPUT_LOG).exists()


@needs_criu
def test_a_file_that_shrank_since_the_dump_is_named_and_nothing_is_restored(tmp_path):
    path = tmp_path / "ck"
    sup = Supervisor.start([sys.executable, str(_script(tmp_path)), "100000"], path)
    _wait_lines(path, 10)
    sup.dump_now()
    sup.flush()
    _kill_tree(sup)
    sup.close()
    (tmp_path / "own.log").write_text("")  # the user truncated the process's log
    with pytest.raises(pccheck.CriuError, match=r"own\.log has 0 bytes, fewer than .* put its bytes back"):
        Supervisor.resume(path)
    assert not os.path.exists(f"/proc/{sup.pid}") and not list(tmp_path.glob("own.log.pcc-after-*"))


def _holding(file: Path, then: str) -> list[str]:
    """A process that opens ``file`` for reading, runs ``then``, says so and sleeps."""
    return [sys.executable, "-c", f"import mmap, time\nf = open({str(file)!r}, 'rb'); {then}\n"
                                  "print('holding', flush=True)\ntime.sleep(60)\n"]


@needs_criu
def test_a_cuda_process_is_refused_without_the_plugin_and_cuda_checkpoint(tmp_path):
    """A process that has a library named like NVIDIA's driver (libcuda.so) mapped: without CRIU's
    CUDA plugin and cuda-checkpoint (none here) the dump is refused, saying what to install."""
    from pccheck.transparent.criu import cuda_support

    if all(cuda_support()):
        pytest.skip("CRIU's CUDA plugin and cuda-checkpoint are installed here")
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * 4096)
    path = tmp_path / "ck"
    sup = Supervisor.start(_holding(lib, "m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)"), path)
    try:
        _wait_lines(path, 1)
        with pytest.raises(pccheck.CriuError, match="uses CUDA.*cuda-checkpoint.*nothing was dumped"):
            sup.dump_now()
        assert sup.stats() == []
    finally:
        _kill_tree(sup)
        sup.close()
    assert not store_files(path)


@needs_criu
def test_a_file_the_process_only_reads_that_grew_is_named_and_left_alone(tmp_path):
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 1000)
    path = tmp_path / "ck"
    sup = Supervisor.start(_holding(data, "f.read(10)"), path)
    _wait_lines(path, 1)
    sup.dump_now()
    sup.flush()
    _kill_tree(sup)
    sup.close()
    with open(data, "ab") as f:
        f.write(b"more")  # someone appended to the input after the dump
    with pytest.raises(pccheck.CriuError, match=r"data\.bin, which the process only reads, grew from 1000 to 1004"):
        Supervisor.resume(path)
    assert data.stat().st_size == 1004 and not list(tmp_path.glob("data.bin.pcc-after-*"))


def test_scratch_directories_of_killed_supervisors_are_swept(tmp_path):
    from pccheck.transparent.supervisor import sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"pccheck-dump-{dead.pid}-abc"
    live = tmp_path / f"pccheck-dump-{os.getpid()}-abc"
    other = tmp_path / f"pccheck-other-{dead.pid}-abc"
    for d in (stale, live, other):
        d.mkdir()
        (d / "pages-1.img").write_bytes(b"x")
    if os.path.exists(f"/proc/{dead.pid}"):
        pytest.skip("the pid was reused at once")
    assert sweep_stale(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


def test_a_torn_last_line_of_the_output_log_is_ended_before_a_resume(tmp_path):
    # A SIGKILL can cut a write between two pages of the file: the restored process appends, so
    # the supervisor ends a torn last line first (and leaves a whole one as it is)
    from pccheck.transparent.supervisor import _end_torn_line

    torn, whole = tmp_path / "torn.log", tmp_path / "whole.log"
    torn.write_bytes(b"0 1.0\n61")
    whole.write_bytes(b"0 1.0\n1 2.0\n")
    _end_torn_line(torn)
    _end_torn_line(whole)
    _end_torn_line(tmp_path / "missing.log")
    assert torn.read_bytes() == b"0 1.0\n61\n" and whole.read_bytes() == b"0 1.0\n1 2.0\n"
    assert not (tmp_path / "missing.log").exists()
    assert _check_log(["0 1048576.0", "1 2097152.0", "2 314", "1 2097152.0", "2 3145728.0", "done"], 3) == [1]
    with pytest.raises(AssertionError):  # a torn line anywhere but before a restart is a fault
        _check_log(["0 1048576.0", "1 209", "2 3145728.0", "done"], 3)
