"""Lazy (on-demand) restore and pccheck.aio."""

from __future__ import annotations

import asyncio
import struct
import threading
import time

import numpy as np
import pytest
import torch

import pccheck
import pccheck.aio
from pccheck.lazy import loader as lazy_loader
from pccheck.persist.recovery import read_manifest, read_store, store_files

BLOCKS = 8


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)  # registered first, runs second
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.norm(torch.relu(self.lin(x)))


def _make(width: int = 32):
    torch.manual_seed(1)
    model = torch.nn.Sequential(*[Block(width) for _ in range(BLOCKS)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    return model, opt, sched


def _step(model, opt, sched, x):
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item().hex()


def _trained_store(path, steps=(1, 2, 3), width: int = 32):
    model, opt, sched = _make(width)
    x = torch.randn(8, width)
    with pccheck.Checkpointer(model, opt, path, extra_state={"sched": sched}, interval=1) as ck:
        for s in steps:
            _step(model, opt, sched, x)
            ck.maybe_checkpoint(s)
    return x


def _hold_back(monkeypatch, *prefixes: str) -> threading.Event:
    """Makes the lazy loader wait, before reading any array whose name starts with one of
    ``prefixes``, until the returned event is set (at most 30 s)."""
    gate = threading.Event()
    real = lazy_loader.read_entry

    def gated(fd, base, entry, crc, into=None):
        if entry.name.startswith(prefixes):
            gate.wait(30)
        return real(fd, base, entry, crc, into=into)

    monkeypatch.setattr(lazy_loader, "read_entry", gated)
    return gate


def test_lazy_restore_trains_bit_for_bit_like_an_eager_one(tmp_path):
    x = _trained_store(tmp_path)
    runs = []
    for lazy in (False, True):
        model, opt, sched = _make()
        r = pccheck.load_latest(tmp_path, model=model, optimizer=opt, extra_state={"sched": sched}, lazy=lazy)
        assert r.step == 3 and r.state["step"] == 3
        torch.manual_seed(7)
        losses = [_step(model, opt, sched, x) for _ in range(10)]  # lazy: starts before r.wait()
        if lazy:
            r.wait()
            assert r.done
            assert not any(m._forward_pre_hooks for m in model.modules()) and not opt._optimizer_step_pre_hooks
        runs.append((losses, model.state_dict(), opt.state_dict(), sched.last_epoch))
    (l0, m0, o0, e0), (l1, m1, o1, e1) = runs
    assert l0 == l1 and e0 == e1
    assert all(torch.equal(m0[k], m1[k]) for k in m0)
    for i, st in o0["state"].items():
        assert all(torch.equal(v, o1["state"][i][k]) if torch.is_tensor(v) else v == o1["state"][i][k]
                   for k, v in st.items())


def test_the_first_use_order_is_recorded_at_save_time(tmp_path):
    _trained_store(tmp_path, steps=(1,))
    image = read_store(store_files(tmp_path)[0][1])
    slot = next(s.slot for s in image.slots if s.meta)
    with open(image.path, "rb") as f:
        order = read_manifest(image, slot, f.fileno()).tree["order"]
    # Block registers norm before lin but runs lin first: forward order wins.
    assert order[:4] == ["model/0.lin.weight", "model/0.lin.bias", "model/0.norm.weight", "model/0.norm.bias"]
    assert order.index("model/7.norm.bias") < min(i for i, n in enumerate(order) if n.startswith("optimizer/"))


def test_a_module_waits_only_for_its_own_tensors(tmp_path, monkeypatch):
    x = _trained_store(tmp_path)
    gate = _hold_back(monkeypatch, f"model/{BLOCKS - 1}.", "optimizer/")
    model, opt, sched = _make()
    r = pccheck.load_latest(tmp_path, model=model, optimizer=opt, extra_state={"sched": sched}, lazy=True)
    try:
        with torch.no_grad():
            first = model[0](x)  # block 0's tensors arrive while the last block's are held back
        assert not r.done
    finally:
        gate.set()
    r.wait()
    eager, _, _ = _make()
    pccheck.load_latest(tmp_path, model=eager)
    with torch.no_grad():
        assert torch.equal(first, eager[0](x))


def _flip_a_byte_of(path, name: str) -> None:
    """Flips one byte of array ``name`` in the latest slot."""
    file = store_files(path)[0][1]
    image = read_store(file)
    slot = image.word_slot
    with open(file, "rb") as f:
        entry = next(e for e in read_manifest(image, slot, f.fileno()).arrays if e.name == name)
    off = image.header["slots_offset"] + slot * image.header["slot_capacity"] + entry.offset
    with open(file, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(struct.pack("B", b[0] ^ 0x40))


def test_a_damaged_tensor_raises_at_the_next_wait_point_and_keeps_raising(tmp_path):
    x = _trained_store(tmp_path)
    _flip_a_byte_of(tmp_path, "optimizer/state/3/exp_avg")
    model, opt, sched = _make()
    r = pccheck.load_latest(tmp_path, model=model, optimizer=opt, extra_state={"sched": sched}, lazy=True)
    assert r.step == 3
    with pytest.raises(pccheck.CorruptCheckpointError, match="lazy=False") as exc:
        # the first wait point after the loader met the damaged array raises: a forward if the
        # loader got there first, else the step (which waits for the optimizer state)
        model(x).pow(2).mean().backward()
        opt.step()
    assert "optimizer/state/3/exp_avg" in str(exc.value)
    with pytest.raises(pccheck.CorruptCheckpointError):
        model(x)  # never silently in use afterwards
    with pytest.raises(pccheck.CorruptCheckpointError):
        r.wait()
    assert not r.done
    m2, o2, s2 = _make()  # the eager load falls back to the previous checkpoint
    assert pccheck.load_latest(tmp_path, model=m2, optimizer=o2, extra_state={"sched": s2}).step == 2


def test_lazy_argument_errors(tmp_path):
    _trained_store(tmp_path, steps=(1,))
    model, opt, _ = _make()
    with pytest.raises(pccheck.ConfigError, match="model="):
        pccheck.load_latest(tmp_path, lazy=True)
    with pytest.raises(pccheck.ConfigError, match="zero_copy"):
        pccheck.load_latest(tmp_path, model=model, lazy=True, zero_copy=True)
    with pccheck.Checkpointer({"w": np.ones(4, np.float32)}, tmp_path / "arrays") as ck:
        ck.checkpoint(1)
    with pytest.raises(pccheck.ConfigError, match="holds arrays"):
        pccheck.load_latest(tmp_path / "arrays", model=model, lazy=True)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(pccheck.ConfigError, match="does not match the model"):
        pccheck.load_latest(tmp_path, model=other, lazy=True)
    assert all(not m._forward_pre_hooks for m in other.modules())


def test_aio_event_loop_keeps_running_while_1GiB_loads(tmp_path):
    """1 GiB of state (AdamW: parameters are a third), loaded from asyncio while a heartbeat
    task ticks every 5 ms: the loop is never blocked for long, and every tensor arrives."""
    width, blocks = 2048, 21  # 21 x (2048 x 2048 + 2048) float32 ~ 336 MiB of parameters
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    with pccheck.Checkpointer(model, opt, tmp_path) as ck:
        ck.checkpoint(1)
    assert ck.stats().checkpoints[-1].nbytes >= (1 << 30) - (64 << 20)
    target = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])
    topt = torch.optim.AdamW(target.parameters(), lr=1e-3)

    async def main():
        ticks: list[float] = []
        stop = asyncio.Event()

        async def heartbeat():
            while not stop.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        hb = asyncio.create_task(heartbeat())
        await asyncio.sleep(0.02)
        r = await pccheck.aio.load_latest(tmp_path, model=target, optimizer=topt)
        t0 = time.perf_counter()
        await r.wait_async()
        waited = time.perf_counter() - t0
        stop.set()
        await hb
        return r, ticks, waited

    r, ticks, waited = asyncio.run(main())
    gaps = np.diff(ticks)
    assert r.done and r.step == 1
    assert len(ticks) >= 5 and gaps.max() < 0.5, (len(ticks), gaps.max(), waited)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), target.state_dict().values()))
    r.wait()  # removes the hooks (on this thread)


