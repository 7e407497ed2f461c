"""How soon training can run after ``load_latest(..., lazy=True)`` .

    python -m bench.lazy [--size 1GiB] [--blocks 8] [--model bench|client] [--order none|build_first|load_first]
                         [--cache fadvise|drop_caches] [--repeats 3] [--json bench/results/lazy/latest.json]

Models (``--model``): ``bench``, ``--blocks`` x (Linear + LayerNorm + Linear); ``client``,
``--blocks`` x (Linear(d, d) + LayerNorm(d) + ReLU), d = 3342 at 1 GiB (the ReLU MLP, ``--model mlp_relu``); with
AdamW (fused where the CPU build supports it), parameters a third of the state.

The store is written the way ``--order`` says a job runs (two jobs, each training
``--train-iters`` steps with a checkpoint at the end): ``none``, a Checkpointer on a trained
model, checkpointed once (the lazy restore's set-up); ``build_first``, each job builds the Checkpointer,
THEN calls ``load_latest`` (when there is a checkpoint), then trains; ``load_first``, load, then
build. Each timed load starts from a cold page cache (``--cache``: ``posix_fadvise(DONTNEED)`` on
the store's files after ``sync``, or ``drop_caches``) into a fresh model, and the timed restart
runs in the same ``--order`` (the Checkpointer's construction is inside the lazy timings for
``load_first``, before the clock for ``build_first``). Medians of ``--repeats``:

* ``eager_s``: ``load_latest(..., lazy=False)``, every array read and validated (no Checkpointer);
* ``lazy_return_s``: ``load_latest(..., lazy=True)`` returning;
* ``first_block_s``: from the lazy call until a forward hook on ``model[0]`` fires, in the first
  ``model(x)`` (the root's forward pre-hooks included, as a user's forward runs them);
* ``first_forward_s``: from the lazy call until that whole forward has returned;
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

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import host_info, parse_size, print_table, scratch_dir, write_json
from bench.micro.recovery import drop_caches
from bench.training.restart import make_cold

__all__ = ["MODELS", "ORDERS", "run", "main"]

RESULTS = BENCH_DIR / "results"
TARGET_FIRST_BLOCK = 0.10
TARGET_FORWARD = 1.25
MODELS = ("bench", "mlp_relu")
ORDERS = ("none", "build_first", "load_first")


def _fused_ok(torch: Any) -> bool:
    """Whether this torch build runs fused AdamW on CPU (torch >= 2.4 does)."""
    try:
        p = torch.nn.Parameter(torch.zeros(1))
        p.grad = torch.zeros(1)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, TypeError, ValueError):
        return False


def _model(torch: Any, kind: str, width: int, blocks: int) -> tuple[Any, Any]:
    torch.manual_seed(0)
    nn = torch.nn
    if kind == "mlp_relu":
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())
                                for _ in range(blocks)])
    else:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, width))
                                for _ in range(blocks)])
    fused = {"fused": True} if _fused_ok(torch) else {}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, **fused)


def _width_for(kind: str, size: int, blocks: int) -> int:
    """The width whose AdamW state (3 x the parameters, float32) is about ``size`` bytes."""
    if kind == "mlp_relu":  # d^2 + 3d parameters a block (weight, bias, LayerNorm's two): 3342 at 1 GiB
        per_block = size / 3 / 4 / blocks
        return max(8, int(((9 + 4 * per_block) ** 0.5 - 3) / 2))
    per_block = size / 3 / 4 / blocks / 2  # two width x width matrices per block
    return max(64, int(per_block ** 0.5) // 64 * 64)


def _job(torch: Any, path: Path, cfg: dict[str, Any], x: Any, step0: int) -> tuple[int, int]:
    """One training job writing the store in ``cfg["order"]``: (last step, checkpoint bytes)."""
    import pccheck

    model, opt = _model(torch, cfg["model"], cfg["width"], cfg["blocks"])
    ck, step = None, step0
    if cfg["order"] == "build_first":
        ck = pccheck.Checkpointer(model, opt, path)
    if cfg["order"] != "none" and step0:
        step = pccheck.load_latest(path, model=model, optimizer=opt).step
    if ck is None and cfg["order"] != "none":
        ck = pccheck.Checkpointer(model, opt, path)
    for _ in range(cfg["train_iters"]):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
    if ck is None:  # "none": the Checkpointer is made on the trained model
        ck = pccheck.Checkpointer(model, opt, path)
    with ck:
        ck.checkpoint(step)
    return step, ck.stats().checkpoints[-1].nbytes


def _save(torch: Any, path: Path, cfg: dict[str, Any]) -> tuple[int, Any]:
    x = torch.randn(4, cfg["width"])
    step, nbytes = _job(torch, path, cfg, x, 0)
    if cfg["order"] != "none":  # a restarted job: it loads, then trains and checkpoints again
        step, nbytes = _job(torch, path, cfg, x, step)
    return nbytes, x


def _param_regions(path: Path) -> list[tuple[int, int]]:
    """(file offset, bytes) of every model array of the latest slot."""
    from pccheck.ops.inventory import locate
    from pccheck.persist.recovery import slot_base

    found = locate(path)
    base = slot_base(found.image, found.slot)
    return [(base + e.offset, e.nbytes) for e in found.manifest.arrays if e.name.startswith("model/")]


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


def _cold(path: Path, cache: str) -> bool:
    return drop_caches() if cache == "drop_caches" else make_cold(path, "fadvise") == "fadvise"


def _lazy_round(torch: Any, path: Path, cfg: dict[str, Any], x: Any) -> dict[str, float]:
    """One cold lazy restart in ``cfg["order"]``: its timings (see the module docstring)."""
    import pccheck

    model, opt = _model(torch, cfg["model"], cfg["width"], cfg["blocks"])
    marks: dict[str, float] = {}
    model[0].register_forward_hook(lambda *_: marks.setdefault("block", time.perf_counter()) and None)
    ck = pccheck.Checkpointer(model, opt, path) if cfg["order"] == "build_first" else None
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    r = pccheck.load_latest(path, model=model, optimizer=opt, lazy=True)
    out["lazy_return_s"] = time.perf_counter() - t0
    if cfg["order"] == "load_first":
        ck = pccheck.Checkpointer(model, opt, path)
        out["checkpointer_s"] = time.perf_counter() - t0 - out["lazy_return_s"]
    with torch.no_grad():
        model(x)
    out["first_forward_s"] = time.perf_counter() - t0
    out["first_block_s"] = marks["block"] - t0
    r.wait()
    out["lazy_all_s"] = time.perf_counter() - t0
    if ck is not None:
        ck.close()
    return out


def _one_round(torch: Any, path: Path, cfg: dict[str, Any], x: Any, regions: list[tuple[int, int]]) -> dict[str, float]:
    import pccheck

    out: dict[str, float] = {}
    cold = _cold(path, cfg["cache"])
    out["param_read_s"] = _read_params(path, regions)
    cold = _cold(path, cfg["cache"]) and cold
    model, opt = _model(torch, cfg["model"], cfg["width"], cfg["blocks"])
    t0 = time.perf_counter()
    pccheck.load_latest(path, model=model, optimizer=opt)
    out["eager_s"] = time.perf_counter() - t0
    del model, opt
    cold = _cold(path, cfg["cache"]) and cold
    out.update(_lazy_round(torch, path, cfg, x))
    out["cold"] = float(cold)
    return out


def run(size: int, blocks: int, repeats: int, scratch: Path, *, model: str = "bench",
                  order: str = "none", cache: str = "fadvise", train_iters: int = 3,
                  threads: int | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // 2))
    cfg = {"model": model, "order": order, "cache": cache, "blocks": blocks, "train_iters": train_iters,
           "width": _width_for(model, size, blocks)}
    path = scratch / "ckpt"
    nbytes, x = _save(torch, path, cfg)
    regions = _param_regions(path)
    rounds = [_one_round(torch, path, cfg, x, regions) for _ in range(repeats)]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if k != "cold"}
    return {
        "state_bytes": nbytes, "param_bytes": sum(n for _, n in regions), **cfg, "fused_adamw": _fused_ok(torch),
        "torch_threads": torch.get_num_threads(), "repeats": repeats,
        "cold_cache": all(r["cold"] for r in rounds), "rounds": rounds, "median": med,
        "range": {k: [min(r[k] for r in rounds), max(r[k] for r in rounds)] for k in med},
        "first_block_vs_eager": med["first_block_s"] / med["eager_s"],
        "first_forward_vs_param_read": med["first_forward_s"] / med["param_read_s"],
        "targets": {"first_block_vs_eager": TARGET_FIRST_BLOCK, "first_forward_vs_param_read": TARGET_FORWARD},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lazy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GiB"), help="state size (default 1GiB)")
    ap.add_argument("--blocks", type=int, default=8, help="model blocks (default 8)")
    ap.add_argument("--model", choices=MODELS, default="bench", help="block shape (default bench)")
    ap.add_argument("--order", choices=ORDERS, default="none",
                    help="when the jobs build the Checkpointer relative to load_latest (default none)")
    ap.add_argument("--cache", choices=("fadvise", "drop_caches"), default="fadvise",
                    help="how the page cache is made cold (default fadvise)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default half the CPUs)")
    ap.add_argument("--train-iters", type=int, default=3, help="training steps per writing job (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="cold loads per measure (default 3)")
    ap.add_argument("--json", default=str(result_path("lazy")), help="JSON output")
    ap.add_argument("--dir", default=str(RESULTS.parent / "_scratch"), help="scratch directory (removed after)")
    args = ap.parse_args(argv)
    with scratch_dir(args.dir) as scratch:
        res = run(args.size, args.blocks, args.repeats, scratch, model=args.model, order=args.order,
                            cache=args.cache, train_iters=args.train_iters, threads=args.threads)
    res["command"] = "python -m bench.lazy " + " ".join(argv if argv is not None else sys.argv[1:])
    res["host"] = host_info(args.dir if os.path.isdir(args.dir) else ".")
    write_json(args.json, res)
    m = res["median"]
    print_table(f"bench.lazy: {res['state_bytes'] / 2**30:.2f} GiB state, {args.blocks} {args.model} blocks "
                f"(width {res['width']}), order {args.order}, {'cold' if res['cold_cache'] else 'WARM'} cache, "
                f"medians of {args.repeats}",
                ["measure", "seconds", "range"],
                [[k, f"{v:.3f}", "{:.3f}-{:.3f}".format(*res["range"][k])] for k, v in m.items()])
    print(f"first block / eager full load: {res['first_block_vs_eager']:.3f} (target <= {TARGET_FIRST_BLOCK})")
    print(f"first forward / parameter read: {res['first_forward_vs_param_read']:.3f} (target <= {TARGET_FORWARD})")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
