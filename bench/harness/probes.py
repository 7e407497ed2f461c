"""What a timed window reads about this process and the machine: memory, page faults, CPU time.

Linux only (``/proc``): the resident set and its peak (``/proc/self/status``, reset through
``/proc/self/clear_refs``), minor page faults and CPU seconds of every thread (``getrusage``), and the
CPU seconds the whole machine spent busy (``/proc/stat``), from which the load that *other* processes
put on this shared machine during a window follows. :func:`settle` is what every benchmark runs,
untimed, before a timed run.
"""

from __future__ import annotations

import gc
import os
import resource
import time

__all__ = ["NOISY_OTHER_CPUS", "thread_times", "proc_status", "write_proc", "reset_peak_rss", "usage", "cpu_busy_s", "wait_quiet", "settle"]

NOISY_OTHER_CPUS = 0.25  # a window where the rest of the machine used more CPUs than this is flagged


def thread_times() -> list[tuple[int, str, float, int]]:
    """Every thread of this process now: (thread id, kernel name, CPU seconds (user + system),
    minor page faults), from /proc/self/task/*/stat; a thread that ends meanwhile is left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="utf-8") as f:
                head, _, rest = f.read().rpartition(")")
            fields = rest.split()
            out.append((int(tid), head.partition("(")[2], (int(fields[11]) + int(fields[12])) / tick, int(fields[7])))
        except (OSError, IndexError, ValueError):
            continue  # the thread ended
    return out


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    return out


def write_proc(path: str, text: str) -> bool:
    """Write ``text`` into a /proc control file; False where the kernel does not permit it."""
    try:
        with open(path, "w", encoding="ascii") as f:
            f.write(text)
        return True
    except OSError:
        return False


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    return write_proc("/proc/self/clear_refs", "5")


def usage() -> tuple[int, float]:
    """(minor page faults, CPU seconds user + system) of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_minflt, ru.ru_utime + ru.ru_stime


def cpu_busy_s() -> float:
    """CPU-seconds the whole machine spent busy (all CPUs, every process, steal included), from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_wait_s: float, threshold: float = NOISY_OTHER_CPUS) -> tuple[float, float]:
    """Wait (up to ``max_wait_s``) until the rest of the machine uses < ``threshold`` CPUs, sampled over
    1 s while this process idles. Returns (seconds waited, the last sample). Other jobs share these
    2 vCPUs; a cell timed while they run measures them, not the checkpointer."""
    t0 = time.perf_counter()
    while True:
        busy0, cpu0 = cpu_busy_s(), usage()[1]
        time.sleep(1.0)
        other = max(0.0, (cpu_busy_s() - busy0) - (usage()[1] - cpu0))
        waited = time.perf_counter() - t0
        if other < threshold or waited >= max_wait_s:
            return waited, other
        time.sleep(2.0)


def settle() -> None:
    """Untimed, before each timed run: collect garbage and flush what earlier runs left dirty, so no
    system pays for the dirty pages, unlinks or discards of the one before it."""
    gc.collect()
    os.sync()
