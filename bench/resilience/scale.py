"""Plan past this machine: goodput of a 16,384-GPU job under Llama 3's interruption rate, per tier set.

Run::

    python -m bench.scale [--inputs bench/results/scale/inputs.json] [--refresh] [--seeds 200]
                          [--out bench/results/scale]

Everything is a pure function of ``--inputs`` (a JSON file, every number with its source), so the
table changes only when an input does. ``--refresh`` first updates the inputs' *measured here*
efficiencies from the result files named in them (e.g. the remote tier's upload throughput over the
raw client's, ``bench/results/remote/latest.json``) and writes the inputs back.

The job (inputs ``job``): ``gpus`` GPUs, ``gpus_per_node`` per node, ``days`` of training,
``interruptions`` unexpected ones in that time (a Poisson process), a share ``hardware_share`` of
them hardware faults, which take the node with its RAM and local disk; the rest are process
failures, after which the node and its memory are intact. Each interruption costs ``restart_s``
(reschedule, process start, collectives) plus the restore, plus the iterations since the step the
job goes back to. ``state_bytes_per_gpu`` and ``iter_s`` fix the checkpoint's size and the pace.

A tier (inputs ``tiers``) writes the node's state at ``write_gbps`` and reads it at ``read_gbps``
(a cited raw figure for such a node, times pccheck's efficiency on that path *measured here*:
``efficiency`` = pccheck's throughput over the raw path's on this machine). Its interval is the
smallest one that keeps up: ``f = max(f_min, ceil(C / (N t)))`` with ``C`` = state per node /
``write_gbps`` and ``N`` checkpoints in flight (pccheck's tuner rule); a checkpoint is durable
``C`` after its call. Which tiers survive: own memory and local disk survive a process failure
only; a peer's memory survives unless every node of the group fails within the exposure window
(restart + re-replication); the remote tier always.

A configuration (inputs ``configs``) is a list of tiers and the loop's slowdown with them on
(measured here, or published). At each interruption all ranks go back to the newest step every
rank can obtain, and the job waits for the slowest rank's restore: the failed node's, from the
nearest tier that holds that step (:func:`replay`). Goodput = iterations kept at the end /
iterations a failure-free, checkpoint-free job would have done. Reported: the mean over
``--seeds`` traces, and the range.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.harness.common import print_table, pyplot, save_figure, write_json

__all__ = ["Tier", "Config", "load_inputs", "refresh", "tiers_of", "replay", "run", "report", "plot", "main"]

_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUTS = _ROOT / "results" / "scale" / "inputs.json"
DAY = 86400.0


@dataclass(frozen=True)
class Tier:
    """One tier at scale: per-node bandwidths (bytes/s), interval (iterations), durability lag (s)."""

    name: str
    write_bps: float
    read_bps: float
    interval: int
    lag_s: float
    survives_node_loss: str  # "no" (own memory, local disk), "group" (a peer's memory), "yes" (remote)


@dataclass(frozen=True)
class Config:
    name: str
    tiers: tuple[str, ...]
    slowdown: float
    source: str
    replicas: int = 1
    restore_speedup: float = 1.0  # published figures only: restore this many times faster than the tier's


def load_inputs(path: Path) -> dict[str, Any]:
    """The inputs document (see the module docstring); raises ValueError naming a missing field."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    for key in ("job", "tiers", "configs"):
        if key not in doc:
            raise ValueError(f"{path}: no {key!r} section")
    return doc


