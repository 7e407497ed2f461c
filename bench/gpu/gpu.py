"""pccheck on one real GPU: copy-engine and disk bandwidth, and the slowdown of training a GPT.

``python -m bench.gpu [--out bench/results/gpu] [--state-gib 8.5] [--accum 4] [--quick] [--dir bench/_scratch]
[--sections d2h,persist,train] [--systems none,pccheck_N2,...] [--iters none:40,10:40,50:100] [--intervals 10,50] [--profile]
[--budget-s 360]``. Needs CUDA; else exit 2, nothing written (no CPU stand-in). latest.json is
rewritten after each phase; latest.csv and latest.png come last. Each section, set-up and window is its own ``try``
(errors recorded, the rest runs); phases due after --budget-s s are skipped. GB/s decimal. --quick: 1 GiB, half
windows, one micro-batch per iteration, to bench/results/gpu/quick.*. The GPT and the systems: bench/gpu/gpu_train.py.

d2h (S = 4 GiB, 1 GiB quick, 8 CUDA float32 tensors): peak = ``copy_(non_blocking=True)`` into 8 pinned
``torch.empty`` + ``torch.cuda.synchronize()``, median of 5 after a warm-up; engine = ``Checkpointer(tensors, path,
interval=1, max_concurrent=1, writer_threads=4, dram_budget=2 S)``, a warm-up, then 5 x ``checkpoint(); wait()``,
D2H s = ``copy_s - backpressure_s`` (``checkpoint`` returns once the bytes are in host chunks), median; the stores
go to /dev/shm when it holds three states (each run waits for its write, which d2h does not measure). Sweep (3
runs after a warm-up each): the engine's ``depth`` (chunks queued per thread) 1-3 with ``raw``
(``cudaMemcpyAsync``) or ``Tensor.copy_`` (depth 1 + copy_: the first GPU run's loop), and 16 / 256 MiB chunks. Overlap:
8192^2 bf16 ``torch.mm`` batches (4 + stream sync) alone and wholly inside one ``checkpoint()`` run by another
thread on a side stream; that copy's GB/s. persist (S of touched host arrays): ``Checkpointer(arrays, path,
interval=1, max_concurrent=1, writer_threads=4)``, 2 warm-ups (both slots written), S / median ``persist_s`` of 3;
raw: 4 threads ``pwrite`` their own 64 MiB pieces from page-aligned mmap buffers into a ``posix_fallocate``-d
``O_DIRECT`` file, then ``fsync``; median of 3 after one.

train: a GPT (vocab 32768, learned positions, d 1536, 12 heads, L pre-LN blocks of causal SDPA + 4x GELU MLP, lm
head tied to the embedding), L the least with 12 B/param (fp32 params + AdamW moments) >= --state-gib (8.5: 26
layers, 789 M params); batch 8 x 1024 random tokens; ``AdamW(lr=1e-4, fused=True)``. Iteration: ``zero_grad``,
forward + cross-entropy in bf16 autocast, backward, ``step()``, then ``torch.cuda.current_stream().synchronize()``
(real per-iteration time; ``torch.cuda.synchronize()`` would also wait for the copy streams under test), then the
checkpoint call (after the sync: DCP's stager does not wait for the training stream).

Systems: ``none`` (timed first and last; t_none = median of both windows' median step time); ``pccheck_N2`` =
``Checkpointer(model, opt, path, max_concurrent=2, writer_threads=4, chunk_size=64 MiB)``, ``maybe_checkpoint`` each
step, 3 warm-up checkpoints, one instance for both intervals (``ck.interval`` set per window); ``pccheck_reserve`` =
the same + ``device_reserve="auto"``; ``pccheck_memory`` = pccheck_N2 + the memory tier every iteration
(``memory_interval=1``, a tmpfs store in /dev/shm, no replicas); ``pccheck_remote`` = pccheck_N2 + the remote
tier, every disk checkpoint queued for upload (``remote_every=1``) to a SeaweedFS ``weed mini`` on 127.0.0.1 with its
data in /dev/shm (it stands for another machine: not on the disk under test; needs ``weed`` and boto3); ``dcp_async`` = ``async_save(sd, storage_writer=FileSystemWriter(new dir,
sync_files=True), no_dist=True, async_stager=DefaultStager(pinned, unshared, async, non-blocking))`` (else DCP's
default: see ``staging``), the next ``optimizer.step`` waiting for ``staging_completion``, the previous
``upload_completion`` awaited before a save; ``dcp_best`` = DCP's "zero-overhead" set-up (torch >= 2.9):
``DefaultStager(pinned, shared memory, async, non-blocking)`` kept across saves where torch allows it, and
``async_checkpointer_type=PROCESS`` (the save in DCP's own process; a one-rank gloo group on 127.0.0.1); ``torch_save`` = ``torch.save(sd, f)`` + flush + ``fsync``. Window per
(system, interval I in 10, 50, and 1 for DCP's systems with ``--intervals 1,...``): step s0 (a multiple of I) and its checkpoint c0 untimed, ``iters`` steps timed (40 /
100; torch_save 20 / 50), then a drain. Slowdown = window / (iters x t_none); extra/iter = window / iters - t_none;
stall per checkpoint, median over c0..c(k-1): pccheck ``stall_s + prepare_s + blocked_copy_s + cow_wait_s``, DCP call + staging
wait, torch_save the save. Targets (met None if unmeasured): D2H/peak >= 0.9; pccheck_N2 slowdown at 10 <= 1.03, its
extra/iter / dcp_async's <= 0.3; median stall with reserve / without <= 0.2; pccheck_memory (the memory
tier every iteration, its device copies straight into the tmpfs slot) at 10 <= 1.10.

Every window records ``breakdown`` per iteration (Trainer.train): start, the CPU queuing the work (launch_s,
of which opt_s), the wait for the GPU (sync_s), the training stream's own time between two events (gpu_s),
and the checkpoint call (call_s). ``disk_bound``: the write rate persist needs at interval 10 against raw
O_DIRECT, the largest state the disk sustains there at 0.8 of raw, and the least interval where persist needs
<= 0.8 of raw; pccheck_N2 gets a window at that interval. DCP's ``DefaultStager`` is made anew per save (torch
2.11's drops its pinned cache after each stage and fails a second stage with ``KeyError: <class 'type'>``).
pccheck (disk, then memory) runs before DCP, so --budget-s cuts DCP and the extras first. --profile (bench/gpu/gpu_profile.py): after
pccheck_N2's interval-10 window, the same window with the first GPU run's copy loop (``_legacy_copy``), then
the disk-bound window, interval 50, the interval-10 window again under py-spy (``pyspy.txt``) and
torch.profiler around one checkpoint (``profile.txt``).
"""

