"""Three claims so far measured on the CPU only, measured on one GPU: lazy restore onto the device, the
CPU replay of ``spread_steps`` against a CUDA optimizer, and the integrations' extra device memory.

``python -m bench.gpu_claims [--out bench/results/gpu_claims] [--device cuda|cpu] [--budget-s 120] [--small] [--dir bench/_scratch]``.
OUT/latest.json (``--claims`` a subset: OUT/latest-<claims>.json) is rewritten after each claim, repeat and variant (a kill keeps what was measured). Each
claim is its own ``try`` (error + traceback tail recorded, the rest runs); past --budget-s no claim,
repeat or variant starts (``"skipped: budget"``, ``cut_short``). Order: spread, lightning, hf, lazy.
``--device cpu`` (implies --small) runs the same code on the CPU; memory is then ``"skipped: no cuda"``.

lazy_cuda: 8 blocks ``Linear(D, D) + LayerNorm(D) + ReLU`` built under ``torch.device(dev)``, ``AdamW(lr=1e-3,
fused=on cuda)``, D = 3342 (--small 256): 89.4 M params, 1.0 GiB with the moments. ``Checkpointer(model,
opt, path, interval=10**6)`` before the first forward (first-use order recorded), 3 steps on 8 x D
inputs, ``checkpoint(3)``, ``close()``. ``load_latest(..., lazy=True, map_location=dev)`` is tried once:
its refusal is recorded (the lazy loads below go into the device model's own tensors). An untimed eager
load, then ``eager_warm_cache_s`` (control). 3 repeats, each an eager then a lazy load into a fresh model
+ optimizer, each after ``os.sync()`` + ``posix_fadvise(DONTNEED)`` on every file of the store: eager_s =
``load_latest(path, model=, optimizer=, map_location=dev)`` + synchronize; from the lazy call:
lazy_return_s (it returned), first_block_s (a forward hook on block 0 fired in ``m2(x)``, no_grad; the
hook synchronizes first), first_forward_s (returned + synchronize), all_s (``r.wait()`` + synchronize).
Medians, runs, first_block/eager, first_forward/eager; ``torch.equal`` with the saved model: parameters
after the lazy forward, state dict + optimizer state after ``r.wait()`` and after the eager load.

spread_cuda: 3 x (``Linear(w, w)``, ReLU) + ``Linear(w, w/4)`` (w = 1024: 3.4 M params; --small 64), MSE
on 64 random rows from a per-step seeded device generator, ``CosineAnnealingLR(T_max=50)``; per variant
(AdamW wd 0.01 for-loop / foreach / fused, SGD momentum 0.9 Nesterov wd 0.01 foreach):
``Checkpointer(model, opt, path, interval=5, spread_steps=3)``, 9 steps (zero_grad, backward, step,
scheduler, ``maybe_checkpoint(s)``), the live ``model.state_dict()`` and ``opt.state_dict()['state']``
cloned to the CPU after each call from step 5; ``close()``; ``load_latest(path)`` (nested CPU tensors)
against the clone of the step it reports, per kind (param, exp_avg, exp_avg_sq, step, momentum_buffer)
and per parameter (optimizer order = part order): elements, differing, max |diff|, max |diff|/|live|
(|live| >= 1e-6), max ULP = |ord(a) - ord(b)| of the float32 bits (ord(i) = i if i >= 0 else -(i &
0x7fffffff): monotonic across zero). A refused variant records its ConfigError. Quoted: the equality
the spread tests assert, the README's reasoned 4(k-1) ulp (``within_readme_bound``, step excluded).

integrations_memory: 10 steps on the device, a save every 3. Lightning: ``Trainer(devices=1, logger=False,
plugins=[pccheck.lightning.CheckpointIO()], callbacks=[meter, ModelCheckpoint(every_n_train_steps=3)])``,
Linear(1024, 1024)-BatchNorm-ReLU-Linear(1024, 1), AdamW, batch 32. HF: ``Trainer(..., callbacks=[meter,
pccheck.hf.Callback(path, interval=3)])``, ``save_strategy="no"``, GPT-2 from a config (2 layers, 256
wide, vocab 1000, HF_HUB_OFFLINE=1), batch 8 x 32. The meter cuts the run at each step's start
(``on_train_batch_start`` / ``on_step_begin``, before pccheck's callback): synchronize, record
``max_memory_allocated`` and ``max_memory_reserved``, ``reset_peak_memory_stats``. Lightning saves at
the end of step s and copies during s+1; the HF callback saves at the start of s+1 and copies during it.
"save" windows hold a save or its copy, "clean" the others but step 1 ("first": optimizer state made)
and step 8 ("control": at its end, where a save would be, every parameter and optimizer tensor is
cloned on the device and freed, to show the meter sees such a snapshot; ``control_extra_*_bytes``).
Claim: extra_alloc_bytes = max(save) - max(clean) = 0 (likewise reserved).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.common import result_path, BENCH_DIR
from bench.harness.common import host_info, scratch_dir, versions, write_json

__all__ = ["main"]

_T0 = time.perf_counter()
_ROOT = BENCH_DIR.parent
SPREAD_K, SPREAD_INTERVAL, SAVE_EVERY, LOOP_STEPS, CONTROL_STEP = 3, 5, 3, 10, 8
_deadline = float("inf")  # perf_counter after which a claim stops at its next repeat (main sets it)

def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", flush=True)

def _sync(torch: Any, dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()

def _free(torch: Any, dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()

def _drop_cache(root: Path) -> int:
    """``sync``, then ``posix_fadvise(DONTNEED)`` on every file under ``root``; how many files."""
    os.sync()
    files = [p for p in root.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)

def _quote(rel: str, needle: str) -> str:
    """``file:line: text`` of the first line of ``rel`` (from the repo root) containing ``needle``."""
    try:
        lines = (_ROOT / rel).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        return f"{rel}: unreadable ({exc})"
    return next((f"{rel}:{i}: {line.strip()}" for i, line in enumerate(lines, 1) if needle in line),
                f"{rel}: {needle!r} not found")

# -- 1. lazy restore onto the device ------------------------------------------------------------------

def _lazy_model(torch: Any, dev: str, width: int, seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    with torch.device(dev):
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width),
                                                      torch.nn.ReLU()) for _ in range(8)])
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=dev == "cuda")

def _same(torch: Any, m: Any, o: Any, ref: Any, ref_opt: Any, params_only: bool = False) -> bool:
    """Every parameter (or state dict tensor) of ``m`` and, unless params_only, the optimizer state torch.equal."""
    want = ref.state_dict()
    if not all(torch.equal(v, want[k]) for k, v in (m.named_parameters() if params_only else m.state_dict().items())):
        return False
    got, ws = o.state_dict()["state"], ref_opt.state_dict()["state"]
    return params_only or (sorted(got) == sorted(ws) and all(
        torch.equal(got[i][k].to(v.device), v) for i in ws for k, v in ws[i].items()))

def _lazy_repeat(torch: Any, pccheck: Any, dev: str, width: int, rep: int, store: Path, x: Any, ref: Any,
                 ref_opt: Any) -> dict[str, Any]:
    """One cold eager load, then one cold lazy load, each into a fresh model: one run's figures."""
    run: dict[str, Any] = {}
    m, o = _lazy_model(torch, dev, width, 10 + rep)
    _sync(torch, dev)
    run["files_dropped"] = _drop_cache(store)
    t0 = time.perf_counter()
    r = pccheck.load_latest(store, model=m, optimizer=o, map_location=dev)
    _sync(torch, dev)
    run["eager_s"] = time.perf_counter() - t0
    run["eager_bitwise"] = _same(torch, m, o, ref, ref_opt)
    del m, o, r
    _free(torch, dev)
    m, o = _lazy_model(torch, dev, width, 20 + rep)
    hit: list[float] = []

    def on_block0(*_: Any) -> None:
        _sync(torch, dev)
        hit.append(time.perf_counter())

    handle = m[0].register_forward_hook(on_block0)
    _sync(torch, dev)
    _drop_cache(store)
    t0 = time.perf_counter()
    r = pccheck.load_latest(store, model=m, optimizer=o, lazy=True)
    run["lazy_return_s"] = time.perf_counter() - t0
    with torch.no_grad():
        m(x)
    _sync(torch, dev)
    run["first_forward_s"] = time.perf_counter() - t0
    run["first_block_s"] = hit[0] - t0
    run["lazy_params_bitwise_after_forward"] = _same(torch, m, o, ref, ref_opt, params_only=True)
    r.wait()
    _sync(torch, dev)
    run["all_s"] = time.perf_counter() - t0
    run["lazy_bitwise_after_wait"] = _same(torch, m, o, ref, ref_opt)
    handle.remove()
    return run

