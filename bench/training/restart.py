"""The cost of a preemption: process start to the first training step after a SIGKILL, per system.

Run::

    python -m bench.restart [--size 1GiB] [--repeats 3] [--systems pccheck_eager,pccheck_lazy,...]
                            [--iter-time 0.05] [--interval 10] [--iters 50] [--blocks 8]
                            [--cache fadvise|drop_caches] [--first-after 1] [--json bench/results/restart/latest.json]
                            [--model bench|client] [--threads N] [--dir bench/_scratch] [--quick]

The ReLU MLP setting (1 GiB, Linear(3342, 3342) + LayerNorm + ReLU blocks, one torch thread,
the first checkpoint 10 steps after the restart, 60 steps in all)::

    python -m bench.restart --systems pccheck_eager,pccheck_eager_build_first,pccheck_lazy_build_first \
        --model mlp_relu --threads 1 --first-after 10 --iters 50 --repeats 5

The workload (:mod:`bench.training.restart_child`): ``--blocks`` x (Linear(d, d) + LayerNorm(d)) with fused
AdamW, ``--size`` of state in all (the parameters a third of it). **The GPU is emulated**: an
iteration is the real forward of every block on a small batch, a sleep of ``--iter-time`` (the
backward on the GPU), then ``AdamW.step()`` over all of the state.

Systems (how each one loads; the checkpoints are written by :mod:`bench.harness.systems`' savers):

``pccheck_eager``  ``pccheck.load_latest(dir, model=, optimizer=)``; saver ``pccheck_N2``
                   (``Checkpointer(model, optimizer, interval=...)``, N = 2, 2 writers, 64 MiB chunks).
``pccheck_lazy``   the same with ``lazy=True``: it returns once the metadata is read and the first
                   step runs while tensors load (``r.wait()`` after the first step). A pccheck
                   without ``lazy`` makes it fail (TypeError); the run goes on without it.
``pccheck_eager_build_first``, ``pccheck_lazy_build_first``: the same two in the other order:
                   the restart builds the ``Checkpointer`` (phase ``setup``), THEN loads.
``torch_load``     ``torch.load(weights_only=True)`` + ``load_state_dict``; saver ``torch_save``.
``dcp``            ``torch.distributed.checkpoint.load`` (no process group) into fresh tensors +
                   ``load_state_dict``; saver ``dcp_async`` (``async_save``).
``safetensors``    ``safetensors.torch.load_file`` of the model's and the optimizer's tensors
                   (flattened as :meth:`bench.harness.workloads.Workload.tensors` names them) + ``load_state_dict``;
                   saver: synchronous ``save_file``.

Method, per repeat and system (round-robin, so drift hits every system alike): a *training* child
checkpoints every ``--interval`` steps; once the checkpoint of step ``interval`` is durable it trains
on, and is SIGKILLed half an interval later (no save of any system in progress). Then the page cache
of the checkpoint is made cold (``--cache``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on every file of
the checkpoint directory after ``sync``, or ``sync`` + ``echo 3 > /proc/sys/vm/drop_caches``, which
also evicts the Python libraries, so the imports are cold too; the result says which was used). A
*restart* child is started and timed from the spawn (the parent's wall clock) to the first completed
step, in phases: ``start`` (interpreter start-up), ``imports`` (torch, the system's library, bench),
``build`` (model, gradients, optimizer), ``load``, ``setup`` (pccheck: ``Checkpointer`` construction
on the reopened store; peers: their saver, next to nothing), ``first_step``; then
``first_checkpoint``: a checkpoint taken right after the first step (``--first-after N``: after N
steps, e.g. the interval, where a training loop takes it), the time it blocked training
(the call's wall time, plus pccheck's ``cow_wait_s``, which falls in the next step; pccheck's own
account, ``stall_s + prepare_s + blocked_copy_s + cow_wait_s`` from ``ck.stats()``, is beside it as
``stats_block_s``: it leaves out what the call spends opening the store; beside it, pccheck's
``backpressure_s`` and whether the chunk pool was faulted in when the call began,
``pool_ready_at_first`` from ``Checkpointer.wait_ready(0)``, and if not, ``pool_ready_after_s``). Then it trains
``--iters`` steps with checkpoints every ``--interval`` steps: the it/s after a restart. A *fresh*
child does the same without a load into an empty directory: the it/s of a fresh start. Reported:
medians over ``--repeats``. Before each timed child the run waits (up to ``--quiet-wait`` s) until
other processes use < 0.25 CPUs; ``other_cpus`` is the load they put on the machine while it ran.

Writes ``--json`` (default ``bench/results/restart/latest.json``; ``--quick``: ``quick.json``; the
command inside), a PNG beside it (stacked phases per system; it/s after a restart and a fresh start),
and prints a table. ``--quick``: 64 MiB, 1 repeat (a smoke run; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import fmt, format_size, host_info, machine_label, median_or_none, parse_size, \
    pccheck_path_first, print_ratio_targets, print_table, pyplot, save_figure, scratch_dir, write_json
from bench.harness.probes import NOISY_OTHER_CPUS, cpu_busy_s, wait_quiet, write_proc
from bench.training.restart_child import PHASES, SAVERS, SYSTEMS, state_bytes
from bench.harness.systems import COLORS

__all__ = ["SYSTEMS", "PHASES", "Config", "child_spec", "train_and_kill", "make_cold", "run_child", "measure",
           "run", "report", "plot", "main"]

_BENCH_DIR = BENCH_DIR
_CHILD = Path(__file__).resolve().with_name("restart_child.py")
PHASE_LABELS = {"start": "python start", "imports": "imports", "build": "model build", "load": "load",
                "setup": "checkpointer", "first_step": "first step", "first_checkpoint": "1st ckpt block"}
PHASE_COLORS = {"start": "#c7c7c7", "imports": "#7f7f7f", "build": "#bcbd22", "load": "#1f77b4",
                "setup": "#9467bd", "first_step": "#2ca02c", "first_checkpoint": "#d62728"}
TARGET = ("pccheck_lazy", "torch_load", 0.25)  # process start -> first step: lazy <= 0.25x torch.load's
FIRST_CHECKPOINT_LIMIT = 1.5  # first checkpoint after a restart: blocks <= 1.5x the steady-state median


@dataclasses.dataclass(frozen=True)
class Config:
    """What every child of one run is given."""

    nbytes: int
    blocks: int = 8
    batch: int = 8
    iter_time: float = 0.05
    interval: int = 10
    iters: int = 50
    cache: str = "fadvise"
    timeout_s: float = 600.0
    quiet_wait_s: float = 30.0
    first_after: int = 1
    model: str = "bench"
    threads: int | None = None


# -- the children ----------------------------------------------------------------------------------------

def child_spec(role: str, system: str, workdir: Path, cfg: Config) -> dict[str, Any]:
    """The JSON object a child of ``role`` (train, restart, fresh) is started with."""
    return {"role": role, "system": system, "dir": str(workdir), "nbytes": cfg.nbytes, "blocks": cfg.blocks,
            "batch": cfg.batch, "iter_time": cfg.iter_time, "interval": cfg.interval, "iters": cfg.iters,
            "first_after": cfg.first_after, "model": cfg.model, "threads": cfg.threads,
            "path_first": pccheck_path_first(), "root": str(_BENCH_DIR.parent)}


def _spawn(spec: dict[str, Any], **kw: Any) -> subprocess.Popen:
    spec = {**spec, "spawn_wall": time.time()}  # the restart's clock starts here
    return subprocess.Popen([sys.executable, str(_CHILD), json.dumps(spec)], text=True, **kw)


def _tail(text: str, n: int = 1500) -> str:
    return text.strip()[-n:]


def train_and_kill(system: str, workdir: Path, cfg: Config) -> int:
    """Run the training child until the checkpoint of step ``interval`` is durable and half an
    interval more, then SIGKILL it; return the step of that checkpoint."""
    proc = _spawn(child_spec("train", system, workdir, cfg), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(cfg.timeout_s, proc.kill)
    watchdog.start()
    ready, kill_at = None, None
    try:
        for line in proc.stdout or ():
            word, _, num = line.partition(" ")
            if word == "ready":
                ready = int(num)
                kill_at = ready + max(1, cfg.interval // 2)
            elif word == "step" and kill_at is not None and int(num) >= kill_at:
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    if ready is None:
        raise RuntimeError(f"the training run of {system} ended before its first checkpoint "
                           f"(status {proc.returncode}): {_tail(err)}")
    return ready


def make_cold(workdir: Path, method: str) -> str:
    """Evict the checkpoint under ``workdir`` from the page cache; return the method that worked:
    ``drop_caches`` (asked for and permitted) or ``fadvise`` (POSIX_FADV_DONTNEED on every file)."""
    os.sync()
    if method == "drop_caches" and write_proc("/proc/sys/vm/drop_caches", "3\n"):
        return "drop_caches"
    for path in workdir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_child(spec: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """Run a ``restart`` or ``fresh`` child to its end; its JSON result, with ``other_cpus`` (the CPUs
    other processes kept busy meanwhile) or ``error``. First waits (up to ``quiet_wait_s``) for the
    rest of the machine to go quiet."""
    if cfg.quiet_wait_s > 0:
        wait_quiet(cfg.quiet_wait_s)
    busy0, cpu0, t0 = cpu_busy_s(), _children_cpu_s(), time.perf_counter()
    proc = _spawn(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=cfg.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"no result within {cfg.timeout_s:g} s: {_tail(err)}"}
    wall = time.perf_counter() - t0
    other = max(0.0, (cpu_busy_s() - busy0) - (_children_cpu_s() - cpu0)) / wall
    lines = out.strip().splitlines()
    try:
        res = json.loads(lines[-1]) if lines else {"error": "no output"}
    except json.JSONDecodeError:
        res = {"error": f"unreadable output: {_tail(out, 300)}"}
    if "error" in res and err.strip():
        res["stderr"] = _tail(err)
    return {**res, "other_cpus": round(other, 3)}


def measure(system: str, workdir: Path, cfg: Config) -> dict[str, Any]:
    """One repeat of one system: train and kill, make the checkpoint cold, restart, fresh start."""
    ckpt, fresh = workdir / "ckpt", workdir / "fresh"
    ready = train_and_kill(system, ckpt, cfg)
    cache = make_cold(ckpt, cfg.cache)
    restart = run_child(child_spec("restart", system, ckpt, cfg), cfg)
    if "error" in restart:
        return {"error": restart["error"], "restart": restart}
    if restart["loaded_step"] != ready:
        return {"error": f"loaded step {restart['loaded_step']}, the newest durable one was {ready}",
                "restart": restart}
    out = {"cache": cache, "durable_step": ready, "restart": restart,
           "fresh": run_child(child_spec("fresh", system, fresh, cfg), cfg)}
    return {**out, "error": out["fresh"]["error"]} if "error" in out["fresh"] else out


# -- the run and its summary --------------------------------------------------------------------------------

def _summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one system."""
    def med(get: Callable[[Mapping[str, Any]], float | None]) -> float | None:
        return median_or_none([x for x in (get(r) for r in runs) if x is not None])

    out: dict[str, Any] = {"phases_s": {p: med(lambda r, p=p: r["restart"]["phases"][p]) for p in PHASES}}
    out["to_first_step_s"] = med(lambda r: r["restart"]["to_first_step_s"])
    out["first_checkpoint_call_s"] = med(lambda r: r["restart"]["first_checkpoint"]["call_s"])
    out["first_checkpoint_stats_s"] = med(lambda r: r["restart"]["first_checkpoint"].get("stats_block_s"))
    out["steady_block_s"] = med(lambda r: r["restart"]["first_checkpoint"].get("steady_block_s"))
    first, steady = out["phases_s"]["first_checkpoint"], out["steady_block_s"]
    out["first_vs_steady_block"] = first / steady if first is not None and steady else None
    fcs = [r["restart"]["first_checkpoint"] for r in runs]
    out["first_vs_steady_runs"] = [f["block_s"] / f["steady_block_s"] if f.get("steady_block_s") else None
                                   for f in fcs]
    out["first_backpressure_s"] = med(lambda r: r["restart"]["first_checkpoint"].get("backpressure_s"))
    # pccheck: how many repeats found the chunk pool faulted in when the first checkpoint began
    out["pool_ready_at_first"] = sum(1 for f in fcs if f.get("pool_ready_at_first"))
    out["it_s_restart"] = med(lambda r: r["restart"]["it_s"])
    out["it_s_fresh"] = med(lambda r: r["fresh"]["it_s"])
    out["fresh_to_first_step_s"] = med(lambda r: r["fresh"]["to_first_step_s"])
    out["fresh_first_checkpoint_s"] = med(lambda r: r["fresh"]["phases"]["first_checkpoint"])
    out["restart_vs_fresh_it_s"] = (out["it_s_restart"] / out["it_s_fresh"]
                                    if out["it_s_restart"] and out["it_s_fresh"] else None)
    out["max_other_cpus"] = max(r[k]["other_cpus"] for r in runs for k in ("restart", "fresh"))
    return out


