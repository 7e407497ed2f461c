"""pccheck.hf: the Trainer callback and the Accelerate hooks, with the real libraries.

Trainer runs are tests/_hf_child.py processes: a tiny GPT-2 (from a config, dropout on) with the
Trainer's own checkpoints as the reference, and with pccheck.hf.Callback, SIGKILLed mid-run and
resumed through ``cb.latest()``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import pccheck  # noqa: E402
from pccheck.errors import ConfigError  # noqa: E402
from conftest import assert_same_tree  # noqa: E402
from pccheck.hf import Callback  # noqa: E402

CHILD = str(Path(__file__).with_name("_hf_child.py"))
STEPS = 20  # 16 batches an epoch: the runs cross an epoch boundary


def child(*args: str, killed: bool = False) -> str:
    # One intra-op thread: a CPU kernel's float reductions then run in one order whatever the load on
    # the machine, so two runs of the same steps are bit-identical (the comparisons below rely on it).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, CHILD, *args], capture_output=True, text=True, timeout=300, env=env)
    if killed:
        assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr[-3000:])
    else:
        assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def line(out: str, tag: str) -> str:
    return next(ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith(tag + " "))


def final(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "final.pt", weights_only=True)


def load(path: Path) -> Any:
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed it
    with torch.serialization.safe_globals([core.multiarray._reconstruct, np.ndarray, np.dtype,
                                           type(np.dtype(np.uint32))]):
        return torch.load(path, weights_only=True)


@pytest.mark.parametrize("setting", ["plain", pytest.param("eval", marks=pytest.mark.slow)])
def test_sigkill_then_resume_from_latest_matches_the_trainers_own_resume(tmp_path, setting):
    """plain: checkpoints and logs every 5 steps. eval: checkpoints and evaluates every 4 steps
    (the evaluation steps ReduceLROnPlateau and sets the best metric after on_evaluate), logs every
    5: a checkpoint must hold the state after all of that, as the Trainer's own does."""
    own, pc, own_resumed = tmp_path / "own", tmp_path / "pc", tmp_path / "own-resumed"
    uninterrupted = json.loads(line(child("trainer", str(own), "own", str(STEPS), "-1", setting), "HISTORY"))

    child("trainer", str(pc), "pccheck", str(STEPS), "13", setting, killed=True)
    assert not list(pc.glob("checkpoint-*")), "the Trainer's own step saves are off"
    out = child("trainer", str(pc), "pccheck", str(STEPS), "-1", setting)
    resumed = Path(line(out, "RESUMED"))
    step = int(resumed.name.removeprefix("checkpoint-"))
    # the newest durable checkpoint before the kill at step 13
    assert step in ((8, 12) if setting == "eval" else (5, 10)), resumed
    assert not resumed.exists(), "the materialized directory is removed once training runs"

    # What pccheck restored is what the Trainer's own save wrote at that step, file by file.
    mine, ref = pc / "resumed-from", own / f"checkpoint-{step}"
    from safetensors.torch import load_file

    weights, saved = torch.load(mine / "pytorch_model.bin", weights_only=True), load_file(ref / "model.safetensors")
    assert set(saved) <= set(weights) and set(weights) - set(saved) == {"lm_head.weight"}  # tied to wte
    assert_same_tree({k: weights[k] for k in saved}, saved, "model")
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        assert_same_tree(load(mine / name), load(ref / name), name)
    a, b = (json.loads((d / "trainer_state.json").read_text()) for d in (mine, ref))
    a.pop("stateful_callbacks"), b.pop("stateful_callbacks")  # TrainerControl: should_save differs
    if setting == "eval":
        assert b["best_global_step"] == step and b["best_metric"] is not None
        b.pop("best_model_checkpoint")  # the Trainer's own directory, which pccheck does not write
        assert a.pop("best_model_checkpoint") is None
    # total_flos is a statistic the Trainer adds its flop counter to when it logs or saves; a
    # callback cannot read that counter, so pccheck's holds the count as of the step's last log.
    flos = a.pop("total_flos"), b.pop("total_flos")
    assert flos[0] == flos[1] if step % 5 == 0 else 0 < flos[0] < flos[1], flos
    a["log_history"], b["log_history"] = untimed(a["log_history"]), untimed(b["log_history"])
    assert a == b

    # The Trainer's own resume from the same step.
    own_out = child("trainer", str(own_resumed), f"own:{ref}", str(STEPS), "-1", setting)
    # In this setting the Trainer's own resume is bit-exact (it restores the dropout RNG states and
    # re-draws the data order from the seed), so pccheck's resume must equal the uninterrupted run;
    # and it must equal the Trainer's own resume in any case.
    assert_same_tree(final(own_resumed), final(own), "the Trainer's own resume vs the uninterrupted run")
    assert_same_tree(final(pc), final(own_resumed), "pccheck's resume vs the Trainer's own")
    assert_same_tree(final(pc), final(own), "pccheck's resume vs the uninterrupted run")
    history, own_history = untimed(json.loads(line(out, "HISTORY"))), untimed(json.loads(line(own_out, "HISTORY")))
    if step % 5:  # the total_flos statistic, as above
        assert history[-1].pop("total_flos") < own_history[-1].pop("total_flos")
    assert history == own_history
    # The final summary's train_loss averages the steps this process ran (the Trainer's own resume
    # does the same), and so does the first logged loss after a resume between two logs; every
    # other logged figure is as in the uninterrupted run.
    uninterrupted = untimed(uninterrupted)
    if step % 5:
        i = next(i for i, h in enumerate(history) if "loss" in h and h["step"] > step)
        assert history[i].pop("loss") != uninterrupted[i].pop("loss")
    assert history[:-1] == uninterrupted[:-1] and "train_loss" in history[-1]