def claim_lazy(res: dict, dev: str, small: bool, scratch: Path, flush: Callable[[], None]) -> None:
    import torch

    import pccheck

    width, store = (256 if small else 3342), scratch / "store"
    ref, ref_opt = _lazy_model(torch, dev, width, 0)
    x = torch.randn(8, width, device=dev)
    t0 = time.perf_counter()
    ck = pccheck.Checkpointer(ref, ref_opt, path=store, interval=10**6)  # before the first forward: order recorded
    for _ in range(3):
        ref_opt.zero_grad(set_to_none=True)
        ref(x).square().mean().backward()
        ref_opt.step()
    ck.checkpoint(3)
    ck.close()
    res.update(width=width, blocks=8, params=sum(p.numel() for p in ref.parameters()),
               state_bytes=ck.stats().checkpoints[-1].nbytes, optimizer=f"AdamW(fused={dev == 'cuda'})",
               save_s=time.perf_counter() - t0, runs=[])
    _log(f"lazy: saved {res['state_bytes'] / 2**30:.2f} GiB (D={width}) in {res['save_s']:.1f} s")
    m, o = _lazy_model(torch, dev, width, 1)
    try:
        pccheck.load_latest(store, model=m, optimizer=o, lazy=True, map_location=dev)
        res["lazy_map_location_refusal"] = None
    except pccheck.ConfigError as exc:
        res["lazy_map_location_refusal"] = f"ConfigError: {exc}"
    pccheck.load_latest(store, model=m, optimizer=o, map_location=dev)  # warm-up: one-time costs, page cache
    t0 = time.perf_counter()
    pccheck.load_latest(store, model=m, optimizer=o, map_location=dev)
    _sync(torch, dev)
    res["eager_warm_cache_s"] = time.perf_counter() - t0
    del m, o
    _free(torch, dev)
    for rep in range(3):
        if rep and time.perf_counter() > _deadline:
            res["cut_short"] = f"budget spent after {rep} repeats"
            break
        res["runs"].append(_lazy_repeat(torch, pccheck, dev, width, rep, store, x, ref, ref_opt))
        _free(torch, dev)
        _log(f"lazy: repeat {rep + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in res["runs"][-1].items()
                                                     if k.endswith("_s")))
        flush()
    med = {k: statistics.median(r[k] for r in res["runs"]) for k in res["runs"][0] if k.endswith("_s")}
    res.update(median=med, first_block_vs_eager=med["first_block_s"] / med["eager_s"],
               first_forward_vs_eager=med["first_forward_s"] / med["eager_s"],
               bitwise=all(r["lazy_params_bitwise_after_forward"] and r["lazy_bitwise_after_wait"]
                           and r["eager_bitwise"] for r in res["runs"]), status="ok")

