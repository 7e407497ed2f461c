"""What one ``Checkpointer.checkpoint()`` call costs the training thread for a model of many small
tensors, where Python work per array (snapshot, layout, copy descriptors, manifest bound)
dominates rather than the bytes.

    python -m bench.call_cost [--blocks 150] [--repeats 40] [--json bench/results/call_cost.json]

The model: ``--blocks`` x (Linear(64, 64) + LayerNorm(64)) with AdamW (its state exists after a
first step): 4 tensors per block in the state_dict, 3x with the optimizer's moments and steps.
Per repeat: one optimizer step (untimed), then ``checkpoint(step)`` timed, then ``wait()``
(untimed). pccheck runs with N=2 and its defaults otherwise, soft copy-on-write on (the call
copies the eager buffers and hands the rest to the background). Reports the median.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence

from bench._common import host_info, write_json

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


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.call_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=150)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--json", default="bench/results/call_cost.json")
    args = p.parse_args(argv)
    res = measure(args.blocks, args.repeats)
    res["host"] = host_info(tempfile.gettempdir())
    print(f"{res['tensors']} tensors: median checkpoint() call {res['median_call_s'] * 1e3:.1f} ms "
          f"(median of {args.repeats})")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