import argparse
import contextlib
import gc
import itertools
import math
import mmap
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import unittest.mock
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness.common import BENCH_DIR, result_path
from bench.harness.common import format_size, fs_info, host_info, machine_label, scratch_dir, write_json
from bench.harness.common import median_or_none as _med
from bench.gpu.gpu_profile import PROFILED, Spy, legacy_window, profile_checkpoint
from bench.gpu.gpu_report import INTERVALS, SYSTEMS, WINDOWS, finalize as _finalize, report
from bench.gpu.gpu_train import BATCH, SEQ, DCPAsync, PCCheck, System, TorchSave, Trainer, engine_info
from bench.harness.systems import pieces

__all__ = ["SECTIONS", "SYSTEMS", "INTERVALS", "main"]

_BENCH_DIR = BENCH_DIR
_GIB, _CHUNK, _MM = 1 << 30, 64 << 20, 8192  # _CHUNK: pccheck chunk_size in train, raw O_DIRECT piece
SECTIONS = ("d2h", "persist", "train")
EVERY_ITERATION = ("dcp_async", "dcp_best")  # the systems with an interval-1 window
ITERS, TORCH_SAVE_ITERS, NONE_ITERS = {1: 8, 10: 40, 50: 100}, {1: 4, 10: 20, 50: 50}, 40  # torch_save: saves take seconds
_T0 = time.perf_counter()
_STEPS = itertools.count(1)  # step numbers of the d2h checkpoints: increasing across Checkpointers

def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)

def _free() -> None:  # between phases: garbage, the CUDA allocator's free blocks, cached pinned host blocks
    import torch
    gc.collect()
    with contextlib.suppress(Exception):  # a broken CUDA context: the phase that broke it recorded why
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()

