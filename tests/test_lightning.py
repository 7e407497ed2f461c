"""pccheck.lightning: the CheckpointIO plugin with the real Lightning.

Trainer runs are tests/_lightning_child.py processes: one with Lightning's own TorchCheckpointIO
as the reference, one with pccheck's plugin, killed mid-run, then both resumed. pccheck must be
exactly as good as the default: the same restored state (torch.equal) and the same losses after.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import pccheck  # noqa: E402
from pccheck.lightning import CheckpointIO  # noqa: E402
from pccheck.integrations.named import read_pointer  # noqa: E402
from pccheck.persist.recovery import read_store, slot_base, store_files  # noqa: E402

CHILD = str(Path(__file__).with_name("_lightning_child.py"))


def run(io: str, root: Path, steps: int, resume: str = "none", world: int = 1) -> dict[int, str]:
    """A Lightning run to ``steps``; rank 0's losses by step (exact reprs)."""
    p = subprocess.run([sys.executable, CHILD, io, str(root), str(steps), resume, str(world)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return losses(p.stdout)


def losses(out: str) -> dict[int, str]:
    return {int(ln.split()[1]): ln.split()[2] for ln in out.splitlines() if ln.startswith("LOSS ")}


def kill_after(proc: subprocess.Popen, step: int, kill: Callable[[], None]) -> int:
    """Kills the run once rank 0 printed the loss of ``step``; the last step it printed. (The
    save at global step g + 1 follows the print of g, so a kill that comes late may let it in.)"""
    last = -1
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("LOSS "):
            last = int(line.split()[1])
            if last >= step:
                break
    kill()
    for line in proc.stdout:  # type: ignore[union-attr]  # what was printed before the kill landed
        if line.startswith("LOSS "):
            last = max(last, int(line.split()[1]))
    proc.wait()
    return last


def torch_file(root: Path, step: int) -> Path:
    found = list(root.glob(f"epoch=*-step={step}.ckpt"))
    assert len(found) == 1, (root, step, found)
    return found[0]


def assert_same(a: Any, b: Any, where: str = "ckpt") -> None:
    """Bit-equal nested checkpoints (tensors torch.equal with the same dtype)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def assert_same_training_state(mine: dict[str, Any], ref: dict[str, Any]) -> None:
    for key in ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers", "loops"):
        assert_same(mine[key], ref[key], key)
    # ModelCheckpoint's state differs only by the directories of the two runs.
    assert list(mine["callbacks"]) == list(ref["callbacks"])


def test_sigkill_then_resume_last_matches_lightnings_own_resume(tmp_path):
    ref_dir, mine_dir = tmp_path / "torch", tmp_path / "pccheck"
    run("torch", ref_dir, 40)
    kill_at = random.randint(12, 30)
    proc = subprocess.Popen([sys.executable, CHILD, "pccheck", str(mine_dir), "40", "none", "1", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    last = kill_after(proc, kill_at, lambda: proc.send_signal(signal.SIGKILL))

    mine = CheckpointIO().load_checkpoint(mine_dir / "last.ckpt")
    step = mine["global_step"]
    assert step % 5 == 0 and 5 <= step <= last + 1, (step, last)
    ref_file = torch_file(ref_dir, step)
    assert_same_training_state(mine, torch.load(ref_file, weights_only=True))

    resumed = run("pccheck", mine_dir, 40, "last")
    other = tmp_path / "torch-resume"
    other.mkdir()
    shutil.copy(ref_file, other / ref_file.name)
    expected = run("torch", other, 40, str(other / ref_file.name))
    assert sorted(resumed) == list(range(step, 40)), sorted(resumed)
    assert resumed == expected


@pytest.mark.slow  # `make test-slow`: four two-rank runs; the single-process tests cover the callback in `make test`
def test_fsdp2_model_parallel_strategy_through_pccheck_dcp_resumes_as_lightnings_own(tmp_path):
    # Lightning's ModelParallelStrategy on 2 CPU ranks (gloo), the model sharded with FSDP2; the
    # last layer's bias and weight are smaller than the mesh, so rank 1 holds empty shards.
    ref_dir, mine_dir = tmp_path / "torch", tmp_path / "pccheck"
    run("fsdp-torch", ref_dir, 20, world=2)
    kill_at = random.randint(11, 16)
    proc = subprocess.Popen([sys.executable, CHILD, "fsdp-pccheck+top1", str(mine_dir), "20", "none", "2", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    # both ranks (Lightning started rank 1 from rank 0)
    last = kill_after(proc, kill_at, lambda: os.killpg(proc.pid, signal.SIGKILL))

    assert (mine_dir / "last.ckpt").is_file() and not any(p.is_dir() for p in mine_dir.glob("*.ckpt"))
    # top-k retention removes the older names (ModelCheckpoint saves the new name, then removes
    # the old: a kill inside that save leaves both)
    names = sorted(int(re.search(r"step=(\d+)", p.name).group(1)) for p in mine_dir.glob("epoch=*.ckpt"))
    assert len(names) == 1 or names == [last + 1 - 5, last + 1], (names, last)
    resumed = run("fsdp-pccheck", mine_dir, 20, "last", world=2)
    step = min(resumed)
    assert step % 5 == 0 and 5 <= step <= last + 1, (step, last)
    ref_ckpt = torch_file(ref_dir, step)  # Lightning's own: a DCP directory
    assert ref_ckpt.is_dir()
    expected = run("fsdp-torch", tmp_path / "torch-resume", 20, str(ref_ckpt), world=2)
    assert sorted(resumed) == list(range(step, 20)), sorted(resumed)
    assert resumed == expected
    # last.ckpt as a power cut before its pointer was durable leaves it (empty): the newest
    # complete save is loaded, the one of step 20.
    (mine_dir / "last.ckpt").write_bytes(b"")
    assert sorted(run("fsdp-pccheck", mine_dir, 22, "last", world=2)) == [20, 21]


@pytest.mark.slow  # a 2-rank FSDP2 Lightning job and its resume: a minute on 2 vCPUs
def test_fsdp2_full_checkpoints_through_the_pccheck_plugin_resume_as_lightnings_own(tmp_path):
    # save_distributed_checkpoint=False: rank 0 saves the full state through pccheck's CheckpointIO;
    # Lightning's own load reads only torch.save files there, pccheck's strategy loads the name.
    ref_dir, mine_dir = tmp_path / "torch", tmp_path / "pccheck"
    run("fsdp-full-torch", ref_dir, 10, world=2)
    run("fsdp-full-pccheck", mine_dir, 10, world=2)
    ptr = read_pointer(mine_dir / "last.ckpt")
    assert ptr is not None and ptr.framework == "lightning" and ptr.step == 10
    resumed = run("fsdp-full-pccheck", mine_dir, 15, "last", world=2)
    expected = run("fsdp-full-torch", ref_dir, 15, str(torch_file(ref_dir, 10)), world=2)
    assert sorted(resumed) == list(range(10, 15)) and resumed == expected


@pytest.mark.slow  # `make test-slow`: four two-rank runs; test_distributed covers DDP on gloo in `make test`
def test_ddp_two_ranks_on_gloo_resume_matches_lightnings_own(tmp_path):
    ref_dir, mine_dir = tmp_path / "torch", tmp_path / "pccheck"
    run("torch", ref_dir, 10, world=2)
    run("pccheck", mine_dir, 10, world=2)
    mine = CheckpointIO().load_checkpoint(mine_dir / "last.ckpt")
    assert mine["global_step"] == 10
    assert_same_training_state(mine, torch.load(torch_file(ref_dir, 10), weights_only=True))
    resumed = run("pccheck", mine_dir, 15, "last", world=2)
    expected = run("torch", ref_dir, 15, str(torch_file(ref_dir, 10)), world=2)
    assert sorted(resumed) == list(range(10, 15)) and resumed == expected


def _checkpoint(step: int, **extra: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"epoch": 0, "global_step": step, "state_dict": {"w": torch.randn(64, generator=g),
                                                            "h": torch.randn(8, generator=g).bfloat16()},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.ones(64) * step}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]}],
            "loops": {"fit_loop": {"total": {"ready": step}}}, **extra}


def test_values_json_cannot_hold_go_through_torch_weights_only(tmp_path):
    io = CheckpointIO(tmp_path / "store")
    extra = {"hyper_parameters": {"blob": b"\x00\xff", "ids": {3, 4}, "lr": 0.1, "inf": float("inf")}}
    io.save_checkpoint(_checkpoint(3, **extra), tmp_path / "a.ckpt")
    io.teardown()
    back = CheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    assert_same(back, _checkpoint(3, **extra))

    io.save_checkpoint(_checkpoint(4, hyper_parameters={"args": argparse.Namespace(lr=0.1)}), tmp_path / "b.ckpt")
    io.teardown()
    with pytest.raises(pccheck.ConfigError, match=r"'hyper_parameters/args'.*weights_only=True.*Namespace"):
        CheckpointIO().load_checkpoint(tmp_path / "b.ckpt")
    with pytest.raises(pccheck.ConfigError, match=r"ckpt/hyper_parameters/fn: cannot checkpoint a function"):
        io.save_checkpoint(_checkpoint(5, hyper_parameters={"fn": lambda x: x}), tmp_path / "c.ckpt")
    assert not (tmp_path / "c.ckpt").exists()
    assert_same(CheckpointIO().load_checkpoint(tmp_path / "a.ckpt"), _checkpoint(3, **extra))  # still there


def _flip(store: Path, newest: bool = True) -> int:
    """Flips one data byte of the store's newest (or oldest) slot; returns its step."""
    image = read_store(store_files(store)[0][1])
    st = (max if newest else min)((s for s in image.slots if s.meta), key=lambda s: s.meta["counter"])
    with open(image.path, "r+b") as f:
        f.seek(slot_base(image, st.slot))
        b = f.read(1)
        f.seek(slot_base(image, st.slot))
        f.write(bytes([b[0] ^ 0xFF]))
    return st.meta["step"]


def test_names_retention_and_fallbacks(tmp_path):
    io = CheckpointIO(tmp_path / "store", max_concurrent=1)  # two slots
    for step, name in [(5, "epoch=0-step=5.ckpt"), (10, "epoch=0-step=10.ckpt"), (10, "last.ckpt"),
                       (15, "epoch=0-step=15.ckpt"), (15, "last.ckpt")]:
        io.save_checkpoint(_checkpoint(step), tmp_path / name)
        io.wait()
    assert_same(io.load_checkpoint(tmp_path / "epoch=0-step=15.ckpt"), _checkpoint(15))
    # step 5's slot was taken by newer commits: a clear error, never another checkpoint.
    with pytest.raises(pccheck.NoCheckpointError, match=r"no valid checkpoint named 'epoch=0-step=5.ckpt'"):
        io.load_checkpoint(tmp_path / "epoch=0-step=5.ckpt")
    # Lightning's top-k removal takes the name away; the newest valid checkpoint stays loadable.
    io.remove_checkpoint(tmp_path / "epoch=0-step=15.ckpt")
    assert not (tmp_path / "epoch=0-step=15.ckpt").exists()
    io.teardown()
    assert CheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 15
    # A pointer a power cut left empty: "last" loads the newest valid checkpoint; another name says why not.
    (tmp_path / "last-v1.ckpt").write_bytes(b"")
    (tmp_path / "epoch=0-step=20.ckpt").write_bytes(b"")
    assert CheckpointIO(tmp_path / "store").load_checkpoint(tmp_path / "last-v1.ckpt")["global_step"] == 15
    with pytest.raises(pccheck.NoCheckpointError, match="is empty"):
        CheckpointIO(tmp_path / "store").load_checkpoint(tmp_path / "epoch=0-step=20.ckpt")
    # A damaged newest "last": the newest valid checkpoint of any name is loaded (step 15's other
    # copy); with that damaged too, nothing valid is left, and that is what the error says.
    assert _flip(tmp_path / "store") == 15
    assert_same(CheckpointIO().load_checkpoint(tmp_path / "last.ckpt"), _checkpoint(15))
    assert _flip(tmp_path / "store", newest=False) == 15
    with pytest.raises(pccheck.NoCheckpointError, match="checksum mismatch"):
        CheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    # A torch.save checkpoint from before pccheck loads through the plugin (weights_only=True).
    torch.save(_checkpoint(2), tmp_path / "old.ckpt")
    assert_same(CheckpointIO().load_checkpoint(tmp_path / "old.ckpt"), _checkpoint(2))
    with pytest.raises(FileNotFoundError):
        CheckpointIO().load_checkpoint(tmp_path / "missing.ckpt")


def test_the_optimizer_step_waits_for_its_state_to_be_copied(tmp_path):
    model = torch.nn.Linear(4096, 8192)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 4096)).sum().backward()
    opt.step()
    io = CheckpointIO(tmp_path / "store")
    for step in (1, 2, 3):
        ckpt = {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]}
        want = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        io.save_checkpoint(ckpt, tmp_path / "last.ckpt")
        opt.step()  # right away: changes exp_avg, exp_avg_sq and step in place
        io.wait()
        back = CheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
        assert back["global_step"] == step
        assert_same(back["optimizer_states"][0]["state"][0], want)
    io.teardown()
    assert io.errors == []
    # The guard was needed: some step found its optimizer state still being copied, and waited.
    assert sum(st.cow_wait_s for st in io.stats()) > 0, io.stats()


def test_import_pccheck_imports_no_framework():
    code = "import sys, pccheck; assert not {'lightning', 'transformers', 'accelerate'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": ""})
