"""Steps lost by the memory tier after a crash: ``python -m bench.tiers_loss``.

Also run by ``python -m bench.tiers`` (``--loss-trials N``, default 3, 0 = off), whose JSON then
holds the same ``steps_lost`` section; ``python -m bench.tiers_loss`` runs the trials alone
(no loop configurations) and writes ``bench/results/tiers_loss/latest.json`` (``--json``).

The job is bench.tiers' ``memory`` configuration: 2 simulated nodes x 1 rank on this machine
(``PCCHECK_NODE`` = the rank; gloo, TCP rendezvous on 127.0.0.1), 256 MiB of state per rank (a
model and its AdamW state), the emulated loop (wait ``iter_time``, an AdamW step, an
all_reduce), ``Checkpointer(interval=10**9, memory_interval=1, replicas=2)``. Here each node
has a directory of its own (``node-<n>/disk`` beside the scratch, ``node-<n>/mem`` in
``--shm``), so a node's loss is its directories wiped.

One trial: a fresh job trains to the kill step X (drawn from ``--kill-range``, seeded, so never
in the first iterations); at X every rank SIGKILLs itself as soon as ``ck.maybe_checkpoint(X)``
returns (no close, no wait; X is the newest step the training reached). Two kinds:

- ``crash``: every process killed, every directory kept;
- ``node_loss``: every process killed (the job dies with its node anyway), then node 1's
  directories wiped: rank 1 must pull its part from node 0's replica.

Then a fresh restore job: both ranks ``load_latest(disk, memory_dir=...)``; steps lost = X -
the restored step, with each rank's tier. Every restore is verified bit for bit: before each
``maybe_checkpoint(step)`` each rank appends the crc32c of all its state (every parameter, both
AdamW moments and the step counter, as the training holds them at that step) to a side file
outside the node directories; the restored state's crc32c must equal the one recorded for the
restored step on that rank, or the bench fails (a figure from damaged state is never reported).
The side file's crc32c costs the training thread one pass over the state per iteration.

The target is "lost <= max_concurrent", with the value the Checkpointer resolved
(``ck.settings["max_concurrent"]``) and the memory tier's own in-flight limit beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.common import result_path, BENCH_DIR, host_info, parse_size, print_table, write_json

RESULTS = BENCH_DIR / "results"
KINDS = ("crash", "node_loss")
KILL_WAIT_S = 60.0  # after the first rank died, how long the other may take to reach its own kill


def _fingerprint(model, opt) -> int:
    """crc32c of every byte of the training state, in a fixed order: per parameter its data, then
    its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``)."""
    from pccheck.persist.reader import crc32c

    crc = 0
    for p in model.parameters():
        st = opt.state.get(p, {})
        for t in (p.detach(), st.get("exp_avg"), st.get("exp_avg_sq"), st.get("step")):
            if t is None:
                raise RuntimeError("the optimizer has no AdamW state to fingerprint")
            crc = crc32c(memoryview(t.detach().contiguous().reshape(-1).numpy().view("uint8")), crc)
    return crc


def _dirs(a: argparse.Namespace, node: int) -> tuple[Path, Path]:
    """(disk directory, memory directory) of ``node``."""
    return Path(a.dir) / f"node-{node}" / "disk", Path(a.shm) / f"node-{node}" / "mem"


def _init(a: argparse.Namespace):
    """This rank's process group, model and optimizer (bench.tiers' state of ``a.size`` bytes)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from bench.resilience.tiers import _model

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    model, opt = _model(a.size)
    opt.step()  # AdamW's state exists from here on
    return rank, model, opt


