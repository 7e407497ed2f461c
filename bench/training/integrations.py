"""Framework integrations: a Lightning run and a Hugging Face Trainer run that checkpoint every
``--every`` steps. Lightning: its default ``TorchCheckpointIO``, its ``AsyncCheckpointIO``, and
``pccheck.lightning``. Trainer: its own checkpoints (``save_steps``) and ``pccheck.hf.Callback``.

    python -m bench.integrations [--size 1GiB] [--steps 40] [--every 10] [--repeats 2]
                                 [--json bench/results/integrations/latest.json]

The model: Linear(2048, 2048) blocks with AdamW, so that parameters plus the optimizer's two
moments make ``--size``; batches of 16 random rows on the CPU (the same for both frameworks).
Each variant runs in a fresh process (``--repeats`` times, interleaved), keeping the newest
checkpoint (Lightning's ``save_top_k=1``, the Trainer's ``save_total_limit=1``). Measured:
iterations per second over the run (after 2 warm-up steps), the time the training thread is
blocked per save (Lightning: the plugin's ``save_checkpoint``; the Trainer: from the end of a
saving step to the start of the next; for pccheck also the optimizer step's wait for the state
still being copied), and the wait at the end for saves still in flight. A run of each framework
without checkpoints gives its baseline it/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import fmt, format_size, host_info, machine_label, parse_size, \
    pccheck_path_first, print_table, pyplot, save_figure, scratch_dir, versions, write_json

LIGHTNING = ("none", "torch", "async", "pccheck")
HF = ("hf-none", "hf-own", "hf-pccheck")
VARIANTS = LIGHTNING + HF
WIDTH = 2048


def blocks_for(size: int) -> int:
    """Linear(WIDTH, WIDTH) blocks whose parameters and two AdamW moments (fp32) make ``size``."""
    return max(1, round(size / (3 * 4 * WIDTH * (WIDTH + 1))))


def child(variant: str, size: int, steps: int, every: int, root: Path, out: Path) -> None:
    """One Lightning run (in its own process); writes its measures to ``out`` as JSON."""
    if variant in HF:
        return hf_child(variant, size, steps, every, root, out)
    import lightning as L
    import torch
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from torch.utils.data import DataLoader, TensorDataset

    class Timed(CheckpointIO):
        """Times the inner plugin's calls on the training thread."""

        def __init__(self, inner: Any) -> None:
            self.inner, self.blocking, self.teardown_s = inner, [], 0.0

        def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
            t0 = time.perf_counter()
            self.inner.save_checkpoint(checkpoint, path, storage_options)
            self.blocking.append(time.perf_counter() - t0)

        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None) -> dict:
            return self.inner.load_checkpoint(path, map_location, weights_only)

        def remove_checkpoint(self, path: Any) -> None:
            self.inner.remove_checkpoint(path)

        def teardown(self) -> None:
            t0 = time.perf_counter()
            self.inner.teardown()
            self.teardown_s += time.perf_counter() - t0

    class Clock(Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.stamps.append(time.perf_counter())

    class Net(L.LightningModule):
        def __init__(self, blocks: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(blocks)])

        def training_step(self, batch: Any, idx: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    blocks = blocks_for(size)
    data = DataLoader(TensorDataset(torch.randn(16 * steps, WIDTH)), batch_size=16)
    inner = {"torch": TorchCheckpointIO, "async": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
             "pccheck": _pccheck_io, "none": None}[variant]
    io = Timed(inner()) if inner is not None else None
    clock = Clock()
    callbacks: list[Any] = [clock]
    if io is not None:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=1))
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=io is not None, callbacks=callbacks,
                        plugins=[io] if io is not None else [])
    t0 = time.perf_counter()
    trainer.fit(Net(blocks), data)
    total = time.perf_counter() - t0
    s = clock.stamps[2:]
    res: dict[str, Any] = {"variant": variant, "blocks": blocks, "state_bytes": 3 * 4 * blocks * WIDTH * (WIDTH + 1),
                           "it_per_s": (len(s) - 1) / (s[-1] - s[0]), "fit_s": total,
                           "blocking_s": io.blocking if io else [], "teardown_s": io.teardown_s if io else 0.0}
    if variant == "pccheck":
        stats = io.inner.stats()  # type: ignore[union-attr]
        res["cow_wait_s"] = [st.cow_wait_s for st in stats]
        res["outcomes"] = [st.outcome for st in stats]
    out.write_text(json.dumps(res))


def hf_child(variant: str, size: int, steps: int, every: int, root: Path, out: Path) -> None:
    """One Hugging Face Trainer run (in its own process); writes its measures to ``out``."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import pccheck.hf

    class Net(torch.nn.Module):
        def __init__(self, blocks: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(blocks)])

        def forward(self, x: Any) -> dict[str, Any]:
            return {"loss": self.net(x).pow(2).mean()}

    class Clock(TrainerCallback):
        """Step ends, first in the list, and step starts, last in the list: a save the Trainer
        makes after a step's end, or a callback makes at either event, falls between."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.begins: list[float] = []

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    class Started(TrainerCallback):
        def __init__(self, clock: Clock) -> None:
            self.clock = clock

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.clock.begins.append(time.perf_counter())

    torch.manual_seed(0)
    blocks = blocks_for(size)
    data = [{"x": x} for x in torch.randn(16 * steps, WIDTH)]
    args = TrainingArguments(str(root), max_steps=steps, per_device_train_batch_size=16, learning_rate=1e-4,
                             optim="adamw_torch", logging_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, save_strategy="steps", save_steps=every, save_total_limit=1)
    clock = Clock()
    callbacks: list[Any] = [clock]
    pc = pccheck.hf.Callback(root / "pccheck", interval=every) if variant == "hf-pccheck" else None
    if pc is not None:
        callbacks.append(pc)
    elif variant == "hf-none":
        args.save_strategy = "no"
    callbacks.append(Started(clock))
    trainer = Trainer(model=Net(blocks), args=args, train_dataset=data, callbacks=callbacks)
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    s = clock.ends[2:]
    gaps = [b - e for e, b in zip(clock.ends, clock.begins[1:])]
    saving = [gaps[i - 1] for i in range(every, len(gaps) + 1, every)] if variant != "hf-none" else []
    res: dict[str, Any] = {"variant": variant, "blocks": blocks, "state_bytes": 3 * 4 * blocks * WIDTH * (WIDTH + 1),
                           "it_per_s": (len(s) - 1) / (s[-1] - s[0]), "fit_s": total, "blocking_s": saving,
                           "teardown_s": total - (clock.ends[-1] - t0)}
    if pc is not None:
        stats = pc.stats().checkpoints
        res["cow_wait_s"] = [st.cow_wait_s for st in stats][:len(saving)]
        res["outcomes"] = [st.outcome for st in stats]
    out.write_text(json.dumps(res))


