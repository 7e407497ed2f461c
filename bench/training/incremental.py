"""Incremental checkpoints on a LoRA-like model: bytes written and time per checkpoint, incremental
against full.

    python -m bench.incremental [--base 384MiB] [--rank 8] [--steps 12] [--repeats 3]
                                [--dir bench/_scratch] [--json PATH]

Model: ``--base`` of frozen float32 weights in square layers (width 2048), each with rank-``r``
LoRA adapters (A: r x 2048, B: 2048 x r), AdamW on the adapters only, on the CPU. Each repeat runs
the same loop twice, with ``incremental=True`` and ``False`` (order alternating between repeats),
checkpointing at interval 1 (``max_concurrent=2``); the first checkpoint (which writes everything
in both modes) is left out of the per-checkpoint figures.

Per mode, medians over the repeats of each repeat's median per checkpoint: bytes written by the
library (``stats().bytes_written``), bytes the process wrote to storage (``/proc/self/io``
``write_bytes`` over the loop, per checkpoint), the training thread's time lost (``blocked_s``), the
time to durable (``persist_s``) and the fingerprint pass (``fingerprint_s``); plus the bytes that
changed (trainable parameters and their optimizer state) for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness.common import (BENCH_DIR, format_size, host_info, parse_size, print_table, result_path,
                                  scratch_dir, write_json)

__all__ = ["main", "run", "report"]

WIDTH = 2048


def _model(base_bytes: int, rank: int) -> tuple[Any, Any, int]:
    """The LoRA-like model, its optimizer, and the bytes its adapters and their AdamW state hold."""
    import torch

    class Lora(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = torch.nn.Linear(WIDTH, WIDTH, bias=False).requires_grad_(False)
            self.a = torch.nn.Parameter(torch.randn(rank, WIDTH) * 0.01)
            self.b = torch.nn.Parameter(torch.zeros(WIDTH, rank))

        def forward(self, x: Any) -> Any:
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    torch.manual_seed(0)
    layers = max(1, base_bytes // (WIDTH * WIDTH * 4))
    model = torch.nn.Sequential(*[Lora() for _ in range(layers)])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    changed = 3 * sum(p.numel() * 4 for p in params)  # the adapters, exp_avg and exp_avg_sq
    return model, opt, changed


def _write_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("write_bytes:"))


def _loop(path: Path, base: int, rank: int, steps: int, incremental: bool) -> dict[str, Any]:
    import torch

    import pccheck

    model, opt, changed = _model(base, rank)
    x = torch.randn(8, WIDTH)
    with pccheck.Checkpointer(model, opt, path, interval=1, max_concurrent=2, incremental=incremental) as ck:
        for step in range(1, steps + 1):
            if step == 2:  # the first checkpoint writes everything in both modes: left out
                ck.wait()
                w0, t0 = _write_bytes(), time.perf_counter()
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.maybe_checkpoint(step)
        ck.wait()
        loop_s = time.perf_counter() - t0
        written = _write_bytes() - w0
        stats = [c for c in ck.stats().checkpoints if c.step >= 2]
    n = len(stats)

    def med(key: str) -> float:
        return statistics.median(getattr(c, key) for c in stats)

    return {"checkpoints": n, "changed_bytes": changed, "state_bytes": stats[0].nbytes if stats else 0,
            "bytes_written": med("bytes_written"), "bytes_referenced": med("bytes_referenced"),
            "io_write_bytes": written / max(n, 1), "blocked_s": med("blocked_s"), "persist_s": med("persist_s"),
            "fingerprint_s": med("fingerprint_s"), "loop_s_per_step": loop_s / max(steps - 1, 1)}


def run(base: int, rank: int, steps: int, repeats: int, scratch: Path) -> dict[str, Any]:
    """Measures both modes ``repeats`` times (alternating their order); returns the result document."""
    runs: dict[str, list[dict[str, Any]]] = {"incremental": [], "full": []}
    for r in range(repeats):
        order = ("incremental", "full") if r % 2 == 0 else ("full", "incremental")
        for mode in order:
            with scratch_dir(scratch) as d:
                runs[mode].append(_loop(d / "ck", base, rank, steps, mode == "incremental"))
    summary = {}
    for mode, rs in runs.items():
        summary[mode] = {k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs),
                             "max": max(r[k] for r in rs)} for k in rs[0] if k != "checkpoints"}
    return {"bench": "incremental", "base_bytes": base, "rank": rank, "steps": steps, "repeats": repeats,
            "command": f"python -m bench.incremental --base {base} --rank {rank} --steps {steps} --repeats {repeats}",
            "host": host_info(scratch), "summary": summary, "runs": runs}


def report(doc: dict[str, Any]) -> None:
    """Prints the medians (and ranges) of both modes."""
    s = doc["summary"]
    rows = []
    for key, fmtf in (("bytes_written", format_size), ("io_write_bytes", format_size),
                      ("bytes_referenced", format_size), ("changed_bytes", format_size),
                      ("blocked_s", lambda v: f"{v * 1e3:.1f} ms"), ("persist_s", lambda v: f"{v * 1e3:.1f} ms"),
                      ("fingerprint_s", lambda v: f"{v * 1e3:.1f} ms"),
                      ("loop_s_per_step", lambda v: f"{v * 1e3:.1f} ms")):
        row = [key]
        for mode in ("incremental", "full"):
            m = s[mode][key]
            row.append(f"{fmtf(m['median'])} [{fmtf(m['min'])}, {fmtf(m['max'])}]")
        rows.append(row)
    print_table(f"LoRA-like model, {format_size(doc['base_bytes'])} frozen base, rank {doc['rank']}, "
                f"interval 1, per checkpoint (median [range] of {doc['repeats']} repeats)",
                ["", "incremental=True", "incremental=False"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.incremental", description=__doc__.split("\n")[0])
    p.add_argument("--base", type=parse_size, default=parse_size("384MiB"), help="frozen base weights (bytes)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, default=BENCH_DIR / "_scratch")
    p.add_argument("--json", type=Path, default=None, help="default: bench/results/incremental/latest.json")
    a = p.parse_args(argv)
    if a.steps < 3 or a.repeats < 1 or a.rank < 1:
        p.error("--steps must be at least 3 (the first checkpoint is left out), --repeats and --rank at least 1")
    doc = run(a.base, a.rank, a.steps, a.repeats, a.dir)
    report(doc)
    write_json(a.json or result_path("incremental"), doc)


if __name__ == "__main__":
    main()
