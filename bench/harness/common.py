"""Small helpers shared by the benchmarks in ``bench/``.

Sizes ("256MiB", "1GiB"), medians, host facts (CPU count, file system and the block driver under a
path, GPU presence, library versions), a scratch directory that is removed afterwards, the command
line every figure module shares, and the three outputs every benchmark writes: a printed table,
CSV + JSON, and a PNG chart. Heavy libraries (rich, matplotlib) are imported lazily inside the
functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import statistics
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# bench/: results/ and _scratch/ live here, whichever subfolder a module sits in.
BENCH_DIR = Path(__file__).resolve().parent.parent
RESULTS_DIR = BENCH_DIR / "results"


def result_path(bench: str, suffix: str = ".json", *, quick: bool = False, variant: str = "",
                root: str | os.PathLike[str] | None = None) -> Path:
    """Where a bench's current figure lives: ``<root>/<bench>/latest[-variant]<suffix>`` (root:
    ``bench/results``), so rerunning the command recorded in that file rewrites it. ``--quick`` runs
    write ``quick[-variant]<suffix>`` beside it (smoke runs: their numbers mean nothing)."""
    name = ("quick" if quick else "latest") + (f"-{variant}" if variant else "")
    return Path(RESULTS_DIR if root is None else root) / bench / f"{name}{suffix}"

__all__ = [
    "BENCH_DIR",
    "RESULTS_DIR",
    "result_path",
    "parse_size",
    "parse_size_list",
    "format_size",
    "gbps",
    "summarize",
    "median_or_none",
    "fmt",
    "versions",
    "fs_info",
    "host_info",
    "machine_label",
    "scratch_dir",
    "print_table",
    "save_figure",
    "write_csv",
    "write_json",
    "bar_chart",
    "interval_axes",
    "pyplot",
    "figure_parser",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse ``"256MiB"``, ``"1GiB"``, ``"1.5G"``, ``"4096"`` into bytes (KiB/MiB/GiB and bare K/M/G
    are binary, KB/MB/GB decimal)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"cannot parse size {text!r}; write it like 256MiB, 1GiB or 4096")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_size_list(text: str) -> list[int]:
    """Parse a comma-separated list of sizes, e.g. ``"256MiB,1GiB"``."""
    return [parse_size(part) for part in text.split(",") if part.strip()]


def format_size(nbytes: int) -> str:
    """Format bytes with the largest binary unit that divides them evenly (else one decimal)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor:
            value = nbytes / factor
            return f"{value:.0f}{unit}" if nbytes % factor == 0 else f"{value:.1f}{unit}"
    return f"{nbytes}B"


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in decimal GB/s (10**9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, min, max and count of a list of timings (seconds)."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "n": float(len(samples)),
    }


def median_or_none(samples: Sequence[float]) -> float | None:
    """The median of ``samples``, or None when there are none."""
    return statistics.median(samples) if samples else None


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or "-" for a value that was not measured."""
    return "-" if x is None else format(x, spec)


def versions(names: Sequence[str]) -> dict[str, str]:
    """Versions of the libraries among ``names`` that this run imported (only those)."""
    return {name: str(getattr(sys.modules[name], "__version__", "?")) for name in names if name in sys.modules}


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, fs type) of the longest mount point in /proc/mounts that holds path."""
    best = ("?", "/", "?")
    target = str(path.resolve())
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            dev, mnt, fstype = fields[0], fields[1].replace("\\040", " "), fields[2]
            inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return best


def _block_driver(device: str) -> str:
    """Kernel driver of a block device such as /dev/vda or /dev/vda1 ("virtio_blk", "nvme", ...)."""
    name = os.path.basename(os.path.realpath(device))
    sys_dev = Path("/sys/class/block") / name
    for candidate in (sys_dev / "device" / "driver", sys_dev.resolve().parent / "device" / "driver"):
        if candidate.exists():
            return os.path.basename(os.path.realpath(candidate))
    return "?"


def fs_info(path: str | os.PathLike[str]) -> dict[str, str]:
    """File system type, device, mount point and block driver under ``path`` (or its nearest parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    dev, mnt, fstype = _mount_of(p)
    return {"fs_type": fstype, "device": dev, "mount": mnt, "block_driver": _block_driver(dev)}


def _gpus() -> list[str]:
    """Names of NVIDIA GPUs visible to the driver, without importing any GPU library."""
    root = Path("/proc/driver/nvidia/gpus")
    names = []
    with contextlib.suppress(OSError):
        for info in sorted(root.glob("*/information")):
            for line in info.read_text(encoding="utf-8").splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
    return names


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _mem_total_bytes() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def host_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Facts about this machine and the storage under ``path``, for result files."""
    gpus = _gpus()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": _cpu_model(),
        "mem_total_bytes": _mem_total_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpus": gpus,
        "cpu_only": not gpus,
        **fs_info(path),
    }