class _Run:
    """Arguments, the scratch directory, the result dict; ``guard`` runs one phase and saves the JSON."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        import torch
        driver = f"{torch.version.cuda} (runtime)"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True,
                                    capture_output=True, timeout=30, check=True).stdout.split("\n")[0].strip() or driver
        self.args, self.work, host = args, work, host_info(work)
        self.res: dict[str, Any] = {
            "command": shlex.join(["python", "-m", "bench.gpu", *args.argv]), "device": torch.cuda.get_device_name(),
            "driver": driver, "torch": torch.__version__, "machine": machine_label(host), "host": host,
            **dict.fromkeys(("d2h_gbps", "pinned_peak_gbps", "state_bytes")), "d2h": {}, "overlap": {},
            "persist": {"fs": fs_info(work)}, "model": {}, "train": {}, "systems": {}, "sections": {},
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    def guard(self, entry: dict[str, Any], fn: Callable[[], Any]) -> bool:
        """Run ``fn``; record ok (merging a returned dict) or its error in ``entry``; rewrite the JSON."""
        t0 = time.perf_counter()
        try:
            out = fn()
            entry.update(out if isinstance(out, dict) else {}, status="ok")
            return True
        except Exception as exc:
            print(tb := traceback.format_exc(), flush=True)
            entry.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=tb.strip().splitlines()[-6:])
            return False
        finally:
            entry["elapsed_s"] = time.perf_counter() - t0
            self.save()

    def save(self) -> None:
        try:
            _finalize(self.res)
        except Exception as exc:  # never lose the measurements to a bug in the arithmetic
            self.res["finalize_error"] = f"{type(exc).__name__}: {exc}"
        self.res["elapsed_s"] = time.perf_counter() - _T0
        write_json(self.args.out / f"{self.args.stem}.json", self.res)

def _section_d2h(run: _Run) -> None:
    import pccheck
    import torch
    n, d2h = run.args.nbytes // 32 * 4, run.res["d2h"]  # n: bytes per tensor
    srcs = {f"t{i}": torch.rand(n // 4, device="cuda") for i in range(8)}
    nbytes, dsts, peak_s = 8 * n, [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in srcs], []
    for _ in range(6):  # the first is the warm-up
        t0 = time.perf_counter()
        for dst, src in zip(dsts, srcs.values()):
            dst.copy_(src.view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        peak_s.append(time.perf_counter() - t0)
    del dsts
    _free()
    peak = run.res["pinned_peak_gbps"] = nbytes / statistics.median(peak_s[1:]) / 1e9
    budget, path = -(-nbytes // (64 << 20)) * (64 << 20) * 2, _d2h_dir(run.work, nbytes)
    d2h.update(nbytes=nbytes, peak_s=peak_s[1:], dram_budget=budget, engine=[], store=str(path))
    _log(f"d2h: pinned copy_ peak {peak:.1f} GB/s ({format_size(nbytes)}); stores in {path}")
    ck = pccheck.Checkpointer(srcs, path=path, interval=1, max_concurrent=1, writer_threads=4, dram_budget=budget)
    sweep = d2h.setdefault("sweep", [])
    try:
        eng = ck.copy_engine
        d2h["copy_engine"] = {**engine_info(ck), "depth": eng.depth, "raw": getattr(eng, "raw", None)}
        d2h["engine"] = _d2h_runs(ck, 6)
        gb = run.res["d2h_gbps"] = statistics.median(x["gbps"] for x in d2h["engine"])
        d2h["ratio_to_peak"] = gb / peak
        _log(f"d2h: pccheck engine {gb:.1f} GB/s = {gb / peak:.3f} of peak; {d2h['copy_engine']}")
        run.guard(run.res["overlap"], lambda: _overlap(ck, gb))
        # Chunks queued per copy thread, and cudaMemcpyAsync (raw) or Tensor.copy_; depth 1 with
        # copy_ is the engine of the first GPU run. The default chunk size, 64 MiB.
        for depth, raw in ((1, False), (2, False), (1, True), (3, True)):
            eng.depth, eng.raw = depth, raw
            sweep.append({"chunk_size": _CHUNK, "depth": depth, "raw": raw, "runs": _d2h_runs(ck, 4)})
            _log(f"d2h sweep: depth {depth} raw {raw}: {_med([r['gbps'] for r in sweep[-1]['runs']]):.1f} GB/s")
    finally:
        ck.close()
        shutil.rmtree(path, ignore_errors=True)
    for chunk in (16 << 20, 256 << 20):  # the chunk size, at the default depth and copy
        def one(chunk: int = chunk) -> dict[str, Any]:
            c = pccheck.Checkpointer(srcs, path=path, interval=1, max_concurrent=1, writer_threads=4,
                                     dram_budget=-(-nbytes // chunk) * chunk * 2, chunk_size=chunk)
            try:
                e = c.copy_engine
                rec = {"chunk_size": chunk, "depth": e.depth, "raw": getattr(e, "raw", None), "runs": _d2h_runs(c, 4)}
                _log(f"d2h sweep: chunk {format_size(chunk)}: {_med([r['gbps'] for r in rec['runs']]):.1f} GB/s")
                return rec
            finally:
                c.close()
                shutil.rmtree(path, ignore_errors=True)
        run.guard(entry := {}, one)
        sweep.append(entry)
    for rec in sweep:
        if rec.get("runs"):
            rec["median_gbps"] = _med([r["gbps"] for r in rec["runs"]])
            rec["ratio_to_peak"] = rec["median_gbps"] / peak


def _d2h_dir(work: Path, nbytes: int) -> Path:
    """Where the d2h checkpoints are written: /dev/shm when it holds three states (the write is not
    what d2h measures, and each run waits for it), else the scratch directory."""
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir() and shutil.disk_usage(shm).free > 3 * nbytes:
            return shm / f"pccheck-bench-d2h-{os.getpid()}"
    return work / "d2h"


def _d2h_runs(ck: Any, n: int) -> list[dict[str, Any]]:
    """``n`` x (checkpoint, wait); the first is a warm-up. D2H GB/s from the copy time net of back-pressure."""
    out = []
    for s in range(n):
        ck.checkpoint(next(_STEPS))
        ck.wait()
        c = ck.stats().checkpoints[-1]  # one at a time: the last finished is this one
        out += [{"step": c.step, "copy_s": c.copy_s, "backpressure_s": c.backpressure_s, "copied_s": c.copied_s,
                 "gbps": c.nbytes / (c.copy_s - c.backpressure_s) / 1e9,
                 "gbps_call_to_copied": c.nbytes / c.copied_s / 1e9 if c.copied_s else None}] if s else []
    return out


def _overlap(ck: Any, copy_alone_gbps: float) -> dict[str, Any]:
    import torch
    a = torch.randn(_MM, _MM, device="cuda", dtype=torch.bfloat16)
    b, c, side, span, flops = torch.randn_like(a), torch.empty_like(a), torch.cuda.Stream(), [], 4 * 2 * _MM**3
    def batch() -> tuple[float, float]:  # 4 matmuls on the default stream, then wait for them
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=c)
        torch.cuda.current_stream().synchronize()
        return t0, time.perf_counter()
    def copy() -> None:  # on a side stream: the copy's ready event must not wait for queued matmuls
        with torch.cuda.stream(side):
            span.append(time.perf_counter())
            ck.checkpoint(next(_STEPS))
            span.append(time.perf_counter())
    alone = [batch() for _ in range(26)][1:]
    with ThreadPoolExecutor(max_workers=1) as pool:
        fut, marks = pool.submit(copy), [batch()]
        while not fut.done():
            marks.append(batch())
        fut.result()
    ck.wait()
    st, inside = ck.stats().checkpoints[-1], [m for m in marks if m[0] >= span[0] and m[1] <= span[1]]
    tf_alone = len(alone) * flops / (alone[-1][1] - alone[0][0]) / 1e12
    tf = len(inside) * flops / sum(t1 - t0 for t0, t1 in inside) / 1e12 if inside else None
    gb = st.nbytes / (st.copy_s - st.backpressure_s) / 1e9
    _log(f"overlap: matmul {tf_alone:.0f} TFLOP/s alone, {tf or float('nan'):.0f} during the copy; "
         f"copy {copy_alone_gbps:.1f} GB/s alone, {gb:.1f} during matmuls")
    return {"matmul_tflops_alone": tf_alone, "matmul_tflops_during_copy": tf, "batches_inside_copy": len(inside),
            "copy_gbps_alone": copy_alone_gbps, "copy_gbps_during_matmul": gb, "copy_wall_s": span[1] - span[0]}

def _section_persist(run: _Run) -> None:
    import numpy as np
    import pccheck
    pe, nbytes = run.res["persist"], run.args.nbytes
    def pcc() -> dict[str, Any]:
        arrays = {f"a{i}": np.full(nbytes // 16, 1.0 + i, dtype=np.float32) for i in range(4)}  # touched
        ck, runs = pccheck.Checkpointer(arrays, path=run.work / "persist", interval=1, max_concurrent=1,
                                        writer_threads=4, incremental=False), []  # the same bytes each time: full
        try:
            for s in range(5):  # steps 0, 1: warm-up, each of the N+1 = 2 slots written once
                t0 = time.perf_counter()
                ck.checkpoint(s)
                ck.wait()
                c = ck.stats().checkpoints[-1]
                runs += [{"wall_s": time.perf_counter() - t0, "persist_s": c.persist_s}] if s > 1 else []
            return {"runs": runs, "gbps": nbytes / _med([r["persist_s"] for r in runs]) / 1e9, "storage": ck.storage}
        finally:
            ck.close()
            shutil.rmtree(run.work / "persist", ignore_errors=True)
    def raw(threads: int = 4) -> dict[str, Any]:
        parts, path, times = pieces(nbytes, _CHUNK), run.work / "raw", []
        bufs = [mmap.mmap(-1, _CHUNK) for _ in range(threads)]  # anonymous mappings are page-aligned
        for buf in bufs:
            buf.write(b"\xa5" * _CHUNK)  # touched
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        def share(i: int) -> None:  # thread i writes pieces i, i + threads, ... from its own buffer
            with memoryview(bufs[i]) as mv:
                for off, n in parts[i::threads]:
                    if (w := os.pwrite(fd, mv[:n], off)) != n:
                        raise OSError(f"short O_DIRECT write: {w} of {n} bytes at offset {off}")

        try:
            os.posix_fallocate(fd, 0, nbytes)
            with ThreadPoolExecutor(max_workers=threads) as pool:
                for _ in range(4):  # the first pass is the warm-up: every extent written once, as pccheck's
                    t0 = time.perf_counter()
                    list(pool.map(share, range(threads)))
                    os.fsync(fd)
                    times.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            for buf in bufs:
                buf.close()
            path.unlink(missing_ok=True)
        return {"threads": threads, "piece_bytes": _CHUNK, "s": times[1:], "gbps": nbytes / _med(times[1:]) / 1e9}
    run.guard(pe.setdefault("pccheck", {}), pcc)
    run.guard(pe.setdefault("raw_odirect", {}), raw)
    p, r = pe["pccheck"].get("gbps"), pe["raw_odirect"].get("gbps")
    pe.update(nbytes=nbytes, ratio_pccheck_vs_raw=p / r if p and r else None)
    _log(f"persist ({format_size(nbytes)}): pccheck {p or 0:.2f} GB/s, raw O_DIRECT {r or 0:.2f} GB/s")

def _window(tr: Trainer, sysm: System, interval: int, iters: int, out: Path | None = None) -> dict[str, Any]:
    """c0 untimed at s0 (a multiple of the interval), then ``iters`` timed iterations, then drain.
    With ``out``, py-spy samples the process during the timed iterations (:class:`_Spy`)."""
    sysm.interval, s0 = interval, -(-tr.step // interval) * interval
    tr.train(s0)
    sysm.call(s0)
    times, calls, parts = [], 0, []
    spy = Spy(out, f"{sysm.name}-i{interval}", iters * 0.6) if out is not None else None
    t0 = time.perf_counter()
    for s in range(s0 + 1, s0 + iters + 1):
        a = time.perf_counter()
        tr.train(s)
        b = time.perf_counter()
        calls += sysm.call(s)
        times.append(time.perf_counter() - a)
        parts.append((tr.last, time.perf_counter() - b, a - t0))
    window = time.perf_counter() - t0
    sysm.drain()
    spied = spy.finish() if spy is not None else None
    tr.step = s0 + iters + 1
    # Where each iteration's time went (Trainer.train): the CPU queuing work, waiting for the GPU,
    # the GPU's own time for the iteration, the checkpoint call.
    brk = {k: [] for k in ("start_s", "launch_s", "opt_s", "sync_s", "gpu_s", "call_s")}
    for last, call_s, start_s in parts:
        tr.last = last
        for k, v in {**tr.timings(), "call_s": call_s, "start_s": start_s}.items():
            brk[k].append(v)
    rec = {"interval": interval, "iters": iters, "steps": [s0, s0 + iters], "window_s": window, "s_per_iter": window / iters,
           "median_iter_s": statistics.median(times), "max_iter_s": max(times), "iter_s": times, "checkpoints": calls,
           "drain_s": time.perf_counter() - t0 - window, "breakdown": brk, **({"py_spy": spied} if spied else {}),
           **sysm.details(s0, s0 + iters)}
    stall = rec.get("median_stall_s")
    _log(f"train/{sysm.name} i{interval}: {iters} it in {window:.2f} s = {window / iters * 1e3:.1f} ms/it (median "
         f"{rec['median_iter_s'] * 1e3:.1f}), {calls} ckpts" + (f", stall {stall * 1e3:.1f} ms" if stall else ""))
    return rec

def _run_system(run: _Run, tr: Trainer, name: str, make: Callable[[], System], cleanup: Path | None,
                extra: list[tuple[str, int, int]] | None = None) -> None:
    """Set-up + warm-up, a window per interval, close; each guarded. With --profile (pccheck): after a
    profiled interval's window, the legacy-copy window and the ``extra`` (key, interval, iters) windows;
    after all, the py-spy and torch.profiler runs. ``cleanup`` is removed at the end."""
    entry, held, budget = run.res["systems"].setdefault(name, {}), [], run.args.budget_s
    late = lambda: 0 < budget < time.perf_counter() - _T0  # noqa: E731  (--budget-s spent)
    def setup() -> dict[str, Any]:
        _log(f"train/{name}: set-up and warm-up")
        held.append(make())
        t0 = time.perf_counter()
        held[0].warmup(tr)
        return {"warmup_s": time.perf_counter() - t0}
    try:
        if late():
            entry["status"] = "skipped: --budget-s spent"
        elif run.guard(entry.setdefault("setup", {}), setup):
            profiled = run.args.profile and isinstance(held[0], PCCheck)
            for i in run.args.intervals:
                if i == 1 and name not in EVERY_ITERATION:
                    continue
                cell = entry.setdefault(str(i), {"status": "skipped: --budget-s spent"})
                if not late():
                    run.guard(cell, lambda i=i: _window(tr, held[0], i, run.args.iters[name][i]))
                if profiled and (name, i) in PROFILED and not late():
                    # --profile: the same window with the first GPU run's copy loop (one chunk at a
                    # time, Tensor.copy_), then the extra windows (e.g. where the disk is not the bound)
                    n = run.args.iters[name][i]
                    run.guard(entry.setdefault(f"{i}_legacy_copy", {}),
                              lambda i=i, n=n: legacy_window(_window, tr, held[0], i, n, None))
                    for key, j, m in extra or []:
                        if not late():
                            run.guard(entry.setdefault(key, {}), lambda j=j, m=m: _window(tr, held[0], j, m))
            for i in sorted({i for n, i in PROFILED if n == name}) if profiled else []:
                # last, as they perturb the loop: under py-spy, then torch.profiler around a checkpoint
                out, n = run.args.out, run.args.iters[name][i]
                if not late():
                    run.guard(entry.setdefault(f"{i}_py_spy", {}), lambda i=i, n=n: _window(tr, held[0], i, n, out))
                if not late():
                    run.guard(entry.setdefault(f"profile_{i}", {}),
                              lambda i=i: profile_checkpoint(tr, held[0], i, out / "profile.txt"))
    finally:
        if held:
            run.guard(entry.setdefault("close", {}), held.pop().close)
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        _free()
        run.save()

def _section_train(run: _Run) -> None:
    import torch
    tr, systems = Trainer(run.args.state_gib, run.args.accum), run.res["systems"]
    run.res["tokens_per_iter"] = run.args.accum * BATCH * SEQ
    for _ in range(3):  # AdamW creates its state at the first step; kernels and autotuning settle
        tr.train(tr.step)
        tr.step += 1
    nparams, mem = sum(p.numel() for p in tr.model.parameters()), torch.cuda.max_memory_allocated()
    state = run.res["state_bytes"] = nparams * 4 + sum(  # + the optimizer's tensors (exp_avg, exp_avg_sq, step)
        v.numel() * v.element_size() for st in tr.opt.state.values() for v in st.values() if torch.is_tensor(v))
    run.res["model"] = {"n_layer": tr.n_layer, "params": nparams, "state_bytes": state, "max_memory_allocated": mem}
    _log(f"train: {tr.n_layer} layers, {nparams / 1e6:.0f} M params, state {state / _GIB:.2f} GiB, GPU {mem / _GIB:.1f} GiB")
    none = lambda: _window(tr, System(), 10, run.args.none_iters)  # noqa: E731
    run.guard(run.res["train"].setdefault("none_first", {}), none)
    store, dcp, ts = run.work / "pccheck", run.work / "dcp", run.work / "torch_save"
    # pccheck's disk tier, then its memory tier (every iteration), then DCP (--budget-s cuts the later
    # phases). The reserve run reopens pccheck_N2's store, then removes it; the others start on an empty
    # scratch dir.
    want = set(run.args.systems)
    if "pccheck_N2" in want:
        bound = run.res["disk_bound"] = _disk_bound(run, state)
        i = bound.get("interval_at_0.8_of_raw")
        extra = [(f"{i}_disk_not_bound", i, i * max(1, 45 // i))] if i and i not in INTERVALS and i <= 40 else []
        _run_system(run, tr, "pccheck_N2", lambda: PCCheck(tr, store, reserve=False), None, extra)
    if "pccheck_reserve" in want:
        _run_system(run, tr, "pccheck_reserve", lambda: PCCheck(tr, store, reserve=True), None)
    shutil.rmtree(store, ignore_errors=True)
    if "pccheck_memory" in want:  # the disk tier at the window's interval, the memory tier every iteration
        shm = Path("/dev/shm") / f"pccheck-bench-gpu-mem-{os.getpid()}"
        try:
            _run_system(run, tr, "pccheck_memory", lambda: PCCheck(tr, store, reserve=False, memory=shm), None)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(store, ignore_errors=True)
    if "dcp_async" in want:
        _run_system(run, tr, "dcp_async", lambda: DCPAsync(tr, dcp, pinned=True), dcp)
        if "error" in (systems["dcp_async"].get(k, {}).get("status") for k in ("setup", "10")):  # DCP's default staging
            systems["dcp_async_pinned_failed"] = systems.pop("dcp_async")
            _run_system(run, tr, "dcp_async", lambda: DCPAsync(tr, dcp, pinned=False), dcp)
    if "dcp_best" in want:
        _run_system(run, tr, "dcp_best", lambda: DCPAsync(tr, dcp, pinned=True, best=True), dcp)
    if "pccheck_remote" in want:
        _with_s3(run, lambda url: _run_system(
            run, tr, "pccheck_remote", lambda: PCCheck(tr, store, reserve=False, remote=url), None))
        shutil.rmtree(store, ignore_errors=True)
    if "torch_save" in want:
        _run_system(run, tr, "torch_save", lambda: TorchSave(tr, ts), ts)
    run.guard(run.res["train"].setdefault("none_last", {}), none)

def _with_s3(run: _Run, body: Callable[[str], None]) -> None:
    """Runs ``body(url)`` against a SeaweedFS (``weed mini``) on 127.0.0.1 with its data in /dev/shm:
    the object store stands for another machine, so it must not share the local disk under test."""
    from pccheck.tiers.remote.devserver import DevServer
    where = Path("/dev/shm") / f"pccheck-bench-gpu-s3-{os.getpid()}"
    server = DevServer(where)
    try:
        if not run.guard(run.res["systems"].setdefault("pccheck_remote", {}).setdefault("server", {}), server.start):
            return
        with unittest.mock.patch.dict(os.environ, server.env()):  # the AWS_* variables, restored after
            body(f"s3://{server.bucket}/gpu")
    finally:
        server.stop()
        shutil.rmtree(where, ignore_errors=True)

def _disk_bound(run: _Run, state: int) -> dict[str, Any]:
    """Where the disk bounds interval-10 checkpointing: the write rate persist needs (state / (10 t)),
    as a share of raw O_DIRECT; the largest state the disk sustains at 0.8 of raw at interval 10; and
    the least interval at which persist needs <= 0.8 of raw (t: none_first's median iteration)."""
    raw = run.res["persist"].get("raw_odirect", {}).get("gbps")
    t = run.res["train"].get("none_first", {}).get("median_iter_s")
    if not raw or not t:
        return {"status": "unmeasured: needs the persist section and none_first"}
    return {"raw_odirect_gbps": raw, "t_iter_s": t, "state_bytes": state,
            "need_gbps_at_10": state / (10 * t) / 1e9, "need_vs_raw_at_10": state / (10 * t) / 1e9 / raw,
            "largest_state_at_10_bytes": 0.8 * raw * 1e9 * 10 * t,
            "interval_at_0.8_of_raw": math.ceil(state / (0.8 * raw * 1e9 * t))}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output directory (default: bench/results/gpu: latest.json, .csv, .png; quick.* with --quick)")
    p.add_argument("--state-gib", type=float, help="training state to reach, GiB (default 8.5; 1 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    p.add_argument("--accum", type=int, help="micro-batches of 8 x 1024 tokens per iteration (default 4; quick 1)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 GiB sizes, half-length windows (~1-2 min)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch", help="scratch directory on the local disk")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    p.add_argument("--iters", dest="iters_arg", default="", help="timed iterations per window, e.g. none:20,10:40,50:50 (default none:40,"
                   "10:40,50:100; torch_save keeps 10:20,50:50)")
    p.add_argument("--intervals", default=",".join(map(str, INTERVALS)),
                   help="comma-separated train windows' intervals from " + ",".join(map(str, WINDOWS))
                   + " (1: DCP's systems only; default " + ",".join(map(str, INTERVALS)) + ")")
    p.add_argument("--profile", action="store_true", help="py-spy (pyspy.txt) and torch.profiler (profile.txt) "
                   "on pccheck_N2 at interval 10")
    p.add_argument("--budget-s", type=float, help="skip phases due after this many s (default 360, quick 120; 0: never)")
    args = p.parse_args(argv)
    args.argv, args.sections = list(sys.argv[1:] if argv is None else argv), args.sections.split(",")
    args.systems = args.systems.split(",")
    args.intervals = [int(i) for i in args.intervals.split(",") if i.isdigit() and int(i) in WINDOWS]
    if not args.intervals:
        p.error(f"--intervals: pick from {','.join(map(str, WINDOWS))}")
    if set(args.systems) - set(SYSTEMS):
        p.error(f"--systems: pick from {','.join(SYSTEMS)}")
    if set(args.sections) - set(SECTIONS) or (args.state_gib is not None and args.state_gib <= 0):
        p.error(f"--sections takes a subset of {','.join(SECTIONS)}; --state-gib a positive number")
    args.state_gib = args.state_gib or (1.0 if args.quick else 8.5)
    args.accum = args.accum or (1 if args.quick else 4)
    args.nbytes, args.none_iters = (_GIB, NONE_ITERS // 2) if args.quick else (4 * _GIB, NONE_ITERS)
    args.budget_s = args.budget_s if args.budget_s is not None else (120.0 if args.quick else 360.0)
    args.out = args.out or result_path("gpu").parent
    args.stem = "quick" if args.quick else "latest"  # latest.json: the current figure (result_path)
    args.iters = {s: {i: max(i, n // 2 // i * i) if args.quick else n  # windows of whole intervals
                      for i, n in (TORCH_SAVE_ITERS if s == "torch_save" else ITERS).items()} for s in SYSTEMS[1:]}
    for item in filter(None, args.iters_arg.split(",")):  # --iters: every system but torch_save
        i, _, n = item.partition(":")
        if i == "none" and n.isdigit() and int(n) > 0:
            args.none_iters = int(n)
            continue
        if not (i.isdigit() and n.isdigit() and int(i) in WINDOWS and int(n) % int(i) == 0 and int(n) > 0):
            p.error(f"--iters takes INTERVAL:ITERS pairs, ITERS a positive multiple of INTERVAL in {WINDOWS}")
        for s in SYSTEMS[1:]:
            if s != "torch_save":
                args.iters[s][int(i)] = int(n)
    return args

def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    global _T0
    _T0, args = time.perf_counter(), _parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU (torch.cuda.is_available()); no CPU stand-in: nothing written", file=sys.stderr)
        return 2
    funcs = {"d2h": _section_d2h, "persist": _section_persist, "train": _section_train}
    with scratch_dir(args.dir) as work:
        run = _Run(args, work)
        _log(f"bench.gpu on {run.res['device']} (driver {run.res['driver']}); {run.res['machine']}; scratch {work}")
        for sec in args.sections:
            _log(f"== {sec}")
            run.guard(run.res["sections"].setdefault(sec, {}), lambda f=funcs[sec]: f(run))
            _free()
    run.guard(run.res.setdefault("report", {}), lambda: report(run.res, args.out, args.stem))
    _log(f"wrote {args.out}/{args.stem}.json, .csv, .png; total elapsed {time.perf_counter() - _T0:.1f} s")
    return 0

if __name__ == "__main__":
    sys.exit(main())
