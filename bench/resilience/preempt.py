"""Preemption: SIGTERM at a random point of a step, SIGKILL at the grace period, the machine lost.

    python -m bench.preempt [--sizes 256MiB,1GiB] [--trials 1] [--grace 30] [--iter-time 0.05] [--after 2] [--raw-repeat 3]
                            [--raw-sizes 256MiB]

Per state size and per system, a training process (bench/resilience/preempt_child.py, the GPU
emulated by a sleep) runs until a SIGTERM lands at a random step after the disk checkpoint of
step ``--after`` x 50 (default 2: steps 102-108, after a first upload was measured and while
the second may be in flight, as in a long run) and at a random point inside that step; a SIGKILL follows at ``--grace``
seconds if it is still alive; then its local and tmpfs directories are deleted.

* ``pccheck``: memory tier every step, disk every 50 steps, the remote tier on a fresh SeaweedFS
  (``weed mini`` on 127.0.0.1, as bench.remote starts it), ``ck.on_preemption(grace_s)``. Reported:
  the seconds from the signal until the flushed step was durable on disk and committed on the
  remote (the FlushResult's ``at_s``), the step resumed from ``s3://`` (``load_latest``, each
  value checked) and the steps lost: the last step whose ``maybe_checkpoint`` returned before the
  signal, minus the resumed one (0 at best; never below 0).
* ``dcp``: ``torch.distributed.checkpoint.async_save`` every 50 steps and the user's own SIGTERM
  handler that calls it for the live state and waits for it. **DCP writes to the local disk
  here** (no fsspec/s3fs in this environment's venv: see bench.remote's ``--s3fs-path``), and its
  directory is kept, so its figures are what a restart on the same machine gets: a lower bound
  of its loss when the machine is lost. Its state is torn when the handler ran between the
  step's two writes; then the resumable step is the periodic one.
* ``raw-client``: boto3 uploading the state's bytes from memory to the same server (bench.remote's
  ``raw_client``: the best of a signed and an unsigned body), ``--raw-repeat`` times for each of
  ``--raw-sizes``: the target
  is pccheck's signal-to-remote-commit at most 1.2x that upload's time for 256 MiB. The ratio is
  reported per size as the median of pccheck's trials over the median of the raw uploads of the
  same run, with its range (each trial's time over that median) and the raw uploads' range; run
  ``--trials 3`` or more for a range that says something.
Speeds on 2 shared vCPUs are the server's too (it runs on the same CPUs): compare within a run.
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
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.harness.common import bar_chart, format_size, host_info, parse_size_list, result_path

EVERY = 50           # the disk's (and DCP's) checkpoint interval; preempt_child.EVERY
WINDOW = (2, 8)      # the SIGTERM lands this many steps after the --after-th disk checkpoint
RAW_TARGET = 1.2     # signal -> remote commit, over the raw client's upload of the same bytes


def trial(system: str, size: int, a: argparse.Namespace, work: Path, url: str, rng: random.Random) -> dict[str, Any]:
    """One child of ``system`` until its SIGTERM (and SIGKILL at the grace period); what it reached."""
    where, mem = work / f"{system}-{uuid.uuid4().hex[:6]}", Path("/dev/shm") / f"pccheck-bench-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                       *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "bench.preempt_child", system, str(size), str(a.iter_time),
                             str(where), str(mem), url, str(a.grace)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, d=d: d.extend(x.rstrip("\n") for x in s), daemon=True)
               for s, d in ((proc.stdout, lines), (proc.stderr, err))]
    for t in readers:
        t.start()
    at = a.after * EVERY + rng.randint(*WINDOW)
    try:
        t0 = time.monotonic()
        while f"STEP {at - 1}" not in lines:
            if proc.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError(f"the {system} child ended or stalled: {err[-20:]}")
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, a.iter_time))  # a random point of step `at`
        last = max(int(x.split()[1]) for x in list(lines) if x.startswith("STEP "))
        t_sig = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(a.grace)
            killed = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            killed = True
        ended_s = time.monotonic() - t_sig
    finally:
        if proc.poll() is None:
            proc.kill()
        for t in readers:
            t.join(10)
        shutil.rmtree(mem, ignore_errors=True)  # the machine's RAM is gone
    got = [json.loads(x[7:]) for x in lines if x.startswith("RESULT ")]
    out: dict[str, Any] = {"system": system, "size": size, "signal_in_step": at, "last_returned": last,
                           "killed_at_grace": killed, "ended_s": ended_s}
    if system == "pccheck":
        shutil.rmtree(where, ignore_errors=True)  # the machine is lost: only the object store is left
        out.update(_pccheck_outcome(got[0]["flush"] if got else None, url, last))
        flushed = [u for u in (got[0]["uploads"] if got else []) if u[0] == out["flushed_step"]]
        # the flushed step's upload alone (from its start to its remote commit): the upload path's
        # own time, against the raw client; the rest of to_remote_s is the disk write and the wait
        # for the superseded upload's parts already in flight
        out["flushed_upload_s"] = flushed[0][4] if flushed else None
    else:
        out.update(_dcp_outcome(got[0] if got else None, last))
        shutil.rmtree(where, ignore_errors=True)
    if not got:
        out["stderr_tail"] = err[-20:]
    return out


def _pccheck_outcome(flush: dict | None, url: str, last: int) -> dict[str, Any]:
    import numpy as np

    import pccheck

    tiers = {t["tier"]: t for t in (flush or {}).get("tiers", [])}
    try:
        r = pccheck.load_latest(url)  # a new machine resumes from the object store
    except pccheck.NoCheckpointError:
        return {"flushed_step": (flush or {}).get("step"), "to_disk_s": None, "to_remote_s": None,
                "resumed_step": None, "resumed_state_ok": False, "resumed_from": "s3://", "steps_lost": last}
    head = r.state["w"][: max(1, r.state["w"].shape[0] // 16)]
    ok = bool(int(r.state["step"][0]) == r.step and np.all(head == r.step) and np.all(r.state["w"][head.shape[0]:] == 0.5))
    return {"flushed_step": (flush or {}).get("step"), "source": (flush or {}).get("source"),
            "to_disk_s": tiers.get("disk", {}).get("at_s"), "to_remote_s": tiers.get("remote", {}).get("at_s"),
            # when the flushed step's upload began (from the memory tier's slot, beside the disk write)
            "remote_started_s": tiers.get("remote", {}).get("started_s"),
            "took_s": (flush or {}).get("took_s"), "resumed_step": r.step, "resumed_state_ok": ok,
            "resumed_from": "s3://", "steps_lost": max(0, last - r.step)}


def _dcp_outcome(res: dict | None, last: int) -> dict[str, Any]:
    if res is None:  # the handler's save did not end before the SIGKILL: the newest periodic step stands
        return {"to_disk_s": None, "to_remote_s": None, "resumed_step": last // EVERY * EVERY,
                "steps_lost": last - last // EVERY * EVERY,
                "resumed_from": "local disk (DCP async_save to the local disk)"}
    step = res["periodic"] if res["torn"] else res["step"]
    step = last // EVERY * EVERY if step is None else step
    return {"saved_step": res["step"], "torn": res["torn"], "blocked_in_handler_s": res["staged_s"],
            "to_disk_s": res["durable_s"], "to_remote_s": None, "resumed_step": step,
            "resumed_from": "local disk (DCP async_save to the local disk)", "steps_lost": max(0, last - step)}


def raw_upload_s(size: int, url: str, repeat: int) -> list[float]:
    """Seconds for boto3 to upload ``size`` bytes from memory (best of signed/unsigned), per repeat."""
    from bench.resilience.remote import raw_client

    return [size / max(raw_client(size, url), raw_client(size, url, None, True)) / 1e9 for _ in range(repeat)]


def run(a: argparse.Namespace) -> dict[str, Any]:
    """Every trial, then the raw client's uploads."""
    from bench.resilience.remote import _env
    from pccheck.tiers.remote.devserver import DevServer

    rng = random.Random(a.seed)
    res: dict[str, Any] = {"trials": [], "raw_upload_s": {}}
    with tempfile.TemporaryDirectory(prefix="pccheck-bench-preempt-", dir=os.environ.get("TMPDIR", "/tmp")) as d:
        srv = DevServer(Path(d) / "s3").start()
        try:
            _env(srv)
            res["server"] = srv.env()["AWS_ENDPOINT_URL"]
            for size in a.sizes:
                for i in range(a.trials):
                    for system in ("pccheck", "dcp"):
                        work = Path(d) / "work"
                        work.mkdir(exist_ok=True)
                        url = f"s3://{srv.bucket}/preempt-{uuid.uuid4().hex[:8]}"
                        t = trial(system, size, a, work, url, rng)
                        res["trials"].append(t)
                        print(json.dumps(t), flush=True)
                if size in a.raw_sizes:
                    res["raw_upload_s"][str(size)] = raw_upload_s(size, f"s3://{srv.bucket}/raw", a.raw_repeat)
                    print(json.dumps({"raw_upload_s": res["raw_upload_s"][str(size)], "size": size}), flush=True)
        finally:
            srv.stop()
    res["summary"] = summarize(res, a)
    return res


