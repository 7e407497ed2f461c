"""Ends a process in each way a training script can end, with pccheck's threads busy, and
records how it ended (tests/test_exit.py).

    python _exit_child.py make DIR             # the stores the scenarios load (one process)
    python _exit_child.py run DIR N S1,S2,...  # N runs of each scenario; one JSON line per run

``run`` imports torch and pccheck once, then forks one child per run. Each child runs the
scenario and then leaves through the interpreter's own ending (``SystemExit`` or an exception
propagating out of the main module), so its threading shutdown, atexit hooks and finalization are
exactly a fresh script's, without paying for the imports again (``gc.freeze`` keeps the child's
collector off the parent's objects, which would otherwise be copied page by page). The parent
starts no pccheck thread and runs no parallel torch op before forking: neither survives a fork.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import pccheck
import pccheck.aio

WIDTH, BLOCKS = 512, 8  # ~8.4 MiB of parameters, ~25 MiB with AdamW: a lazy load still running at exit
HANG_S = 120.0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.LayerNorm(WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, ck: pccheck.Checkpointer | None = None) -> None:
    for step in range(1, steps + 1):
        m(torch.randn(4, WIDTH)).sum().backward()
        opt.step()
        opt.zero_grad()
        if ck is not None:
            ck.maybe_checkpoint(step)


def make(root: Path) -> None:
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    with pccheck.Checkpointer(m, opt, root / "lazy", interval=1) as ck:
        train(m, opt, 2, ck)


def _lazy(root: Path) -> tuple[torch.nn.Module, Any]:
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    return m, pccheck.load_latest(root / "lazy", model=m, optimizer=opt, lazy=True)


def setup(kind: str, root: Path, run: int, ending: str = "end") -> Callable[[], None]:
    """Starts pccheck's background work of one kind (its stores named by ``ending`` and ``run``);
    returns a step of work to repeat."""
    if kind == "lazy":  # a lazy restore, its loader mid-way
        m, _ = _lazy(root)
        return lambda: m(torch.randn(2, WIDTH)) and None
    if kind == "lazy-wait":  # a lazy restore waited for, then used
        m, r = _lazy(root)
        r.wait()
        m(torch.randn(2, WIDTH))
        return lambda: m(torch.randn(2, WIDTH)) and None
    if kind == "aio":  # pccheck.aio's lazy load, not awaited to its end
        async def go() -> Any:
            m = model()
            await pccheck.aio.load_latest(root / "lazy", model=m, optimizer=torch.optim.AdamW(m.parameters()))
            return m
        m = asyncio.run(go())
        return lambda: m(torch.randn(2, WIDTH)) and None
    # each scenario's own paths: two drivers may run two endings of one kind at once
    path = root / f"{kind}-{ending}-{run}"
    if kind in ("open", "spread"):  # a Checkpointer never closed, checkpoints in flight (GoCkpt: a
        m = model()                 # spread checkpoint gathering its parts)
        opt = torch.optim.AdamW(m.parameters())
        train(m, opt, 5, pccheck.Checkpointer(m, opt, path, interval=1 if kind == "open" else 2,
                                              spread_steps=1 if kind == "open" else 2))
        return lambda: m(torch.randn(2, WIDTH)) and None
    arrays = {"w": np.full(4 << 20, run, dtype=np.float32), "b": np.arange(1000, dtype=np.int64)}
    if kind == "memory":  # the memory tier every step, never closed
        ck = pccheck.Checkpointer(arrays, path, interval=2, memory_interval=1, memory_dir=root / f"shm-{ending}-{run}")
    elif kind == "remote":  # an upload in flight at the end, never closed
        ck = pccheck.Checkpointer(arrays, path, interval=1, remote=f"{os.environ['EXIT_TEST_S3']}/{ending}-{run}")
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    for step in range(1, 6):
        arrays["w"] += 1
        ck.maybe_checkpoint(step)
    return lambda: arrays["b"].sum() and None


def scenario(name: str, root: Path, run: int) -> int:
    """``KIND:ENDING``: sets up KIND, then ends: "end" (returns 0), "raise" (an exception
    propagates out of the script), "signal" (SIGTERM, whose handler calls ``sys.exit(7)``)."""
    kind, ending = name.split(":")
    if ending == "signal":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    work = setup(kind, root, run, ending)
    if ending == "raise":
        raise RuntimeError("the script failed")
    if ending == "signal":
        os.kill(os.getpid(), signal.SIGTERM)
        while True:  # the handler runs between two bytecodes of this loop
            work()
    return 0


def run_all(root: Path, names: list[str], n: int) -> None:
    m = torch.nn.Linear(2, 2)  # torch.optim imports most of what it needs lazily, at the first use
    torch.optim.AdamW(m.parameters())
    torch.optim.SGD(m.parameters())
    gc.collect()
    gc.freeze()
    for name in names:
        for run in range(n):
            _one(root, name, run)


def _one(root: Path, name: str, run: int) -> None:
    """Forks one child that runs the scenario and ends; prints how it ended."""
    err = root / f"{name.replace(':', '-')}-{run}.stderr"
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - the child's own stderr, to its end
        # The child leaves through the interpreter's own ending: SystemExit, or the exception.
        raise SystemExit(scenario(name, root, run))
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() - t0 > HANG_S:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = -1
            break
        time.sleep(0.01)
    rc = "hang" if status == -1 else (os.waitstatus_to_exitcode(status))
    print(json.dumps({"scenario": name, "run": run, "rc": rc, "s": round(time.monotonic() - t0, 3),
                      "stderr": err.read_text(errors="replace")}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        run_all(Path(sys.argv[2]), sys.argv[4].split(","), int(sys.argv[3]))