# -- 2. spread_steps against a CUDA optimizer ---------------------------------------------------------

def _diff(torch: Any, got: Any, want: Any) -> dict[str, Any]:
    """Elements, differing elements, max |diff|, max relative diff and max ULP (float32) of two tensors."""
    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    if got.shape != want.shape or got.dtype != want.dtype:
        return {"numel": want.numel(), "differing": want.numel(), "mismatch": f"{got.shape}/{got.dtype}"}
    out: dict[str, Any] = {"numel": want.numel(), "differing": int((got != want).sum())}
    if want.is_floating_point() and want.numel():
        d = (got.double() - want.double()).abs()
        big = want.double().abs() >= 1e-6
        out.update(max_abs=float(d.max()), max_rel=float((d[big] / want.double().abs()[big]).max()) if big.any() else 0.0)
        if want.dtype == torch.float32:
            def order(t: Any) -> Any:
                i = t.view(torch.int32).to(torch.int64)
                return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
            out["max_ulp"] = int((order(got) - order(want)).abs().max())
    return out

def _spread_variant(torch: Any, pccheck: Any, dev: str, width: int, make: Callable[[Any], Any], path: Path,
                    bound: int) -> dict[str, Any]:
    torch.manual_seed(0)
    with torch.device(dev):
        layers = [m for _ in range(3) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(width, width // 4))
    opt = make(model.parameters())
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)
    try:
        ck = pccheck.Checkpointer(model, opt, path=path, interval=SPREAD_INTERVAL, spread_steps=SPREAD_K)
    except pccheck.ConfigError as exc:
        return {"status": "refused", "refusal": f"ConfigError: {exc}"}
    live: dict[int, tuple[dict, dict]] = {}
    try:
        for s in range(1, SPREAD_INTERVAL + SPREAD_K + 2):
            g = torch.Generator(device=dev).manual_seed(s)
            x, y = torch.randn(64, width, device=dev, generator=g), torch.randn(64, width // 4, device=dev, generator=g)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            ck.maybe_checkpoint(s)
            if s >= SPREAD_INTERVAL:
                live[s] = ({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
                           {i: {k: v.to("cpu", copy=True) for k, v in st.items()}
                            for i, st in opt.state_dict()["state"].items()})
    finally:
        ck.close()
    stats = [st for st in ck.stats().checkpoints if st.outcome == "committed"]
    r = pccheck.load_latest(path)
    if r.step not in live:
        return {"status": "error", "error": f"loaded step {r.step}, expected {SPREAD_INTERVAL + SPREAD_K}",
                "steps_committed": [st.step for st in stats]}
    want_model, want_opt = live[r.step]
    names = [n for n, _ in model.named_parameters()]  # optimizer index i is names[i]
    by_kind: dict[str, dict] = {}
    per_param = []
    for i, st in sorted(want_opt.items()):
        row: dict[str, Any] = {"index": i, "name": names[i]}
        pairs = [("param", r.state["model"][names[i]], want_model[names[i]])]
        for kind, got, want in pairs + [(k, r.state["optimizer"]["state"][i][k], v) for k, v in st.items()]:
            d = _diff(torch, got, want)
            acc = by_kind.setdefault(kind, {})
            for k, v in d.items():
                acc[k] = acc.get(k, 0) + v if k in ("numel", "differing") else v if k == "mismatch" else max(acc.get(k, 0), v)
            row[kind] = {k: d[k] for k in ("differing", "max_ulp") if k in d}
        per_param.append(row)
    return {"status": "ok", "step_loaded": r.step, "step_expected": SPREAD_INTERVAL + SPREAD_K, "spread_steps": [st.spread_steps for st in stats],
            "steps_committed": [st.step for st in stats], "by_kind": by_kind, "per_param": per_param,
            "within_readme_bound": all(v.get("max_ulp", 0) <= bound and "mismatch" not in v
                                       for k, v in by_kind.items() if k != "step")}

def claim_spread(res: dict, dev: str, small: bool, scratch: Path, flush: Callable[[], None]) -> None:
    import torch

    import pccheck

    AdamW, SGD = torch.optim.AdamW, torch.optim.SGD
    variants = {"adamw_forloop": lambda p: AdamW(p, lr=1e-3, weight_decay=0.01, foreach=False),
                "adamw_foreach": lambda p: AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
                "adamw_fused": lambda p: AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
                "sgd_nesterov_foreach": lambda p: SGD(p, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                                                      foreach=True)}
    res.update(k=SPREAD_K, interval=SPREAD_INTERVAL, width=64 if small else 1024, variants={},
               readme_bound_ulp=4 * (SPREAD_K - 1), readme_bound=_quote("README.md", "ulp of the live one"),
               test_tolerance=_quote("tests/test_spread.py", "torch.equal(a[k], b[k])")
               + " (assert_same: exact equality, on CPU training only)")
    for name, make in variants.items():
        if time.perf_counter() > _deadline:
            res["variants"][name] = {"status": "skipped: budget"}
            continue
        try:
            out = _spread_variant(torch, pccheck, dev, res["width"], make, scratch / name, res["readme_bound_ulp"])
            _log(f"spread: {name}: {out['status']} " + ", ".join(
                f"{k} {v['differing']}/{v['numel']} differ, max {v.get('max_ulp', '-')} ulp"
                for k, v in out.get("by_kind", {}).items()))
        except Exception as exc:  # noqa: BLE001 - recorded, the next variant runs
            out = {"status": "error", "error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
            _log(f"spread: {name}: {exc!r}")
        res["variants"][name] = out
        flush()
    res["status"] = "ok"

# -- 3. extra device memory during a save -------------------------------------------------------------

class _Meter:
    """Per-step windows of the device's peak memory (see the module docstring)."""

    def __init__(self, torch: Any, cuda: bool) -> None:
        self.torch, self.cuda, self.windows, self.cur, self.control_bytes = torch, cuda, [], None, 0

    def control(self, step: int, model: Any, optimizer: Any) -> None:
        """The positive control, at the end of step CONTROL_STEP: clone every parameter and optimizer
        tensor on the device (what a device-side snapshot would allocate) and free the clones."""
        if step == CONTROL_STEP:
            state = getattr(optimizer, "optimizer", optimizer).state  # accelerate wraps the torch optimizer
            clones = [t.detach().clone() for t in [*model.parameters(), *(v for st in state.values()
                                                                           for v in st.values())]
                      if self.torch.is_tensor(t)]
            self.control_bytes = sum(c.numel() * c.element_size() for c in clones)

    def boundary(self, next_step: int | None) -> None:
        cuda = self.torch.cuda
        if self.cur is not None:
            if self.cuda:
                cuda.synchronize()
            self.windows.append({"step": self.cur, **({"alloc": cuda.max_memory_allocated(),
                                                        "reserved": cuda.max_memory_reserved()} if self.cuda else {})})
        self.cur = next_step
        if self.cuda and next_step is not None:
            cuda.reset_peak_memory_stats()

    def summary(self, res: dict, saved: list[int], save_windows: set[int]) -> None:
        for w in self.windows:
            w["kind"] = ("first" if w["step"] == 1 else "save" if w["step"] in save_windows else
                         "control" if w["step"] == CONTROL_STEP else "clean")
        res.update(saved_steps=saved, windows=self.windows, control_clone_bytes=self.control_bytes,
                   status="skipped: no cuda")
        if self.cuda:
            for key in ("alloc", "reserved"):
                clean, save, ctl = ([w[key] for w in self.windows if w["kind"] == k] for k in ("clean", "save", "control"))
                res.update({f"peak_{key}_clean": max(clean), f"peak_{key}_save": max(save),
                            f"extra_{key}_bytes": max(save) - max(clean),
                            f"control_extra_{key}_bytes": max(ctl) - max(clean)})
            res["status"] = "ok"

def claim_lightning(res: dict, dev: str, small: bool, scratch: Path, flush: Callable[[], None]) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    import pccheck.lightning

    d, meter = (32 if small else 1024), _Meter(torch, dev == "cuda")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.BatchNorm1d(d), torch.nn.ReLU(),
                                           torch.nn.Linear(d, 1))

        def training_step(self, batch: Any, idx: int) -> Any:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class Meter(L.Callback):
        def on_train_batch_start(self, trainer: Any, *_: Any) -> None:
            meter.boundary(trainer.global_step + 1)

        def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
            devices.add(str(next(module.parameters()).device))  # Lightning moves it back to the CPU at the end
            meter.control(trainer.global_step, module, trainer.optimizers[0])

        def on_train_end(self, *_: Any) -> None:
            meter.boundary(None)

    torch.manual_seed(0)
    devices: set[str] = set()
    data = TensorDataset(torch.randn(32 * LOOP_STEPS, d), torch.randn(32 * LOOP_STEPS, 1))
    io, net = pccheck.lightning.CheckpointIO(), Net()
    trainer = L.Trainer(accelerator="gpu" if dev == "cuda" else "cpu", devices=1, max_steps=LOOP_STEPS, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[io], default_root_dir=scratch,
                        callbacks=[Meter(), ModelCheckpoint(dirpath=scratch / "ckpt", every_n_train_steps=SAVE_EVERY)])
    trainer.fit(net, DataLoader(data, batch_size=32))
    saved = [st.step for st in io.stats() if st.outcome != "failed"]
    res.update(param_bytes=sum(p.numel() * p.element_size() for p in net.parameters()),
               model_device=",".join(sorted(devices)), errors=[repr(e) for e in io.errors])
    meter.summary(res, saved, {w for s in saved for w in (s, s + 1)})

def claim_hf(res: dict, dev: str, small: bool, scratch: Path, flush: Callable[[], None]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import pccheck.hf

    meter = _Meter(torch, dev == "cuda")

    class Meter(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.boundary(state.global_step + 1)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.control(state.global_step, kw["model"], kw["optimizer"])

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            meter.boundary(None)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32 if small else 256, vocab_size=1000,
                                       n_positions=64))
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 1000, (8 * LOOP_STEPS, 32))]
    args = TrainingArguments(str(scratch / "out"), max_steps=LOOP_STEPS, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_strategy="no", save_strategy="no", report_to=[], seed=0,
                             use_cpu=dev != "cuda", disable_tqdm=True)
    cb = pccheck.hf.Callback(scratch / "store", interval=SAVE_EVERY)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[Meter(), cb]).train()
    saved = [st.step for st in cb.stats().checkpoints if st.outcome != "failed"]
    res.update(model_device=str(next(model.parameters()).device),
               param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()))
    meter.summary(res, saved, {s + 1 for s in saved})

