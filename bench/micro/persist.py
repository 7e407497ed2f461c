"""Time to make one checkpoint of S bytes durable: pccheck against the device limit and its peers.

Run::

    python -m bench.persist [--sizes 256MiB,1GiB,4GiB] [--repeats 3] [--systems pccheck,raw_odirect,...]
                            [--json bench/results/persist/latest.json] [--dir bench/_scratch]

The state is a dict of 4 float32 arrays totalling S bytes, filled with random data once (which also
touches every page, so first-touch cost is never timed). For each size every selected system is set up
once (untimed), warmed up once (untimed), then timed ``--repeats`` times; the repetitions are
interleaved round-robin across systems, so slow drift of this noisy machine hits every system alike.
Before each timed run the benchmark calls ``gc.collect()`` and ``os.sync()`` (untimed), so no system
pays for the dirty pages, unlinks or discards left by the one before it. Reported: the median.

Systems (each is timed from the call that starts the checkpoint until its data is durable; what each
one does is :mod:`bench.harness.systems`'s):

``pccheck``      ``Checkpointer(state, path=d, interval=1, max_concurrent=2, writer_threads=2,
                 chunk_size=64 MiB)`` created once per size; timed ``maybe_checkpoint(step); wait()``.
                 ``stall`` is the time ``maybe_checkpoint`` alone blocked the caller.
``raw_odirect``  the device limit: the same bytes, already in one page-aligned buffer, written with
                 ``os.pwrite`` in 64 MiB pieces by 2 threads into a file preallocated with
                 ``posix_fallocate`` and opened ``O_DIRECT``, then ``fdatasync``.
``torch_save``   ``torch.save`` of the tensors (``torch.from_numpy``, no copy) to a new file, then
                 flush + ``fsync``.
``safetensors``  ``safetensors.torch.save_file`` to a new file, then open + ``fsync``.
``dcp_async``    ``torch.distributed.checkpoint.async_save(..., storage_writer=FileSystemWriter(new dir,
                 sync_files=True))`` then ``.result()``; ``stall`` is the time ``async_save`` blocked.

The peers write a new file (directory for DCP) per checkpoint as users do; it is deleted untimed after
each run. They only fsync the file, not its directory, which if anything favours them. GB/s are decimal
(10**9 bytes/s) of the S state bytes. torch, safetensors, matplotlib and pccheck are imported only
when a system (or the plot) that needs them runs.
"""

from __future__ import annotations

import abc
import argparse
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import bar_chart, fmt, format_size, gbps, host_info, machine_label, parse_size_list, print_table, \
    scratch_dir, summarize, versions, write_csv, write_json
from bench.harness.probes import settle
from bench.harness.systems import ALIGN, CHUNK, dcp_async_save, dcp_upload, dcp_writer, odirect_share, pccheck_on_arrays, \
    pieces, quiet_dcp_warnings, safetensors_save_durable, torch_save_durable, torch_tensors

__all__ = ["SYSTEMS", "TARGETS", "make_state", "run", "main"]

_BENCH_DIR = BENCH_DIR
_N_ARRAYS = 4

SYSTEMS: tuple[str, ...] = ("pccheck", "pccheck_mmap", "raw_odirect", "torch_save", "safetensors", "dcp_async")
PEERS: tuple[str, ...] = ("raw_odirect", "torch_save", "dcp_async", "safetensors")
# (peer, minimum pccheck GB/s divided by the peer's GB/s) at TARGET_SIZE.
TARGETS: tuple[tuple[str, float], ...] = (("raw_odirect", 0.9), ("torch_save", 4.0), ("dcp_async", 3.0))
TARGET_SIZE = 1 << 30

State = dict[str, np.ndarray]


def make_state(nbytes: int, n_arrays: int = _N_ARRAYS, seed: int = 0) -> State:
    """A dict of ``n_arrays`` float32 arrays totalling ``nbytes`` (rounded down to 4 bytes), filled with
    random values; filling touches every page once, so later copies run at pre-touched speed."""
    elems, rng = nbytes // 4, np.random.default_rng(seed)
    base, extra = divmod(elems, n_arrays)
    state: State = {}
    for i in range(n_arrays):
        arr = np.empty(base + (1 if i < extra else 0), dtype=np.float32)
        rng.random(dtype=np.float32, out=arr)
        state[f"layer{i}.weight"] = arr
    return state


def _state_nbytes(state: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in state.values())


