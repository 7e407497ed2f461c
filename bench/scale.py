"""Goodput of checkpoint tiers at 16,384 GPUs: ``python -m bench.scale`` (issue 29, part 5).

    python -m bench.scale [--inputs bench/inputs/scale.json] [--json bench/results/scale.json]

A first-order model (Young/Daly style), every input in ``bench/inputs/scale.json`` with its
source (cited, derived, measured here, or assumed). Interruptions arrive at rate
lambda = interruptions / duration for the whole job; a fraction ``hardware_fraction`` loses a node
(its RAM and local disk), the rest only the processes. Per node the state is
S = state_bytes_per_gpu x gpus_per_node; a tier with bandwidth B writes or restores it in
W = S / B. For each configuration:

- overhead: the fraction of each iteration spent on checkpointing (measured slowdowns, or
  published ones);
- cost of an interruption restored from a tier checkpointed every k iterations of t seconds:
  restart_s + W (the restore) + k t / 2 (work since the newest checkpoint, on average) + W (the
  newest one was still being written);
- goodput = 1 - overhead - lambda x E[cost]; wasted GPU-hours = (1 - goodput) x GPUs x duration.

Configurations: ``disk`` only (the job's shared durable storage, its aggregate bandwidth split
over the nodes, at Young's interval sqrt(2 C / lambda), no shorter than N checkpoints in flight
allow); ``disk+remote`` (the local disk, lost with its node, for
crashes; the remote tier every ``remote_every_iters`` for node losses); ``memory+peers+disk+remote``
(pccheck's memory tier every iteration with replicas=2: crashes from memory, node losses from
the peer; a whole group lost is rarer and not modelled); ``gemini`` (Gemini's published
figures: every iteration, no overhead, recovery 13x faster than from remote storage).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ._common import bar_chart, print_table, write_csv, write_json

__all__ = ["main", "model"]

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"


def _measured(inp: dict[str, Any]) -> dict[str, float]:
    """The inputs left null in the file, from this repo's results (their medians)."""
    v = {k: d["value"] for k, d in inp.items() if not k.startswith("_")}
    if v["memory_gbps_per_node"] is None:
        mt = json.loads((RESULTS / "memory_tier.json").read_text())
        v["memory_gbps_per_node"] = mt["size"] / mt["median_s"]["tmpfs_store"] / 1e9
    tiers = json.loads((RESULTS / "tiers.json").read_text())
    if v["memory_overhead_frac"] is None:
        v["memory_overhead_frac"] = max(0.0, tiers["slowdown"]["memory"] - 1)
    if v["disk_overhead_frac"] is None:
        v["disk_overhead_frac"] = max(0.0, tiers["slowdown"]["disk"] - 1)
    return v


def _cost(restart: float, w: float, k: float, t: float) -> float:
    """Seconds an interruption costs when restored from a tier written every k iterations."""
    return restart + w + k * t / 2 + w


def model(v: dict[str, float]) -> list[dict[str, Any]]:
    """Goodput and wasted GPU-hours of each configuration (see the module docstring)."""
    t, hw = v["iter_time_s"], v["hardware_fraction"]
    duration = v["days"] * 86400
    lam = v["interruptions"] / duration
    s = v["state_bytes_per_gpu"] * v["gpus_per_node"]
    w_disk, w_mem = s / (v["disk_gbps_per_node"] * 1e9), s / (v["memory_gbps_per_node"] * 1e9)
    w_shared = s / (v["shared_disk_gbps_per_node"] * 1e9)
    w_peer, w_remote = s / (v["peer_gbps_per_node"] * 1e9), s / (v["remote_gbps_per_node"] * 1e9)
    r = v["restart_s"]
    # Young's interval for the disk: per-checkpoint cost C = the measured overhead of one
    # checkpoint per iteration, times t; no shorter than N writes in flight allow.
    c = max(v["disk_overhead_frac"], 1e-4) * t

    def young(w: float) -> float:
        return max(math.sqrt(2 * c / lam) / t, w / (v["max_concurrent"] * t), 1.0)

    k_disk, k_shared = young(w_disk), young(w_shared)
    k_remote = v["remote_every_iters"]
    configs = []

    def add(name: str, overhead: float, crash: float, node: float, note: str) -> None:
        waste = overhead + lam * ((1 - hw) * crash + hw * node)
        configs.append({"config": name, "overhead_frac": overhead, "crash_cost_s": crash, "node_loss_cost_s": node,
                        "goodput": 1 - waste, "wasted_gpu_hours": waste * v["gpus"] * duration / 3600, "note": note})

    d_over = c / (k_disk * t)
    add("disk", c / (k_shared * t), _cost(r, w_shared, k_shared, t), _cost(r, w_shared, k_shared, t),
        f"the job's shared durable storage every {k_shared:.1f} iterations (Young)")
    add("disk+remote", d_over, _cost(r, w_disk, k_disk, t), _cost(r, w_remote, k_remote, t),
        f"local disk every {k_disk:.1f}, remote every {k_remote}")
    m_over = v["memory_overhead_frac"] + d_over
    add("memory+peers+disk+remote", m_over, _cost(r, w_mem, 1, t), _cost(r, w_peer + w_mem, 1, t),
        "memory every iteration, replicas=2 (overhead measured on 2 vCPUs)")
    add("memory+peers (overhead 0)", d_over, _cost(r, w_mem, 1, t), _cost(r, w_peer + w_mem, 1, t),
        "the same with Gemini's overhead: where a node has the cores and NIC to spare")
    add("gemini (published)", v["gemini_overhead_frac"], _cost(r, w_remote / v["gemini_recovery_speedup_vs_remote"], 1, t),
        _cost(r, w_remote / v["gemini_recovery_speedup_vs_remote"], 1, t), "every iteration; recovery 13x faster than remote")
    return configs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=Path, default=ROOT / "inputs" / "scale.json")
    p.add_argument("--json", type=Path, default=RESULTS / "scale.json")
    a = p.parse_args(argv)
    inp = json.loads(a.inputs.read_text())
    v = _measured(inp)
    rows = model(v)
    print_table(f"{v['gpus']} GPUs, {v['interruptions']} interruptions in {v['days']} days "
                f"({v['hardware_fraction']:.0%} hardware), t = {v['iter_time_s']} s",
                ["config", "overhead", "crash cost s", "node-loss cost s", "goodput", "wasted GPU-h"],
                [[x["config"], f"{x['overhead_frac']:.3%}", f"{x['crash_cost_s']:.0f}", f"{x['node_loss_cost_s']:.0f}",
                  f"{x['goodput']:.3%}", f"{x['wasted_gpu_hours']:.0f}"] for x in rows])
    write_json(a.json, {"benchmark": "scale", "model": "first order; see bench/scale.py", "inputs": inp,
                        "values": v, "configs": rows})
    write_csv(a.json.with_suffix(".csv"), list(rows[0]), [list(x.values()) for x in rows])
    bar_chart(a.json.with_suffix(".png"), [x["config"] for x in rows],
              {"wasted GPU-hours": [x["wasted_gpu_hours"] for x in rows]},
              title=f"{v['gpus']} GPUs, {v['days']} days: GPU-hours lost to checkpointing and interruptions",
              ylabel="GPU-hours")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
