"""Tests that need a CUDA device (marker ``gpu``; skipped without one). Run them with
``scripts/gpu-check.sh`` (``make gpu-check``) on a GPU machine.

- Soft copy-on-write on a real GPU: a 1.5 GiB model + AdamW (foreach and fused, bf16 and fp32)
  whose copy to the host cannot finish before the next optimizer step; the checkpoint still
  holds exactly the checkpointed step.
- The copy runs on its own stream beside compute on the default stream; the chunk pool is pinned.
- cupy arrays, and cupy's current stream: a checkpoint sees the work queued on it.
- Bitwise resume after SIGKILL of a CUDA training child (CUDA RNG, deterministic cuBLAS).
- ``load_latest(map_location="cuda")`` restores into device tensors.
- ``device_reserve``: the step runs while the copy goes on from a device-side clone.

Device memory stays under 30 GiB in every test (asserted), and the multi-GiB stores are deleted
after each test.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import pccheck
from conftest import assert_state_equal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB, GiB = 1 << 20, 1 << 30
DEVICE_MEMORY_LIMIT = 30 * GiB
WIDTH = 8192  # of the big models' square Linear layers: 64 Mi parameters each
K = 3         # the checkpointed step in the race tests


@pytest.fixture(autouse=True)
def _release(tmp_path):
    """Frees device memory between tests, checks the peak, and deletes this test's stores."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    yield
    peak = torch.cuda.max_memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    shutil.rmtree(tmp_path, ignore_errors=True)
    print(f"peak device memory {peak / GiB:.2f} GiB")
    assert peak < DEVICE_MEMORY_LIMIT, f"the test used {peak / GiB:.1f} GiB of device memory"


@pytest.fixture
def store(tmp_path) -> Path:
    return tmp_path / "ckpt"


# -- helpers ---------------------------------------------------------------------------------------


def _clone(x: Any) -> Any:
    """A deep copy of a nested state; tensors are cloned where they live. A device clone is queued
    on the current stream, so it holds the values of the work queued before it, whatever runs next."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_clone(v) for v in x)
    return copy.deepcopy(x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: Any, want: Any, path: str = "", device: str | None = None) -> None:
    """Same structure, plain values, tensor dtypes, shapes and bytes; with ``device``, every
    tensor of ``got`` is on that device type ("same": on ``want``'s tensor's device type)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, \
            f"{path}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        if device is not None:
            where = want.device.type if device == "same" else device
            assert got.device.type == where, f"{path} is on {got.device}, not {where}"
        assert torch.equal(_bits(got), _bits(want)), f"{path} differs"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{path}: keys differ"
        for k in want:
            _assert_same(got[k], want[k], f"{path}/{k}", device)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}/{i}", device)
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def _cupy_or_none() -> Any:
    try:
        import cupy

        return cupy if cupy.cuda.is_available() else None
    except Exception:  # not installed, or built for another CUDA
        return None


def _memory_type(attrs: Any) -> int:
    """cudaPointerAttributes.type (cupy's name for it changed over versions)."""
    return attrs.type if hasattr(attrs, "type") else attrs.memoryType