def test_the_step_hook_never_removes_hooks_while_torch_runs_them(tmp_path, monkeypatch):
    """Regression: with another step pre-hook registered after the restore's (here a
    Checkpointer's), a step taken once loading is done (it finished after the forward) must not
    mutate the hook dict torch is iterating over."""
    x = _trained_store(tmp_path)
    gate = _hold_back(monkeypatch, "optimizer/")
    model, opt, sched = _make()
    r = pccheck.load_latest(tmp_path, model=model, optimizer=opt, extra_state={"sched": sched}, lazy=True)
    with pccheck.Checkpointer(model, opt, tmp_path / "again", interval=1) as ck:
        model(x).pow(2).mean().backward()  # model tensors are in; the optimizer state is held back
        gate.set()
        assert r._loader.finished.wait(30)
        opt.step()  # the restore's step hook runs first, sees everything in, and must not remove
        ck.maybe_checkpoint(4)
    r.wait()
    assert r.done


def test_tensors_outside_the_hooks_reach_are_read_before_returning(tmp_path):
    """A tensor hyperparameter (Adam's lr as a tensor) lives in param_groups, which no hook
    guards: it is read before load_latest returns, not left a placeholder."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.001))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with pccheck.Checkpointer(model, opt, tmp_path) as ck:
        ck.checkpoint(1)
    model2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.Adam(model2.parameters(), lr=torch.tensor(0.5))
    r = pccheck.load_latest(tmp_path, model=model2, optimizer=opt2, lazy=True)
    assert float(opt2.param_groups[0]["lr"]) == pytest.approx(0.001)
    r.wait()


def test_a_refused_lazy_load_changes_nothing(tmp_path):
    _trained_store(tmp_path)
    model, opt, sched = _make()
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    with pytest.raises(pccheck.ConfigError, match="no extra_state 'other'"):
        pccheck.load_latest(tmp_path, model=model, optimizer=opt, extra_state={"sched": sched, "other": sched},
                            lazy=True)
    after = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(before[k], after[k]) for k in before)


class UsesHeadWeight(torch.nn.Module):
    """The root reads its head's weight directly; the head's own forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.linear(self.body(x), self.head.weight)


