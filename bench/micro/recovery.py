"""Recovery time: load one checkpoint from a cold page cache, pccheck against the device limit and peers.

Run::

    python -m bench.recovery [--size 1GiB] [--repeats 3] [--out bench/results (root: files go to OUT/recovery/)] [--dir bench/_scratch] [--quick]

The state is :func:`bench.persist.make_state` (4 float32 arrays, random values). Each system first
writes it once (untimed, with its own save path), then, ``--repeats`` times and round-robin across
systems: ``os.sync()`` + ``echo 3 > /proc/sys/vm/drop_caches`` (untimed; where the kernel refuses,
the run says "warm" in every output instead of "cold"), then the timed load. Each load produces
fresh memory, as a restarted process has; nothing it returns is reused.

Systems (how each writes and loads is :mod:`bench.harness.systems`'s):

``pccheck``           ``pccheck.load_latest(dir)``: picks the slot, validates meta + manifest, reads
                      every array into a new numpy array and checks its crc32c (``verify=True``, the
                      default a restart uses).
``raw_odirect``       the device limit: the *same bytes* (the slot's data region of pccheck's store file)
                      read with ``O_DIRECT`` by 2 threads in 64 MiB pieces into one page-aligned,
                      pre-touched buffer.
``raw_odirect_fresh`` the same into a freshly mapped (untouched) buffer: what a restart pays for memory.
``pccheck_zero_copy`` ``pccheck.load_latest(zero_copy=True)``: read-only views of the store file's page
                      cache mapping, every array's crc32c verified (so every byte is read from disk);
                      like safetensors' mapped load, no fresh anonymous memory is touched.
``torch_load``        ``torch.load(file, mmap=False)`` of a ``torch.save`` of the same tensors.
``safetensors``       ``safetensors.torch.load_file`` of a ``save_file`` of the same tensors, then one
                      byte of every page read (load_file maps the file lazily; without this nothing is
                      read from disk).
``dcp``               ``torch.distributed.checkpoint.load`` (``no_dist=True``) into freshly allocated
                      tensors, from a ``dcp.save`` of the same tensors.

Diagnosis components (same cold cache, same bytes, timed alone, ``--repeats`` times; the summary quotes
the best of them, their intrinsic cost on this noisy machine): ``buffered_read_touched`` (``preadv``
through the page cache into a pre-touched buffer), ``first_touch`` (writing every page of a fresh
``np.empty`` of S bytes), ``crc32c`` (pccheck's native crc32c over S bytes already in memory). They
explain where pccheck's load time goes (see the summary's note). Target: pccheck load >= 0.9x the raw
O_DIRECT read (ratio = raw seconds / pccheck seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import result_path, figure_parser, format_size, gbps, host_info, machine_label, parse_size, print_table, \
    pyplot, save_figure, scratch_dir, summarize, write_csv, write_json
from bench.micro.persist import make_state
from bench.harness.probes import write_proc
from bench.harness.systems import ALIGN, CHUNK, dcp_load, dcp_save, odirect_share, pccheck_on_arrays, pieces, \
    quiet_dcp_warnings, safetensors_load, safetensors_save_durable, torch_load, torch_save_durable, torch_tensors

__all__ = ["SYSTEMS", "COMPONENTS", "TARGET_RATIO", "drop_caches", "run", "report", "main"]

SYSTEMS: tuple[str, ...] = ("pccheck", "pccheck_zero_copy", "raw_odirect", "raw_odirect_fresh", "torch_load", "safetensors", "dcp")
COMPONENTS: tuple[str, ...] = ("buffered_read_touched", "first_touch", "crc32c")
TARGET_RATIO = 0.9  # pccheck load speed / raw O_DIRECT read speed


def drop_caches() -> bool:
    """``sync`` then drop the page cache, dentries and inodes; False where not permitted."""
    os.sync()
    return write_proc("/proc/sys/vm/drop_caches", "3\n")


def _data_region(store_dir: Path) -> tuple[Path, int, int]:
    """(store file, first byte, length) of the arrays of the slot pccheck.load_latest would load,
    widened to O_DIRECT alignment."""
    from pccheck.persist import recovery as rec

    _, path = rec.store_files(store_dir)[0]
    image = rec.read_store(path)
    slot = rec.candidate_order(image)[0]
    with open(path, "rb", buffering=0) as f:
        man = rec.read_manifest(image, slot, f.fileno())
    base = image.header["slots_offset"] + slot * image.header["slot_capacity"]
    lo = base + min(e.offset for e in man.arrays)
    hi = base + max(e.offset + e.nbytes for e in man.arrays)
    lo_al = lo // ALIGN * ALIGN
    return path, lo_al, -(-(hi - lo_al) // ALIGN) * ALIGN


def _odirect_read(path: Path, off: int, length: int, buf: mmap.mmap, threads: int = 2) -> None:
    """Read ``length`` bytes at ``off`` into ``buf`` with O_DIRECT, ``threads`` threads, 64 MiB pieces."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    parts = pieces(length, CHUNK)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for fut in [pool.submit(odirect_share, fd, buf, parts, i, threads, write=False, base=off)
                        for i in range(threads)]:
                fut.result()
    finally:
        os.close(fd)