def untimed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A log history without its wall-clock figures."""
    return [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k} for h in history]


def test_a_run_stopped_early_is_checkpointed_at_its_last_step(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class Stop(TrainerCallback):  # as early stopping does, after the callback in the list
        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            control.should_training_stop = state.global_step == 7

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=97, n_positions=16))
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 97, (32, 8))]
    args = TrainingArguments(str(tmp_path / "out"), max_steps=20, per_device_train_batch_size=4,
                             save_strategy="epoch", report_to=[], use_cpu=True, disable_tqdm=True)
    cb = Callback(tmp_path / "pc", interval=5)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, Stop()]).train()
    # step 7's may commit before step 5's (two in flight): then step 5's reads as superseded
    outcomes = {s.step: s.outcome for s in cb.stats().checkpoints}
    assert outcomes in ({5: "committed", 7: "committed"}, {5: "superseded", 7: "committed"}), outcomes
    assert not list((tmp_path / "out").glob("checkpoint-*")), "the epoch save strategy's saves are off too"
    resume = Path(cb.latest(scratch_dir=tmp_path / "scratch"))
    assert resume.parent.parent == tmp_path / "scratch" and resume.name == "checkpoint-7"
    assert json.loads((resume / "trainer_state.json").read_text())["global_step"] == 7
    cb.latest()  # the next call removes what the last one wrote
    assert not resume.exists()


def test_latest_writes_to_dev_shm_only_with_room_to_spare(tmp_path):
    from pccheck.integrations.hf import _scratch_dir

    assert _scratch_dir(None, 1 << 60) is None  # too big for any tmpfs: the system's temporary directory
    if os.access("/dev/shm", os.W_OK) and shutil.disk_usage("/dev/shm").free >= (2 << 20) + (64 << 20):
        assert _scratch_dir(None, 1 << 20) == "/dev/shm"  # twice the need and 64 MiB to spare
    assert _scratch_dir(tmp_path / "mine", 1 << 60) == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()


@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_save_state_load_state_round_trip_through_pccheck(tmp_path, processes):
    if processes == 1:
        out = child("accelerate", str(tmp_path))
    else:  # the main process keeps the weights; every process loads them (gloo on CPU)
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc_per_node={processes}", CHILD, "accelerate", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        out = p.stdout
    assert line(out, "SAME") == f"True PROCESSES {processes}"
    files = json.loads(line(out, "FILES"))
    assert "pccheck-models.json" in files
    assert not [f for f in files if f.startswith(("model", "pytorch_model"))], files  # weights: pccheck's
    assert int(line(out, "COMMITTED")) == 1


def test_bad_input_gets_a_clear_error(tmp_path):
    for interval in (0, True, 2.5):
        with pytest.raises(ConfigError, match="interval"):
            Callback(tmp_path, interval=interval)
    with pytest.raises(ConfigError, match="no_such_option"):
        Callback(tmp_path, no_such_option=1)
    with pytest.raises(ConfigError, match="on_error"):
        Callback(tmp_path, on_error="ignore")
    assert Callback(tmp_path / "nothing-yet").latest() is None
    # A store another front-end wrote is not taken for a Trainer checkpoint.
    with pccheck.Checkpointer({"w": np.arange(4.0)}, tmp_path / "arrays") as ck:
        ck.checkpoint(1)
    with pytest.raises(ConfigError, match="not written by pccheck.hf.Callback"):
        Callback(tmp_path / "arrays").latest()
    with pytest.raises(ConfigError, match="Accelerator"):
        pccheck.hf.register_accelerate(object(), tmp_path)