def _targets(systems: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The targets: process start -> first step, pccheck lazy <= 0.25x the torch.load path;
    the first checkpoint after a restart blocks <= 1.5x the steady-state median (each pccheck)."""
    def summary(s: str) -> Mapping[str, Any]:
        return systems.get(s, {}).get("summary", {})

    def target(what: str, value: float | None, limit: float) -> dict[str, Any]:
        return {"what": what, "limit": limit, "value": value, "met": None if value is None else value <= limit}

    mine, peer, limit = TARGET
    a, b = (summary(s).get("to_first_step_s") for s in (mine, peer))
    out = [target(f"process start -> first step after SIGKILL: {mine} / {peer}", a / b if a and b else None, limit)]
    for s in systems:
        if s.startswith("pccheck"):
            out.append(target(f"{s}: first checkpoint after a restart blocks / steady-state median block",
                              summary(s).get("first_vs_steady_block"), FIRST_CHECKPOINT_LIMIT))
    return out


def run(cfg: Config, systems: Sequence[str], repeats: int, base_dir: Path,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every system ``repeats`` times, round-robin; a system that fails is reported and left out of
    the later repeats."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    errors: dict[str, dict[str, Any]] = {}
    with scratch_dir(base_dir) as work:
        host = host_info(work)
        for rep in range(repeats):
            for system in [s for s in systems if s not in errors]:
                progress(f"restart: {system} {rep + 1}/{repeats}")
                with scratch_dir(work) as d:
                    try:
                        r = measure(system, d, cfg)
                    except RuntimeError as exc:
                        r = {"error": str(exc)}
                if "error" in r:
                    errors[system] = r
                    progress(f"restart: {system} FAILED: {r['error']}")
                else:
                    runs[system].append(r)
    results = {s: ({"failed": errors[s]} if s in errors else {"summary": _summary(runs[s]), "runs": runs[s]})
               for s in systems}
    caches = sorted({r["cache"] for rs in runs.values() for r in rs})
    return {
        "benchmark": "bench.restart", "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine_label(host), "host": host, "config": dataclasses.asdict(cfg),
        "state_bytes": state_bytes(cfg.nbytes, cfg.blocks, cfg.model),
        "repeats": repeats, "savers": {s: SAVERS[s] for s in systems},
        "cache": ", ".join(caches) or "-", "results": results, "targets": _targets(results),
        "versions": next((r["restart"]["versions"] for rs in runs.values() for r in rs), {}),
    }


# -- output -------------------------------------------------------------------------------------------------

_HEADERS = ["system", *(PHASE_LABELS[p] for p in PHASES[:-1]), "to first step", "vs torch_load",
            PHASE_LABELS["first_checkpoint"], "(pccheck stats)", "steady block", "it/s restart", "it/s fresh", "restart/fresh"]


def _row(name: str, r: Mapping[str, Any], base: float | None) -> list[str]:
    if "failed" in r:
        return [name, "FAILED: " + r["failed"]["error"][:70], *[""] * (len(_HEADERS) - 2)]
    s = r["summary"]
    rel = s["to_first_step_s"] / base if base else None
    return [name, *(fmt(s["phases_s"][p], ".2f") for p in PHASES[:-1]), fmt(s["to_first_step_s"], ".2f"),
            fmt(rel, ".2f") + ("x" if rel else ""), fmt(s["phases_s"]["first_checkpoint"], ".3f"),
            fmt(s["first_checkpoint_stats_s"], ".3f"), fmt(s["steady_block_s"], ".3f"),
            fmt(s["it_s_restart"], ".2f"), fmt(s["it_s_fresh"], ".2f"), fmt(s["restart_vs_fresh_it_s"], ".2f")]


def report(result: Mapping[str, Any]) -> None:
    """The table (seconds, medians) and the target."""
    res = result["results"]
    base = res.get("torch_load", {}).get("summary", {}).get("to_first_step_s")
    cfg = result["config"]
    print_table(f"restart after SIGKILL: {format_size(result['state_bytes'])} state, cache {result['cache']}, "
                f"median of {result['repeats']}, seconds ({result['machine']})",
                _HEADERS, [_row(n, r, base) for n, r in res.items()])
    print(f"it/s: {cfg['iters']} iterations after the first step, a checkpoint every {cfg['interval']}; "
          f"emulated GPU time {cfg['iter_time'] * 1e3:g} ms per iteration")
    noisy = [f"{n} ({r['summary']['max_other_cpus']:.2f})" for n, r in res.items()
             if "summary" in r and r["summary"]["max_other_cpus"] > NOISY_OTHER_CPUS]
    if noisy:
        print(f"noisy: other processes kept more than {NOISY_OTHER_CPUS} CPUs busy while timing: "
              + ", ".join(noisy))
    print_ratio_targets(result["targets"])


def plot(path: Path, result: Mapping[str, Any]) -> bool:
    """Stacked phases per system (left); it/s after a restart and a fresh start (right)."""
    plt = pyplot(path)
    ok = {n: r["summary"] for n, r in result["results"].items() if "summary" in r}
    if plt is None or not ok:
        return False
    names = list(ok)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    bottom = [0.0] * len(names)
    for p in PHASES:
        vals = [ok[n]["phases_s"][p] or 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, color=PHASE_COLORS[p], label=PHASE_LABELS[p])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, n in enumerate(names):
        ax.annotate(f"{ok[n]['to_first_step_s']:.2f} s to step 1", (i, bottom[i]), ha="center",
                    va="bottom", fontsize=7)
    ax.set_ylabel("seconds (median), lower is better")
    ax.set_title(f"Process start -> first step after SIGKILL, then the first checkpoint's blocking time\n"
                 f"{format_size(result['state_bytes'])} state, {result['cache']} cache; {result['machine']}",
                 fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    xs = range(len(names))
    for off, key, label in ((-0.2, "it_s_restart", "after a restart"), (0.2, "it_s_fresh", "fresh start")):
        ax2.bar([x + off for x in xs], [ok[n][key] or 0.0 for n in names], 0.4, label=label,
                color=[COLORS.get(SAVERS[n], "grey") for n in names], alpha=1.0 if off < 0 else 0.45)
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel(f"it/s over {result['config']['iters']} iterations")
    ax2.set_title("it/s after a restart (solid) vs a fresh start (light)", fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    for a in (ax, ax2):
        a.tick_params(axis="x", labelsize=7, rotation=20)
    save_figure(fig, path)
    return True


# -- command line ---------------------------------------------------------------------------------------------

def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.restart", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default=None, help="model + AdamW state (default 1GiB; 64MiB with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="runs per system, medians reported (default 3; quick 1)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ",".join(SYSTEMS))
    p.add_argument("--iter-time", type=float, default=0.05, help="emulated GPU time per iteration, s (default 0.05)")
    p.add_argument("--interval", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument("--iters", type=int, default=50, help="iterations timed after the first step (default 50)")
    p.add_argument("--blocks", type=int, default=8, help="Linear + LayerNorm blocks (default 8)")
    p.add_argument("--cache", choices=("fadvise", "drop_caches"), default="fadvise",
                   help="how the checkpoint is made cold: POSIX_FADV_DONTNEED on its files, or drop_caches "
                        "(root; evicts the libraries too; falls back to fadvise) (default: %(default)s)")
    p.add_argument("--quiet-wait", type=float, default=None,
                   help="before each timed child wait up to this many seconds for the rest of the machine to use "
                        f"< {NOISY_OTHER_CPUS} CPUs (0: do not wait; default 30; quick 5)")
    p.add_argument("--first-after", type=int, default=1,
                   help="steps after the restart at which the first checkpoint is taken (default 1: right after "
                        "the first step; the interval: where a training loop would take it)")
    p.add_argument("--model", choices=("bench", "mlp_relu"), default="bench",
                   help="bench: Linear + LayerNorm blocks; client: + ReLU, d solved for d^2 + 3d (3342 at 1 GiB in 8 "
                        "blocks) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads in every child (the ReLU MLP setting: 1; default: torch's own)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one child may take (default 600)")
    p.add_argument("--json", type=Path, default=None,
                   help="result JSON, the PNG beside it (default bench/results/restart/latest.json; quick: quick.json)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch",
                   help="scratch directory on the disk under test; removed afterwards (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="64MiB, 1 repeat: a smoke run")
    a = p.parse_args(argv)
    a.size = parse_size(a.size or ("64MiB" if a.quick else "1GiB"))
    a.repeats = a.repeats or (1 if a.quick else 3)
    a.quiet_wait = (5.0 if a.quick else 30.0) if a.quiet_wait is None else a.quiet_wait
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if not a.systems or set(a.systems) - set(SYSTEMS):
        p.error(f"unknown systems; choose from {','.join(SYSTEMS)}")
    if a.json is None:
        a.json = result_path("restart", quick=a.quick)
    if min(a.repeats, a.interval, a.iters, a.blocks, a.first_after) < 1 or a.iter_time < 0:
        p.error("--repeats, --interval, --iters, --blocks and --first-after must be >= 1, --iter-time >= 0")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    args = list(sys.argv[1:] if argv is None else argv)
    a = _parse_args(args)
    cfg = Config(nbytes=a.size, blocks=a.blocks, iter_time=a.iter_time, interval=a.interval, iters=a.iters,
                 cache=a.cache, timeout_s=a.timeout, quiet_wait_s=a.quiet_wait, first_after=a.first_after,
                 model=a.model, threads=a.threads)
    t0 = time.perf_counter()
    res = {"command": shlex.join(["python", "-m", "bench.restart", *args]),
           **run(cfg, a.systems, a.repeats, a.dir)}
    res["runtime_s"] = time.perf_counter() - t0
    report(res)
    write_json(a.json, res)
    wrote = [a.json]
    if plot(a.json.with_suffix(".png"), res):
        wrote.append(a.json.with_suffix(".png"))
    print("wrote " + ", ".join(map(str, wrote)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