def train_worker(a: argparse.Namespace) -> None:
    """One rank of a killed job: trains to ``a.kill``, appending "FP step crc" before each
    checkpoint to its side file, then "KILL step" and SIGKILL right after maybe_checkpoint."""
    import torch
    import torch.distributed as dist

    import pccheck

    rank, model, opt = _init(a)
    disk, mem = _dirs(a, rank)
    ck = pccheck.Checkpointer(model, opt, path=disk, interval=10**9, memory_interval=1, replicas=2, memory_dir=mem)
    # unbuffered writes: each line is in the kernel before the next step, so the SIGKILL loses none
    side = os.open(Path(a.side) / f"rank-{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    in_flight = getattr(getattr(ck._memory, "_engine", None), "max_concurrent", None)
    os.write(side, f"SETTINGS {int(ck.settings['max_concurrent'])} {in_flight}\n".encode())
    token = torch.zeros(1)
    for step in range(1, a.kill + 1):
        time.sleep(a.iter_time)  # the emulated GPU computes
        opt.step()               # the update mutates all of the state
        dist.all_reduce(token)   # lockstep, like DDP's gradient allreduce
        os.write(side, f"FP {step} {_fingerprint(model, opt)}\n".encode())
        ck.maybe_checkpoint(step)
    # what this rank knew at the kill (newest own memory commit, sent, replicated everywhere, replicas held)
    os.write(side, f"TIERS {json.dumps(ck.stats().tiers, separators=(',', ':'))}\nKILL {a.kill}\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def restore_worker(a: argparse.Namespace) -> None:
    """One rank of the restore job: ``load_latest`` into a fresh model whose state was set to
    NaN first (a load that wrote nothing cannot match a fingerprint); prints one JSON line."""
    import torch
    import torch.distributed as dist

    import pccheck

    rank, model, opt = _init(a)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    opt.state.clear()
    disk, mem = _dirs(a, rank)
    t0 = time.perf_counter()
    r = pccheck.load_latest(disk, model=model, optimizer=opt, memory_dir=mem)
    out = {"rank": rank, "step": r.step, "tier": r.tier, "restore_s": time.perf_counter() - t0,
           "fingerprint": _fingerprint(model, opt)}
    dist.barrier()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def _spawn(a: argparse.Namespace, role: str, extra: list[str]) -> list[subprocess.Popen]:
    from bench.resilience.tiers import _port

    cmd = [sys.executable, "-m", "bench.tiers_loss", "--worker", role, "--port", str(_port()), "--dir", a.dir,
           "--shm", a.shm, "--side", a.side, "--size", str(a.size), "--iter-time", str(a.iter_time), *extra]
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=BENCH_DIR.parent,
                             env={**os.environ, "RANK": str(r), "PCCHECK_NODE": str(r), "GLOO_SOCKET_IFNAME": "lo",
                                  "TORCH_CPP_LOG_LEVEL": "ERROR"})
            for r in range(2)]


def _killed_job(a: argparse.Namespace, kill: int) -> list[dict]:
    """Runs the training job to its kill step; returns per rank what its side file says: the
    settings, {step: crc}, its tiers' newest steps at the kill and whether it reached its own SIGKILL (else it was killed here, after
    the other rank's death, ``KILL_WAIT_S`` at most)."""
    procs = _spawn(a, "train", ["--kill", str(kill)])
    deadline = None
    while any(p.poll() is None for p in procs):
        if deadline is None and any(p.poll() is not None for p in procs):
            deadline = time.monotonic() + KILL_WAIT_S
        if deadline is not None and time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()  # SIGKILL: the rank that could not reach its own kill dies like the other
        time.sleep(0.05)
    out = []
    for r, p in enumerate(procs):
        err = p.stderr.read()  # type: ignore[union-attr]
        lines = [l.split() for l in (Path(a.side) / f"rank-{r}.txt").read_text().splitlines()]
        fps = {int(l[1]): int(l[2]) for l in lines if l[0] == "FP"}
        settings = next((l for l in lines if l[0] == "SETTINGS"), None)
        if settings is None or max(fps, default=0) < kill:
            raise RuntimeError(f"rank {r} did not train to step {kill} (exit {p.returncode}): {err[-3000:]}")
        at_kill = next((json.loads(l[1]) for l in lines if l[0] == "TIERS"), None)
        out.append({"fps": fps, "at_kill": at_kill, "self_killed": ["KILL", str(kill)] in lines and p.returncode == -signal.SIGKILL,
                    "max_concurrent": int(settings[1]),
                    "memory_in_flight": None if settings[2] == "None" else int(settings[2])})
    return out


def _restore_job(a: argparse.Namespace) -> list[dict]:
    procs = _spawn(a, "restore", [])
    outs = []
    for r, p in enumerate(procs):
        stdout, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"restore rank {r} failed with {p.returncode}: {err[-3000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    return outs


def trial(a: argparse.Namespace, kind: str, kill: int) -> dict:
    """One killed job and its restore (see the module docstring); raises RuntimeError when a
    rank's restored state is not bit for bit the one it trained to at the restored step."""
    for d in (a.dir, a.shm, a.side):
        shutil.rmtree(d, ignore_errors=True)
        Path(d).mkdir(parents=True)
    trained = _killed_job(a, kill)
    if kind == "node_loss":
        for d in _dirs(a, 1):
            shutil.rmtree(d.parent)
    restored = _restore_job(a)
    steps = {o["step"] for o in restored}
    if len(steps) != 1:
        raise RuntimeError(f"the ranks restored different steps: {restored}")
    step = steps.pop()
    for r, (o, t) in enumerate(zip(restored, trained)):
        if t["fps"].get(step) in (t["fps"].get(step - 1), t["fps"].get(step + 1)):
            raise RuntimeError(f"rank {r}'s fingerprints do not tell step {step} from its neighbours")
        if t["fps"].get(step) != o["fingerprint"]:
            raise RuntimeError(f"{kind} X={kill}: rank {r}'s restored state of step {step} ({o['tier']}) is not "
                               f"the state it trained to (crc {o['fingerprint']} != {t['fps'].get(step)})")
    return {"kill_step": kill, "restored_step": step, "lost": kill - step, "tiers": [o["tier"] for o in restored],
            "verified": True, "self_killed": [t["self_killed"] for t in trained],
            "at_kill": [t["at_kill"] for t in trained],
            "restore_s": max(o["restore_s"] for o in restored),
            "max_concurrent": trained[0]["max_concurrent"], "memory_in_flight": trained[0]["memory_in_flight"]}


