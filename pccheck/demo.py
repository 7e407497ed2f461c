"""``python -m pccheck.demo``: train, crash, recover, resume (what ``make demo`` runs).

A small numpy MLP is trained on a fixed synthetic regression task (the embedded default) in a
child process that checkpoints every 10 steps into ./checkpoints (or --dir). Before each
checkpoint the child reports a sha256 of its state. The demo SIGKILLs the child mid-run (the
injected crash), then ``load_latest`` recovers in this process, the recovered bytes are compared
with what the training process had at that step, and training resumes from there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import pccheck

IN, HIDDEN, OUT, BATCH = 512, 2048, 512, 256
LR, MOMENTUM = 1e-3, 0.9


def init_state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    s = {
        "w1": (rng.standard_normal((IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.standard_normal((HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }
    for k in list(s):
        s["m_" + k] = np.zeros_like(s[k])  # momentum buffers: optimizer state
    s["step"] = np.array(0, np.int64)
    return s


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1_000_003 * step + 17)
    x = rng.standard_normal((BATCH, IN), dtype=np.float32)
    target = np.tanh(x[:, :OUT] * 2.0) + 0.1 * x[:, OUT - 1:OUT]
    return x, target.astype(np.float32)


def train_step(s: dict[str, np.ndarray], step: int) -> float:
    """One SGD-with-momentum step, in place. Returns the loss."""
    x, y = _batch(step)
    h = np.maximum(x @ s["w1"] + s["b1"], 0)
    err = h @ s["w2"] + s["b2"] - y
    grads = {"w2": h.T @ err / BATCH, "b2": err.mean(0)}
    dh = (err @ s["w2"].T) * (h > 0)
    grads["w1"], grads["b1"] = x.T @ dh / BATCH, dh.mean(0)
    for k, g in grads.items():
        m = s["m_" + k]
        m *= MOMENTUM
        m += g
        s[k] -= LR * m
    s["step"][...] = step
    return float((err ** 2).mean())


def digest(s: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k, v in s.items():
        h.update(k.encode())
        h.update(np.ascontiguousarray(v).tobytes())
    return h.hexdigest()[:16]


def child(directory: str, steps: int) -> None:
    """The training process: prints 'STATE step digest', 'LOSS step loss', 'DURABLE step'."""
    state = init_state()
    with pccheck.Checkpointer(state, path=directory, interval=10, max_concurrent=2, writer_threads=2,
                              chunk_size=4 << 20) as ck:
        durable, reported = None, 0
        for step in range(1, steps + 1):
            loss = train_step(state, step)
            if step % ck.interval == 0:
                print(f"STATE {step} {digest(state)}", flush=True)
            ck.maybe_checkpoint(step)
            print(f"LOSS {step} {loss:.6f}", flush=True)
            if ck.last_durable_step != durable:
                durable = ck.last_durable_step
                print(f"DURABLE {durable}", flush=True)
            stats = ck.stats().checkpoints
            for st in stats[reported:]:
                print(f"STAT {st.step} {st.stall_s + st.blocked_copy_s + st.cow_wait_s:.6f} {st.persist_s:.6f}", flush=True)
            reported = len(stats)


def run(directory: Path, steps: int, crash_at: int) -> int:
    if directory.exists():
        for f in list(directory.glob("store-*.pcc")) + [directory / "LOCK"]:
            f.unlink(missing_ok=True)  # the demo starts from scratch
    print(f"pccheck demo: training a numpy MLP ({sum(v.nbytes for v in init_state().values()) / 2**20:.1f} MiB "
          f"of state) in a child process, checkpointing every 10 steps into {directory}/")
    print(f"injecting a crash (SIGKILL) at step {crash_at}...")
    proc = subprocess.Popen([sys.executable, "-m", "pccheck.demo", "--child", "--dir", str(directory),
                             "--steps", str(steps)], stdout=subprocess.PIPE, text=True)
    digests: dict[int, str] = {}
    losses: dict[int, float] = {}
    blocked, persist = [], []
    durable = None
    for line in proc.stdout:  # type: ignore[union-attr]
        kind, *rest = line.split()
        if kind == "STATE":
            digests[int(rest[0])] = rest[1]
        elif kind == "STAT":
            blocked.append(float(rest[1]))
            persist.append(float(rest[2]))
        elif kind == "DURABLE" and rest[0] != "None":
            durable = int(rest[0])
        elif kind == "LOSS":
            losses[int(rest[0])] = float(rest[1])
            if int(rest[0]) >= crash_at:
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait()
    trained = max(losses) if losses else 0
    print(f"child killed after step {trained} (last step it saw durable: {durable})")

    t0 = time.perf_counter()
    r = pccheck.load_latest(directory)
    load_s = time.perf_counter() - t0
    match = digests.get(r.step) == digest(r.state)
    state = {k: v.copy() for k, v in r.state.items()}
    resumed = [train_step(state, s) for s in range(r.step + 1, r.step + 11)]

    rows = [
        ("steps trained before the crash", str(trained)),
        ("last step reported durable", str(durable)),
        ("recovered step (load_latest)", str(r.step)),
        ("steps to redo", str(trained - r.step)),
        ("checkpoints committed before the crash", str(len(persist))),
        ("median time training was blocked per checkpoint", f"{_median_ms(blocked)}"),
        ("median time to durable per checkpoint", f"{_median_ms(persist)}"),
        ("load time", f"{load_s * 1000:.1f} ms"),
        ("recovered bytes == training state at that step", "yes" if match else "NO"),
        (f"loss at step {r.step} -> after 10 resumed steps", f"{losses.get(r.step, float('nan')):.5f} -> {resumed[-1]:.5f}"),
    ]
    width = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")
    ok = match and (durable is None or r.step >= durable)
    print("\nOK: recovered the latest durable checkpoint bit-for-bit." if ok else "\nFAILED")
    return 0 if ok else 1


def _median_ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1000:.1f} ms" if xs else "n/a"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.environ.get("PCCHECK_DIR", "checkpoints"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--crash-at", type=int, default=None, help="step at which to kill (default: random in 60-140)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.dir, a.steps)
        return 0
    crash_at = a.crash_at or random.randint(60, 140)
    return run(Path(a.dir), a.steps, crash_at)


if __name__ == "__main__":
    sys.exit(main())
