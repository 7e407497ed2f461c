"""The PyTorch front-end: what a checkpoint holds and how load_latest puts it back."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import pccheck
from pccheck.persist.recovery import read_store, store_files
import _torch_train as tt


def _manifest_names(path) -> list[str]:
    r = pccheck.persist.recovery.load_newest(path)
    return list(r.state)


def test_every_dtype_no_casting_empty_and_views(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "fp16": torch.randn(3, 4).to(torch.float16),
        "int64": torch.tensor([2**62 + 1, -(2**63), 7], dtype=torch.int64),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "view_t": base.t(),
        "view_slice": base[::2, 3:8],
        "complex": torch.randn(4, dtype=torch.complex64),
        "uint8": torch.arange(250, dtype=torch.uint8),
        "f8": torch.randn(6).to(torch.float8_e4m3fn),
    }

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for k, v in tensors.items():
                self.register_buffer(k, v)

    m = Holder()
    with pccheck.Checkpointer(m, path=tmp_path, interval=1) as ck:
        ck.maybe_checkpoint(1)
    m2 = Holder()
    for b in m2.buffers():
        b.zero_() if b.dtype != torch.float8_e4m3fn else None
    r = pccheck.load_latest(tmp_path, model=m2)
    for k, v in tensors.items():
        got = getattr(m2, k)
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else got,
                           v.contiguous().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v), k
    # Without a model: the nested state, with tensors of the original dtypes.
    raw = pccheck.load_latest(tmp_path)
    assert raw.state["model"]["bf16"].dtype == torch.bfloat16 and raw.step == 1
    assert r.state["model"]["int64"][1].item() == -(2**63)


def test_tied_parameters_saved_once_and_stay_tied(tmp_path):
    tt.setup()
    model, optim, sched = tt.make(width=64)
    tt.train_step(model, optim, sched, 1)
    with pccheck.Checkpointer(model, optim, path=tmp_path, interval=1) as ck:
        ck.maybe_checkpoint(1)
    names = _manifest_names(tmp_path)
    assert "model/mid.weight" in names and "model/mid2.weight" not in names  # one storage, once
    model2, optim2, _ = tt.make(width=64)
    pccheck.load_latest(tmp_path, model=model2, optimizer=optim2)
    assert model2.mid.weight is model2.mid2.weight
    assert torch.equal(model2.mid.weight, model.mid.weight)


def test_lazy_optimizer_state_grows_after_first_checkpoint(tmp_path):
    """Adam has no state before its first step; the layout grows and a new generation follows."""
    tt.setup()
    model, optim, sched = tt.make(width=64)
    with pccheck.Checkpointer(model, optim, path=tmp_path, interval=1, extra_state={"sched": sched}) as ck:
        ck.checkpoint(0)          # before any step: no optimizer state at all
        ck.wait()
        gen0 = ck.generation
        tt.train_step(model, optim, sched, 1)
        ck.checkpoint(1)          # now exp_avg / exp_avg_sq / step exist
        ck.wait()
        assert ck.generation == gen0 + 1
    model2, optim2, sched2 = tt.make(width=64)
    r = pccheck.load_latest(tmp_path, model=model2, optimizer=optim2, extra_state={"sched": sched2})
    assert r.step == 1
    st1, st2 = optim.state_dict()["state"], optim2.state_dict()["state"]
    assert st1.keys() == st2.keys()
    for i in st1:
        for k in st1[i]:
            assert torch.equal(st1[i][k], st2[i][k]), (i, k)
    assert sched2.state_dict() == sched.state_dict()
    assert len(store_files(tmp_path)) == 1  # the old generation was retired after the commit


def test_extra_state_plain_values_rng_and_metadata(tmp_path):
    tt.setup()
    model, optim, sched = tt.make(width=32)
    scaler_like = torch.amp.GradScaler("cpu", init_scale=128.0, enabled=True)
    extra = {"sched": sched, "scaler": scaler_like, "epoch": 3, "cfg": {"name": "x", "betas": (0.9, 0.99),
                                                                        "inf": float("inf"), "ids": [1, 2]}}
    tt.train_step(model, optim, sched, 1)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    with pccheck.Checkpointer(model, optim, path=tmp_path, interval=1, extra_state=extra,
                              metadata={"run": "r1"}) as ck:
        ck.maybe_checkpoint(1, metadata={"loss": 0.5})
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model2, optim2, sched2 = tt.make(width=32)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=1.0, enabled=True)
    r = pccheck.load_latest(tmp_path, model=model2, optimizer=optim2,
                            extra_state={"sched": sched2, "scaler": scaler2})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect  # RNG restored
    assert scaler2.get_scale() == 128.0
    assert r.state["extra"]["epoch"] == 3
    assert r.state["extra"]["cfg"] == {"name": "x", "betas": (0.9, 0.99), "inf": float("inf"), "ids": [1, 2]}
    assert r.metadata == {"run": "r1", "loss": 0.5}
    assert r.state["step"] == 1


def test_map_location_and_arrays_checkpoint_with_model_is_an_error(tmp_path):
    with pccheck.Checkpointer({"a": np.arange(3)}, tmp_path / "arr", interval=1) as ck:
        ck.maybe_checkpoint(1)
    with pytest.raises(pccheck.ConfigError):
        pccheck.load_latest(tmp_path / "arr", model=torch.nn.Linear(2, 2))
    m = torch.nn.Linear(3, 3)
    with pccheck.Checkpointer(m, path=tmp_path / "m", interval=1) as ck:
        ck.maybe_checkpoint(1)
    r = pccheck.load_latest(tmp_path / "m", map_location="cpu")
    assert r.state["model"]["weight"].device.type == "cpu"


def test_unsupported_values_are_refused_with_their_path(tmp_path):
    m = torch.nn.Linear(2, 2)
    with pytest.raises(pccheck.ConfigError, match="extra/obj"):
        pccheck.Checkpointer(m, path=tmp_path, extra_state={"obj": object()})
    with pytest.raises(pccheck.ConfigError):
        pccheck.Checkpointer(m, path=tmp_path, soft_cow=True)  # soft copy-on-write needs the optimizer
    with pytest.raises(pccheck.ConfigError):
        pccheck.Checkpointer({"a": np.zeros(2)}, torch.optim.SGD(m.parameters(), lr=1), path=tmp_path)


def test_when_busy_skip_counts(tmp_path):
    from pccheck.orchestrator.copy_engine import ThrottledCopyEngine

    m = torch.nn.Linear(512, 1024)  # 2 MiB of parameters, copied in the background at 8 MiB/s
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pccheck.Checkpointer(m, opt, path=tmp_path, interval=1, max_concurrent=1, when_busy="skip",
                              chunk_size=64 << 10, copy_engine=ThrottledCopyEngine(8 << 20)) as ck:
        took = [ck.maybe_checkpoint(1), ck.maybe_checkpoint(2)]  # the first is still copying
        ck.wait()
        rep = ck.stats()
    assert took == [True, False]
    d = json.loads(rep.to_json())
    assert d["summary"]["skipped"] == 1 and d["summary"]["count"] == 1
    assert d["summary"]["last_durable_step"] == 1 and d["summary"]["last_durable_age_s"] >= 0
    assert d["checkpoints"][0]["gbps"] > 0
