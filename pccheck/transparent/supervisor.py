"""The supervised process: started (or restored), dumped with CRIU, persisted by the orchestrator.

A dump freezes the process tree while CRIU writes its image into a tmpfs directory (the
snapshot; ``--leave-running``, so it goes on at once). The image files then go through
``Orchestrator.start`` as ``criu/<file>`` arrays: copied into the DRAM chunk pool before it
returns (the tmpfs copy is deleted then), persisted by the writer threads and committed by the CAS
in the background, with up to ``max_concurrent`` in flight (``when_busy`` as for any checkpoint).

The child runs in its own session, with stdin from /dev/null and stdout and stderr appended to
``PATH/output.log`` (``O_APPEND``: CRIU restores an append-only file that grew since the dump);
``forward=True`` copies that file to this process's stdout as it grows. The supervisor is a child
subreaper, so a restored tree (``criu restore -d``) becomes its child and its exit status is
known. The manifest's metadata ``transparent`` object records the command, the pid and the dump.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import shutdown
from ..errors import ConfigError, CorruptCheckpointError, CriuError, NoCheckpointError, PCCheckError
from ..orchestrator.copy_engine import CpuCopyEngine
from ..orchestrator.options import EngineOptions, check_int
from ..orchestrator.orchestrator import Orchestrator
from ..orchestrator.stats import CheckpointStats
from ..persist.layout import plan
from ..persist.recovery import load_newest, store_files
from .criu import Criu, require_cuda_support, uses_cuda
from .image import PREFIX, read_image, write_image
from .openfiles import RECORD, FileProblem, action_script, prepare_files, tree_pids

__all__ = ["DumpStats", "Supervisor", "OUTPUT_LOG", "sweep_stale", "tmpfs_dir"]

log = logging.getLogger("pccheck")

OUTPUT_LOG = "output.log"
UNKNOWN_EXIT = 255  # the exit code reported when the process's status could not be read
_PR_SET_CHILD_SUBREAPER = 36


def tmpfs_dir() -> str:
    """Where snapshots are dumped: ``$PCCHECK_TMPFS``, else /dev/shm, else the temp directory."""
    for d in (os.environ.get("PCCHECK_TMPFS"), "/dev/shm"):
        if d and os.path.isdir(d) and os.access(d, os.W_OK):
            return d
    return tempfile.gettempdir()


_SCRATCH = re.compile(r"^pccheck-(?:dump|restore|supervisor)-(\d+)-")


def _scratch(kind: str, parent: str) -> Path:
    """A new private directory named after this process (so a later supervisor can sweep it up
    if this one is killed: a dump's directory holds a whole process image in RAM)."""
    return Path(tempfile.mkdtemp(prefix=f"pccheck-{kind}-{os.getpid()}-", dir=parent))


def sweep_stale(parent: str) -> list[str]:
    """Removes the scratch directories in ``parent`` left by supervisors that no longer run;
    returns their names."""
    gone = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return gone
    for e in entries:
        m = _SCRATCH.match(e.name)
        if m and e.is_dir(follow_symlinks=False) and not os.path.exists(f"/proc/{m.group(1)}"):
            shutil.rmtree(e.path, ignore_errors=True)
            gone.append(e.name)
    if gone:
        log.info("pccheck: removed %d scratch directories of supervisors that were killed: %s", len(gone),
                 ", ".join(gone))
    return gone


def _exec_dir(store: Path) -> str:
    """A directory whose file system allows exec (CRIU runs the action script from it)."""
    for d in (tmpfs_dir(), tempfile.gettempdir(), str(store)):
        try:
            if not os.statvfs(d).f_flag & os.ST_NOEXEC:
                return d
        except OSError:
            continue
    raise CriuError("no directory that allows exec for CRIU's action script (tmpfs, $TMPDIR and the store "
                    "are all noexec); set TMPDIR to one that does")


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise CriuError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")


@dataclass
class DumpStats:
    """One dump: ``freeze_s`` the process tree was stopped (CRIU's dump, an upper bound),
    ``start_s`` handing the image to the DRAM pool, ``persist_s`` from then until durable."""

    step: int
    pid: int
    image_bytes: int
    files: int
    freeze_s: float
    start_s: float
    persist_s: float | None = None
    outcome: str = "in flight"   # then "committed", "superseded", "failed" or "skipped"

    @property
    def bandwidth(self) -> float | None:
        """Image bytes per second from the dump's start to durable."""
        if self.persist_s is None or self.outcome != "committed":
            return None
        return self.image_bytes / (self.freeze_s + self.start_s + self.persist_s)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bandwidth": self.bandwidth}


def _end_torn_line(log_path: Path) -> None:
    """Ends the output log's last line if it is torn. A SIGKILL can cut a write to a file between
    two of its pages, so the killed process's last line may lack its newline; the restored
    process appends (``O_APPEND``), and its first line would otherwise be glued to that torn one."""
    try:
        with open(log_path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
                log.info("pccheck: %s ended with a torn line (the process was killed mid-write); ended it", log_path)
    except FileNotFoundError:
        pass


class Supervisor:
    """Runs ``cmd`` under CRIU checkpoints into the store at ``path`` (or, with :meth:`resume`,
    restores the newest valid image there and supervises it).

    Args:
        cmd: the command and its arguments.
        path: the store directory (created); it must hold no store yet (use :meth:`resume`).
        every: seconds between dumps (None: only :meth:`dump_now`).
        max_concurrent: dumps in flight at once (persisting); ``when_busy``: "block" or "skip".
        criu: the criu executable (default: ``$PCCHECK_CRIU``, then PATH).
        forward: copy the child's output (``PATH/output.log``) to this process's stdout.
    """

    def __init__(self, cmd: Sequence[str], path: str | os.PathLike[str], *, every: float | None = None,
                 max_concurrent: int = 2, when_busy: str = "block", criu: str | None = None,
                 forward: bool = False, _restore: bool = False) -> None:
        self.cmd = [str(c) for c in cmd] if not isinstance(cmd, str) else []
        if not self.cmd:
            raise ConfigError("the command to run is missing: give it as a list, e.g. ['python', 'train.py']")
        if every is not None and not (isinstance(every, (int, float)) and every > 0):
            raise ConfigError(f"every must be a positive number of seconds, got {every!r}")
        check_int("max_concurrent", max_concurrent, 1, 254)
        self.every = float(every) if every is not None else None
        self.path = Path(path)
        self.engine = EngineOptions(max_concurrent=max_concurrent, writer_threads=2, chunk_size=64 << 20,
                                    when_busy=when_busy)
        self.criu = Criu(criu)
        self.criu_version = self.criu.check()
        if not _restore and self.path.is_dir() and store_files(self.path):
            raise ConfigError(f"{self.path} already holds checkpoints: continue it with `pccheck resume --path "
                              f"{self.path}`, or choose another path")
        self.path.mkdir(parents=True, exist_ok=True)
        self.pid: int | None = None
        self.returncode: int | None = None
        self.next_step = 1
        self._orch: Orchestrator | None = None
        self._dump_lock = threading.Lock()   # one dump at a time
        self._stats: dict[int, DumpStats] = {}
        self._stats_lock = threading.Lock()
        self._errors: list[PCCheckError] = []
        self._stop = threading.Event()
        self._closed = False  # guarded by _dump_lock: no dump starts after close()
        self._popen: subprocess.Popen | None = None
        self._exited = threading.Event()
        self._threads: list[threading.Thread] = []
        self._forward = forward
        self._forget_exit: Any = lambda: None
        for d in {tmpfs_dir(), _exec_dir(self.path)}:
            sweep_stale(d)
        self._private = _scratch("supervisor", _exec_dir(self.path))
        self._action = action_script(self._private)  # records the files open for writing at each dump
        self._libdir: str | None = None  # CRIU's plugin directory, once the process is seen to use CUDA
        _become_subreaper()  # before any child exists: a restored tree must come back to us

    # -- starting ------------------------------------------------------------------------------------

    @classmethod
    def start(cls, cmd: Sequence[str], path: str | os.PathLike[str], **kw: Any) -> "Supervisor":
        """Starts ``cmd`` in its own session and supervises it."""
        sup = cls(cmd, path, **kw)
        out = os.open(sup.path / OUTPUT_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            # Own session, stdin /dev/null, output appended to the log; SIGPIPE back to its default.
            # No kernel write watch in the tree (orchestrator/write_watch.py): CRIU cannot dump a
            # userfaultfd, so a process that checkpoints incrementally inside fingerprints instead.
            child = subprocess.Popen(sup.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                     start_new_session=True, env={**os.environ, "PCCHECK_WRITE_WATCH": "0"})
        except OSError as exc:
            sup.close()
            raise ConfigError(f"cannot start {sup.cmd[0]!r}: {exc.strerror or exc}") from None
        finally:
            os.close(out)
        # Reaped by _reap (os.waitpid), never through the Popen object; kept referenced so that
        # subprocess's own clean-up (of dropped Popen objects) never reaps it first.
        sup._popen = child
        sup._attach(child.pid)
        return sup

    @classmethod
    def resume(cls, path: str | os.PathLike[str], *, every: float | None = None, **kw: Any) -> "Supervisor":
        """Restores the newest valid image at ``path`` (every crc checked first; a damaged newest
        falls back to an older valid one) and supervises it, dumping into the same store."""
        r = load_newest(path)
        meta = r.metadata.get("transparent") if isinstance(r.metadata, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get("pid"), int) or not isinstance(meta.get("cmd"), list):
            raise NoCheckpointError(f"the newest checkpoint at {path} (step {r.step}) is not a transparent-mode "
                                    "image; pccheck resume restores what `pccheck run` wrote")
        old = meta["pid"]
        if os.path.exists(f"/proc/{old}"):
            raise CriuError(f"PID {old}, the dumped process's, is in use by another process ({_comm(old)}); "
                            "CRIU restores the original PIDs: wait until it has exited, then resume again")
        step = meta.get("step", r.step)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or not all(isinstance(c, str) for c in meta["cmd"]):
            raise CorruptCheckpointError(f"the transparent-mode metadata of step {r.step} is malformed")
        record = _files_record(r.state)
        libdir = require_cuda_support(old) if meta.get("cuda") is True else None  # before anything changes
        sup = cls(meta["cmd"], path, every=every if every is not None else meta.get("every"), _restore=True, **kw)
        images: Path | None = None
        try:
            # Every check is done: now the files the process writes are cut back to the dump.
            try:
                moved = prepare_files(record, step)
            except FileProblem as exc:
                raise CriuError(f"cannot restore the image of step {step}: {exc}") from None
            for path_, aside in moved:
                log.warning("pccheck: %s grew after the dump of step %d: the bytes written since are in %s, and "
                            "the restored process writes on from where it was", path_, step, aside)
            _end_torn_line(sup.path / OUTPUT_LOG)
            images = _scratch("restore", tmpfs_dir())
            write_image(r.state, images)
            del r
            sup._libdir = libdir
            pid = sup.criu.restore(images, libdir=libdir)
        except BaseException:
            sup.close()
            raise
        finally:
            if images is not None:
                shutil.rmtree(images, ignore_errors=True)
        sup.next_step = step + 1
        sup._attach(pid)
        log.info("pccheck: restored process %d from the image of step %d", pid, sup.next_step - 1)
        return sup

    def _attach(self, pid: int) -> None:
        self.pid = pid
        # The reaper (waitpid) and the output forwarder (a pipe read) block in plain system calls
        # for as long as the process lives, which may outlast this interpreter; they run no native
        # code of pccheck's or torch's, so they stay plain daemon threads. The dumps do run the
        # native writers: close() stops them at interpreter exit (pccheck.shutdown).
        threads = [threading.Thread(target=self._reap, name="pccheck-supervise", daemon=True)]
        if self._forward:
            threads.append(threading.Thread(target=self._forward_output, name="pccheck-output", daemon=True))
        for t in threads:
            t.start()
        if self.every is not None:
            self._forget_exit = shutdown.on_exit(self.close)
            threads.append(shutdown.thread(self._periodic, "pccheck-dumps"))
        self._threads = threads

    # -- the process ---------------------------------------------------------------------------------

    def _reap(self) -> None:
        assert self.pid is not None
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
                break
            except ChildProcessError:  # not our child after all: its status is unknown
                while os.path.exists(f"/proc/{self.pid}"):
                    time.sleep(0.05)
                log.error("pccheck: process %d was not this supervisor's child; its exit status is unknown",
                          self.pid)
                status = None
                break
            except InterruptedError:
                continue
        self.returncode = os.waitstatus_to_exitcode(status) if status is not None else UNKNOWN_EXIT
        self._exited.set()

    def alive(self) -> bool:
        return self.pid is not None and not self._exited.is_set()

    def _periodic(self) -> None:
        assert self.every is not None
        while not self._stop.wait(self.every) and self.alive():
            try:
                self.dump_now()
            except PCCheckError as exc:  # the process runs on; the last committed image stays
                log.error("pccheck: a dump failed (the last committed image stays): %s", exc)
                self._errors.append(exc)

    def _forward_output(self) -> None:
        pos = 0
        log_path = self.path / OUTPUT_LOG
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos = f.tell() if self.next_step > 1 else 0  # a resumed run: only what comes next
            while True:
                f.seek(pos)
                chunk = f.read(1 << 16)
                if chunk:
                    pos += len(chunk)
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                    continue
                if self._exited.is_set() and f.seek(0, os.SEEK_END) <= pos:
                    return
                time.sleep(0.05)

    # -- dumps ---------------------------------------------------------------------------------------

    def _orchestrator(self, arrays: dict[str, Any], metadata: dict[str, Any]) -> Orchestrator:
        if self._orch is None:
            layout = plan(arrays)
            self._orch = Orchestrator(self.path, layout, self.engine, copy_engine=CpuCopyEngine(),
                                      on_error=self._errors.append, on_finished=self._finished)
        return self._orch

    def _finished(self, st: CheckpointStats) -> None:
        with self._stats_lock:
            d = self._stats.get(st.step)
            if d is not None:
                d.persist_s, d.outcome = st.persist_s, st.outcome

    def dump_now(self) -> DumpStats | None:
        """Dumps the process now and hands the image to the writers; returns its stats (None if
        the process has exited, or the dump was skipped with ``when_busy="skip"``)."""
        with self._dump_lock:
            if not self.alive() or self._closed:
                return None
            assert self.pid is not None
            step = self.next_step
            images = _scratch("dump", tmpfs_dir())
            try:
                if self._libdir is None and uses_cuda(tree_pids(self.pid)):
                    self._libdir = require_cuda_support(self.pid)  # CRIU's CUDA plugin, or a clear refusal
                freeze = self.criu.dump(self.pid, images, action_script=self._action, libdir=self._libdir)
                arrays = read_image(images)
                nbytes = sum(int(a.nbytes) for a in arrays.values())
                meta = {"transparent": {"pid": self.pid, "cmd": self.cmd, "every": self.every, "step": step,
                                        "cuda": self._libdir is not None,
                                        "freeze_s": freeze, "image_bytes": nbytes, "criu": self.criu_version,
                                        "time": time.time()}}
                orch = self._orchestrator(arrays, meta)
                stats = DumpStats(step, self.pid, nbytes, len(arrays), freeze, 0.0)
                with self._stats_lock:
                    self._stats[step] = stats
                t0 = time.perf_counter()
                started = orch.start(step, arrays, meta)  # every byte is in DRAM chunks when it returns
                stats.start_s = time.perf_counter() - t0
                del arrays
            finally:
                shutil.rmtree(images, ignore_errors=True)
            self.next_step = step + 1
            if not started:
                stats.outcome = "skipped"
                return None
            return stats

    # -- ending --------------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> int | None:
        """Waits for the process to exit and every dump to be committed; returns its exit code
        (negative: killed by that signal), or None on timeout."""
        if not self._exited.wait(timeout):
            return None
        self._stop.set()
        self.flush()
        for t in self._threads:
            if t.name == "pccheck-output":
                t.join(10)  # the last of its output is forwarded before we return
        return self.returncode

    def flush(self) -> None:
        """Waits until every dump handed to the writers is committed (or failed)."""
        with self._dump_lock:
            if self._orch is not None:
                self._orch.wait()

    def stop(self, final_dump: bool = True, timeout: float = 30.0) -> int | None:
        """The preemption path: one final dump, committed, then SIGTERM to the process tree
        (SIGKILL after ``timeout``); returns its exit code."""
        self._stop.set()
        if final_dump and self.alive():
            try:
                self.dump_now()
                self.flush()
            except PCCheckError as exc:  # the process is stopped anyway; the last committed image stays
                log.error("pccheck: the final dump failed (the last committed image stays): %s", exc)
                self._errors.append(exc)
        if self.alive() and self.pid is not None:
            _signal_tree(self.pid, signal.SIGTERM)
            if not self._exited.wait(timeout):
                _signal_tree(self.pid, signal.SIGKILL)
                self._exited.wait(timeout)
        return self.wait(timeout)

    def stats(self) -> list[DumpStats]:
        """Every dump of this supervisor, oldest first."""
        with self._stats_lock:
            return [self._stats[k] for k in sorted(self._stats)]

    @property
    def errors(self) -> list[PCCheckError]:
        """Background failures (dumps and writes); the last committed image survived each."""
        return list(self._errors)

    def close(self) -> None:
        """Stops dumping, waits for the writers and closes the store (the process is left alone)."""
        self._forget_exit()
        self._stop.set()
        with self._dump_lock:
            self._closed = True
            if self._orch is not None:
                self._orch.close()
                self._orch = None
            shutil.rmtree(self._private, ignore_errors=True)

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _files_record(state: dict[str, Any]) -> dict[str, list[int]]:
    """The image's record of open files ({path: [size, writing]}), checked, or {} without one."""
    raw = state.get(PREFIX + RECORD)
    if raw is None:
        return {}
    try:
        record = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"the image's {RECORD} is not JSON ({exc})") from None
    def entry_ok(k: Any, v: Any) -> bool:
        return (isinstance(k, str) and k.startswith("/") and "\0" not in k and isinstance(v, list) and len(v) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v) and v[1] in (0, 1))
    if not isinstance(record, dict) or not all(entry_ok(k, v) for k, v in record.items()):
        raise CorruptCheckpointError(f"the image's {RECORD} is not a map of absolute paths to [size, writing]")
    return record


def _signal_tree(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session and process group
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
