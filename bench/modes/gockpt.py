"""GoCkpt mode (``spread_steps``) against one-step soft copy-on-write and DCP, over an emulated slow link.

``python -m bench.gockpt [--size 256MiB] [--iter-time 0.05] [--ratio 4] [--spread auto|k]``

**The GPU is emulated.** An iteration sleeps ``--iter-time`` t (the forward and backward, the window
a copy can hide in), then runs ``torch.optim.AdamW.step()`` on the CPU over ``--size`` S of state
(parameters + both moments, 16 tensors; the gradients are set once). The device-to-host link is
emulated by pccheck's ``ThrottledCopyEngine`` at B = S / (ratio * t) bytes/s, so a snapshot needs
``--ratio`` (>= 3) iterations to cross it; a spread checkpoint's part copies and gradient captures
go through the same link. Systems, each in a fresh process state (a new model) and store:

- ``none``: no checkpoints (the baseline);
- ``pccheck_k1``: ``Checkpointer(..., copy_engine=ThrottledCopyEngine(B))``: the whole snapshot in
  one step (the paper's Async-O analog);
- ``pccheck_spread``: the same with ``spread_steps=--spread``;
- ``dcp_async``: ``dcp.async_save`` of the same state (its staging is a CPU copy: not held to B);
- ``replay_floor``: no checkpoint, only the CPU work of a spread's replay beside the loop: from
  each checkpoint call on, a thread at the replay's priority (``pccheck.spread.driver.REPLAY_NICE``)
  runs step j of k (``--floor-k``; the fixed ``--spread`` if given) over j/k of a CPU copy of the
  state, one step per iteration as the captured steps arrive. What it costs the loop is the floor
  of any spread on this host: the replay re-runs (k+1)/2 whole-state optimizer steps per checkpoint.

Per system, triples of cycles of ``--interval`` c iterations, in one process: A begins a
checkpoint (its call timed), B runs on while the checkpoint's background work ends (whatever
outlives B is waited for, timed: replay, copy, write), C is clean. Checkpointing every c
iterations, each interval holds one checkpoint's A-part and the previous one's B-part, so the
loop pays (A - C) + (B - C) per checkpoint: slowdown = median over the triples of (A + B - C) / C.
``--checkpoints`` timed triples follow one untimed (its checkpoint sizes the store, and "auto"
decides k from it). Measuring within one process cancels this VM's drift (its CPU optimizer step
swings by 30% between processes); ``none``'s triples give the noise floor. Stall per
checkpoint = what the training thread waited for it (``ck.stats()``: the call, the optimizer pre-hook's
waits and gradient captures), against ``pccheck.spread.plan``'s models at the configured B, t, S,
gradient bytes and the clean cycles' optimizer step time: ``stall_overlapped`` (pccheck copies the
gradients beside the step) and the paper's ``stall`` (gradient transfers stop training).
Repeats are interleaved (every system once per round); medians are reported. ``--hog N`` runs N
busy-looping processes beside the whole run (a noisy neighbour on this machine's CPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import fmt, format_size, host_info, machine_label, parse_size, pccheck_path_first, print_table, \
    pyplot, save_figure, scratch_dir, write_json
from bench.harness.probes import thread_times, wait_quiet

SYSTEMS = ("none", "pccheck_k1", "pccheck_spread", "dcp_async", "replay_floor")
N_PARAMS = 16
_BENCH_DIR = BENCH_DIR


def make_workload(nbytes: int, iter_time: float) -> tuple[Any, Any, Any]:
    """(model, AdamW, step): parameters + AdamW's two moments hold ``nbytes``."""
    import torch

    elems = max(N_PARAMS, nbytes // 12)
    model = torch.nn.Module()
    model.params = torch.nn.ParameterList([torch.nn.Parameter(torch.full((elems // N_PARAMS,), 0.5))
                                           for _ in range(N_PARAMS)])
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # AdamW's state exists from here on

    def step() -> None:
        time.sleep(iter_time)  # the emulated forward/backward: the window a copy hides in
        opt.step()
    return model, opt, step


def _make_system(system: str, cfg: dict[str, Any], model: Any, opt: Any, step: Any,
                 workdir: Path) -> tuple[Any, Any, Any, Any]:
    """(Checkpointer or None, DCP saver or None, the per-iteration call, the drain) of a system,
    checkpointing every third cycle (see run_system)."""
    cycle = cfg["interval"]
    if system.startswith("pccheck"):
        import pccheck
        from pccheck.orchestrator.copy_engine import ThrottledCopyEngine

        spread = cfg["spread"] if system == "pccheck_spread" else 1
        ck = pccheck.Checkpointer(model, opt, path=workdir, interval=3 * cycle, max_concurrent=2,
                                  copy_engine=ThrottledCopyEngine(cfg["link_bps"]), spread_steps=spread)
        return ck, None, ck.maybe_checkpoint, ck.wait
    if system == "dcp_async":
        from bench.harness.systems import make_loop_system
        from bench.harness.workloads import Workload

        saver = make_loop_system("dcp_async", Workload("gockpt", model, opt, step, ""), workdir, 3 * cycle, None)
        return None, saver, saver.after_step, saver.drain
    if system == "replay_floor":
        floor = ReplayFloor(opt, cfg["floor_k"], 3 * cycle)
        return None, None, floor.call, floor.drain

    def call(s: int) -> bool:
        return False
    return None, None, call, None


def run_system(system: str, cfg: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One system: a warm-up triple of cycles, then ``checkpoints`` timed triples (the module doc)."""
    import torch

    torch.set_num_threads(1)
    model, opt, step = make_workload(cfg["nbytes"], cfg["iter_time"])
    cycle, triples = cfg["interval"], cfg["checkpoints"]
    ck, saver, call, drain = _make_system(system, cfg, model, opt, step, workdir)

    def run_cycle(first: int, begins: bool = False, drains: bool = False) -> float:
        """Seconds of steps first .. first+cycle-1 and their calls (the last step's call is left to
        the next cycle). ``begins``: step first-1's call, which begins a checkpoint, is timed here;
        ``drains``: everything of it is waited for at the end, timed."""
        t0 = time.perf_counter()
        if begins:
            call(first - 1)
        for s in range(first, first + cycle - 1):
            step()
            call(s)
        step()
        if drains and drain is not None:
            drain()
        return time.perf_counter() - t0

    # Triples of cycles: A begins a checkpoint, B runs on while its background work ends (what
    # outlives B is waited for and timed), C is clean. Run every c iterations, each interval
    # holds one checkpoint's A-part and the previous one's B-part: per checkpoint the loop pays
    # (A - C) + (B - C), so the slowdown is (A + B - C) / C, measured within one process.
    s = 0
    for _ in range(3 * cycle - 1):  # up to the step before the first checkpoint
        s += 1
        step()
        call(s)
    s += 1
    step()
    ratios, deltas, cycles = [], [], []
    cpu0 = wall0 = None
    for i in range(triples + 1):    # triple 0: the warm-up ("auto" measures B and t from its checkpoint)
        if i == 1:  # the timed triples' CPU time by thread, from here
            cpu0, wall0 = thread_cpu(), time.perf_counter()
        t_a = run_cycle(s + 1, begins=True)
        s += cycle
        call(s)
        t_b = run_cycle(s + 1, drains=True)
        s += cycle
        call(s)
        t_c = run_cycle(s + 1)
        s += cycle
        if i:
            ratios.append((t_a + t_b - t_c) / t_c)
            deltas.append(t_a + t_b - 2 * t_c)
            cycles.append([t_a, t_b, t_c])
    out: dict[str, Any] = {"ratios": ratios, "deltas_s": deltas, "cycles_s": cycles, "iters_per_cycle": cycle}
    if cpu0 is not None:
        out.update(cpu_breakdown(cpu0, thread_cpu(), time.perf_counter() - wall0, 3 * cycle * triples * cfg["iter_time"]))
    if ck is not None:
        ck.wait()
        stats = ck.stats().as_dict()["checkpoints"][1:]  # the warm-up's first checkpoint left out
        out.update({"spread_steps": [c["spread_steps"] for c in stats],
                    "blocked_s": [c["stall_s"] + c["prepare_s"] + c["blocked_copy_s"] + c["cow_wait_s"] for c in stats],
                    "grad_bytes": [c["grad_bytes"] for c in stats], "replay_s": [c["replay_s"] for c in stats],
                    "outcomes": [c["outcome"] for c in stats],
                    # the copy alone (a one-step checkpoint's: permit wait and preparation left out)
                    "copy_wall_s": [c["copied_s"] - c["prepare_s"] - c["stall_s"] for c in stats],
                    "replay_cpu_s": [c["replay_cpu_s"] for c in stats],
                    "spread_waits": [c["spread_waits"] for c in stats],
                    "decisions": [c["spread_decision"] for c in stats]})
        ck.close()
    elif saver is not None:
        saver.drain()
        saver.close()
    return out


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of every thread of this process, by thread: its Python name with
    the trailing pool index cut ("pccheck-spread-copy_1" -> "pccheck-spread-copy"), the main
    thread as "training", threads Python does not know (native, the hog is another process) as
    "native" (bench.harness.probes.thread_times)."""
    import re
    import threading

    names = {t.native_id: ("training" if t is threading.main_thread() else re.sub(r"[_-]?\d+$", "", t.name))
             for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid, _, cpu, _ in thread_times():
        name = names.get(tid, "native")
        out[name] = out.get(name, 0.0) + cpu
    return out


def cpu_breakdown(before: dict[str, float], after: dict[str, float], wall: float, slept: float) -> dict[str, Any]:
    """Where the timed triples' time went: CPU seconds by thread group over ``wall`` seconds, and
    the training thread's off-CPU time beyond its ``slept`` seconds of emulated forward/backward
    (waiting for a CPU, or for the checkpoint: ``blocked_s`` says how much of it was the latter).
    Threads that ended inside the window are missing from ``after`` (their share is lost)."""
    cpu = {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after)}
    return {"thread_cpu_s": cpu, "timed_wall_s": wall,
            "training_off_cpu_s": wall - cpu.get("training", 0.0) - slept}


def child_main(spec: dict[str, Any]) -> int:
    print(json.dumps(run_system(spec["system"], spec["cfg"], Path(spec["dir"]))), flush=True)
    return 0


# A child loads the parent's pccheck (the checkout's or the installed one), then bench from the checkout.
_CHILD_BOOT = ("import json, sys; spec = json.loads(sys.argv[1]); sys.path[:1] = spec['path_first']; "
               "sys.path.append(spec['root']); from bench.modes.gockpt import child_main; sys.exit(child_main(spec))")


class ReplayFloor:
    """``replay_floor``'s calls (the module doc): a shadow AdamW (:attr:`optimizer`) over clones of
    ``opt``'s parameters, state and gradients; each call at a multiple of ``every`` starts a replay
    of k steps, every later call lets one more step run (step j updates the first j/k parameters:
    the others' gradients are None, so AdamW leaves them out)."""

    def __init__(self, opt: Any, k: int, every: int) -> None:
        import threading

        import torch

        live = [p for g in opt.param_groups for p in g["params"]]
        self.shadow = [torch.nn.Parameter(p.detach().clone()) for p in live]
        self.grads = [p.grad.detach().clone() for p in live]
        self.optimizer = torch.optim.AdamW(self.shadow, lr=opt.defaults["lr"])  # as make_workload's
        for sp, p in zip(self.shadow, live):
            self.optimizer.state[sp] = {name: t.clone() for name, t in opt.state[p].items()}
        self.k, self.every = k, every
        self._arrived = threading.Semaphore(0)
        self._worker: threading.Thread | None = None

    def _replay(self) -> None:
        import os
        import threading

        from pccheck.spread.driver import REPLAY_NICE

        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(REPLAY_NICE, os.getpriority(os.PRIO_PROCESS, tid)))
        for j in range(1, self.k + 1):
            self._arrived.acquire()
            n = round(j * len(self.shadow) / self.k)
            for i, sp in enumerate(self.shadow):
                sp.grad = self.grads[i] if i < n else None
            self.optimizer.step()

    def call(self, s: int) -> bool:
        import threading

        if self._worker is not None and self._worker.is_alive():
            self._arrived.release()  # one more captured step arrives
        elif s % self.every == 0:
            self._worker = threading.Thread(target=self._replay, daemon=True)
            self._worker.start()
        return False

    def drain(self) -> None:
        if self._worker is not None:
            for _ in range(self.k):
                self._arrived.release()
            self._worker.join()
            self._worker = None
            while self._arrived.acquire(blocking=False):
                pass


def run(cfg: dict[str, Any], systems: Sequence[str], repeats: int, base: Path) -> dict[str, Any]:
    import subprocess

    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    # --hog: busy-looping processes beside every run (a noisy neighbour), stopped at the end
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cfg.get("hogs", 0))]
    try:
        host = _run_all(cfg, systems, repeats, base, runs)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return {"benchmark": "bench.gockpt", "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine_label(host),
            "host": host, "config": cfg, "runs": runs, "summary": summarize(runs, cfg)}


def _run_all(cfg: dict[str, Any], systems: Sequence[str], repeats: int, base: Path,
             runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Every system ``repeats`` times, interleaved, each in a child process; results into ``runs``.
    Returns the host's description."""
    import subprocess

    with scratch_dir(base) as work:
        host = host_info(work)
        for rep in range(repeats):
            for system in systems:
                wait_quiet(cfg["quiet_wait_s"])
                print(f"gockpt: {system} {rep + 1}/{repeats}", flush=True)
                with scratch_dir(work) as d:
                    spec = {"system": system, "cfg": cfg, "dir": str(d / "ck"), "path_first": pccheck_path_first(),
                            "root": str(_BENCH_DIR.parent)}
                    p = subprocess.run([sys.executable, "-c", _CHILD_BOOT, json.dumps(spec)],
                                       capture_output=True, text=True, timeout=cfg["timeout_s"])
                    if p.returncode != 0:
                        raise RuntimeError(f"{system}: {p.stderr[-2000:]}")
                    runs[system].append(json.loads(p.stdout.strip().splitlines()[-1]))
    return host


def summarize(runs: dict[str, list[dict[str, Any]]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Medians per system. The stall per checkpoint is what the training thread waited for it
    (``blocked_s`` of ``ck.stats()``: the call, the pre-hook waits and gradient captures). The loop:
    over every triple, (A + B - C) / C and A + B - 2C (see the module doc); ``none``'s triples show
    the noise floor of that measure."""
    from pccheck.spread.plan import modelled_stall, stall

    def pooled(rs: list[dict[str, Any]], key: str) -> list[float]:
        return [x for r in rs for x in r[key]]

    clean = [c[-1] for r in runs["none"] for c in r["cycles_s"]]
    cycle = runs["none"][0]["iters_per_cycle"]
    step_time = max(0.0, statistics.median(clean) / cycle - cfg["iter_time"])  # the emulated optimizer step
    out: dict[str, Any] = {"none": {"slowdown": statistics.median(pooled(runs["none"], "ratios")),
                                    "loop_stall_s": statistics.median(pooled(runs["none"], "deltas_s")),
                                    "clean_cycle_s": statistics.median(clean), "optimizer_step_s": step_time}}
    out["none"].update(_spread(pooled(runs["none"], "ratios"), [r["ratios"] for r in runs["none"]], "slowdown"))
    for system, rs in runs.items():
        if system == "none":
            continue
        row: dict[str, Any] = {"slowdown": statistics.median(pooled(rs, "ratios")),
                               "loop_stall_s": statistics.median(pooled(rs, "deltas_s")),
                               "slowdown_runs": pooled(rs, "ratios")}
        row.update(_spread(pooled(rs, "ratios"), [r["ratios"] for r in rs], "slowdown"))
        row.update(_cpu_per_checkpoint(rs))
        if system.startswith("pccheck"):
            ks = pooled(rs, "spread_steps")
            k = int(statistics.median(ks))
            args = (cfg["nbytes"], cfg["grad_bytes"], cfg["link_bps"], cfg["iter_time"])
            row.update({"spread_steps": k, "spread_steps_all": ks, "stall_s": statistics.median(pooled(rs, "blocked_s")),
                        "paper_model_s": stall(k, *args),
                        "model_s": modelled_stall(k, *args, step_time),
                        "replay_s": statistics.median(pooled(rs, "replay_s"))})
            row.update(_spread(pooled(rs, "blocked_s"), [r["blocked_s"] for r in rs], "stall"))
            row.update(_measured_model(rs, k, cfg, step_time))
        out[system] = row
    targets = []
    if "pccheck_spread" in out and cfg["spread"] == "auto":
        ks = out["pccheck_spread"]["spread_steps_all"]
        targets.append({"what": f"\"auto\" picks k > 1 at S/(B t) = {cfg['ratio']} (share of checkpoints; "
                                f"k: {min(ks)}-{max(ks)})", "limit": "= 1", "value": sum(k > 1 for k in ks) / len(ks)})
    if "pccheck_spread" in out and "pccheck_k1" in out:
        a, b = out["pccheck_spread"], out["pccheck_k1"]
        per_rep = [x / y for x, y in zip(a["stall_repeat_medians"], b["stall_repeat_medians"]) if y > 0]
        targets.append({"what": "stall per checkpoint, spread / k=1 (per repeat: "
                                f"{min(per_rep):.2f}-{max(per_rep):.2f})", "limit": 0.5,
                        "value": a["stall_s"] / b["stall_s"], "repeats": per_rep})
        for name, r in (("spread", a), ("k=1", b)):
            targets.append({"what": f"measured stall / model at the measured link and window, {name} "
                                    f"(model {r['model_measured_s']:.3f} s)", "limit": "within ±25%",
                            "value": r["stall_s"] / r["model_measured_s"] if r["model_measured_s"] else None})
    if "pccheck_spread" in out:  # the loop itself, against no checkpointing (the spread's loop target)
        limit = 1.10 if cfg["iter_time"] < 0.2 else 1.03
        targets.append({"what": f"loop slowdown with spread_steps, t={cfg['iter_time']} s", "limit": limit,
                        "value": out["pccheck_spread"]["slowdown"]})
    if "replay_floor" in out:  # the replay's CPU alone: no spread on this host can do better
        targets.append({"what": f"loop slowdown of the replay alone (k = {cfg['floor_k']}), the floor of a "
                                f"spread here, t={cfg['iter_time']} s", "limit": 1.10 if cfg["iter_time"] < 0.2 else 1.03,
                        "value": out["replay_floor"]["slowdown"]})
    for t in targets:
        v, lim = t["value"], t["limit"]
        t["met"] = (None if v is None else v <= lim if isinstance(lim, float) else v == 1 if lim == "= 1"
                    else 0.75 <= v <= 1.25)
    out["targets"] = targets
    return out


def _cpu_per_checkpoint(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of each thread group's CPU seconds per timed triple (one
    checkpoint), and of the training thread's off-CPU time per triple (run_system's breakdown)."""
    rs = [r for r in rs if "thread_cpu_s" in r]
    if not rs:
        return {}
    groups = sorted({g for r in rs for g in r["thread_cpu_s"]})
    per = {g: statistics.median(r["thread_cpu_s"].get(g, 0.0) / len(r["ratios"]) for r in rs) for g in groups}
    return {"thread_cpu_per_ckpt_s": per,
            "training_off_cpu_per_ckpt_s": statistics.median(r["training_off_cpu_s"] / len(r["ratios"]) for r in rs)}


def _spread(values: list[float], per_repeat: list[list[float]], name: str) -> dict[str, Any]:
    """The spread of a measure, not only its median: min and max over every checkpoint (or
    triple), and the median of each repeat."""
    meds = [statistics.median(r) for r in per_repeat if r]
    return {f"{name}_min": min(values), f"{name}_max": max(values), f"{name}_repeat_medians": meds}


def _measured_model(rs: list[dict[str, Any]], k: int, cfg: dict[str, Any], step_time: float) -> dict[str, Any]:
    """The stall model fed with what was measured instead of what was configured: the link as
    the copies ran (a spread's: "auto"'s own estimate, its part copies; k = 1: the one-step
    copies' wall time, whose memcpy and thread scheduling the nominal B leaves out) and, where
    "auto" measured it, the window between optimizer steps."""
    from pccheck.spread.plan import modelled_stall

    decided = [d for r in rs for d in r.get("decisions", []) if d and d.get("link_bps")]
    whole = [cfg["nbytes"] / s for r in rs for s, kk in zip(r.get("copy_wall_s", []), r["spread_steps"])
             if kk == 1 and s > 0]
    if k > 1 and decided:
        link = statistics.median(d["link_bps"] for d in decided)
    else:
        link = statistics.median(whole) if whole else cfg["link_bps"]
    window = statistics.median(d["window_s"] for d in decided) if decided else cfg["iter_time"]
    replays = [r_s / ((kk + 1) / 2) for r in rs for r_s, kk in zip(r.get("replay_s", []), r["spread_steps"]) if kk > 1]
    replay = statistics.median(replays) if replays else 0.0
    model = modelled_stall(k, cfg["nbytes"], cfg["grad_bytes"], link, window, step_time, replay_step_s=replay)
    # per checkpoint: what "auto" modelled when it chose (its inputs then) against what it waited
    per = [{"k": kk, "model_s": d["model_stall_s"], "measured_s": b, "waits": w}
           for r in rs for kk, d, b, w in zip(r["spread_steps"], r.get("decisions", []), r["blocked_s"],
                                                r.get("spread_waits", [])) if d]
    waits = {c: statistics.median(w[c] for w in ws) for ws in [[p["waits"] for p in per if p["waits"]]] if ws
             for c in ws[0]}
    return {"link_measured_bps": link, "window_measured_s": window, "replay_step_measured_s": replay,
            "model_measured_s": model, "model_vs_measured": per, "waits_median_s": waits,
            "replay_cpu_s": statistics.median(x for r in rs for x in r.get("replay_cpu_s", [0.0]))}


def plot(path: Path, res: dict[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    s = res["summary"]
    names = [n for n in SYSTEMS if n in s and n != "none"]
    fig, ax = plt.subplots(figsize=(7, 4))
    measured = [s[n].get("stall_s", s[n]["loop_stall_s"]) for n in names]
    model = [s[n].get("model_s") or 0.0 for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured (training thread waited; dcp: loop time)")
    ax.bar([x + 0.2 for x in xs], model, width=0.4, label="stall model")
    ax.set_xticks(list(xs), [f"{n}\n(k={s[n].get('spread_steps', '-')})" for n in names], fontsize=8)
    ax.set_ylabel("stall per checkpoint, s (lower is better)")
    cfg = res["config"]
    ax.set_title(f"{format_size(cfg['nbytes'])} AdamW, t={cfg['iter_time']} s, link S/(B t)={cfg['ratio']}; "
                 f"{res['machine']}", fontsize=8)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gockpt", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--size", default="256MiB", help="model + AdamW state (default 256MiB)")
    p.add_argument("--iter-time", type=float, default=0.05, help="emulated forward/backward time t, s")
    p.add_argument("--ratio", type=float, default=4.0, help="S/(B t): iterations the snapshot needs on the link")
    p.add_argument("--spread", default="auto", help='spread_steps of pccheck_spread: "auto" or an int')
    p.add_argument("--interval", type=int, default=20,
                   help="iterations per cycle c, as if checkpointing every c (default 20)")
    p.add_argument("--checkpoints", type=int, default=4, help="timed triples of cycles (one checkpoint each)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--quiet-wait", type=float, default=10.0)
    p.add_argument("--floor-k", type=int, default=5,
                   help="k of replay_floor's replay when --spread is auto (default 5, what auto picks at ratio 4)")
    p.add_argument("--hog", type=int, default=0,
                   help="busy-looping processes to run beside every run (a noisy neighbour; default 0)")
    p.add_argument("--json", type=Path, default=None,
                   help="default bench/results/gockpt/latest.json (with --hog: latest-hog.json; quick: quick*.json)")
    p.add_argument("--dir", type=Path, default=_BENCH_DIR / "_scratch")
    p.add_argument("--quick", action="store_true", help="32MiB, 1 repeat, 2 checkpoints: a smoke run")
    args = p.parse_args(argv)
    nbytes = parse_size("32MiB" if args.quick else args.size)
    cfg = make_config(nbytes, args.iter_time, args.ratio, args.spread, args.interval,
                      2 if args.quick else args.checkpoints, args.quiet_wait, args.hog, args.floor_k)
    json_path = args.json or result_path("gockpt", quick=args.quick, variant="hog" if args.hog else "")
    command = "python -m bench.gockpt " + " ".join(argv if argv is not None else sys.argv[1:])
    return run_and_report(cfg, args.systems.split(","), 1 if args.quick else args.repeats, args.dir, json_path,
                          command)


def make_config(nbytes: int, iter_time: float, ratio: float, spread: str, interval: int, checkpoints: int,
                quiet_wait: float, hogs: int = 0, floor_k: int = 5) -> dict[str, Any]:
    """The run's settings: the state rounded to whole AdamW parameters, and the link's B = S/(ratio t)."""
    if ratio < 3 or iter_time <= 0 or interval < 2 or checkpoints < 1:
        raise ValueError("need --ratio >= 3 (S/(B t)), --iter-time > 0, an interval >= 2 and >= 1 checkpoint")
    k: int | str = spread if spread == "auto" else int(spread)
    elems = max(N_PARAMS, nbytes // 12) // N_PARAMS * N_PARAMS
    return {"nbytes": elems * 12, "grad_bytes": elems * 4, "iter_time": iter_time, "ratio": ratio,
            "link_bps": elems * 12 / (ratio * iter_time), "spread": k, "interval": interval,
            "checkpoints": checkpoints, "quiet_wait_s": quiet_wait, "timeout_s": 900, "hogs": hogs,
            "floor_k": k if isinstance(k, int) else floor_k}


def run_and_report(cfg: dict[str, Any], systems: Sequence[str], repeats: int, base: Path, json_path: Path,
                   command: str) -> int:
    """Runs the systems (``none`` always), prints the table and the targets, writes JSON + PNG."""
    systems = [s for s in SYSTEMS if s in systems]
    if "none" not in systems:
        systems.insert(0, "none")
    res = run(cfg, systems, repeats, base)
    res["command"] = command
    s = res["summary"]
    def rng(row: dict[str, Any], name: str) -> str:
        return f"{row[name + '_min']:.3f}-{row[name + '_max']:.3f}" if name + "_min" in row else "-"

    rows = [[n, str(s[n].get("spread_steps", "-")), fmt(s[n].get("stall_s"), ".3f"), rng(s[n], "stall"),
             fmt(s[n].get("model_s"), ".3f"), fmt(s[n].get("model_measured_s"), ".3f"),
             fmt(s[n]["loop_stall_s"], ".3f"), fmt(s[n]["slowdown"], ".3f"), rng(s[n], "slowdown")]
            for n in systems]
    print_table(f"GoCkpt: {format_size(cfg['nbytes'])} AdamW, t={cfg['iter_time']} s, link "
                f"{cfg['link_bps'] / 1e9:.2f} GB/s (S/(B t)={cfg['ratio']}), every {cfg['interval']} iterations; "
                f"medians and min-max ({res['machine']})",
                ["system", "k", "stall/ckpt", "range", "model", "model (measured B, t)", "cycle delta", "slowdown",
                 "range"], rows)
    for n in systems:
        if s[n].get("waits_median_s"):
            print(f"{n}: training's waits by cause (median s) {({c: round(v, 4) for c, v in s[n]['waits_median_s'].items()})}, "
                  f"replay of one whole-state step {s[n]['replay_step_measured_s']:.3f} s, replay CPU "
                  f"{s[n]['replay_cpu_s']:.2f} s per checkpoint")
    for t in s["targets"]:
        print(f"target: {t['what']}: {fmt(t['value'], '.2f')} (limit {t['limit']}) "
              f"{'MET' if t['met'] else 'MISSED'}")
    write_json(json_path, res)
    plot(json_path.with_suffix(".png"), res)
    print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