class _Loader:
    """One way to load the checkpoint. ``__init__`` writes it (untimed); ``load()`` is timed."""

    name = "?"

    def load(self) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _PCCheck(_Loader):
    name = "pccheck"

    def __init__(self, state: Mapping[str, np.ndarray], d: Path) -> None:
        ck = pccheck_on_arrays(state, d)
        try:
            ck.checkpoint(1)
            ck.wait()
        finally:
            ck.close()
        self.dir = d

    def load(self) -> Any:
        import pccheck

        return pccheck.load_latest(self.dir)


class _PCCheckZeroCopy(_Loader):
    """The same store as ``_PCCheck``'s, loaded as verified read-only views of the file mapping."""

    name = "pccheck_zero_copy"

    def __init__(self, store_dir: Path) -> None:
        self.dir = store_dir

    def load(self) -> Any:
        import pccheck

        return pccheck.load_latest(self.dir, zero_copy=True)


class _Raw(_Loader):
    name = "raw_odirect"

    def __init__(self, store_dir: Path, fresh: bool) -> None:
        self.path, self.off, self.len = _data_region(store_dir)
        self.fresh = fresh
        if fresh:
            self.name = "raw_odirect_fresh"
            self.buf = None
        else:
            self.buf = mmap.mmap(-1, self.len)
            np.frombuffer(self.buf, dtype=np.uint8)[:] = 1  # pre-touch every page once

    def load(self) -> Any:
        buf = mmap.mmap(-1, self.len) if self.fresh else self.buf
        _odirect_read(self.path, self.off, self.len, buf)
        return buf

    def close(self) -> None:
        if self.buf is not None:
            self.buf.close()


class _File(_Loader):
    """A peer's file: written once with ``save(tensors, path)`` (untimed), loaded with ``load(path)``."""

    def __init__(self, state: Mapping[str, np.ndarray], d: Path, name: str, filename: str,
                 save: Callable[[Mapping[str, Any], Path], None], load: Callable[[Path], Any]) -> None:
        d.mkdir(parents=True, exist_ok=True)
        self.name, self.path, self._load = name, d / filename, load
        save(torch_tensors(state), self.path)

    def load(self) -> Any:
        return self._load(self.path)


class _DCP(_Loader):
    name = "dcp"

    def __init__(self, state: Mapping[str, np.ndarray], d: Path) -> None:
        quiet_dcp_warnings()
        self.dir = d
        self.shapes = {k: (v.shape, v.dtype) for k, v in state.items()}
        dcp_save(torch_tensors(state), d)

    def load(self) -> Any:
        return dcp_load(self.shapes, self.dir)


