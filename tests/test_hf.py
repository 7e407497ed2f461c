"""pccheck.hf: the Trainer callback and the Accelerate hooks, with the real libraries (issue 17).

Trainer runs are tests/_hf_child.py processes: a tiny GPT-2 (from a config, dropout on) with the
Trainer's own checkpoints as the reference, and with pccheck.hf.Callback, SIGKILLed mid-run and
resumed through ``cb.latest()``.
"""

from __future__ import annotations

import json
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
    p = subprocess.run([sys.executable, CHILD, *args], capture_output=True, text=True, timeout=300)
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


def test_sigkill_then_resume_from_latest_matches_the_trainers_own_resume(tmp_path):
    own, pc, own_resumed = tmp_path / "own", tmp_path / "pc", tmp_path / "own-resumed"
    uninterrupted = json.loads(line(child("trainer", str(own), "own", str(STEPS)), "HISTORY"))

    child("trainer", str(pc), "pccheck", str(STEPS), "13", killed=True)
    assert not list(pc.glob("checkpoint-*")), "the Trainer's own step saves are off"
    out = child("trainer", str(pc), "pccheck", str(STEPS))
    resumed = Path(line(out, "RESUMED"))
    step = int(resumed.name.removeprefix("checkpoint-"))
    assert step in (5, 10), resumed  # the newest durable checkpoint before the kill at step 13
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
    assert a == b

    # The Trainer's own resume from the same step.
    own_out = child("trainer", str(own_resumed), f"own:{ref}", str(STEPS))
    # In this setting the Trainer's own resume is bit-exact (it restores the dropout RNG states and
    # re-draws the data order from the seed), so pccheck's resume must equal the uninterrupted run;
    # and it must equal the Trainer's own resume in any case.
    assert_same_tree(final(own_resumed), final(own), "the Trainer's own resume vs the uninterrupted run")
    assert_same_tree(final(pc), final(own_resumed), "pccheck's resume vs the Trainer's own")
    assert_same_tree(final(pc), final(own), "pccheck's resume vs the uninterrupted run")
    history = untimed(json.loads(line(out, "HISTORY")))
    assert history == untimed(json.loads(line(own_out, "HISTORY")))
    # The final summary's train_loss averages the steps this process ran (the Trainer's own resume
    # does the same); every logged step before it is as in the uninterrupted run.
    assert history[:-1] == untimed(uninterrupted)[:-1] and "train_loss" in history[-1]


def untimed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A log history without its wall-clock figures."""
    return [{k: v for k, v in h.items() if "runtime" not in k and "per_second" not in k} for h in history]


def test_accelerate_save_state_load_state_round_trip_through_pccheck(tmp_path):
    out = child("accelerate", str(tmp_path))
    assert line(out, "SAME") == "True"
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