def _dig(doc: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        doc = doc[part]
    return doc


def refresh(doc: dict[str, Any], root: Path) -> list[str]:
    """Updates each tier's ``efficiency`` that names a result file (``efficiency_from``: ``file``,
    and ``key``, a dotted path to a ratio in it, or ``num`` and ``den``, two dotted paths whose
    quotient it is) from that file; returns what changed, for the log."""
    changed = []
    for name, tier in doc["tiers"].items():
        src = tier.get("efficiency_from")
        if not src:
            continue
        f = root / src["file"]
        if not f.exists():
            changed.append(f"{name}: {src['file']} not found, efficiency kept at {tier['efficiency']}")
            continue
        res = json.loads(f.read_text(encoding="utf-8"))
        value = (float(_dig(res, src["num"])) / float(_dig(res, src["den"])) if "num" in src
                 else float(_dig(res, src["key"])))
        if value != tier["efficiency"]:
            what = src.get("key") or f"{src['num']} / {src['den']}"
            changed.append(f"{name}: efficiency {tier['efficiency']} -> {value:.3f} ({src['file']}: {what})")
            tier["efficiency"] = round(value, 4)
    return changed


def tiers_of(doc: Mapping[str, Any]) -> dict[str, Tier]:
    """Each tier at scale, from the job's state per node and the tier's bandwidths."""
    job = doc["job"]
    node_bytes = job["state_bytes_per_gpu"] * job["gpus_per_node"]
    out = {}
    for name, t in doc["tiers"].items():
        write = t["write_gbps"] * 1e9 * t["efficiency"]
        read = t["read_gbps"] * 1e9 * t["efficiency"]
        c = node_bytes / write
        f = max(int(t.get("min_interval", 1)), math.ceil(c / (t.get("in_flight", 2) * job["iter_s"])))
        out[name] = Tier(name, write, read, f, c, t["survives_node_loss"])
    return out


def _held(tier: Tier, progress: float, base: int, iter_s: float) -> int:
    """The newest step ``tier`` holds durably when the job is at ``progress`` iterations (the step
    restored at the last restart, ``base``, counts as held: it is checkpointed at once)."""
    durable = progress - tier.lag_s / iter_s
    return max(base, int(durable // tier.interval) * tier.interval) if durable >= 0 else base


def replay(cfg: Config, tiers: Mapping[str, Tier], job: Mapping[str, Any], seed: int) -> dict[str, float]:
    """One trace: Poisson interruptions over the job's days; returns goodput and where time went."""
    rng = random.Random(seed)
    total = job["days"] * DAY
    rate = job["interruptions"] / total
    nodes = job["gpus"] // job["gpus_per_node"]
    node_bytes = job["state_bytes_per_gpu"] * job["gpus_per_node"]
    t_iter = job["iter_s"] * cfg.slowdown
    now, resumed_at, base = 0.0, 0.0, 0
    lost_s = restore_s = 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= total:
            break
        progress = base + max(0.0, now - resumed_at) / t_iter
        hardware = rng.random() < job["hardware_share"]
        window = job["restart_s"] + node_bytes / max(t.read_bps for t in tiers.values())
        group_lost = hardware and cfg.replicas > 1 and \
            rng.random() < 1 - math.exp(-rate * job["hardware_share"] / nodes * (cfg.replicas - 1) * window)
        usable = [tiers[n] for n in cfg.tiers
                  if not hardware or tiers[n].survives_node_loss == "yes"
                  or (tiers[n].survives_node_loss == "group" and cfg.replicas > 1 and not group_lost)]
        step = max((_held(t, progress, base, t_iter) for t in usable), default=0)
        source = next((t for t in usable if _held(t, progress, base, t_iter) == step), None)
        load = node_bytes / source.read_bps / cfg.restore_speedup if source is not None and step > 0 else 0.0
        lost_s += (progress - step) * t_iter
        restore_s += job["restart_s"] + load
        base, resumed_at = step, now + job["restart_s"] + load
    final = base + max(0.0, total - resumed_at) / t_iter
    return {"goodput": final / (total / job["iter_s"]), "lost_h": lost_s / 3600, "restore_h": restore_s / 3600}


def _configs(doc: Mapping[str, Any]) -> list[Config]:
    return [Config(c["name"], tuple(c["tiers"]), float(c["slowdown"]), c["source"], int(c.get("replicas", 1)),
                   float(c.get("restore_speedup", 1.0))) for c in doc["configs"]]


def run(doc: Mapping[str, Any], seeds: int) -> dict[str, Any]:
    """Every configuration over ``seeds`` traces: mean goodput and its range, the tiers' intervals."""
    tiers = tiers_of(doc)
    for cfg in _configs(doc):
        missing = [n for n in cfg.tiers if n not in tiers]
        if missing:
            raise ValueError(f"config {cfg.name!r} names unknown tiers {missing}")
    rows = []
    for cfg in _configs(doc):
        runs = [replay(cfg, tiers, doc["job"], seed) for seed in range(seeds)]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        rows.append({"config": cfg.name, "tiers": list(cfg.tiers), "slowdown": cfg.slowdown, "source": cfg.source,
                     "intervals": {n: tiers[n].interval for n in cfg.tiers}, **mean,
                     "goodput_min": min(r["goodput"] for r in runs), "goodput_max": max(r["goodput"] for r in runs)})
    return {"benchmark": "scale", "seeds": seeds, "job": doc["job"],
            "tiers": {n: {"write_gbps": t.write_bps / 1e9, "read_gbps": t.read_bps / 1e9, "interval": t.interval,
                          "lag_s": t.lag_s} for n, t in tiers.items()},
            "rows": rows}


def report(res: Mapping[str, Any]) -> None:
    job = res["job"]
    print(f"{job['gpus']} GPUs, {job['interruptions']} interruptions in {job['days']} days "
          f"({job['hardware_share']:.0%} hardware), {job['state_bytes_per_gpu'] / 1e9:.1f} GB of state per GPU, "
          f"t = {job['iter_s']} s, restart {job['restart_s']} s; {res['seeds']} traces")
    print_table("tiers at scale (per node)", ["tier", "write GB/s", "read GB/s", "interval (it)", "durable after (s)"],
                [[n, f"{t['write_gbps']:.2f}", f"{t['read_gbps']:.2f}", t["interval"], f"{t['lag_s']:.1f}"]
                 for n, t in res["tiers"].items()])
    print_table("goodput", ["configuration", "slowdown", "goodput", "range", "recomputed (h)", "restarts+restores (h)"],
                [[r["config"], f"{r['slowdown']:.3f}", f"{r['goodput']:.4f}",
                  f"{r['goodput_min']:.4f}-{r['goodput_max']:.4f}", f"{r['lost_h']:.1f}", f"{r['restore_h']:.1f}"]
                 for r in res["rows"]])


def plot(res: Mapping[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    rows = res["rows"]
    ax.barh([r["config"] for r in rows], [r["goodput"] for r in rows],
            xerr=[[r["goodput"] - r["goodput_min"] for r in rows], [r["goodput_max"] - r["goodput"] for r in rows]],
            color="tab:blue")
    ax.set_xlabel("goodput (iterations kept / failure-free iterations)")
    ax.set_xlim(min(r["goodput_min"] for r in rows) * 0.98, 1.0)
    ax.invert_yaxis()
    job = res["job"]
    ax.set_title(f"{job['gpus']} GPUs, {job['interruptions']} interruptions in {job['days']} days (model)", fontsize=9)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS, help="the model's inputs (JSON)")
    p.add_argument("--refresh", action="store_true", help="update measured efficiencies from bench/results first")
    p.add_argument("--seeds", type=int, default=200, help="interruption traces per configuration")
    p.add_argument("--out", type=Path, default=_ROOT / "results" / "scale",
                   help="latest.json and latest.png go here (default: %(default)s)")
    a = p.parse_args(argv)
    doc = load_inputs(a.inputs)
    if a.refresh:
        for line in refresh(doc, _ROOT.parent):
            print("refresh:", line)
        write_json(a.inputs, doc)
    res = run(doc, a.seeds)
    res["command"] = "python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:])
    report(res)
    write_json(a.out / "latest.json", res)
    plot(res, a.out / "latest.png")
    print(f"wrote {a.out / 'latest.json'} and latest.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