def test_the_root_waits_for_tensors_of_modules_that_never_ran_forward(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = UsesHeadWeight()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 8)
    with pccheck.Checkpointer(model, opt, tmp_path, interval=1) as ck:
        model(x).sum().backward()
        opt.step()
        ck.maybe_checkpoint(1)
        want = model(x).detach()
    gate = _hold_back(monkeypatch, "model/head.")
    torch.manual_seed(1)
    target = UsesHeadWeight()
    r = pccheck.load_latest(tmp_path, model=target, optimizer=torch.optim.SGD(target.parameters(), lr=0.1),
                            lazy=True)
    threading.Timer(0.2, gate.set).start()
    with torch.no_grad():
        got = target(x)  # the root's hook waits for head.weight (head never ran forward)
    assert torch.equal(got, want)
    r.wait()


# -- a job that builds the Checkpointer before its lazy load: the restart order ------------------------


def _blocks_model(width: int = 24):
    """Sequential of blocks, each Linear + LayerNorm + ReLU, with AdamW."""
    torch.manual_seed(3)
    nn = torch.nn
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU())
                            for _ in range(BLOCKS)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _build_first_job(path, x, steps: int) -> int:
    """A build-first job: the Checkpointer is built, THEN load_latest (lazy), then training."""
    model, opt = _blocks_model()
    with pccheck.Checkpointer(model, opt, path, interval=2) as ck:
        try:
            start = pccheck.load_latest(path, model=model, optimizer=opt, lazy=True).step
        except pccheck.NoCheckpointError:
            start = 0
        for s in range(start + 1, start + steps + 1):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            ck.maybe_checkpoint(s)
    return start + steps