def _state_nbytes_for(nbytes: int) -> int:
    """Bytes make_state(nbytes) really holds (float32 elements)."""
    return (nbytes // 4) * 4


class _System(abc.ABC):
    """One way of making a checkpoint durable.

    Call order: ``__init__(state, workdir)`` once per size (untimed; may preallocate) → ``run(step)``
    once as warm-up and then once per repetition, with increasing ``step`` → ``close()``.
    ``run`` times itself and returns ``{"s": seconds until durable}`` plus, where the system returns
    control before it is durable, ``"stall_s"``: how long the caller was blocked. Any clean-up ``run``
    does after its timed region is not counted.
    """

    name: str
    info: dict[str, Any] = {}  # facts about the configured system, copied into the JSON per size

    @abc.abstractmethod
    def run(self, step: int) -> dict[str, float]:
        """Make one checkpoint of the state durable; return its timings."""

    def close(self) -> None:
        """Release files, threads and buffers."""


class _PCCheck(_System):
    """pccheck with its defaults for SSDs (O_DIRECT writer), N=2, p=2.

    Measured in steady state: before timing, every one of the N+1 slots is written once (as in
    any training run longer than N+1 checkpoints), so no timed write converts the unwritten
    extents that posix_fallocate leaves. The raw O_DIRECT file gets the same treatment.
    """

    name = "pccheck"
    storage = "auto"

    def __init__(self, state: State, workdir: Path) -> None:
        self._ck = pccheck_on_arrays(state, workdir, self.storage)
        for warm in range(-3, 0):  # one untimed pass over the N+1 = 3 slots
            self._ck.checkpoint(warm)
            self._ck.wait()
        self.info = {"storage": str(getattr(self._ck, "storage", "?"))}

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        started = self._ck.maybe_checkpoint(step)
        t1 = time.perf_counter()
        self._ck.wait()
        t2 = time.perf_counter()
        if started is False:  # interval=1 must checkpoint every step; a skipped one would time nothing
            raise RuntimeError(f"pccheck skipped step {step}; the benchmark expects one checkpoint per step")
        return {"s": t2 - t0, "stall_s": t1 - t0}

    def close(self) -> None:
        self._ck.close()


class _PCCheckMmap(_PCCheck):
    """pccheck's other SSD writer, memcpy into a shared mapping + msync: measured to pick the default."""

    name = "pccheck_mmap"
    storage = "mmap"


class _RawODirect(_System):
    """The device limit: the state's bytes in one page-aligned buffer, written with O_DIRECT in 64 MiB
    pieces by 2 threads into a preallocated file, then ``fdatasync``."""

    name = "raw_odirect"

    def __init__(self, state: State, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        nbytes = _state_nbytes(state)
        self._len = -(-nbytes // ALIGN) * ALIGN
        self._buf = mmap.mmap(-1, self._len)  # anonymous mappings are page-aligned, as O_DIRECT needs
        dst = np.frombuffer(self._buf, dtype=np.uint8)
        off = 0
        for arr in state.values():
            src = arr.reshape(-1).view(np.uint8)
            dst[off : off + src.size] = src
            off += src.size
        del dst  # drop the exported buffer so the mapping can be closed later
        self._pieces = pieces(self._len, CHUNK)
        self._fd = os.open(workdir / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        os.posix_fallocate(self._fd, 0, self._len)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="raw-odirect")

    def run(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        for fut in [self._pool.submit(odirect_share, self._fd, self._buf, self._pieces, i, 2, write=True)
                    for i in range(2)]:
            fut.result()
        os.fdatasync(self._fd)
        return {"s": time.perf_counter() - t0}

    def close(self) -> None:
        self._pool.shutdown()
        os.close(self._fd)
        self._buf.close()


class _FileSave(_System):
    """A peer that writes a new file per checkpoint with ``save(tensors, path)`` (torch tensors sharing
    the state's memory); the file is deleted after the timed region."""

    def __init__(self, state: State, workdir: Path, name: str, suffix: str,
                 save: Callable[[Mapping[str, Any], Path], None]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self._tensors, self._dir = torch_tensors(state), workdir
        self.name, self._suffix, self._save = name, suffix, save

    def run(self, step: int) -> dict[str, float]:
        path = self._dir / f"ckpt-{step}{self._suffix}"
        t0 = time.perf_counter()
        self._save(self._tensors, path)
        elapsed = time.perf_counter() - t0
        path.unlink()
        return {"s": elapsed}


class _DCPAsync(_System):
    name = "dcp_async"

    def __init__(self, state: State, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self._tensors, self._dir = torch_tensors(state), workdir
        quiet_dcp_warnings()

    def run(self, step: int) -> dict[str, float]:
        out = self._dir / f"step-{step}"
        writer = dcp_writer(out)
        t0 = time.perf_counter()
        fut = dcp_async_save(self._tensors, writer)
        t1 = time.perf_counter()
        dcp_upload(fut).result()
        t2 = time.perf_counter()
        shutil.rmtree(out)
        return {"s": t2 - t0, "stall_s": t1 - t0}


_FACTORIES: dict[str, Callable[[State, Path], _System]] = {
    "pccheck": _PCCheck,
    "pccheck_mmap": _PCCheckMmap,
    "raw_odirect": _RawODirect,
    "torch_save": lambda state, d: _FileSave(state, d, "torch_save", ".pt", torch_save_durable),
    "safetensors": lambda state, d: _FileSave(state, d, "safetensors", ".safetensors", safetensors_save_durable),
    "dcp_async": _DCPAsync,
}


def _bench_size(
    nbytes: int, systems: Sequence[str], repeats: int, workdir: Path, first_step: int
) -> tuple[dict[str, list[dict[str, float]]], dict[str, dict[str, Any]], int]:
    """Measure every system at one size; return their per-repetition timings, their info and the
    next step."""
    state = make_state(nbytes)
    runners: dict[str, _System] = {}
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    step = first_step
    try:
        for name in systems:
            runners[name] = _FACTORIES[name](state, workdir / f"{name}-{nbytes}")
        for runner in runners.values():  # one untimed warm-up each
            settle()
            runner.run(step)
            step += 1
        for _ in range(repeats):  # round-robin, so drift hits every system alike
            for name, runner in runners.items():
                settle()
                samples[name].append(runner.run(step))
                step += 1
    finally:
        for runner in runners.values():
            runner.close()
    return samples, {name: r.info for name, r in runners.items() if r.info}, step


def _size_record(
    nbytes: int, samples: Mapping[str, list[dict[str, float]]], info: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Medians, GB/s and pccheck ratios of one size, keyed as in the JSON output."""
    rec: dict[str, Any] = {"size_bytes": nbytes, "size": format_size(nbytes)}
    rec.update({f"{name}_info": dict(facts) for name, facts in info.items()})
    for name, runs in samples.items():
        total = summarize([r["s"] for r in runs])
        rec[f"{name}_s"] = total["median"]
        rec[f"{name}_gbps"] = gbps(nbytes, total["median"])
        rec[f"{name}_min_s"], rec[f"{name}_max_s"] = total["min"], total["max"]
        rec[f"{name}_runs_s"] = [r["s"] for r in runs]
        if runs and "stall_s" in runs[0]:
            rec[f"{name}_stall_s"] = summarize([r["stall_s"] for r in runs])["median"]
    if "pccheck" in samples:
        for peer in PEERS:
            if peer in samples:
                rec[f"pccheck_over_{peer}"] = rec["pccheck_gbps"] / rec[f"{peer}_gbps"]
    return rec


def _targets(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check each target ratio at TARGET_SIZE, where both pccheck and the peer were measured."""
    out = []
    rec = next((r for r in records if r["size_bytes"] == TARGET_SIZE), None)
    for peer, want in TARGETS:
        key = f"pccheck_over_{peer}"
        got = rec.get(key) if rec else None
        out.append({
            "peer": peer,
            "size_bytes": TARGET_SIZE,
            "target_ratio": want,
            "ratio": got,
            "met": None if got is None else got >= want,
        })
    return out


def report(records: Sequence[Mapping[str, Any]], systems: Sequence[str], label: str) -> list[list[Any]]:
    """Print the results table; return its rows in CSV form."""
    headers = ["size", "system", "median s", "GB/s", "min-max s", "stall s", "pccheck ÷ system"]
    rows, csv_rows = [], []
    for rec in records:
        for name in systems:
            ratio = rec.get(f"pccheck_over_{name}")
            stall = rec.get(f"{name}_stall_s")
            rows.append([
                rec["size"], name, f"{rec[f'{name}_s']:.3f}", f"{rec[f'{name}_gbps']:.2f}",
                f"{rec[f'{name}_min_s']:.3f}-{rec[f'{name}_max_s']:.3f}", fmt(stall, ".3f"),
                fmt(ratio, ".2f") + ("x" if ratio is not None else ""),
            ])
            csv_rows.append([
                rec["size_bytes"], rec["size"], name, rec[f"{name}_s"], rec[f"{name}_gbps"],
                rec[f"{name}_min_s"], rec[f"{name}_max_s"], len(rec[f"{name}_runs_s"]),
                "" if stall is None else stall, "" if ratio is None else ratio,
            ])
    print_table(f"persist: one checkpoint made durable (median; {label})", headers, rows)
    return csv_rows


def _print_targets(targets: Sequence[Mapping[str, Any]]) -> None:
    print(f"\nTargets at {format_size(TARGET_SIZE)} (pccheck GB/s ÷ peer GB/s):")
    for t in targets:
        head = f"  pccheck vs {t['peer']:<12} target >= {t['target_ratio']:.1f}x:"
        if t["ratio"] is None:
            print(f"{head} not evaluated (needs pccheck and {t['peer']} at {format_size(TARGET_SIZE)})")
            continue
        margin = t["ratio"] - t["target_ratio"]
        verdict = "MET" if t["met"] else "MISSED"
        print(f"{head} {t['ratio']:.2f}x  {verdict} by {abs(margin):.2f}x "
              f"({100 * margin / t['target_ratio']:+.0f}% of target)")


def plot(path: Path, records: Sequence[Mapping[str, Any]], systems: Sequence[str], label: str) -> bool:
    """Save the GB/s bar chart; False (and :func:`bench._common.pyplot` says so) when matplotlib is missing."""
    return bar_chart(
        path,
        [r["size"] for r in records],
        {name: [r[f"{name}_gbps"] for r in records] for name in systems},
        title=f"Checkpoint made durable, GB/s (median)\n{label}",
        ylabel="GB/s (10^9 B/s), higher is better",
    )


def run(
    sizes: Sequence[int], systems: Sequence[str], repeats: int, base_dir: Path
) -> dict[str, Any]:
    """Measure all selected systems at all sizes in a scratch directory under ``base_dir``."""
    records = []
    with scratch_dir(base_dir) as workdir:
        host = host_info(workdir)
        step = 1
        for nbytes in sizes:
            samples, info, step = _bench_size(nbytes, systems, repeats, workdir, step)
            records.append(_size_record(_state_nbytes_for(nbytes), samples, info))
    return {
        "benchmark": "bench.persist",
        "machine": machine_label(host),
        "note": ("time from the call that starts one checkpoint of S bytes of pre-touched host state "
                 "until it is durable; median of the repeats after 1 untimed warm-up per system and size; "
                 "GB/s = S / 1e9 / median s; ratios are pccheck GB/s / peer GB/s"),
        "host": host,
        "config": {
            "sizes_bytes": list(sizes),
            "repeats": repeats,
            "warmup": 1,
            "systems": list(systems),
            "state": f"{_N_ARRAYS} float32 arrays, random values, pre-touched",
            "pccheck": {"interval": 1, "max_concurrent": 2, "writer_threads": 2, "chunk_size": CHUNK},
            "raw_odirect": {"threads": 2, "piece_bytes": CHUNK},
            "dir": str(base_dir),
            "versions": versions(("numpy", "torch", "safetensors", "matplotlib", "pccheck")),
        },
        "results": records,
        "targets": _targets(records),
    }


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.persist", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256MiB,1GiB", help="comma-separated state sizes (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system and size (default: %(default)s)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ",".join(SYSTEMS))
    p.add_argument("--json", type=Path, default=result_path("persist"),
                   help="JSON output; the CSV and PNG go beside it with the same stem (default: %(default)s)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    args = p.parse_args(argv)
    args.sizes = parse_size_list(args.sizes)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        p.error(f"unknown systems {unknown}; choose from {','.join(SYSTEMS)}")
    if args.repeats < 1 or not args.sizes or min(args.sizes) < 4 * _N_ARRAYS:
        p.error("need --repeats >= 1 and sizes of at least 16 bytes")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    args = _parse_args(argv)
    t0 = time.perf_counter()
    result = run(args.sizes, args.systems, args.repeats, args.dir)
    if result["host"]["fs_type"] in ("tmpfs", "ramfs"):
        print(f"warning: {args.dir} is on {result['host']['fs_type']}; these are not disk numbers")
    csv_rows = report(result["results"], args.systems, result["machine"])
    _print_targets(result["targets"])
    json_path: Path = args.json
    write_json(json_path, result)
    write_csv(
        json_path.with_suffix(".csv"),
        ["size_bytes", "size", "system", "median_s", "gbps", "min_s", "max_s", "n", "stall_s", "pccheck_over_system"],
        csv_rows,
    )
    wrote = [json_path, json_path.with_suffix(".csv")]
    if plot(json_path.with_suffix(".png"), result["results"], args.systems, result["machine"]):
        wrote.append(json_path.with_suffix(".png"))
    print(f"\nwrote {', '.join(str(p) for p in wrote)}  ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