def summarize(res: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    def med(xs: list) -> float | None:
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def span(xs: list) -> list[float] | None:
        xs = [x for x in xs if x is not None]
        return [min(xs), max(xs)] if xs else None

    out: dict[str, Any] = {}
    for size in a.sizes:
        key = format_size(size)
        out[key] = {}
        for system in ("pccheck", "dcp"):
            ts = [t for t in res["trials"] if t["size"] == size and t["system"] == system]
            out[key][system] = {"trials": len(ts), "to_disk_s": med([t["to_disk_s"] for t in ts]),
                                "flushed_upload_s": med([t.get("flushed_upload_s") for t in ts]),
                                "to_remote_s": med([t["to_remote_s"] for t in ts]),
                                "to_remote_s_range": span([t["to_remote_s"] for t in ts]),
                                "remote_started_s": med([t.get("remote_started_s") for t in ts]),
                                "steps_lost": [t["steps_lost"] for t in ts],
                                "resumed_from": ts[0]["resumed_from"] if ts else None}
        raws = res["raw_upload_s"].get(str(size), [])
        raw = med(raws)
        pr = out[key]["pccheck"]["to_remote_s"]
        out[key]["raw_upload_s"] = raw
        out[key]["raw_upload_s_range"] = span(raws)
        out[key]["raw_uploads"] = len(raws)
        # notice -> remote commit over the raw client's upload of the same bytes, same run: the
        # median trial over the median raw upload, and each trial's over that median
        out[key]["remote_vs_raw_upload"] = pr / raw if pr is not None and raw else None
        rng = out[key]["pccheck"]["to_remote_s_range"]
        out[key]["remote_vs_raw_upload_range"] = [x / raw for x in rng] if rng is not None and raw else None
        up = out[key]["pccheck"]["flushed_upload_s"]
        out[key]["upload_alone_vs_raw_upload"] = up / raw if up is not None and raw else None
    return out


def targets(res: dict[str, Any]) -> dict[str, Any]:
    """The targets: 0 steps lost from s3:// (every pccheck trial, each resumed state
    checked), and signal -> remote commit <= 1.2x the raw upload for 256 MiB."""
    pc = [t for t in res["trials"] if t["system"] == "pccheck"]
    ratio = res["summary"].get(format_size(256 << 20), {}).get("remote_vs_raw_upload")
    rng = res["summary"].get(format_size(256 << 20), {}).get("remote_vs_raw_upload_range")
    return {"pccheck_zero_steps_lost": all(t["steps_lost"] == 0 and t.get("resumed_state_ok") for t in pc),
            "remote_vs_raw_upload_256MiB": ratio, "remote_vs_raw_upload_256MiB_range": rng,
            "remote_within_1.2x_raw_256MiB": None if ratio is None else ratio <= RAW_TARGET}


def report(res: dict[str, Any]) -> None:
    print(f"{'size':>8} {'system':>8} {'->disk s':>9} {'->remote s':>11} {'lost':>8} {'raw up s':>9} {'ratio':>6} "
          f"{'upload alone/raw':>17}")
    for key, row in res["summary"].items():
        for system in ("pccheck", "dcp"):
            r = row[system]
            f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            print(f"{key:>8} {system:>8} {f(r['to_disk_s']):>9} {f(r['to_remote_s']):>11} {str(r['steps_lost']):>8} "
                  f"{f(row['raw_upload_s']) if system == 'pccheck' else '':>9} "
                  f"{f(row['remote_vs_raw_upload']) if system == 'pccheck' else '':>6} "
                  f"{f(row.get('upload_alone_vs_raw_upload')) if system == 'pccheck' else '':>17}")
    for key, row in res["summary"].items():
        r, rr, raw = row["remote_vs_raw_upload"], row.get("remote_vs_raw_upload_range"), row.get("raw_upload_s_range")
        if r is None:
            continue
        print(f"{key}: notice -> remote commit / raw client upload of the same bytes (same run): {r:.2f}x, the "
              f"median of {row['pccheck']['trials']} trials (range {rr[0]:.2f}-{rr[1]:.2f}x); raw upload "
              f"{row['raw_upload_s']:.2f} s, the median of {row['raw_uploads']} (range {raw[0]:.2f}-{raw[1]:.2f} s); "
              f"target <= {RAW_TARGET}x")
    print(json.dumps(res["targets"]))


def plot(res: dict[str, Any], path: Path) -> None:
    """Signal -> durable on disk and -> committed on the remote, per size and system (medians)."""
    series = {}
    for key, row in res["summary"].items():
        series[f"pccheck {key}"] = [row["pccheck"]["to_disk_s"] or 0.0, row["pccheck"]["to_remote_s"] or 0.0,
                                    row["raw_upload_s"] or 0.0]
        series[f"DCP (local disk) {key}"] = [row["dcp"]["to_disk_s"] or 0.0, 0.0, 0.0]
    bar_chart(path, ["signal -> durable on disk", "signal -> committed on remote", "raw boto3 upload"], series,
              title="SIGTERM at a random point of a step; SeaweedFS on loopback, 2 vCPUs (DCP: local disk only)",
              ylabel="seconds (median of trials)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=parse_size_list, default=parse_size_list("256MiB,1GiB"))
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--iter-time", type=float, default=0.05)
    ap.add_argument("--raw-repeat", type=int, default=3)
    ap.add_argument("--raw-sizes", type=parse_size_list, default=parse_size_list("256MiB"),
                    help="the sizes the raw client uploads (the 1.2x target is for 256 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--after", type=int, default=2, help="the SIGTERM comes 2-8 steps after this many disk "
                                                         "checkpoints (every 50 steps)")
    ap.add_argument("--out", default=str(result_path("preempt")))
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    res = run(a)
    res["targets"] = targets(res)
    res.update({"command": "python -m bench.preempt " + " ".join(argv if argv is not None else sys.argv[1:]),
                "gpu": "EMULATED (sleep iter_time per step)", "grace_s": a.grace, "iter_time": a.iter_time,
                "every": EVERY, "after": a.after, "wall_s": time.monotonic() - t0, "host": host_info(tempfile.gettempdir())})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    plot(res, out.with_suffix(".png"))
    report(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
