"""What one ``Checkpointer.checkpoint()`` call costs the training thread for a model of many small
tensors, where Python work per array (snapshot, layout, copy descriptors, manifest bound)
dominates rather than the bytes.

    python -m bench.call_cost [--blocks 150] [--repeats 40] [--json bench/results/call_cost/latest.json]
    python -m bench.call_cost --busy-disk [--size 512MiB] [--repeats 12] [--json bench/results/call_cost/latest-busy-disk.json]

The model: ``--blocks`` x (Linear(64, 64) + LayerNorm(64)) with AdamW (its state exists after a
first step): 4 tensors per block in the state_dict, 3x with the optimizer's moments and steps.
Per repeat: one optimizer step (untimed), then ``checkpoint(step)`` timed, then ``wait()``
(untimed). pccheck runs with N=2 and its defaults otherwise, soft copy-on-write on (the call
copies the eager buffers and hands the rest to the background). Reports the median.

``--busy-disk``: the call while the disk is busy with the previous checkpoint, as at interval 10 on
the GPU (bench/results/gpu/: persist 3.6-5.5 s against 3.9 s between checkpoints). State: 8 touched
numpy arrays of ``--size`` in all; ``Checkpointer(arrays, path in --dir, interval=1, max_concurrent=2,
writer_threads=4)``; 3 warm-up checkpoints (every slot written), then one more to time the persist P.
Per repeat: change one byte per array, ``checkpoint(s)`` timed, then sleep 0.45 P, so each call comes
while the previous checkpoint is still being written and never waits for a permit. After all,
``wait()``; per call: its wall time and its ``prepare_s`` (the time in the call before the copy:
the slot, and anything the call writes to the disk itself); medians and maxima.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence

from bench.harness.common import result_path, host_info, write_json

__all__ = ["main"]


def measure(blocks: int, repeats: int) -> dict:
    import torch

    import pccheck

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
                                  for _ in range(blocks)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()

    step()
    with tempfile.TemporaryDirectory() as d:
        ck = pccheck.Checkpointer(model, opt, path=d, interval=1, max_concurrent=2)
        for s in range(1, 4):  # every slot written once
            step()
            ck.checkpoint(s)
        ck.wait()
        times = []
        for s in range(4, 4 + repeats):
            step()
            t0 = time.perf_counter()
            ck.checkpoint(s)
            times.append(time.perf_counter() - t0)
            ck.wait()
        ck.close()
    n = sum(1 for _ in model.state_dict()) + sum(len(v) for v in opt.state.values())
    return {"blocks": blocks, "tensors": n, "repeats": repeats, "median_call_s": statistics.median(times),
            "calls_s": times}


def measure_busy(size: int, repeats: int, directory: str) -> dict:
    import os

    import numpy as np

    import pccheck

    arrays = {f"a{i}": np.full(size // 8 // 4, i, dtype=np.float32) for i in range(8)}
    with tempfile.TemporaryDirectory(dir=directory) as d:
        ck = pccheck.Checkpointer(arrays, path=d, interval=1, max_concurrent=2, writer_threads=4)
        for s in range(1, 4):  # every slot written once
            ck.checkpoint(s)
        ck.wait()
        t0 = time.perf_counter()
        ck.checkpoint(4)
        ck.wait()
        persist = time.perf_counter() - t0
        calls = []
        for s in range(5, 5 + repeats):
            for a in arrays.values():
                a[s % a.size] += 1
            t0 = time.perf_counter()
            ck.checkpoint(s)
            calls.append(time.perf_counter() - t0)
            time.sleep(0.45 * persist)
        ck.wait()
        stats = [c for c in ck.stats().checkpoints if c.step >= 5]
        ck.close()
        os.sync()
    prepare = [c.prepare_s for c in stats]
    return {"size": size, "repeats": repeats, "persist_s": persist, "gap_s": 0.45 * persist,
            "calls_s": calls, "prepare_s": prepare, "median_call_s": statistics.median(calls),
            "max_call_s": max(calls), "median_prepare_s": statistics.median(prepare), "max_prepare_s": max(prepare),
            "outcomes": [c.outcome for c in stats]}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.call_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=150)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--json", help="default bench/results/call_cost/latest.json (--busy-disk: latest-busy-disk.json)")
    p.add_argument("--busy-disk", action="store_true", help="time the call while the previous checkpoint persists")
    p.add_argument("--size", default="512MiB", help="--busy-disk: state size (e.g. 512MiB, 1GiB)")
    p.add_argument("--dir", default="bench/_scratch", help="--busy-disk: where the store goes (a disk, not tmpfs)")
    args = p.parse_args(argv)
    if args.busy_disk:
        import os

        from bench.harness.common import format_size, parse_size
        os.makedirs(args.dir, exist_ok=True)
        res = measure_busy(parse_size(args.size), args.repeats if args.repeats != 40 else 12, args.dir)
        res["host"] = host_info(args.dir)
        print(f"{format_size(res['size'])}, persist {res['persist_s']:.2f} s: checkpoint() call median "
              f"{res['median_call_s'] * 1e3:.1f} ms (max {res['max_call_s'] * 1e3:.1f}), prepare_s median "
              f"{res['median_prepare_s'] * 1e3:.1f} ms (max {res['max_prepare_s'] * 1e3:.1f})")
        write_json(args.json or result_path("call_cost", variant="busy-disk"), res)
        return 0
    res = measure(args.blocks, args.repeats)
    res["host"] = host_info(tempfile.gettempdir())
    print(f"{res['tensors']} tensors: median checkpoint() call {res['median_call_s'] * 1e3:.1f} ms "
          f"(median of {args.repeats})")
    write_json(args.json or result_path("call_cost"), res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
