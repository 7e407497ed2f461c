"""How soon training can run after ``load_latest(..., lazy=True)`` (issue 13's targets).

    python -m bench.lazy [--size 1GiB] [--blocks 8] [--repeats 3] [--json bench/results/lazy.json]

A model of ``--blocks`` equal blocks (Linear + LayerNorm + Linear) whose parameters are a third of
the state (AdamW: parameters, exp_avg, exp_avg_sq), checkpointed once by pccheck. Each timed load
starts from a cold page cache (``sync`` + ``drop_caches``, from bench.recovery) into a fresh
model, and measures, as medians of ``--repeats``:

* ``eager_s``: ``load_latest(..., lazy=False)``, every array read and validated;
* ``lazy_return_s``: ``load_latest(..., lazy=True)`` returning;
* ``first_block_s``: from the lazy call until the first block's forward has returned;
* ``first_forward_s``: from the lazy call until the whole first forward has returned;
* ``param_read_s``: reading the parameter bytes alone (the same file regions, buffered, with
  their crc32c, as the lazy loader reads them) into memory already faulted in, as a built model's
  tensors are: the floor for a forward that needs every parameter.

Targets: ``first_block_s`` ≤ 0.10 × ``eager_s``; ``first_forward_s`` ≤ 1.25 × ``param_read_s``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ._common import host_info, parse_size, print_table, scratch_dir, write_json
from .recovery import drop_caches

__all__ = ["run_benchmark", "main"]

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_FIRST_BLOCK = 0.10
TARGET_FORWARD = 1.25


def _model(torch: Any, width: int, blocks: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width),
                                                      torch.nn.Linear(width, width)) for _ in range(blocks)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _width_for(size: int, blocks: int) -> int:
    """The width whose AdamW state (3 x the parameters, float32) is about ``size`` bytes."""
    per_block = size / 3 / 4 / blocks / 2  # two width x width matrices per block
    return max(64, int(per_block ** 0.5) // 64 * 64)


def _save(torch: Any, path: Path, width: int, blocks: int) -> tuple[int, Any]:
    import pccheck

    model, opt = _model(torch, width, blocks)
    x = torch.randn(4, width)
    model(x).sum().backward()
    opt.step()
    with pccheck.Checkpointer(model, opt, path) as ck:
        ck.checkpoint(1)
    return ck.stats().checkpoints[-1].nbytes, x


def _param_regions(path: Path) -> list[tuple[int, int]]:
    """(file offset, bytes) of every model array of the latest slot."""
    from pccheck.persist.recovery import read_manifest, read_store, slot_base, store_files

    image = read_store(store_files(path)[0][1])
    slot = image.word_slot
    with open(image.path, "rb") as f:
        man = read_manifest(image, slot, f.fileno())
    base = slot_base(image, slot)
    return [(base + e.offset, e.nbytes) for e in man.arrays if e.name.startswith("model/")]


def _read_params(path: Path, regions: list[tuple[int, int]]) -> float:
    """Seconds to read the parameter bytes (with their crc32c, as the loader does) into memory
    that is already faulted in, as a built model's tensors are: the floor for a full forward."""
    import numpy as np

    from pccheck.persist.recovery import store_files
    from pccheck.persist.reader import read_array

    bufs = [np.ones(n, dtype=np.uint8) for _, n in regions]  # touched before the clock starts
    t0 = time.perf_counter()
    with open(store_files(path)[0][1], "rb", buffering=0) as f:
        for (off, n), buf in zip(regions, bufs):
            read_array(f.fileno(), off, n, into=buf)
    return time.perf_counter() - t0


def _one_round(torch: Any, path: Path, width: int, blocks: int, x: Any, regions: list[tuple[int, int]]) -> dict[str, float]:
    import pccheck

    out: dict[str, float] = {}
    cold = drop_caches()
    out["param_read_s"] = _read_params(path, regions)
    cold = drop_caches() and cold
    model, opt = _model(torch, width, blocks)
    t0 = time.perf_counter()
    pccheck.load_latest(path, model=model, optimizer=opt)
    out["eager_s"] = time.perf_counter() - t0
    cold = drop_caches() and cold
    model, opt = _model(torch, width, blocks)
    t0 = time.perf_counter()
    r = pccheck.load_latest(path, model=model, optimizer=opt, lazy=True)
    out["lazy_return_s"] = time.perf_counter() - t0
    with torch.no_grad():
        h = model[0](x)
        out["first_block_s"] = time.perf_counter() - t0
        for block in model[1:]:
            h = block(h)
        out["first_forward_s"] = time.perf_counter() - t0
    r.wait()
    out["lazy_all_s"] = time.perf_counter() - t0
    out["cold"] = float(cold)
    return out


def run_benchmark(size: int, blocks: int, repeats: int, scratch: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    width = _width_for(size, blocks)
    path = scratch / "ckpt"
    nbytes, x = _save(torch, path, width, blocks)
    regions = _param_regions(path)
    rounds = [_one_round(torch, path, width, blocks, x, regions) for _ in range(repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "cold"}
    return {
        "state_bytes": nbytes, "param_bytes": sum(n for _, n in regions), "blocks": blocks, "width": width,
        "repeats": repeats, "cold_cache": all(r["cold"] for r in rounds), "rounds": rounds, "median": med,
        "first_block_vs_eager": med["first_block_s"] / med["eager_s"],
        "first_forward_vs_param_read": med["first_forward_s"] / med["param_read_s"],
        "targets": {"first_block_vs_eager": TARGET_FIRST_BLOCK, "first_forward_vs_param_read": TARGET_FORWARD},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lazy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size (default 1GiB)")
    ap.add_argument("--blocks", type=int, default=8, help="model blocks (default 8)")
    ap.add_argument("--repeats", type=int, default=3, help="cold loads per measure (default 3)")
    ap.add_argument("--json", default=str(RESULTS / "lazy.json"), help="JSON output")
    ap.add_argument("--dir", default=str(RESULTS.parent / "_scratch"), help="scratch directory (removed after)")
    args = ap.parse_args(argv)
    with scratch_dir(args.dir) as scratch:
        res = run_benchmark(args.size, args.blocks, args.repeats, scratch)
    res["command"] = "python -m bench.lazy " + " ".join(argv if argv is not None else sys.argv[1:])
    res["host"] = host_info(args.dir if os.path.isdir(args.dir) else ".")
    write_json(args.json, res)
    m = res["median"]
    print_table(f"bench.lazy: {res['state_bytes'] / 2**30:.2f} GiB state, {args.blocks} blocks, "
                f"{'cold' if res['cold_cache'] else 'WARM'} cache, medians of {args.repeats}",
                ["measure", "seconds"], [[k, f"{v:.3f}"] for k, v in m.items()])
    print(f"first block / eager full load: {res['first_block_vs_eager']:.3f} (target <= {TARGET_FIRST_BLOCK})")
    print(f"first forward / parameter read: {res['first_forward_vs_param_read']:.3f} (target <= {TARGET_FORWARD})")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