def _peer(name: str, state: Mapping[str, np.ndarray], d: Path) -> _Loader:
    """The loader of a peer system (not pccheck, not raw)."""
    if name == "torch_load":
        return _File(state, d, name, "ckpt.pt", torch_save_durable, torch_load)
    if name == "safetensors":
        return _File(state, d, name, "ckpt.safetensors", safetensors_save_durable, safetensors_load)
    return _DCP(state, d)


def _components(store_dir: Path, nbytes: int, repeats: int) -> dict[str, list[float]]:
    """Timed pieces of pccheck's load path, each alone (see the module docstring)."""
    from pccheck.native import _native

    path, off, length = _data_region(store_dir)
    out: dict[str, list[float]] = {k: [] for k in COMPONENTS}
    touched = np.ones(length, dtype=np.uint8)
    for _ in range(repeats):
        drop_caches()
        fd = os.open(path, os.O_RDONLY)
        t0 = time.perf_counter()
        mv, got = memoryview(touched), 0
        while got < length:
            k = os.preadv(fd, [mv[got:]], off + got)
            if k <= 0:
                break
            got += k
        out["buffered_read_touched"].append(time.perf_counter() - t0)
        os.close(fd)
        t0 = time.perf_counter()
        fresh = np.empty(nbytes, dtype=np.uint8)
        fresh[::4096] = 1  # one write per page: the page faults alone, no bulk copy
        out["first_touch"].append(time.perf_counter() - t0)
        del fresh
        t0 = time.perf_counter()
        _native.crc32c(memoryview(touched)[:nbytes])
        out["crc32c"].append(time.perf_counter() - t0)
    return out


