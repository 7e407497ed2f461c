"""``python -m pccheck.demo``: train a tiny GPT, crash it, resume it bit for bit (``make demo``).

A character-level GPT defined below is trained on CPU on the embedded corpus, checkpointing
every 10 steps into ./checkpoints (or --dir) with pccheck (soft copy-on-write, N=2 in flight).
The demo SIGKILLs the training process at a random step (the injected crash), resumes in a fresh
process from ``load_latest`` (model, AdamW, LR schedule, RNG states), and checks that every loss
after the resumed step equals an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

CORPUS = (
    "a checkpoint is a promise kept for later. the trainer writes down where it stands, "
    "and when the machine goes away in the night, the next one picks up the page and reads on. "
    "most checkpoints are slow because the trainer waits for the disk. this one does not wait: "
    "it copies its state into memory it set aside at the start, and several writers carry the "
    "pages to the disk while the next steps run. a single word at the top of the file says which "
    "page is the newest whole one, and it only ever moves forward, after the page is safe. "
    "if the power fails in the middle, the old word still points at a page that is whole. "
) * 4
CONTEXT, WIDTH, HEADS, LAYERS, BATCH = 48, 128, 4, 2, 16


def _model():
    import torch
    from torch import nn

    vocab = sorted(set(CORPUS))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.attn = nn.MultiheadAttention(WIDTH, HEADS, dropout=0.1, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                     nn.Dropout(0.1))

        def forward(self, x):
            mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(len(vocab), WIDTH)
            self.pos = nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
            self.ln = nn.LayerNorm(WIDTH)
            self.head = nn.Linear(WIDTH, len(vocab), bias=False)
            self.head.weight = self.tok.weight  # tied embeddings: saved once

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            return self.head(self.ln(self.blocks(x)))

    return TinyGPT(), vocab


def _batch(step: int, data):
    import torch

    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=g)
    x = torch.stack([data[s:s + CONTEXT] for s in starts])
    y = torch.stack([data[s + 1:s + CONTEXT + 1] for s in starts])
    return x, y


def train(directory: str, steps: int, resume: bool) -> None:
    """The training process: prints 'START s', 'LOSS step value' and 'STATS json' lines."""
    import torch

    import pccheck

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, vocab = _model()
    data = torch.tensor([vocab.index(c) for c in CORPUS])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    start = 0
    if resume:
        t0 = time.perf_counter()
        r = pccheck.load_latest(directory, model=model, optimizer=opt, extra_state={"sched": sched})
        start = r.step
        print(f"LOADED {time.perf_counter() - t0:.6f}", flush=True)
    print(f"START {start}", flush=True)
    ck = pccheck.Checkpointer(model, opt, path=directory, extra_state={"sched": sched},
                              disk=pccheck.DiskOptions(every=10), max_concurrent=2, chunk_size=1 << 20)
    for step in range(start + 1, steps + 1):
        model.train()
        x, y = _batch(step, data)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ck.maybe_checkpoint(step)
        print(f"LOSS {step} {loss.item()!r}", flush=True)
        print(f"STATS {ck.stats().to_json()}", flush=True)
    ck.close()


def _child(directory: Path, steps: int, resume: bool = False) -> subprocess.Popen:
    args = [sys.executable, "-m", "pccheck.demo", "--child", "--dir", str(directory), "--steps", str(steps)]
    return subprocess.Popen(args + (["--resume"] if resume else []), stdout=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen, kill_at: int | None = None) -> dict:
    import json

    out: dict = {"losses": {}, "stats": None, "start": 0, "load_s": None}
    for line in proc.stdout:  # type: ignore[union-attr]
        kind, _, rest = line.strip().partition(" ")
        if kind == "LOSS":
            step, value = rest.split()
            out["losses"][int(step)] = float(value)
            if kill_at is not None and int(step) >= kill_at:
                proc.send_signal(signal.SIGKILL)  # the injected crash
                break
        elif kind == "STATS":
            out["stats"] = json.loads(rest)
        elif kind == "START":
            out["start"] = int(rest)
        elif kind == "LOADED":
            out["load_s"] = float(rest)
    proc.wait()
    return out


def run(directory: Path, steps: int, crash_at: int) -> int:
    import tempfile

    from ..persist.files import LOCK, STORE_GLOB

    if directory.exists():
        for f in list(directory.glob(STORE_GLOB)) + [directory / LOCK]:
            f.unlink(missing_ok=True)  # the demo starts from scratch
    print(f"pccheck demo: a tiny GPT trained on CPU for {steps} steps, checkpointing every 10 steps "
          f"into {directory}/ (N=2 concurrent, soft copy-on-write)")
    print(f"1. training, with a crash (SIGKILL) injected at step {crash_at} ...")
    crashed = _read(_child(directory, steps), kill_at=crash_at)
    print("2. resuming in a fresh process from load_latest ...")
    resumed = _read(_child(directory, steps, resume=True))
    print("3. an uninterrupted run of the same steps, for comparison ...")
    with tempfile.TemporaryDirectory() as ref_dir:
        reference = _read(_child(Path(ref_dir), steps))

    start = resumed["start"]
    tail = sorted(resumed["losses"])
    identical = bool(tail) and all(resumed["losses"][s] == reference["losses"][s] for s in tail)
    s = (crashed["stats"] or {}).get("summary", {})
    rows = [
        ("steps trained before the crash", str(max(crashed["losses"], default=0))),
        ("last step durable before the crash", str(s.get("last_durable_step"))),
        ("resumed at step (load_latest)", str(start)),
        ("load time", f"{resumed['load_s'] * 1000:.1f} ms" if resumed["load_s"] else "n/a"),
        ("checkpoints before the crash", str(s.get("count"))),
        ("median time training was blocked per checkpoint", _ms(s.get("median_stall_s"))),
        ("median time to durable per checkpoint", _ms(s.get("median_persist_s"))),
        (f"losses of steps {start + 1}..{steps} == uninterrupted run", "yes, bit for bit" if identical else "NO"),
        ("loss at the end (resumed / uninterrupted)",
         f"{resumed['losses'].get(steps, float('nan')):.6f} / {reference['losses'].get(steps, float('nan')):.6f}"),
    ]
    width = max(len(a) for a, _ in rows)
    print()
    for a, b in rows:
        print(f"  {a:<{width}}  {b}")
    print("\nOK: resumed from the last durable checkpoint; the rest of training is identical." if identical
          else "\nFAILED")
    return 0 if identical else 1


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=os.environ.get("PCCHECK_DIR", "checkpoints"))
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--crash-at", type=int, default=None, help="step at which to kill (default: random in 35-95)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        train(a.dir, a.steps, a.resume)
        return 0
    return run(Path(a.dir), a.steps, a.crash_at or random.randint(35, 95))


if __name__ == "__main__":
    sys.exit(main())