def _check_pinned(engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The engine's chunk pool is page-locked, confirmed by the CUDA runtime through cupy when it
    is importable; or registration failed and the engine said so in a warning."""
    print(f"{engine.name} engine: pinned={engine.pinned}")
    if not engine.pinned:
        assert any(r.name == "pccheck" and r.levelno >= logging.WARNING for r in caplog.records), \
            "the chunk pool is not pinned and no warning was logged"
        return
    cupy = _cupy_or_none()
    if cupy is None:
        return
    ne = engine.native_engine
    for addr in (ne.pool_address, ne.pool_address + ne.pool_bytes - 1):
        assert _memory_type(cupy.cuda.runtime.pointerGetAttributes(addr)) == 1, \
            f"{addr:#x} is not registered host memory (cudaMemoryTypeHost)"


# -- soft copy-on-write against the real optimizer step ---------------------------------------------


def _big_model(layers: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, device="cuda", dtype=dtype)
                                 for _ in range(layers)])


def _big_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, dtype: torch.dtype) -> None:
    """One short iteration (a batch of 16): the optimizer step follows within milliseconds. No
    host synchronisation, so nothing but the pre-hook holds the update back."""
    g = torch.Generator(device="cuda").manual_seed(step)
    x = torch.randn(16, WIDTH, generator=g, device="cuda", dtype=dtype)
    loss = model(x).float().square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _race(store: Path, layers: int, dtype: torch.dtype, opt_kw: dict[str, Any], **ck_kw: Any) -> Any:
    """Trains K steps, checkpoints step K, takes the reference at once, trains two more steps while
    the copy to the host is still running, then checks the loaded checkpoint against the reference
    byte for byte. Returns the checkpoint's stats."""
    model = _big_model(layers, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **opt_kw)
    for s in range(1, K + 1):
        _big_step(model, opt, s, dtype)
    ck = pccheck.Checkpointer(model, opt, path=store, interval=10**6, max_concurrent=1, **ck_kw)
    try:
        ck.checkpoint(K)
        # The reference, as device clones queued before the next update. (A .cpu() of the whole
        # state here would outlast the background copy and leave no race to test.)
        want = {"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict())}
        for s in (K + 1, K + 2):
            _big_step(model, opt, s, dtype)
        ck.wait()
        st = ck.stats().checkpoints[0]
    finally:
        ck.close()
    name, live = next(iter(model.state_dict().items()))
    assert not torch.equal(live, want["model"][name]), "the steps after the checkpoint changed nothing"
    del ck, opt, model, live
    r = pccheck.load_latest(store)
    assert r.step == K
    _assert_same(r.state["model"], want["model"], "model")
    _assert_same(r.state["optimizer"], want["optimizer"], "optimizer")
    return st


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("opt", ["foreach", "fused"])  # fused AdamW does not bump tensor versions
def test_soft_cow_guards_the_optimizer_step(store, opt, dtype):
    layers = 4 if dtype == torch.bfloat16 else 2  # 512 MiB of parameters, 1.5 GiB with the moments
    st = _race(store, layers, dtype, {opt: True})
    print(f"AdamW {opt} {dtype}: {st.nbytes / GiB:.2f} GiB, cow_wait_s={st.cow_wait_s:.4f}, "
          f"copy_s={st.copy_s:.3f}, persist_s={st.persist_s:.3f}")
    assert st.outcome == "committed"
    assert st.nbytes >= 1536 * MiB
    # 1.5 GiB cannot cross PCIe (<= ~55 GB/s) in the few milliseconds before the next step, so the
    # pre-hook must have waited for the copy: the race really happened.
    assert st.cow_wait_s > 0


def test_device_reserve_lets_the_step_run_before_the_copy_ends(tmp_path):
    layers = 3  # fp32: 768 MiB of parameters, 2.25 GiB with AdamW's moments
    plain = _race(tmp_path / "plain", layers, torch.float32, {"foreach": True}, device_reserve=None)
    shutil.rmtree(tmp_path / "plain")
    gc.collect()
    torch.cuda.empty_cache()
    staged = _race(tmp_path / "reserve", layers, torch.float32, {"foreach": True}, device_reserve=4 << 30)
    print(f"cow_wait_s without reserve {plain.cow_wait_s:.4f}, with a 4 GiB reserve {staged.cow_wait_s:.4f} "
          f"({staged.reserve_bytes / GiB:.2f} GiB staged of {staged.nbytes / GiB:.2f} GiB)")
    assert plain.outcome == staged.outcome == "committed"
    assert plain.reserve_bytes == 0
    assert staged.reserve_bytes > 0
    assert staged.cow_wait_s < plain.cow_wait_s


# -- the copy engines -----------------------------------------------------------------------------


def test_copy_overlaps_compute_on_its_own_stream(store):
    g = torch.Generator(device="cuda").manual_seed(7)
    arrays = {
        "bytes": torch.randint(0, 256, (GiB,), dtype=torch.uint8, device="cuda", generator=g),
        "floats": torch.randn(GiB // 4, device="cuda", generator=g),
        "strided": torch.arange(1 << 22, dtype=torch.int64, device="cuda").view(2048, 2048).t(),
    }
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16, generator=g)
    c = torch.empty_like(a)
    torch.cuda.synchronize()
    ck = pccheck.Checkpointer(arrays, store, interval=1, max_concurrent=1)
    errors: list[BaseException] = []

    def take() -> None:
        try:
            ck.checkpoint(1)  # arrays: returns once every byte is in the host chunks
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    try:
        worker = threading.Thread(target=take)
        matmuls = 0
        worker.start()
        while worker.is_alive():  # compute on the default stream for as long as the copy runs
            for _ in range(4):
                torch.matmul(a, b, out=c)
            matmuls += 4
            torch.cuda.current_stream().synchronize()
        worker.join()
        assert not errors, errors
        ck.wait()
        st = ck.stats().checkpoints[0]
    finally:
        ck.close()
    print(f"{matmuls} bf16 8192^3 matmuls while {st.nbytes / GiB:.2f} GiB were copied in "
          f"{st.blocked_copy_s:.3f} s")
    assert st.outcome == "committed"
    r = pccheck.load_latest(store)
    assert r.step == 1
    assert_state_equal(r.state, {k: t.cpu().numpy() for k, t in arrays.items()})


def test_chunk_pool_is_pinned(store, caplog):
    caplog.set_level(logging.WARNING, logger="pccheck")
    w = torch.randn(16 << 20, device="cuda")  # 64 MiB
    ck = pccheck.Checkpointer({"w": w}, store, interval=1, max_concurrent=1)
    try:
        assert ck.copy_engine.name == "cuda"
        _check_pinned(ck.copy_engine, caplog)
        ck.checkpoint(1)
        ck.wait()
    finally:
        ck.close()
    assert_state_equal(pccheck.load_latest(store).state, {"w": w.cpu().numpy()})


@pytest.mark.parametrize("raw", [True, False])
def test_memory_tier_copies_device_state_into_its_registered_slot(tmp_path, caplog, raw):
    """The memory tier's device copies land in the tmpfs slot itself (cuda_engine.py, "In place"):
    each slot is registered for DMA once (or a warning says why not), the chunk pool is a single
    chunk the copies never use, and every memory checkpoint loads back bit for bit."""
    caplog.set_level(logging.WARNING, logger="pccheck")
    g = torch.Generator(device="cuda").manual_seed(int(raw))
    arrays = {"w": torch.randn(3 * (1 << 20) + 7, generator=g, device="cuda"),  # odd: a short last chunk
              "b": torch.randn(999, 17, generator=g, device="cuda").bfloat16()}
    shm = Path("/dev/shm") / f"pccheck-gpu-test-{os.getpid()}-{int(raw)}"
    try:
        with pccheck.Checkpointer(arrays, tmp_path / "ckpt", disk=pccheck.DiskOptions(every=1000),
                                  memory=pccheck.MemoryOptions(every=1, dir=shm), chunk_size=1 << 20) as ck:
            eng = ck._memory.orch.copy_engine
            eng.raw = raw and eng.raw
            for step in (1, 2, 3, 4):
                want = _clone(arrays)
                ck.maybe_checkpoint(step)  # the memory tier's checkpoint (the disk's is at 1000)
                ck.wait()
                r = pccheck.load_latest(tmp_path / "ckpt", memory_dir=shm)
                assert r.step == step
                for k, v in want.items():  # bytes (bf16 has no numpy dtype of its own)
                    assert np.array_equal(np.asarray(r.state[k]).reshape(-1).view(np.uint8), _bits(v).numpy()), k
                for v in arrays.values():
                    v.mul_(1.5).add_(1)
            ne = ck._memory.orch.engine
            assert ne.pool_bytes == ne.chunk_size == 1 << 20, "the memory tier's device pool holds more than a chunk"
            print(f"pinned slots {eng.pinned_slots}")
            if eng.pinned_slots == 0:
                assert any("memory-tier slot failed" in r.getMessage() for r in caplog.records)
            else:
                assert eng.pinned_slots == 2  # N + 1 slots, one in flight at a time
                cupy = _cupy_or_none()
                if cupy is not None:
                    for base, n in eng._slots.items():
                        for addr in (base, base + n - 1):
                            assert _memory_type(cupy.cuda.runtime.pointerGetAttributes(addr)) == 1
        assert eng.pinned_slots == 0, "close left a slot registered"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("depth,raw", [(1, False), (2, False), (1, True), (2, True), (3, True)])
def test_device_copy_loops_write_the_same_bytes(store, depth, raw):
    """Every copy loop (chunks queued per thread, cudaMemcpyAsync or Tensor.copy_) writes the
    stream bytes of the first GPU run's loop: arrays that end and begin inside a chunk, one larger
    than several chunks, odd sizes (gaps), a non-contiguous view, a host array beside them; and a
    second checkpoint after the arrays changed holds the new values."""
    g = torch.Generator(device="cuda").manual_seed(depth * 2 + raw)
    arrays = {
        "big": torch.randn(3 * (1 << 18) + 5, generator=g, device="cuda"),  # ~3 chunks of 1 MiB
        "odd": torch.randint(0, 255, (12345,), generator=g, device="cuda", dtype=torch.uint8),
        "bf16": torch.randn(777, 333, generator=g, device="cuda").bfloat16(),
        "view": torch.randn(600, 900, generator=g, device="cuda")[::3, 1::2],
        "host": np.arange(1001, dtype=np.int64),
        "i64": torch.arange(-70000, 70000, device="cuda", dtype=torch.int64) * 3_000_000_000,
    }
    assert not arrays["view"].is_contiguous()
    with pccheck.Checkpointer(arrays, store, interval=1, max_concurrent=1, chunk_size=1 << 20) as ck:
        eng = ck.copy_engine
        if raw and not eng.raw:
            pytest.skip("torch's CUDA runtime library was not found: no raw copies here")
        eng.depth, eng.raw = depth, raw
        for step in (1, 2):
            want = {k: v if isinstance(v, np.ndarray) else v.cpu().numpy() for k, v in arrays.items()
                    if k != "bf16"}
            want_bf16 = _bits(arrays["bf16"]).numpy()
            ck.checkpoint(step)
            ck.wait()
            r = pccheck.load_latest(store)
            assert r.step == step
            got = {k: v for k, v in r.state.items() if k != "bf16"}
            assert_state_equal(got, want)
            assert np.array_equal(np.asarray(r.state["bf16"]).reshape(-1).view(np.uint8), want_bf16)
            for v in arrays.values():
                if isinstance(v, torch.Tensor):
                    v.add_(1) if v.dtype != torch.uint8 else v.sub_(1)
            arrays["host"] += 1


@pytest.fixture
def cupy():
    cp = _cupy_or_none()
    if cp is None:
        pytest.skip("cupy with a CUDA device is not available")
    yield cp
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()


def test_cupy_arrays_round_trip(store, cupy, caplog):
    caplog.set_level(logging.WARNING, logger="pccheck")
    rs = cupy.random.RandomState(5)
    base = cupy.arange(512 * 768, dtype=cupy.int32).reshape(512, 768)
    arrays = {
        "f32": rs.standard_normal((1024, 1024), dtype=cupy.float32),
        "i64": cupy.arange(-5000, 5000, dtype=cupy.int64) * 3_000_000_000,
        "slice": base[::2, 1::3],
    }
    assert not arrays["slice"].flags.c_contiguous
    want = {k: cupy.asnumpy(v) for k, v in arrays.items()}
    with pccheck.Checkpointer(arrays, store, interval=1, max_concurrent=1) as ck:
        assert ck.copy_engine.name == "cupy"
        _check_pinned(ck.copy_engine, caplog)
        ck.checkpoint(7)
    r = pccheck.load_latest(store)
    assert r.step == 7
    assert_state_equal(r.state, want)


def test_cupy_checkpoint_sees_the_work_queued_on_the_current_stream(store, cupy):
    n, updates = GiB // 4, 300  # 1 GiB of float32: each update reads and writes it (~0.7 ms on an H100)
    a = cupy.zeros(n, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()  # `a` is ready before another stream touches it
    with pccheck.Checkpointer({"a": a}, store, interval=1, max_concurrent=1) as ck:
        with cupy.cuda.Stream(non_blocking=True) as s:
            for _ in range(updates):
                a += 1  # queued on s, nothing waits for it
            still_queued = not s.done
            ck.checkpoint(1)  # the engine records its ready event on s, the current stream
        s.synchronize()
    got = pccheck.load_latest(store).state["a"]
    assert got.dtype == np.float32 and got.shape == (n,)
    bad = np.flatnonzero(got != np.float32(updates))
    assert bad.size == 0, f"{bad.size} values are not {updates} (first: a[{bad[0]}] = {got[bad[0]]})"
    assert still_queued, "the updates had finished before the checkpoint: the ordering was not tested"


# -- restoring on the device ----------------------------------------------------------------------


def test_load_latest_map_location_cuda_restores_device_tensors(store):
    torch.manual_seed(3)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

    model, opt = make()
    for s in range(1, 4):
        g = torch.Generator(device="cuda").manual_seed(s)
        x = torch.randn(64, 256, generator=g, device="cuda")
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with pccheck.Checkpointer(model, opt, path=store, interval=10**6) as ck:
        ck.checkpoint(3)
        want = {"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict())}
    m2, o2 = make()  # other initial weights, no optimizer state yet
    r = pccheck.load_latest(store, model=m2, optimizer=o2, map_location="cuda")
    assert r.step == 3
    _assert_same(r.state["model"], want["model"], "loaded model", device="cuda")
    _assert_same(r.state["optimizer"], want["optimizer"], "loaded optimizer", device="cuda")
    _assert_same(m2.state_dict(), want["model"], "m2", device="cuda")
    _assert_same(o2.state_dict(), want["optimizer"], "o2", device="cuda")
    assert o2.state and all(p.is_cuda for p in m2.parameters())


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_lazy_restore_into_a_device_model(store, fused):
    """The optimizer's placeholders are made on the device (no host-to-device copy at load time),
    the loader fills them, and the state after ``wait`` is the saved one, bit for bit."""
    torch.manual_seed(4)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).cuda()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)

    model, opt = make()
    x = torch.randn(64, 256, device="cuda")
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    with pccheck.Checkpointer(model, opt, path=store, interval=10**6) as ck:
        ck.checkpoint(3)
        want = {"model": _clone(model.state_dict()), "optimizer": _clone(opt.state_dict())}
    m2, o2 = make()
    r = pccheck.load_latest(store, model=m2, optimizer=o2, lazy=True)
    assert all(v.device == p.device for p in m2.parameters() for k, v in o2.state[p].items() if k != "step")
    m2(x)  # waits for the model's own tensors only
    r.wait()
    _assert_same(m2.state_dict(), want["model"], "m2", device="cuda")
    _assert_same(o2.state_dict(), want["optimizer"], "o2", device="same")  # foreach keeps "step" on the CPU


# -- bitwise resume of a CUDA training run after SIGKILL -------------------------------------------

CHILD = str(Path(__file__).with_name("_gpu_train.py"))
STEPS, INTERVAL, PAUSE = 30, 2, "0.03"
CHILD_TIMEOUT = 300


def _child(path: Path, *extra: str) -> list[str]:
    return [sys.executable, CHILD, str(path), str(STEPS), str(INTERVAL), *extra]


def _child_env() -> dict[str, str]:
    return {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def _parse(stdout: str) -> tuple[int, dict[int, str]]:
    lines = stdout.splitlines()
    start = int(next(line for line in lines if line.startswith("START")).split()[1])
    return start, {int(line.split()[1]): line.split()[2] for line in lines if line.startswith("LOSS")}


def _run(cmd: list[str]) -> tuple[int, dict[int, str]]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT, env=_child_env())
    assert out.returncode == 0, out.stderr[-4000:]
    return _parse(out.stdout)


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory) -> tuple[dict[int, str], dict[str, torch.Tensor]]:
    """The uninterrupted run, in a child like the others: its losses (float.hex) and final weights."""
    d = tmp_path_factory.mktemp("gpu-reference")
    start, losses = _run(_child(d / "ck", "--final", str(d / "final.pt")))
    assert start == 0 and sorted(losses) == list(range(1, STEPS + 1))
    final = torch.load(d / "final.pt", weights_only=True)
    shutil.rmtree(d, ignore_errors=True)
    return losses, final


def _kill_at(path: Path, kill_step: int, log: Path) -> int:
    with open(log, "w") as err:
        proc = subprocess.Popen(_child(path, "--sleep", PAUSE), stdout=subprocess.PIPE, stderr=err,
                                text=True, env=_child_env())
        watchdog = threading.Timer(CHILD_TIMEOUT, proc.kill)
        watchdog.start()
        last = 0
        try:
            for line in proc.stdout:  # type: ignore[union-attr]
                if line.startswith("LOSS"):
                    last = int(line.split()[1])
                    if last >= kill_step:
                        os.kill(proc.pid, signal.SIGKILL)
                        break
            proc.wait(60)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL and last >= kill_step, \
        f"child ended with {proc.returncode} after step {last}, not killed at step {kill_step}:\n" \
        f"{log.read_text()[-4000:]}"
    return last


@pytest.mark.parametrize("trial", range(2))
def test_sigkill_then_resume_is_bitwise_on_gpu(tmp_path, gpu_reference, trial):
    ref_losses, ref_final = gpu_reference
    kill = random.Random(100 + trial).randint(4, STEPS - 4)
    killed_after = _kill_at(tmp_path / "ck", kill, tmp_path / "killed.log")
    start, losses = _run(_child(tmp_path / "ck", "--resume", "--final", str(tmp_path / "final.pt")))
    print(f"killed after step {killed_after}, resumed at step {start}")
    assert INTERVAL <= start <= killed_after and start % INTERVAL == 0
    assert sorted(losses) == list(range(start + 1, STEPS + 1))
    for s, loss in losses.items():
        assert loss == ref_losses[s], f"step {s}: {loss} != {ref_losses[s]} (resumed at {start})"
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final.keys() == ref_final.keys()
    for k in ref_final:
        assert torch.equal(_bits(final[k]), _bits(ref_final[k])), k
