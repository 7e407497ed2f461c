"""The figures of ``python -m bench.gpu`` (bench/gpu/gpu.py runs it): slowdowns, extra time per
iteration, ratios and target verdicts derived from the raw records (``finalize``), and the table,
CSV and chart (``report``)."""

from pathlib import Path
from typing import Any

from bench.harness.common import bar_chart, print_table, write_csv
from bench.harness.common import median_or_none as _med

__all__ = ["INTERVALS", "WINDOWS", "SYSTEMS", "TARGETS", "finalize", "report"]

_GIB = 1 << 30
INTERVALS = (10, 50)  # the train windows' default intervals
WINDOWS = (1, 10, 50)  # --intervals may add 1: DCP's systems only (pccheck_memory is every iteration already)
SYSTEMS = ("none", "pccheck_N2", "pccheck_reserve", "dcp_async", "dcp_best", "torch_save", "pccheck_memory",
           "pccheck_remote")
TARGETS = {"d2h_vs_peak": (">=", 0.9), "slowdown_pccheck_N2_i10": ("<=", 1.03),
           "extra_pccheck_vs_dcp_i10": ("<=", 0.3), "stall_reserve_vs_none_i10": ("<=", 0.2),
           "slowdown_pccheck_memory_i10": ("<=", 1.10)}


def finalize(res: dict[str, Any]) -> None:
    """Everything derived from the raw records: slowdowns, extra time per iteration, ratios, targets."""
    tr, systems = res["train"], res["systems"]
    t_none = res["t_none_s"] = _med([tr[k]["median_iter_s"] for k in ("none_first", "none_last")
                                     if tr.get(k, {}).get("status") == "ok"])
    slow: dict[int, dict[str, Any]] = {i: {"none": 1.0 if t_none else None} for i in WINDOWS}
    extra: dict[str, dict[str, Any]] = {"none": {str(i): 0.0 if t_none else None for i in WINDOWS}}
    for name in SYSTEMS[1:]:
        for i in WINDOWS:
            rec = systems.get(name, {}).get(str(i), {})
            if rec.get("status") == "ok" and t_none:
                rec["slowdown"] = rec["window_s"] / (rec["iters"] * t_none)
                rec["extra_s_per_iter"] = rec["s_per_iter"] - t_none
            slow[i][name], extra.setdefault(name, {})[str(i)] = rec.get("slowdown"), rec.get("extra_s_per_iter")
    res["slowdown"], res["slowdown_50"], res["extra_time_per_iter_s"] = slow[10], slow[50], extra
    res["slowdown_1"] = slow[1]
    for entry in systems.values():  # the other windows (e.g. --profile's legacy copy loop)
        for key, rec in entry.items():
            if key not in ("1", "10", "50") and isinstance(rec, dict) and "window_s" in rec and t_none:
                rec["slowdown"] = rec["window_s"] / (rec["iters"] * t_none)
                rec["extra_s_per_iter"] = rec["s_per_iter"] - t_none
    pe, de = extra["pccheck_N2"]["10"], extra["dcp_async"]["10"]
    res["ratio_pccheck_extra_vs_dcp"] = pe / de if pe is not None and de is not None and de > 0 else None
    sn, sr = (systems.get(s, {}).get("10", {}).get("median_stall_s") for s in ("pccheck_N2", "pccheck_reserve"))
    res["ratio_stall_reserve_vs_none"] = sr / sn if sr is not None and sn else None
    d2h, peak = res["d2h_gbps"], res["pinned_peak_gbps"]
    values = (d2h / peak if d2h and peak else None, slow[10]["pccheck_N2"], res["ratio_pccheck_extra_vs_dcp"],
              res["ratio_stall_reserve_vs_none"], slow[10]["pccheck_memory"])  # in the order of TARGETS
    res["targets"] = {k: {"value": v, "target": f"{op} {thr}", "met": None if v is None else (
        v >= thr if op == ">=" else v <= thr)} for (k, (op, thr)), v in zip(TARGETS.items(), values)}

def report(res: dict[str, Any], out: Path, stem: str = "latest") -> None:
    """Print every figure and the target verdicts; write {stem}.csv and {stem}.png under ``out``."""
    ov, pe = res["overlap"], res["persist"]
    rows: list[tuple[str, str, Any, Any, str]] = [
        ("d2h_gbps", "pccheck copy engine", "", res["d2h_gbps"], "GB/s"),
        ("pinned_peak_gbps", "torch copy_ to pinned", "", res["pinned_peak_gbps"], "GB/s"),
        *[(k, "torch.mm bf16", "", ov.get(k), "TFLOP/s") for k in ("matmul_tflops_alone", "matmul_tflops_during_copy")],
        ("copy_gbps_during_matmul", "pccheck copy engine", "", ov.get("copy_gbps_during_matmul"), "GB/s"),
        *[("persist_gbps", k, "", pe.get(k, {}).get("gbps"), "GB/s") for k in ("pccheck", "raw_odirect")],
        ("t_none", "none", "", res.get("t_none_s"), "s/iter")]
    for name in SYSTEMS[1:]:
        for i in WINDOWS:
            r = res["systems"].get(name, {}).get(str(i), {})
            if not r:
                continue
            rows += [(k, name, i, r.get(k), u) for k, u in (("status", ""), ("iters", ""), ("checkpoints", ""),
                     ("slowdown", "x"), ("extra_s_per_iter", "s"), ("median_stall_s", "s"))]
    rows += [("ratio_pccheck_extra_vs_dcp", "pccheck_N2/dcp_async", 10, res["ratio_pccheck_extra_vs_dcp"], "x"),
             ("ratio_stall_reserve_vs_none", "pccheck_reserve/pccheck_N2", 10, res["ratio_stall_reserve_vs_none"], "x")]
    rows += [(f"target {k}", t["target"], "", t["value"], f"met={t['met']}") for k, t in res["targets"].items()]
    write_csv(out / f"{stem}.csv", ["metric", "system", "interval", "value", "unit"],
              [[m, s, i, "" if v is None else v, u] for m, s, i, v, u in rows])
    gib = (res["state_bytes"] or 0) / _GIB
    print_table(f"bench.gpu on {res['device']} (driver {res['driver']}, torch {res['torch']}; state {gib:.2f} GiB)",
                ["figure", "system", "interval", "value", "unit"],
                [[m, s, i, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else v, u] for m, s, i, v, u in rows])
    keys = [(k, f"interval {i}") for k, i in (("slowdown_1", 1), ("slowdown", 10), ("slowdown_50", 50))
            if any(v is not None for s, v in (res.get(k) or {}).items() if s != "none")]
    series = {s: [(res[k] or {}).get(s) or float("nan") for k, _ in keys] for s in SYSTEMS}
    bar_chart(out / f"{stem}.png", [label for _, label in keys], series, ylabel="slowdown (lower is better)",
              title=f"{res['device']}: GPT training slowdown while checkpointing ({gib:.1f} GiB state)")