def _pccheck_io() -> Any:
    import pccheck.lightning

    return pccheck.lightning.CheckpointIO()


def run_child(variant: str, size: int, steps: int, every: int, work: Path) -> dict[str, Any]:
    out = work / f"{variant}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pccheck_path_first(), str(BENCH_DIR.parent)])}
    p = subprocess.run([sys.executable, "-m", "bench.integrations", "--child", variant, "--size", str(size),
                        "--steps", str(steps), "--every", str(every), "--dir", str(work / variant), "--json", str(out)],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"the {variant} run failed:\n{p.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize_runs(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    med = statistics.median
    out: dict[str, dict[str, Any]] = {}
    for v, rs in runs.items():
        blocking = [b + w for r in rs for b, w in zip(r["blocking_s"], r.get("cow_wait_s", [0.0] * len(r["blocking_s"])))]
        out[v] = {"it_per_s": med(r["it_per_s"] for r in rs), "blocking_per_save_s": med(blocking) if blocking else None,
                  "teardown_s": med(r["teardown_s"] for r in rs), "saves": len(blocking)}
    for v in out:
        out[v]["slowdown"] = out["hf-none" if v in HF else "none"]["it_per_s"] / out[v]["it_per_s"]
    return out


def plot(path: Path, res: dict[str, Any]) -> bool:
    plt = pyplot(path)
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, title, names in ((axes[0], "Lightning", ["torch", "async", "pccheck"]),
                             (axes[1], "HF Trainer", ["hf-own", "hf-pccheck"])):
        ax.bar(names, [res["summary"][v]["blocking_per_save_s"] for v in names],
               color=["#999", "#bbb", "#2a7"][-len(names):])
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("training blocked per save (s)")
    fig.suptitle(f"{format_size(res['state_bytes'])} state; {res['machine']}", fontsize=8)
    save_figure(fig, path)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.integrations", description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=result_path("integrations"))
    ap.add_argument("--dir", type=Path, default=BENCH_DIR / "_scratch")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    size = parse_size(str(args.size))
    if args.child:
        child(args.child, size, args.steps, args.every, Path(args.dir), Path(args.json))
        return 0
    if args.steps < args.every + 3 or args.every < 1 or args.repeats < 1:
        ap.error("need --every >= 1, --steps >= --every + 3 and --repeats >= 1")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    with scratch_dir(args.dir) as work:
        host = host_info(work)
        for rep in range(args.repeats):
            for v in VARIANTS:
                print(f"integrations: round {rep + 1}/{args.repeats}: {v}", flush=True)
                runs[v].append(run_child(v, size, args.steps, args.every, work))
    summary = summarize_runs(runs)
    ratio = summary["pccheck"]["blocking_per_save_s"] / summary["async"]["blocking_per_save_s"]
    hf_ratio = summary["hf-pccheck"]["blocking_per_save_s"] / summary["hf-own"]["blocking_per_save_s"]
    res = {"benchmark": "bench.integrations", "date": time.strftime("%Y-%m-%d %H:%M %Z"), "host": host,
           "machine": machine_label(host), "versions": versions(["lightning", "transformers", "torch"]),
           "state_bytes": runs["pccheck"][0]["state_bytes"], "steps": args.steps, "every": args.every,
           "repeats": args.repeats, "runs": runs, "summary": summary,
           "targets": [{"what": "Lightning: blocking per save, pccheck / AsyncCheckpointIO", "limit": 0.3,
                        "value": ratio, "met": ratio <= 0.3}],
           "hf_blocking_ratio": hf_ratio,  # pccheck.hf / the Trainer's own saves (no target set)
           "command": "python -m bench.integrations " + " ".join(argv if argv is not None else sys.argv[1:])}
    print_table(f"{format_size(res['state_bytes'])} state (params + AdamW), a save every {args.every} steps; "
                f"medians of {args.repeats} ({res['machine']})",
                ["run", "it/s", "slowdown", "blocked per save (s)", "wait at the end (s)"],
                [[v, fmt(s["it_per_s"], ".3f"), fmt(s["slowdown"], ".3f"), fmt(s["blocking_per_save_s"], ".3f"),
                  fmt(s["teardown_s"], ".3f")] for v, s in summary.items()])
    print(f"HF Trainer: blocking per save, pccheck.hf / the Trainer's own: {hf_ratio:.3f}")
    for t in res["targets"]:
        print(f"target: {t['what']}: {t['value']:.3f} (limit {t['limit']}) {'MET' if t['met'] else 'MISSED'}")
    write_json(args.json, res)
    plot(Path(args.json).with_suffix(".png"), res)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
