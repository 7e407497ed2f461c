"""The memory tier against disk and DCP (loop overhead, restores, steps lost): ``python -m bench.tiers``.

2 simulated nodes x 1 rank on this machine (``PCCHECK_NODE`` = the rank; gloo, TCPStore
rendezvous on 127.0.0.1), 256 MiB of state per rank (a model and its AdamW state), the emulated
loop (the host waits ``t``, then an AdamW step updates all of the state; the GPU is emulated).
Each configuration is a fresh job, checkpointing every iteration:

- ``none``: no checkpoint;
- ``memory``: pccheck's memory tier, ``MemoryOptions(every=1, replicas=2)`` (``keep_last`` from
  ``--memory-keep-last``, default 0; disk tier off);
- ``disk``: pccheck's disk tier, ``interval=1``;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` every iteration, one in flight (the next
  save waits for the previous one, as users write it).

Restore times, after the loop (``max`` over the ranks; each load a collective of both ranks):

- after a process crash: ``load_latest(memory_dir=...)`` (own memory) vs ``load_latest`` from the
  disk tier (O_DIRECT reads: the page cache is not used);
- after a node loss: rank 1's memory store deleted, ``load_latest(memory_dir=...)`` pulls its part
  from node 0's replica (time on rank 1) vs ``load_latest("s3://...")`` from pccheck's remote tier
  (a fresh ``weed mini`` on 127.0.0.1, pccheck.tiers.remote.devserver; the same state,
  uploaded once after the loop by a disk + remote Checkpointer; ``--remote off`` skips it) vs DCP
  ``load`` of the last ``async_save``; peer, raw and remote restores interleaved;
- the raw link: one gloo ``send``/``recv`` of the same bytes between the two ranks.

The memory tier's tmpfs footprint per rank (``tmpfs_bytes_per_rank``): the store files under each
node's memory directory summed as ``du`` does, its own store and the replicas it holds, after the
loop, and each over the state per rank.

Each rank's CPU-seconds (user + system, every thread) during each node-loss restore and raw
transfer are recorded too (``*_cpu_all_s``): the two simulated nodes share this machine's CPUs,
so ``(rank 0's + rank 1's) / nproc`` is the shortest wall time that work can take here.

Steps lost after a process crash and after a node loss (``--loss-trials N`` kill trials of each
kind, default 3, 0 = none; bench.tiers_loss, whose docstring says how): the ``steps_lost``
section and its target. ``--configs=`` (empty) runs only these trials.

Writes ``bench/results/tiers/latest.json`` (``--json``) and ``latest.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.harness.common import result_path, BENCH_DIR, host_info, parse_size, print_table, write_json
from bench.harness.probes import thread_times

RESULTS = BENCH_DIR / "results"
CONFIGS = ("none", "memory", "disk", "dcp")


def _model(size: int):  # noqa: ANN202
    import torch

    n = size // 12 // 4  # AdamW: the parameter plus two moments, 4 bytes each
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for _ in range(4)])
    for p in model:
        p.grad = torch.full_like(p, 1e-3)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _timed_load(fn) -> float:  # noqa: ANN001
    return _timed_cpu(fn)[0]


def _timed_cpu(fn) -> tuple[float, float]:  # noqa: ANN001
    """(wall seconds, this process's CPU-seconds) of ``fn``, started together on both ranks."""
    import torch.distributed as dist

    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _restores(a: argparse.Namespace, rank: int, model, opt) -> dict:  # noqa: ANN001
    import pccheck

    out = {}
    base = Path(a.dir)
    if a.config == "memory":
        mem, disk = Path(a.shm) / f"mem-node{rank}", base / "disk"
        r = [None]
        _fresh(opt, r)
        out["crash_memory_s"] = _timed_load(lambda: r.__setitem__(0, pccheck.load_latest(
            disk, model=model, optimizer=opt, memory_dir=mem)))
        out["crash_memory_tier"] = r[0].tier
        if rank == 1:
            shutil.rmtree(mem / "rank-1")
        _node_loss(a, rank, model, opt, out, disk, mem)
        out.update(_unit_costs(rank, a.size))
    elif a.config == "disk":
        _fresh(opt, [None])
        out["crash_disk_s"] = _timed_load(lambda: pccheck.load_latest(base / "disk", model=model, optimizer=opt))
    elif a.config == "dcp":
        import torch.distributed.checkpoint as dcp

        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        out["node_loss_dcp_s"] = _timed_load(lambda: dcp.load(sd, checkpoint_id=str(base / f"dcp{a.last % 2}"),
                                                              process_group=a.dcp_pg))
    return out


def _node_loss(a: argparse.Namespace, rank: int, model, opt, out: dict, disk: Path, mem: Path) -> None:  # noqa: ANN001
    """Rank 1's node lost (its memory store gone): the peer restore, the raw transfer and (with a
    remote) the remote tier's restore, interleaved ``restore_repeats`` times (drift hits all
    alike); medians and every repeat's wall and CPU seconds into ``out``."""
    import pccheck

    r = [None]
    t: dict[str, list[tuple[float, float]]] = {"node_loss_peer": [], "raw_link": [], "node_loss_remote": []}
    parts = []
    for _ in range(a.restore_repeats):
        _fresh(opt, r)
        with _RestoreLog() as phases:
            t["node_loss_peer"].append(_timed_cpu(_profiled(rank, lambda: r.__setitem__(0, pccheck.load_latest(
                disk, model=model, optimizer=opt, memory_dir=mem)))))
        parts.append(phases.part_s)
        out["node_loss_tier"] = r[0].tier
        _fresh(opt, r)
        t["raw_link"].append(_raw_link(rank, a.size))
        if a.remote_url:
            _fresh(opt, r)
            t["node_loss_remote"].append(_timed_cpu(lambda: r.__setitem__(0, pccheck.load_latest(
                a.remote_url, model=model, optimizer=opt))))
            out["node_loss_remote_tier"] = r[0].tier
    _fresh(opt, r)
    for name, xs in t.items():
        if xs:
            out[f"{name}_all_s"], out[f"{name}_cpu_all_s"] = [w for w, _ in xs], [c for _, c in xs]
            out[f"{name}_s"] = statistics.median(w for w, _ in xs)
    out["node_loss_part_all_s"] = parts
    out["node_loss_part_s"] = statistics.median(p for p in parts if p is not None) if all(parts) else None


def _upload_remote(a: argparse.Namespace, model, opt, step: int) -> float:  # noqa: ANN001
    """The state as it is now, checkpointed once by a disk + remote Checkpointer and committed
    in the remote tier at ``a.remote_url`` (collective); returns the seconds that took."""
    import pccheck

    t0 = time.perf_counter()
    ck = pccheck.Checkpointer(model, opt, path=Path(a.dir) / "remote-src", interval=1, remote=a.remote_url)
    ck.checkpoint(step)
    if not ck.wait(remote=True, timeout=600):
        raise RuntimeError("the remote tier did not commit within 600 s")
    ck.close()
    return time.perf_counter() - t0


class _RestoreLog(logging.Handler):
    """Catches load_nearest's "restored" record: this rank's own part of the restore (its pull or
    load and every check, before the vote, whose wait is the slowest rank's part)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.part_s: float | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if "restored step" in record.msg and "its part" in record.msg:
            self.part_s = float(record.args[3])

    def __enter__(self) -> "_RestoreLog":
        log = logging.getLogger("pccheck")
        self._level = log.level
        log.addHandler(self)
        log.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("pccheck")
        log.removeHandler(self)
        log.setLevel(self._level)


def _fresh(opt, held: list) -> None:  # noqa: ANN001
    """A restore as a fresh process makes it: the optimizer without state and the last load's
    arrays freed before the clock starts (freeing 170 MiB of AdamW moments is not a restore's)."""
    import gc

    opt.state.clear()
    held[0] = None
    gc.collect()


def _profiled(rank: int, fn):  # noqa: ANN001, ANN202
    """``fn``, under cProfile on rank 1 when ``TIERS_PROFILE`` names a file (its stats go there)."""
    where = os.environ.get("TIERS_PROFILE")
    if not where or rank != 1:
        return fn

    def run() -> None:
        import cProfile

        prof = cProfile.Profile()
        prof.runcall(fn)
        prof.dump_stats(where)
    return run


def _unit_costs(rank: int, size: int) -> dict:
    """CPU-seconds of the passes a replicated memory checkpoint is made of, for ``size`` bytes on
    this machine: one memcpy into touched memory, one crc32c (pccheck's native), and one gloo
    send/recv on loopback (each end's process CPU, user + system). The loop's floor is their sum
    over what one iteration must do (bench/README.md, "Memory tier and peer replicas")."""
    import numpy as np
    import torch.distributed as dist

    from pccheck.persist.reader import crc32c

    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    out: dict = {}
    for name, fn in (("memcpy_cpu_s", lambda: np.copyto(dst, src)), ("crc32c_cpu_s", lambda: crc32c(memoryview(src)))):
        costs = []
        for _ in range(3):
            c0 = time.process_time()
            fn()
            costs.append(time.process_time() - c0)
        out[name] = min(costs)
    import torch

    touched = torch.ones(size // 4)  # as the replication's receive buffer, reused every iteration
    for name, into in (("link_cpu_s", None), ("link_touched_cpu_s", touched)):
        # this end of one transfer (rank 0 sends, rank 1 receives); link_cpu_s: rank 1 receives
        # into fresh memory (its first touch included), link_touched_cpu_s into memory touched
        # before; the buffers are made before the clock starts
        out[name] = min(_raw_link(rank, size, into)[1] for _ in range(3))
    return out


def _raw_link(rank: int, size: int, into=None) -> tuple[float, float]:  # noqa: ANN001
    """One gloo send (rank 0) / recv (rank 1) of ``size`` bytes: (wall seconds, this end's
    CPU-seconds), both counted after the buffers exist (rank 0's filled, rank 1's fresh unless
    ``into`` is given)."""
    import torch
    import torch.distributed as dist

    t = into if into is not None else (torch.ones(size // 4) if rank == 0 else torch.empty(size // 4))
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    if rank == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    dist.barrier()
    return time.perf_counter() - t0, time.process_time() - c0


def worker(a: argparse.Namespace) -> None:
    """One rank: the loop, then the restores; prints one JSON line."""
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    import pccheck

    rank = int(os.environ["RANK"])
    if os.environ.get("TIERS_DEBUG"):
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["TIERS_DEBUG"]), exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=600))
    model, opt = _model(a.size)
    opt.step()  # AdamW's state exists from here on
    base = Path(a.dir)
    ck, future = None, None
    if a.config == "memory":
        ck = pccheck.Checkpointer(model, opt, path=base / "disk", interval=10**9,
                                  memory=pccheck.MemoryOptions(every=1, replicas=2, dir=Path(a.shm) / f"mem-node{rank}",
                                                               keep_last=a.memory_keep_last))
    elif a.config == "disk":
        ck = pccheck.Checkpointer(model, opt, path=base / "disk", interval=1)
    token = torch.zeros(1)
    # DCP's background save runs collectives: on a group of their own, never beside the loop's
    dcp_pg = dist.new_group(backend="gloo") if a.config == "dcp" else None

    def iteration(step: int) -> None:
        nonlocal future
        time.sleep(a.iter_time)  # the emulated GPU computes
        opt.step()               # the update mutates all of the state
        dist.all_reduce(token)   # lockstep, like DDP's gradient allreduce
        if ck is not None:
            ck.maybe_checkpoint(step)
        elif a.config == "dcp":
            import torch.distributed.checkpoint as dcp

            if future is not None:
                future.result()  # one in flight
            future = dcp.async_save({"model": model.state_dict(), "optim": opt.state_dict()},
                                    checkpoint_id=str(base / f"dcp{step % 2}"), process_group=dcp_pg)

    for step in range(1, a.warmup + 1):
        iteration(step)
    dist.barrier()
    t0, cpu0, threads0 = time.perf_counter(), time.process_time(), _threads_cpu()
    last = a.warmup + a.iters
    for step in range(a.warmup + 1, last + 1):
        iteration(step)
    elapsed = time.perf_counter() - t0  # the loop's own time: what training sees
    cpu = time.process_time() - cpu0    # every thread of this rank, user + system (gloo's, the kernel's TCP)
    if future is not None:
        future.result()
    out = {"rank": rank, "iter_s": elapsed / a.iters, "cpu_per_iter_s": cpu / a.iters,
           "threads_per_iter": _per_iter(threads0, _threads_cpu(), a.iters)}  # [CPU-s, minor faults]
    if ck is not None:
        out["tiers"] = ck.stats().tiers
        if a.config == "memory":
            out["tmpfs_bytes"] = _tmpfs_bytes(Path(a.shm) / f"mem-node{rank}")
        ck.close()
    a.last, a.dcp_pg = last, dcp_pg
    if a.config == "memory" and a.remote_url:  # the same state, in the remote tier, for the node-loss restores
        out["remote_upload_s"] = _upload_remote(a, model, opt, last)
    out.update(_restores(a, rank, model, opt))
    dist.barrier()
    print(json.dumps(out, default=str), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def _tmpfs_bytes(mem: Path) -> dict[str, int]:
    """This node's memory-tier store files, as ``du`` counts them (allocated blocks; the stores are
    populated whole when they open): ``own`` (``rank-<r>/``) and ``replicas`` (``replica-<s>/``),
    and their apparent sizes (``*_apparent``)."""
    from pccheck.persist.recovery import store_files

    out = {"own": 0, "replicas": 0, "own_apparent": 0, "replicas_apparent": 0}
    for d in sorted(mem.iterdir()) if mem.is_dir() else ():
        kind = "own" if d.name.startswith("rank-") else "replicas" if d.name.startswith("replica-") else None
        if kind is None or not d.is_dir():
            continue
        for _, f in store_files(d):
            st = f.stat()
            out[kind] += st.st_blocks * 512
            out[f"{kind}_apparent"] += st.st_size
    return out


def _threads_cpu() -> dict[str, list[float]]:
    """Per thread of this process: [CPU-seconds (user + system), minor page faults] (Linux /proc),
    keyed by the Python thread's name; threads Python did not start (gloo's, pccheck's native
    writers and copy threads, torch's) as "native:<kernel name>", summed per name."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, list[float]] = {}
    for tid, comm, cpu, faults in thread_times():
        acc = out.setdefault(names.get(tid) or f"native:{comm}", [0.0, 0.0])
        acc[0] += cpu
        acc[1] += faults
    return out


def _per_iter(before: dict[str, list[float]], after: dict[str, list[float]], n: int) -> dict[str, list[float]]:
    """Per iteration: each thread's [CPU-seconds, minor faults] between two _threads_cpu calls."""
    return {k: [round((v[0] - before.get(k, [0, 0])[0]) / n, 4), round((v[1] - before.get(k, [0, 0])[1]) / n, 1)]
            for k, v in sorted(after.items())}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(config: str, a: argparse.Namespace, scratch: Path, shm: Path) -> list[dict]:
    for d in (scratch, shm):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    cmd = [sys.executable, "-m", "bench.tiers", "--worker", "--config", config, "--port", str(_port()),
           "--dir", str(scratch), "--size", str(a.size), "--iter-time", str(a.iter_time), "--iters", str(a.iters),
           "--warmup", str(a.warmup), "--shm", str(shm),
           "--restore-repeats", str(a.restore_repeats), "--memory-keep-last", str(a.memory_keep_last)]
    if config == "memory" and a.remote_url:
        cmd += ["--remote-url", f"{a.remote_url}/{shm.name}-{time.monotonic_ns()}"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=BENCH_DIR.parent,
                              env={**os.environ, **a.remote_env, "RANK": str(r), "PCCHECK_NODE": str(r),
                                   "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR"})
             for r in range(2)]
    outs = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{config} rank failed with {p.returncode}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    return outs


def _remote_server(a: argparse.Namespace, configs: list[str], scratch: Path):  # noqa: ANN202
    """A fresh ``weed mini`` on 127.0.0.1 (its data under ``scratch``) for the remote tier's
    restores, or None (``--remote off``, no memory config, or ``auto`` without a weed binary).
    Sets ``a.remote_url`` and ``a.remote_env`` (the AWS_* variables the workers get)."""
    from pccheck.tiers.remote.devserver import DevServer, weed_binary

    a.remote_url, a.remote_env = None, {}
    if a.remote == "off" or "memory" not in configs or (a.remote == "auto" and weed_binary() is None):
        return None
    srv = DevServer(scratch / "s3").start()
    a.remote_url, a.remote_env = f"s3://{srv.bucket}/tiers", srv.env()
    return srv


def _median(runs: list[list[dict]], key: str, rank: int | None = None) -> float | None:
    vals = [max(o[key] for o in outs) if rank is None else outs[rank][key] for outs in runs if key in outs[0]]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _cpu_bound(runs: list[list[dict]]) -> dict[str, float]:
    """Per node-loss restore kind: the median over repeats of (rank 0's + rank 1's CPU-seconds) /
    nproc, the shortest wall time that work can take on this machine's shared CPUs, beside the
    median wall time on rank 1."""
    out: dict[str, float] = {}
    for name in ("node_loss_peer", "raw_link", "node_loss_remote"):
        key = f"{name}_cpu_all_s"
        pairs = [(c0 + c1) / (os.cpu_count() or 1) for outs in runs if key in outs[1]
                 for c0, c1 in zip(outs[0][key], outs[1][key])]
        if pairs:
            out[f"{name}_cpu_both_over_nproc_s"] = statistics.median(pairs)
            out[f"{name}_cpu_rank0_s"] = statistics.median(c for outs in runs for c in outs[0][key])
            out[f"{name}_cpu_rank1_s"] = statistics.median(c for outs in runs for c in outs[1][key])
    return out


def _parser() -> argparse.ArgumentParser:
    from bench.resilience import tiers_loss

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="state per rank")
    p.add_argument("--iter-time", type=float, default=0.2)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--restore-repeats", type=int, default=3,
                   help="node-loss restores and raw sends per memory job (interleaved; the job reports medians)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="comma-separated subset of " + ",".join(CONFIGS) + " (the ratios need all four; empty: "
                        "only the steps-lost trials)")
    p.add_argument("--json", type=Path, default=result_path("tiers"))
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier's stores go")
    p.add_argument("--memory-keep-last", type=int, choices=(0, 1), default=0,
                   help="MemoryOptions.keep_last of the memory config (1: one older checkpoint, 6x instead of 4x)")
    p.add_argument("--remote", choices=("auto", "on", "off"), default="auto",
                   help="the node-loss restore from pccheck's remote tier on a fresh `weed mini` (auto: when the "
                        "memory config runs and a weed binary is found)")
    p.add_argument("--remote-url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    tiers_loss.add_arguments(p, 3)
    return p


def _loop(a: argparse.Namespace, configs: list[str]) -> dict[str, list[list[dict]]]:
    """Every configuration's jobs, ``a.repeats`` rounds (round-robin), each a fresh job."""
    runs: dict[str, list[list[dict]]] = {c: [] for c in configs}
    shm = Path(tempfile.mkdtemp(prefix="pcc-tiers-", dir=a.shm))
    disk = Path(tempfile.mkdtemp(prefix="pcc-tiers-"))  # the root file system, outside the repository
    srv = _remote_server(a, configs, disk)
    try:
        for rep in range(a.repeats):  # round-robin: drift hits every configuration alike
            for config in configs:
                runs[config].append(run_job(config, a, disk / config, shm / config))
    finally:
        if srv is not None:
            srv.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    return runs


def _summary(a: argparse.Namespace, configs: list[str], runs: dict[str, list[list[dict]]]) -> dict:
    """The loop's result document: per configuration s/iter, slowdown and CPU; the restores,
    the ratios with the range behind each, the targets."""
    it = {c: statistics.median(max(o["iter_s"] for o in outs) for outs in runs[c]) for c in configs}
    slow = {c: it[c] / it["none"] for c in configs} if "none" in it else {}
    cpu = {c: statistics.median(statistics.mean(o["cpu_per_iter_s"] for o in outs) for outs in runs[c])
           for c in configs}  # CPU-seconds one rank spends per iteration (2 ranks share the machine's CPUs)
    rest = {
        "crash_memory_s": _median(runs.get("memory", []), "crash_memory_s"),
        "crash_disk_s": _median(runs.get("disk", []), "crash_disk_s"),
        "node_loss_peer_s": _median(runs.get("memory", []), "node_loss_peer_s", rank=1),
        "node_loss_dcp_s": _median(runs.get("dcp", []), "node_loss_dcp_s"),
        "raw_link_s": _median(runs.get("memory", []), "raw_link_s", rank=1),
        "node_loss_part_s": _median(runs.get("memory", []), "node_loss_part_s", rank=1),
        "node_loss_remote_s": _median(runs.get("memory", []), "node_loss_remote_s", rank=1),
    }
    units = {k: _median(runs.get("memory", []), k)
             for k in ("memcpy_cpu_s", "crc32c_cpu_s", "link_cpu_s", "link_touched_cpu_s")}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    # tmpfs per rank (the larger rank's, median over repeats): own store, replicas, in bytes and
    # as a multiple of the state per rank
    tmpfs: dict[str, float] = {}
    mem_runs = [outs for outs in runs.get("memory", []) if all("tmpfs_bytes" in o for o in outs)]
    for k in ("own", "replicas"):
        if mem_runs:
            tmpfs[k] = statistics.median(max(o["tmpfs_bytes"][k] for o in outs) for outs in mem_runs)
    if tmpfs:
        tmpfs["total"] = statistics.median(max(o["tmpfs_bytes"]["own"] + o["tmpfs_bytes"]["replicas"] for o in outs)
                                           for outs in mem_runs)
        tmpfs.update({f"{k}_over_state": v / a.size for k, v in list(tmpfs.items())})

    ratios = {
        "loop_slowdown_memory_replicas2": slow.get("memory"),
        "crash_restore_memory_over_disk": ratio(rest["crash_memory_s"], rest["crash_disk_s"]),
        "peer_vs_raw_gloo": ratio(rest["raw_link_s"], rest["node_loss_peer_s"]),
        "peer_part_vs_raw_gloo": ratio(rest["raw_link_s"], rest["node_loss_part_s"]),
        "node_loss_peer_over_dcp_load": ratio(rest["node_loss_peer_s"], rest["node_loss_dcp_s"]),
        "node_loss_peer_over_remote": ratio(rest["node_loss_peer_s"], rest["node_loss_remote_s"]),
    }
    # per repeat (each a fresh job): the range behind each median
    per_repeat = {"peer_vs_raw_gloo": [o[1]["raw_link_s"] / o[1]["node_loss_peer_s"] for o in runs.get("memory", [])],
                  "peer_part_vs_raw_gloo": [o[1]["raw_link_s"] / o[1]["node_loss_part_s"] for o in runs.get("memory", [])
                                            if o[1].get("node_loss_part_s")],
                  "node_loss_peer_over_remote": [o[1]["node_loss_peer_s"] / o[1]["node_loss_remote_s"]
                                                 for o in runs.get("memory", []) if o[1].get("node_loss_remote_s")]}
    if "none" in runs:
        for c in configs:
            per_repeat[f"slowdown_{c}"] = [max(o["iter_s"] for o in x) / max(o["iter_s"] for o in n)
                                          for x, n in zip(runs[c], runs["none"])]
    return {"iters": a.iters, "warmup": a.warmup, "repeats": a.repeats, "iter_s": it, "slowdown": slow,
            "cpu_per_iter_s": cpu, "nproc": os.cpu_count(), "unit_cpu_s": units,
            "restore_s": rest, "ratios": ratios, "per_repeat": per_repeat, "tmpfs_bytes_per_rank": tmpfs,
            "targets": {"loop_slowdown_memory_replicas2": "<= 1.05", "crash_restore_memory_over_disk": "<= 0.2",
                        "peer_vs_raw_gloo": ">= 0.8",
                        "node_loss_peer_over_remote": "<= 0.1"},
            "cpu_bound_s": _cpu_bound(runs.get("memory", [])), "runs": runs}


def report(a: argparse.Namespace, res: dict) -> None:
    """The loop's tables (when it ran), then the steps-lost tables (when the trials ran)."""
    from bench.resilience import tiers_loss

    it, slow, cpu = res.get("iter_s", {}), res.get("slowdown", {}), res.get("cpu_per_iter_s", {})
    if it:
        print_table(f"2 nodes x 1 rank, {a.size / 2**20:.0f} MiB/rank, t={a.iter_time}s, every iteration (GPU emulated)",
                    ["config", "s/iter", "slowdown", "CPU-s/iter/rank"],
                    [[c, f"{it[c]:.4f}", f"{slow[c]:.3f}x" if c in slow else "-", f"{cpu[c]:.3f}"] for c in it])
        tmpfs = res.get("tmpfs_bytes_per_rank") or {}
        if tmpfs:
            print_table("memory tier's tmpfs per rank (store files, du)", ["what", "MiB", "x state"],
                        [[k, f"{tmpfs[k] / 2**20:.1f}", f"{tmpfs[k + '_over_state']:.2f}"]
                         for k in ("own", "replicas", "total")])
        print_table("restore (s)", ["what", "seconds"],
                    [[k, f"{v:.3f}" if v is not None else "-"] for k, v in res["restore_s"].items()])
        print_table("ratios", ["ratio", "value", "per repeat"],
                    [[k, f"{v:.3f}" if v is not None else "-",
                      " ".join(f"{x:.3f}" for x in res["per_repeat"].get(k, []))] for k, v in res["ratios"].items()])
    if "steps_lost" in res:
        tiers_loss.report(res["steps_lost"])


def main(argv: list[str] | None = None) -> int:
    from bench.resilience import tiers_loss

    a = _parser().parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    configs = [c for c in CONFIGS if c in a.configs.split(",")]
    res: dict = {"benchmark": "tiers", "gpu": "emulated (host waits iter_time, then an AdamW step updates all state)",
                 "nodes": 2, "ranks_per_node": 1, "size_bytes_per_rank": a.size, "iter_time_s": a.iter_time,
                 "configs": configs, "targets": {}}
    if configs:
        res.update(_summary(a, configs, _loop(a, configs)))
    if a.loss_trials > 0:
        res["steps_lost"] = tiers_loss.run(a)
        res["targets"].update(tiers_loss.targets(res["steps_lost"]))
    res["command"] = "python -m bench.tiers " + " ".join(argv if argv is not None else sys.argv[1:])
    res["host"] = host_info(RESULTS)
    write_json(a.json, res)
    report(a, res)
    from bench.resilience.tiers_plot import plot

    drawn = plot(res, a.json.with_suffix(".png"))
    print(f"wrote {a.json}" + (f" and {a.json.with_suffix('.png').name}" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