def run(a: argparse.Namespace) -> dict:
    """``a.loss_trials`` trials of each kind, kinds interleaved, kill steps drawn from
    ``a.kill_range`` with ``a.loss_seed``; the ``steps_lost`` section (per kind: the trials,
    median and max lost) and its target."""
    lo, hi = (int(x) for x in a.kill_range.split(","))
    rng = random.Random(a.loss_seed)
    trials: dict[str, list[dict]] = {k: [] for k in KINDS}
    root_disk, root_shm = Path(tempfile.mkdtemp(prefix="pcc-loss-")), Path(tempfile.mkdtemp(prefix="pcc-loss-", dir=a.shm))
    sub = argparse.Namespace(**{**vars(a), "dir": str(root_disk / "job"), "shm": str(root_shm / "job"),
                                "side": str(root_disk / "side")})
    try:
        for _ in range(a.loss_trials):
            for kind in KINDS:
                trials[kind].append(trial(sub, kind, rng.randint(lo, hi)))
    finally:
        shutil.rmtree(root_disk, ignore_errors=True)
        shutil.rmtree(root_shm, ignore_errors=True)
    out: dict = {"kill_range": [lo, hi], "seed": a.loss_seed, "trials_per_kind": a.loss_trials}
    for kind, ts in trials.items():
        lost = [t["lost"] for t in ts]
        out[kind] = {"trials": [[t["kill_step"], t["restored_step"], t["lost"], t["tiers"]] for t in ts],
                     "median": statistics.median(lost) if lost else None, "max": max(lost, default=None),
                     "detail": ts}
    every = [t for ts in trials.values() for t in ts]
    out["max_concurrent"] = every[0]["max_concurrent"] if every else None
    out["memory_in_flight"] = every[0]["memory_in_flight"] if every else None
    return out


def targets(section: dict) -> dict:
    """The target, with the max_concurrent the Checkpointer resolved, and whether each
    kind met it (its worst trial)."""
    mc = section.get("max_concurrent")
    return {"steps_lost": f"<= {mc}",
            "steps_lost_met": {k: section[k]["max"] <= mc for k in KINDS
                               if mc is not None and section[k]["max"] is not None}}


def report(section: dict) -> None:
    """The trials and the summary, as tables."""
    def known(t: dict, key: str) -> str:  # per rank, what it knew at the kill
        return "/".join(str((r or {}).get(key)) for r in t.get("at_kill", []))

    rows = [[k, t["kill_step"], t["restored_step"], t["lost"], "/".join(t["tiers"]), known(t, "memory"),
             known(t, "replicated")] for k in KINDS for t in section[k]["detail"]]
    print_table(f"steps lost at memory_interval=1 (max_concurrent {section.get('max_concurrent')}, memory tier "
                f"in flight {section.get('memory_in_flight')})", ["kind", "X", "restored", "lost", "tiers (rank 0/1)", "own memory at kill",
                 "replicated at kill"],
                rows)
    print_table("steps lost", ["kind", "median", "max"],
                [[k, section[k]["median"], section[k]["max"]] for k in KINDS])


def add_arguments(p: argparse.ArgumentParser, default_trials: int) -> None:
    """The loss trials' options (shared with bench.tiers)."""
    p.add_argument("--loss-trials", type=int, default=default_trials,
                   help="kill trials per kind (process crash, node loss); 0 = none")
    p.add_argument("--kill-range", default="8,20", help="the kill step X is drawn from this range (inclusive)")
    p.add_argument("--loss-seed", type=int, default=29)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=parse_size, default=parse_size("256MiB"), help="state per rank")
    p.add_argument("--iter-time", type=float, default=0.2)
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier's stores go")
    p.add_argument("--json", type=Path, default=result_path("tiers_loss"))
    add_arguments(p, 3)
    p.add_argument("--worker", choices=("train", "restore"), help=argparse.SUPPRESS)
    p.add_argument("--kill", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.worker:
        (train_worker if a.worker == "train" else restore_worker)(a)
        return 0
    t0 = time.perf_counter()
    section = run(a)
    res = {"benchmark": "tiers_loss", "nodes": 2, "ranks_per_node": 1, "size_bytes_per_rank": a.size,
           "iter_time_s": a.iter_time, "steps_lost": section, "targets": targets(section),
           "wall_s": time.perf_counter() - t0,
           "command": "python -m bench.tiers_loss " + " ".join(argv if argv is not None else sys.argv[1:]),
           "host": host_info(RESULTS)}
    write_json(a.json, res)
    report(section)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