def run(nbytes: int, repeats: int, base_dir: Path, systems: Sequence[str] = SYSTEMS,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the checkpoint with every system, then time cold loads round-robin."""
    progress = progress or (lambda label: None)
    with scratch_dir(base_dir) as work:
        host = host_info(work)
        state = make_state(nbytes)
        real = sum(a.nbytes for a in state.values())
        loaders: dict[str, _Loader] = {}
        try:
            for name in systems:
                progress(f"recovery: writing {name}")
                if name.startswith(("pccheck", "raw")) and "pccheck" not in loaders:
                    loaders["pccheck"] = _PCCheck(state, work / "pccheck")
                if name == "pccheck_zero_copy":
                    loaders[name] = _PCCheckZeroCopy(work / "pccheck")
                elif name.startswith("raw"):
                    loaders[name] = _Raw(work / "pccheck", fresh=name.endswith("fresh"))
                elif not name.startswith("pccheck"):
                    loaders[name] = _peer(name, state, work / name)
            del state
            gc.collect()
            order = [n for n in systems if n in loaders]
            samples: dict[str, list[float]] = {n: [] for n in order}
            cold = True
            for rep in range(repeats):
                for name in order:
                    progress(f"recovery: {name} load {rep + 1}/{repeats}")
                    gc.collect()
                    cold = drop_caches() and cold
                    t0 = time.perf_counter()
                    obj = loaders[name].load()
                    samples[name].append(time.perf_counter() - t0)
                    del obj
            progress("recovery: components")
            comps = _components(work / "pccheck", real, repeats) if "pccheck" in loaders else {}
        finally:
            for ld in loaders.values():
                with contextlib.suppress(Exception):
                    ld.close()
    rows = {}
    for name, xs in list(samples.items()) + list(comps.items()):
        s = summarize(xs)
        rows[name] = {"median_s": s["median"], "min_s": s["min"], "max_s": s["max"], "n": len(xs),
                      "gbps": gbps(real, s["median"]), "runs_s": xs}
    ratio = None
    if "pccheck" in rows and "raw_odirect" in rows:
        ratio = rows["raw_odirect"]["median_s"] / rows["pccheck"]["median_s"]
    return {
        "benchmark": "bench.recovery",
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_label(host),
        "host": host,
        "size_bytes": real,
        "size": format_size(real),
        "cache": "cold (page cache dropped before every load)" if cold else
                 "WARM: /proc/sys/vm/drop_caches is not writable here, so loads may hit the page cache",
        "cold": cold,
        "repeats": repeats,
        "results": rows,
        "target": {"what": "pccheck load >= 0.9x raw O_DIRECT read (raw s / pccheck s)", "limit": TARGET_RATIO,
                   "value": ratio, "met": None if ratio is None else ratio >= TARGET_RATIO},
    }


def report(result: Mapping[str, Any], out: Path, quick: bool = False) -> list[Path]:
    """Print the table; write CSV, JSON and PNG under ``out``; return the paths written."""
    rows = result["results"]
    base = rows.get("raw_odirect", {}).get("median_s")
    table, csv_rows = [], []
    for name, r in rows.items():
        rel = base / r["median_s"] if base else None
        kind = "component" if name in COMPONENTS else "system"
        table.append([name, kind, f"{r['median_s']:.3f}", f"{r['gbps']:.2f}", f"{r['min_s']:.3f}-{r['max_s']:.3f}",
                      "-" if rel is None else f"{rel:.2f}x"])
        csv_rows.append([result["size_bytes"], name, kind, r["median_s"], r["gbps"], r["min_s"], r["max_s"], r["n"],
                         "" if rel is None else rel, int(result["cold"])])
    print_table(f"recovery: load {result['size']} ({result['cache']}; {result['machine']})",
                ["what", "kind", "median s", "GB/s", "min-max s", "speed vs raw O_DIRECT"], table)
    t = result["target"]
    if t["value"] is not None:
        print(f"target: {t['what']}: {t['value']:.2f}x  {'MET' if t['met'] else 'MISSED'} "
              f"by {abs(t['value'] - t['limit']):.2f}x")
    out.mkdir(parents=True, exist_ok=True)
    stem = result_path("recovery", "", quick=quick, root=out)
    paths = [stem.with_suffix(".json"), stem.with_suffix(".csv")]
    write_json(paths[0], result)
    write_csv(paths[1], ["size_bytes", "what", "kind", "median_s", "gbps", "min_s", "max_s", "n",
                         "speed_vs_raw_odirect", "cold"], csv_rows)
    if plot(stem.with_suffix(".png"), result):
        paths.append(stem.with_suffix(".png"))
    return paths


def plot(path: Path, result: Mapping[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    rows = result["results"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = ["#A7B972" if n == "pccheck" else "#888888" if n in COMPONENTS else "#4392B8" for n in names]
    bars = ax.barh(names, [rows[n]["median_s"] for n in names], color=colors)
    ax.bar_label(bars, labels=[f"{rows[n]['median_s']:.2f} s ({rows[n]['gbps']:.2f} GB/s)" for n in names],
                 fontsize=7, padding=2)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (median), lower is better")
    ax.set_title(f"Recovery: load one {result['size']} checkpoint, {result['cache'].split(' (')[0]} cache\n"
                 f"state: 4 float32 arrays (no training; load path only). Grey: pieces of pccheck's load path\n"
                 f"{result['machine']}", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)
    return True


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = figure_parser("python -m bench.recovery", __doc__)
    p.add_argument("--size", default=None, help="checkpoint size (default 1GiB; 16MiB with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="cold loads per system (default 3; 1 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ",".join(SYSTEMS))
    a = p.parse_args(argv)
    a.size = parse_size(a.size or ("16MiB" if a.quick else "1GiB"))
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.systems = [s for s in a.systems.split(",") if s]
    if set(a.systems) - set(SYSTEMS):
        p.error(f"unknown systems; choose from {','.join(SYSTEMS)}")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    a = _parse_args(argv)
    res = run(a.size, a.repeats, a.dir, a.systems)
    paths = report(res, a.out, a.quick)
    print("wrote " + ", ".join(map(str, paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