def test_build_first_restarts_record_the_order_and_the_first_block_needs_only_its_own_bytes(tmp_path, monkeypatch):
    x = torch.randn(4, 24)
    assert _build_first_job(tmp_path, x, 4) == 4
    assert _build_first_job(tmp_path, x, 4) == 8  # a build-first job restarted from its own store
    image = read_store(store_files(tmp_path)[0][1])
    with open(image.path, "rb") as f:
        tree = read_manifest(image, image.word_slot, f.fileno()).tree
    n_model = 4 * BLOCKS  # Linear weight, bias; LayerNorm weight, bias
    assert tree["order_forward"] == n_model and tree["order"][:2] == ["model/0.0.weight", "model/0.0.bias"]
    # The timed restart, in the same order: everything but block 0 is held back.
    gate = _hold_back(monkeypatch, *[f"model/{i}." for i in range(1, BLOCKS)], "optimizer/")
    model, opt = _blocks_model()
    ck = pccheck.Checkpointer(model, opt, tmp_path, interval=2)
    block0 = threading.Event()
    model[0].register_forward_hook(lambda *_: block0.set())
    r = pccheck.load_latest(tmp_path, model=model, optimizer=opt, lazy=True)
    out: list = []
    fwd = threading.Thread(target=lambda: out.append(model(x)))
    try:
        fwd.start()
        # the root's hook and block 0's wait for block 0's bytes only, not the held-back rest
        assert block0.wait(30), "the first block waited for more than its own tensors"
        assert not r.done
        # no chunk pool or store yet: their prefault and validation would compete with the loader
        assert ck.copy_engine.native_engine is None and ck.storage == "closed"
    finally:
        gate.set()
    fwd.join(30)
    out[0].pow(2).mean().backward()
    opt.step()  # waits for everything; at its end the Checkpointer prepares the pool and the store
    assert r.done and ck.copy_engine.native_engine is not None and ck.storage != "closed"
    pool = ck.copy_engine.native_engine
    ck.maybe_checkpoint(10)
    assert ck.copy_engine.native_engine is pool  # the first checkpoint did not remake it
    ck.close()
    r.wait()


@pytest.mark.parametrize("fused", [False, True])
def test_optimizer_placeholders_are_made_where_load_state_dict_puts_them(fused):
    """On a device model, each placeholder is replaced by an empty tensor of the device and dtype
    that Optimizer.load_state_dict casts to, so its cast copies nothing ("meta" stands in for a
    device here); ``step`` moves only for fused or capturable optimizers, as torch's rule says."""
    from pccheck.lazy.restore import _place_like_params

    model = torch.nn.Linear(4, 3, device="meta", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=fused) if fused else torch.optim.AdamW(model.parameters())
    kept = torch.zeros(3)  # not a placeholder: left alone
    saved = {"param_groups": [{**opt.param_groups[0], "params": [0, 1]}],
             "state": {0: {"step": torch.empty(()), "exp_avg": torch.empty(3, 4), "exp_avg_sq": torch.empty(3, 4)},
                       1: {"step": torch.empty(()), "exp_avg": kept, "exp_avg_sq": torch.empty(3)}}}
    ph = {id(v) for st in saved["state"].values() for k, v in st.items() if v is not kept}
    _place_like_params(torch, opt, saved, ph)
    for st in saved["state"].values():
        for k, v in st.items():
            if k == "step":
                assert v.device.type == ("meta" if fused else "cpu")
            elif v is not kept:
                assert v.device.type == "meta" and v.dtype == torch.bfloat16
    assert saved["state"][1]["exp_avg"] is kept