def machine_label(host: Mapping[str, Any]) -> str:
    """One line such as "CPU-only, 2 vCPUs, ext4 on virtio_blk (/dev/vda)" built from host_info()."""
    compute = "CPU-only" if host.get("cpu_only") else "GPU: " + ", ".join(host.get("gpus", []))
    return (f"{compute}, {host.get('nproc')} vCPUs, {host.get('fs_type')} on "
            f"{host.get('block_driver')} ({host.get('device')})")


@contextlib.contextmanager
def scratch_dir(base: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh directory inside ``base``; remove it afterwards, and ``base`` too if this made it
    and it is left empty."""
    base = Path(base)
    made_base = not base.exists()
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()


def print_ratio_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    """One line per target judged as a ratio ``value`` against ``limit`` (those with a value)."""
    for t in targets:
        if t["value"] is not None:
            print(f"target: {t['what']}: {t['value']:.2f}x (limit {t['limit']}x) {'MET' if t['met'] else 'MISSED'}")


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print a table with rich when it is installed, else as aligned plain text."""
    cells = [[str(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
        line = "  ".join("-" * w for w in widths)
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        print(line)
        for r in cells:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title)
    for h in headers:
        table.add_column(h, justify="right")
    for r in cells:
        table.add_row(*r)
    # Off a terminal rich assumes 80 columns and would squeeze wide tables into ellipses.
    need = sum(max([len(h)] + [len(r[i]) for r in cells]) + 3 for i, h in enumerate(headers)) + 1
    console = Console()
    Console(width=max(console.width, need)).print(table)


def write_csv(path: str | os.PathLike[str], headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Write rows under a header line to a CSV file, creating its directory."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(headers)
        writer.writerows(rows)


def source_commit() -> str | None:
    """The git commit of the checkout bench/ sits in (None outside a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(BENCH_DIR), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write an object as indented JSON, creating its directory. A result document (a dict written as
    ``latest*.json``, :func:`result_path`) gets the ``commit`` it was measured at when it has none."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if isinstance(obj, dict) and "commit" not in obj and Path(path).name.startswith("latest"):
        obj = {**obj, "commit": source_commit()}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


def bar_chart(
    path: str | os.PathLike[str],
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    title: str,
    ylabel: str,
) -> bool:
    """Save a grouped bar chart (one group per category, one bar per series) as PNG (Agg backend);
    False when matplotlib is missing (:func:`pyplot` says so)."""
    plt = pyplot(path)
    if plt is None:
        return False

    n = max(len(series), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(categories) * n / 2), 4.5))
    for i, (name, values) in enumerate(series.items()):
        xs = [c + (i - (n - 1) / 2) * width for c in range(len(categories))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(len(categories)), list(categories))
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path)
    return True


def interval_axes(ax: Any, intervals: Sequence[int], *, ylabel: str, title: str, title_size: int = 9,
                  legend_size: int = 8) -> None:
    """The x axis of every "per checkpoint interval" panel (log scale, one tick per interval), its
    labels, title, grid and legend."""
    ax.set_xscale("log")
    ax.set_xticks(list(intervals), [str(i) for i in intervals])
    ax.set_xlabel("checkpoint interval (iterations)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def pyplot(path: str | os.PathLike[str] | None = None) -> Any:
    """matplotlib.pyplot on the Agg backend, or None (saying which figure is skipped) when
    matplotlib is not installed: the benchmarks' numbers never depend on it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; skipped {path or 'the figure'}")
        return None
    return plt


def save_figure(fig: Any, path: str | os.PathLike[str]) -> None:
    """Lay out, save as PNG (120 dpi; the parent directory is created) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line every figure module shares: ``--quick``, ``--out`` (the results root: each figure
    writes ``<out>/<figure>/latest.*``, :func:`result_path`) and
    ``--dir`` (scratch directory on the disk under test)."""
    bench_dir = BENCH_DIR
    p = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, short windows: a smoke run")
    p.add_argument("--out", type=Path, default=bench_dir / "results",
                   help="results root; files go to OUT/<bench>/latest.* (default: %(default)s)")
    p.add_argument("--dir", type=Path, default=bench_dir / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    return p


def pccheck_path_first() -> list[str]:
    """Where this process finds pccheck (without importing it): a benchmark's child processes look
    there first, so they load the same pccheck as the parent (the checkout's or the installed one)."""
    spec = importlib.util.find_spec("pccheck")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return [str(Path(locations[0]).parent)] if locations else []
