"""Finding CRIU and running its dump and restore.

pccheck looks for CRIU in ``$PCCHECK_CRIU``, then on ``PATH``. CRIU needs root, and on this kind
of host Debian trixie's 4.x (``scripts/get-criu.sh`` fetches it into a private prefix and prints
the wrapper to put in ``PCCHECK_CRIU``). Every failure is a :class:`~pccheck.errors.CriuError`
whose message says what to do, with the tail of CRIU's own log.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

from ..errors import CriuError

__all__ = ["Criu", "find_criu", "ENV", "cuda_support", "uses_cuda", "require_cuda_support"]

log = logging.getLogger("pccheck")

ENV = "PCCHECK_CRIU"
DUMP_LOG = "dump.log"        # CRIU's logs live beside the image files but are never persisted
RESTORE_LOG = "restore.log"
LOGS = (DUMP_LOG, RESTORE_LOG)
_GET = "run scripts/get-criu.sh (it prints the path of a working criu) and set PCCHECK_CRIU to it"


def find_criu(explicit: str | os.PathLike[str] | None = None) -> str:
    """The criu executable: ``explicit``, else ``$PCCHECK_CRIU``, else ``criu`` on PATH."""
    for source, value in (("criu", explicit), (ENV, os.environ.get(ENV))):
        if value:
            path = shutil.which(str(value)) or (str(value) if os.access(value, os.X_OK) else None)
            if path is None:
                raise CriuError(f"{source}={value!s} is not an executable; {_GET}")
            return path
    path = shutil.which("criu")
    if path is None:
        raise CriuError(f"no criu found: {ENV} is not set and there is no criu on PATH; {_GET}")
    return path


CUDA_PLUGIN = "cuda_plugin.so"
LIBDIR_ENV = "PCCHECK_CRIU_LIBDIR"


def cuda_support() -> tuple[str | None, str | None]:
    """(the directory holding CRIU's CUDA plugin, the ``cuda-checkpoint`` executable), each None
    when not found: the plugin in ``$PCCHECK_CRIU_LIBDIR``, then /usr/lib/criu and
    /usr/local/lib/criu; cuda-checkpoint on PATH."""
    libdir = None
    for d in (os.environ.get(LIBDIR_ENV), "/usr/lib/criu", "/usr/local/lib/criu"):
        if d and os.path.isfile(os.path.join(d, CUDA_PLUGIN)):
            libdir = d
            break
    return libdir, shutil.which("cuda-checkpoint")


def uses_cuda(pids: list[int]) -> bool:
    """Whether any of ``pids`` has NVIDIA's driver library (libcuda) mapped."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                if any(b"/libcuda.so" in line for line in f):
                    return True
        except OSError:
            continue
    return False


def require_cuda_support(pid: int) -> str:
    """The plugin directory to pass CRIU (``-L``) for a process that uses CUDA; CriuError saying
    what to install when the plugin or cuda-checkpoint is missing."""
    libdir, tool = cuda_support()
    missing = ([f"CRIU's CUDA plugin ({CUDA_PLUGIN}: build CRIU >= 4.0 with its plugins/cuda, then put its "
                f"directory in {LIBDIR_ENV})"] if libdir is None else []) + \
              (["NVIDIA's cuda-checkpoint on PATH (github.com/NVIDIA/cuda-checkpoint, driver >= 550)"]
               if tool is None else [])
    if missing:
        raise CriuError(f"process {pid} uses CUDA (libcuda is mapped), and CRIU can checkpoint it only with "
                        f"{' and '.join(missing)}; nothing was dumped")
    assert libdir is not None
    return libdir


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    # CRIU in a container always logs this one; it is harmless (README, transparent mode).
    keep = [ln for ln in text if "RLIMIT_NOFILE" not in ln]
    return "\n".join(keep[-lines:])


class Criu:
    """One criu executable, checked once (``check()``) before it is used."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = find_criu(path)

    def _run(self, args: list[str], timeout: float) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([self.path, *args], capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CriuError(f"criu {args[0]} did not finish in {timeout:.0f} s") from None
        except OSError as exc:
            raise CriuError(f"cannot run {self.path}: {exc}; {_GET}") from None

    def check(self) -> str:
        """Runs ``criu check``; returns its version line. CriuError unless it passes as root."""
        if os.geteuid() != 0:
            raise CriuError("transparent mode needs root (CRIU dumps and restores other processes); "
                            "run pccheck run / resume as root")
        version = self._run(["--version"], 30)
        if version.returncode != 0:
            raise CriuError(f"{self.path} --version failed: {version.stderr.strip()[-500:]}; {_GET}")
        checked = self._run(["check"], 60)
        if checked.returncode != 0 or "Looks good" not in checked.stdout + checked.stderr:
            raise CriuError(f"`{self.path} check` fails on this host: {(checked.stdout + checked.stderr).strip()[-800:]}"
                            f"; Debian bookworm's criu 3.17 is known to fail here: {_GET}")
        return version.stdout.strip().splitlines()[0] if version.stdout.strip() else "criu"

    def dump(self, pid: int, images: Path, *, leave_running: bool = True, action_script: Path | None = None,
             libdir: str | None = None, timeout: float = 600.0) -> float:
        """Dumps the process tree rooted at ``pid`` into ``images``; returns the seconds it took
        (the tree is frozen for about that long). ``action_script``: run by CRIU at each action
        (openfiles.py's). CriuError with CRIU's log if it fails."""
        args = ["dump", "-t", str(pid), "-D", str(images), "-o", DUMP_LOG, "-v2"]
        if leave_running:
            args.append("--leave-running")
        if action_script is not None:
            args += ["--action-script", str(action_script)]
        if libdir is not None:  # plugins (CUDA)
            args += ["-L", libdir]
        t0 = time.perf_counter()
        r = self._run(args, timeout)
        took = time.perf_counter() - t0
        if r.returncode != 0:
            raise CriuError(f"criu dump of process {pid} failed (exit {r.returncode}):\n{_tail(images / DUMP_LOG)}")
        return took

    def restore(self, images: Path, *, libdir: str | None = None, timeout: float = 600.0) -> int:
        """Restores the tree dumped in ``images``, detached (``-d``: the restored root becomes a
        child of the nearest subreaper, the caller); returns its pid."""
        pidfile = images / "restored.pid"
        args = ["restore", "-d", "-D", str(images), "-o", RESTORE_LOG, "-v2", "--pidfile", str(pidfile)]
        if libdir is not None:
            args += ["-L", libdir]
        r = self._run(args, timeout)
        if r.returncode != 0:
            tail = _tail(images / RESTORE_LOG)
            hint = ""
            if "File exists" in tail or "Can't fork for" in tail or "PID" in tail and "busy" in tail:
                hint = "; a PID of the dumped tree is in use: wait until that process has exited, then resume again"
            raise CriuError(f"criu restore failed (exit {r.returncode}){hint}:\n{tail}")
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise CriuError(f"criu restore did not write the restored pid ({exc})") from None
