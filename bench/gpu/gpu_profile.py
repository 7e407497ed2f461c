"""``python -m bench.gpu --profile``: where the time of a training window goes. py-spy samples the
process during a window (:class:`Spy`), the window is repeated with the first GPU run's copy loop
(:func:`legacy_window`), and torch.profiler records the iterations around one checkpoint
(:func:`profile_checkpoint`). The window itself is bench/gpu/gpu.py's ``_window``, passed in."""

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.gpu_train import PCCheck, System, Trainer

__all__ = ["PROFILED", "Spy", "legacy_window", "profile_checkpoint"]

PROFILED = {("pccheck_N2", 10)}  # --profile: the windows repeated under py-spy, then a torch.profiler run


class Spy:
    """py-spy (``$PY_SPY``, else on the PATH) sampling this process while a window runs: one recording of
    the threads that hold the GIL (``--gil``), one of every thread, idle ones too (``--idle``); both
    ``--nonblocking`` (the process is never paused) at 200 Hz, raw collapsed stacks per thread,
    appended to ``out/pyspy.txt`` under a header. ``finish()`` stops them (SIGINT) and returns a summary:
    samples per thread, with this process's thread names (py-spy names threads by their pthread id)."""

    def __init__(self, out: Path, tag: str, duration_s: float) -> None:
        import threading
        self.out, self.tag, self.procs, self.files = out, tag, [], []
        self.names = {f"{t.ident:#x}": t.name for t in threading.enumerate() if t.ident}
        exe = os.environ.get("PY_SPY") or shutil.which("py-spy")
        if exe is None:
            self.note = "py-spy not found"
            return
        self.note = exe
        for mode in ("gil", "idle"):
            f = out / f".pyspy-{mode}.txt"
            cmd = [exe, "record", "--pid", str(os.getpid()), "--rate", "200", "--format", "raw", "--threads",
                   "--nonblocking", f"--{mode}", "--duration", str(int(duration_s) + 30), "-o", str(f)]
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            self.files.append((mode, f))
        time.sleep(1.0)  # let both attach before the timed iterations

    def finish(self) -> dict[str, Any]:
        import signal
        import threading
        self.names.update({f"{t.ident:#x}": t.name for t in threading.enumerate() if t.ident})
        summary: dict[str, Any] = {"py_spy": self.note, "thread_names": self.names}
        for p, (mode, f) in zip(self.procs, self.files):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
            try:
                log, _ = p.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                log, _ = p.communicate()
            per_thread: dict[str, int] = {}
            text = f.read_text() if f.exists() else ""
            for line in text.splitlines():
                stack, _, n = line.rpartition(" ")
                thread = next((fr for fr in stack.split(";") if fr.startswith("thread (")), "?")
                if n.isdigit():
                    per_thread[thread] = per_thread.get(thread, 0) + int(n)
            summary[mode] = {"rc": p.returncode, "log_tail": (log or "")[-400:], "samples_per_thread": per_thread}
            with open(self.out / "pyspy.txt", "a") as dst:
                dst.write(f"## {self.tag} --{mode}\n{text}")
            f.unlink(missing_ok=True)
        return summary


def profile_checkpoint(tr: Trainer, sysm: System, interval: int, path: Path) -> dict[str, Any]:
    """torch.profiler (CPU + CUDA, every thread) over 2 quiet iterations, a checkpoint's and the 2 after it;
    per iteration: wall, and the CPU / device time of its ``record_function`` range; the top operators by
    self device time and by self CPU time. Written to ``path``; not part of any timed window."""
    from torch.profiler import ProfilerActivity, profile, record_function
    sysm.interval = interval
    c = -(-(tr.step + 2) // interval) * interval
    steps, wall = list(range(c - 2, c + 3)), {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in steps:
            a = time.perf_counter()
            with record_function(f"iter {s}{' (checkpoint)' if s == c else ''}"):
                tr.train(s)
                sysm.call(s)
            wall[s] = time.perf_counter() - a
    sysm.drain()
    tr.step = steps[-1] + 1
    ka = prof.key_averages()
    iters = {ev.key: {"cpu_s": ev.cpu_time_total / 1e6, "device_s": getattr(ev, "device_time_total", 0) / 1e6}
             for ev in ka if ev.key.startswith("iter ")}
    with open(path, "a") as f:
        f.write(f"# torch.profiler, interval {interval}, checkpoint at step {c}\n")
        f.write("".join(f"step {s}: wall {w * 1e3:.1f} ms\n" for s, w in wall.items()))
        f.write("".join(f"{k}: {v}\n" for k, v in iters.items()))
        for key in ("self_device_time_total", "self_cpu_time_total"):
            with contextlib.suppress(Exception):
                f.write(f"\n## by {key}\n{ka.table(sort_by=key, row_limit=30, max_name_column_width=60)}\n")
    return {"checkpoint_step": c, "wall_s": {str(k): v for k, v in wall.items()}, "ranges": iters}


def legacy_window(window: Callable[..., dict[str, Any]], tr: Trainer, sysm: PCCheck, interval: int, iters: int,
                  out: Path | None) -> dict[str, Any]:
    """``window(tr, sysm, interval, iters, out)`` with the copy engine set to one chunk at a time and
    ``Tensor.copy_`` (the first GPU run's loop), then set back."""
    eng = sysm.ck.copy_engine
    if not hasattr(eng, "depth"):
        raise RuntimeError(f"the {getattr(eng, 'name', eng)} copy engine has no device copy loop to compare")
    saved = eng.depth, getattr(eng, "raw", False)
    eng.depth, eng.raw = 1, False
    try:
        sysm.name += "_legacy_copy"
        return {"depth": 1, "raw": False, **window(tr, sysm, interval, iters, out)}
    finally:
        eng.depth, eng.raw = saved
        sysm.name = sysm.name.removesuffix("_legacy_copy")