# -- driver -------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    global _deadline
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_claims", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=result_path("gpu_claims").parent,
                    help="results directory: latest.json goes there, latest-<claims>.json for a --claims subset "
                         "(default: %(default)s)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget-s", type=float, default=120.0, help="no claim starts after this many seconds")
    ap.add_argument("--small", action="store_true", help="small sizes (implied by --device cpu)")
    ap.add_argument("--dir", type=Path, default=_ROOT / "bench" / "_scratch", help="scratch dir (removed after)")
    ap.add_argument("--claims", default="spread,lightning,hf,lazy",
                    help="comma-separated subset of spread,lightning,hf,lazy (the others are recorded as not run)")
    a = ap.parse_args(argv)
    chosen = a.claims.split(",")
    if not set(chosen) <= {"spread", "lightning", "hf", "lazy"}:
        ap.error(f"--claims: unknown claim in {a.claims!r} (spread, lightning, hf, lazy)")
    import torch

    dev, small, _deadline = a.device, a.small or a.device == "cpu", _T0 + a.budget_s
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu", file=sys.stderr)
        return 2
    # all claims: latest.json; a subset (--claims lazy) its own file, so it never overwrites the full run
    every = ["spread", "lightning", "hf", "lazy"]
    out = a.out / ("latest.json" if set(chosen) == set(every) else f"latest-{'-'.join(c for c in every if c in chosen)}.json")
    doc: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                           "torch": torch.__version__, "small": small, "command": "python -m bench.gpu_claims "
                           + " ".join(argv if argv is not None else sys.argv[1:]),
                           "lazy_cuda": {}, "spread_cuda": {}, "integrations_memory": {"lightning": {}, "hf": {}}}

    def flush() -> None:
        doc["elapsed_s"] = time.perf_counter() - _T0
        doc["versions"] = versions(["torch", "numpy", "lightning", "transformers", "accelerate", "pccheck"])
        write_json(out, doc)

    claims = [("spread", doc["spread_cuda"], claim_spread),
              ("lightning", doc["integrations_memory"]["lightning"], claim_lightning),
              ("hf", doc["integrations_memory"]["hf"], claim_hf), ("lazy", doc["lazy_cuda"], claim_lazy)]
    with scratch_dir(a.dir) as scratch:
        doc["host"] = host_info(scratch)
        for name, res, fn in claims:
            if name not in chosen:
                res["status"] = "not run: --claims"
            elif time.perf_counter() > _deadline:
                res["status"] = "skipped: budget"
                _log(f"{name}: skipped (budget of {a.budget_s:.0f} s spent)")
            else:
                _log(f"{name}: start")
                try:
                    (scratch / name).mkdir()
                    fn(res, dev, small, scratch / name, flush)
                    _log(f"{name}: {res.get('status')}")
                except Exception as exc:  # noqa: BLE001 - recorded, the next variant runs
                    res.update(status="error", error=repr(exc), traceback=traceback.format_exc()[-3000:])
                    _log(f"{name}: error {exc!r}")
                _free(torch, dev)
            flush()
    _log(f"wrote {out}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
